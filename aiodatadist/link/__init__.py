"""Links between clusters: a link is a control channel (:mod:`aiodatadist.control`) plus a data plane
(:mod:`aiodatadist.transport`); this layer is the only one that knows both.  :mod:`.link` (the :class:`Link`),
:mod:`.planes` (the factory that picks a link's plane from the handshake), :mod:`.manager` (the handshake, the
link table, unlinking, and dispatch of a link's requests), :mod:`.attempts` (a link in progress, shared by the
concurrent callers that ask for it) , :mod:`.drops` (why recent links went away, for the calls that follow), :mod:`.comm_domains` (two-sided
``link``/``unlink`` among 2 to 4 clusters as one-sided links) and :mod:`.rank_table` (the HCCL rank table they
parse)."""
