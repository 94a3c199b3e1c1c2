"""The caches of an instance and what peers may read of them:

* :mod:`.caches`: :class:`~.caches.CacheRegistry`, the cache table (keys, leases, release);
* :mod:`.publication`: :class:`~.publication.CacheDirectory`, the shared-memory directory of published caches
  that same-host and TCP peers read without asking.
"""
