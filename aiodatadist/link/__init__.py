"""Links between clusters: a link is a control channel (:mod:`aiodatadist.control`) plus a data plane
(:mod:`aiodatadist.transport`); this layer is the only one that knows both.  :mod:`.link` (the :class:`Link`),
:mod:`.planes` (the factory that picks a link's plane from the handshake), :mod:`.manager` (the
:class:`LinkManager` an instance holds, composing the parts below), :mod:`.accept` (the server side: listening,
HELLOs, admission), :mod:`.dial` (the client side: the handshake, its data connections), :mod:`.table` (the link
table: liveness, drops, unlinking, dispatch of a link's requests), :mod:`.local_end` (what this end announces),
:mod:`.plane_setup` (a link's plane chosen and built), :mod:`.fd_socket` (segments for same-host peers under
another user), :mod:`.attempts` (a link in progress, shared by the concurrent callers that ask for it) ,
:mod:`.drops` (why recent links went away, for the calls that follow), :mod:`.comm_domains` (two-sided
``link``/``unlink`` among 2 to 4 clusters as one-sided links) and :mod:`.rank_table` (the HCCL rank table they
parse)."""
