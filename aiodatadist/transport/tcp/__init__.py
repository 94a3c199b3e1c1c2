"""The TCP data plane of a link: :mod:`.frames` (the frame format), :mod:`.native_connections` (the compiled helper's
I/O threads; serves one-sided reads) and :mod:`.python_connections` (Python threads, the fallback)."""
