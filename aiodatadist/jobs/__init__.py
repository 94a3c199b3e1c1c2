"""The job contract every executor follows, below both the host pools (:mod:`aiodatadist.copy`) and the GPU
executor (:mod:`aiodatadist.cuda`):

* :mod:`.base`: :class:`~.base.ExecutorBase`, :class:`~.base.ExecutorJob`, awaiting a job through cancellations;
* :mod:`.chunks`: how spans are cut into pieces and chunks;
* :mod:`.completion`: the pipe and the polling through which native threads report finished jobs to an event
  loop (shared with the TCP plane's I/O threads).
"""
