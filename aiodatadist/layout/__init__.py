"""Cache geometry and copy plans: which byte ranges a transfer moves (no threads, no I/O).

* :mod:`.plans`: geometry, transfer parameters, plans and their span lists;
* ``_blocks``: the compiled fast path of block lists -> byte runs (optional: numpy does it without).
"""
