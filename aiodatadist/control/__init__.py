"""The control plane on pyzmq's asyncio sockets: :mod:`.channel` (a link's message pipe, the instance's
background tasks), :mod:`.sockets` (the context, the ROUTER server, DEALER clients) and :mod:`.links` (the
handshake's I/O, the link table, liveness watchers, unlinking)."""
