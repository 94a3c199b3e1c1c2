"""The transfer conversation (``BEGIN``/``END``/``ABORT``/``FREED``) and the copies it starts; no zmq here.

* :mod:`.validate`: argument checks of pull/push -> :class:`~aiodatadist.layout.TransferParams`;
* :mod:`.requester`: this instance's pulls and pushes (one deadline; round-trip, published and one-sided paths);
* :mod:`.owner`: the peers' pulls and pushes of this instance's caches (resolve, lease, release);
* :mod:`.state`: per-link transfer state and the owner's leases;
* :mod:`.engine`: :class:`~.engine.CopyEngine`, the instance's copy jobs on the host executor or its GPU;
* :mod:`.service`: :class:`~.service.TransferService`, both sides behind the link manager's hooks.
"""
