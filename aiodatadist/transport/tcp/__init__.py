"""The TCP data plane of a link: :mod:`.frames` (the frame format), :mod:`.native_plane` (the compiled helper's
I/O threads; serves one-sided reads) and :mod:`.python_plane` (Python threads, the fallback)."""
