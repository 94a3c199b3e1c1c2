"""Helpers shared by the test suite (``tests/`` is on ``sys.path``: ``from helpers.world import World``).

``ids``          fresh cluster ids for in-process instances.
``data``         test bytes: fill caches, read them back, views per slot/block.
``world``        the two-process world of the transfer and link tests (a local instance and a peer process).
``fault_proxy``  a fault-injecting TCP proxy (pass, stall, cut).
``fake_cuda``    the emulated GPU (a fake ``libcuda.so.1`` built from ``fake_libcuda.c``).
``internals``    the one seam into a CacheManager's private parts (registry, copy engine, GPU).
"""
