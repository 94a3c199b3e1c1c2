"""The control protocol, sans IO: ``codec`` (kinds, msgpack frames, field checks), ``messages`` (one typed value
per message kind, one encoder and one decoder each), ``handshake`` (admission, plane choice, the challenge both
ways) and ``auth`` (HMAC proofs, the server's challenge table).  Nothing here touches a socket or a clock."""
