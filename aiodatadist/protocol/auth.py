"""Mutual authentication of a link with a shared key (``LLMConfig.auth_key`` / ``llm.AuthKey``).

An HMAC-SHA256 challenge in the handshake, both ways, before the server admits the link:

1. the client's ``HELLO`` carries a fresh 32-byte nonce ``cn``;
2. a server that has a key does not admit it yet: it answers with its own nonce ``sn`` and the *server proof*
   ``HMAC(k, "server" | cn | sn | client id | server id)``; a client with the same key checks it (so it never
   talks to a server without the key), a client without a key fails with ``LLM_LINK_FAILED``;
3. the client repeats ``HELLO`` with ``sn`` and the *client proof* (``"client"`` instead of ``"server"``); the
   server checks it against the challenge it issued to that connection (single use, 10 s) and only then admits
   the link.  A wrong or missing proof gets ``LLM_LINK_FAILED`` and nothing else: no request of an
   unadmitted connection is ever served.

``k`` is derived from the key with SHA-256, so the key itself never crosses the network, and neither does
anything that lets an eavesdropper answer a later challenge.  The TCP data connections of an authenticated link
present ``HMAC(k, "data" | cn | sn)`` (truncated to 16 bytes) instead of a token sent in the clear.  See
``docs/security.md`` for what this does and does not protect.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

__all__ = ["CHALLENGE_TTL", "MAX_PENDING", "NONCE_BYTES", "ChallengeTable", "data_token", "derive_key", "new_nonce",
           "proof", "verify"]

NONCE_BYTES = 32
CHALLENGE_TTL = 10.0
MAX_PENDING = 16384
"""Challenges pending at once (about 4 MiB): a flood must issue this many between a legitimate client's challenge
and its answer to push that challenge out."""


def derive_key(auth_key: str) -> bytes:
    return hashlib.sha256(b"aiodatadist-auth-v1\0" + auth_key.encode()).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes, side: str, client_nonce: bytes, server_nonce: bytes, client_id: int, server_id: int) -> bytes:
    """What ``side`` ("client" or "server") sends to prove it holds the key, bound to both nonces and ids."""
    message = b"|".join([side.encode(), client_nonce, server_nonce, str(client_id).encode(), str(server_id).encode()])
    return hmac.new(key, message, hashlib.sha256).digest()


def verify(expected: bytes, given: object) -> bool:
    return isinstance(given, bytes) and hmac.compare_digest(expected, given)


def data_token(key: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """The token the data connections of an authenticated link present (never sent in the clear)."""
    return hmac.new(key, b"data|" + client_nonce + b"|" + server_nonce, hashlib.sha256).digest()[:16]


class ChallengeTable:
    """Server side: the challenges issued per connection (routing id), single use, expiring, bounded.

    ``now`` is the caller's clock (``time.monotonic()``, in seconds): the table reads no clock itself."""

    def __init__(self) -> None:
        self._pending: dict[bytes, tuple[bytes, bytes, float]] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def issue(self, routing_id: bytes, client_nonce: bytes, now: float) -> bytes:
        """A fresh server nonce for this connection (replacing any earlier one); at :data:`MAX_PENDING`
        challenges, the expired ones go first, else the one issued first.  The table is in issuing order, which is
        the order of the deadlines (one TTL for all): both are found at its front, in constant time a challenge."""
        pending = self._pending
        pending.pop(routing_id, None)
        if len(pending) >= MAX_PENDING:
            while pending and next(iter(pending.values()))[2] < now:
                del pending[next(iter(pending))]
            if len(pending) >= MAX_PENDING:
                del pending[next(iter(pending))]
        server_nonce = new_nonce()
        pending[routing_id] = (client_nonce, server_nonce, now + CHALLENGE_TTL)
        return server_nonce

    def take(self, routing_id: bytes, now: float) -> tuple[bytes, bytes] | None:
        """The (client nonce, server nonce) issued to this connection, if still valid (removed either way)."""
        found = self._pending.pop(routing_id, None)
        if found is None or found[2] < now:
            return None
        return found[0], found[1]
