"""The control protocol, sans IO: ``codec`` (kinds, msgpack frames, field checks), ``messages`` (one typed value
per message kind, one encoder and one decoder each), ``handshake`` (admission, plane choice, the challenge both
ways) , ``auth`` (HMAC proofs, the server's challenge table) and ``identity`` (a shared segment's identity as
peers announce it).  Nothing here touches a socket or a clock."""
