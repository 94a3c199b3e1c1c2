"""The link handshake's rules, sans IO: admission, the challenge both ways, the data plane and the TCP data
connections.  Inputs are values (the decoded messages, this instance's settings and link table, the time), outputs
are values (a status code and message, the next message to send, a plane); the control plane does the I/O.

Server side, for a HELLO (:class:`~aiodatadist.protocol.messages.Hello`):

1. :func:`authenticate` when this instance has a key: a challenge to send, a refusal, or the nonces;
2. :func:`admit`: protocol version, target, self-link, already linked, :data:`MAX_LINKS`;
3. the host probe (I/O: it maps the peer's segment), then :func:`choose_plane`: a peer on another host while
   either end forces ``shm`` is refused (:data:`SHM_ELSEWHERE`); either end forcing ``tcp`` gives ``tcp``.

Client side: :func:`may_link` before connecting, :func:`answer_challenge` on the first answer, then
:func:`choose_plane` and :func:`client_plane` on the admission, and :func:`data_connections` for a TCP link.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass

from ..errors import LLMStatusCode
from ..types import Transport
from . import auth
from .messages import MAX_DATA_CONNECTIONS, Hello, HelloChallenge, HelloReply, Plane
from .messages import transport_from_wire as transport_of

__all__ = [
    "ADMITTED",
    "AUTH_FAILED",
    "AUTH_REQUIRED",
    "MAX_LINKS",
    "PROTOCOL_VERSION",
    "SHM_ELSEWHERE",
    "TRANSPORT_CONFLICT",
    "DataConnections",
    "Refused",
    "admit",
    "answer_challenge",
    "authenticate",
    "choose_plane",
    "client_plane",
    "data_connections",
    "may_link",
    "plane_for",
    "plane_refusal",
    "transport_of",
]

S = LLMStatusCode
PROTOCOL_VERSION = 9  # 2: batched frames, segments announced at link time; 3: geometries carry the data type;
# 4: RESOLVE (registered tensors holding raw destination addresses); 5: the nixl plane, fd socket; 6: TCP data
# frames FENCE/FENCE_ACK and one-sided WRITE/WRITE_ACK; 7: WITHDRAW (same-host pushes into caller-owned caches
# without a round trip), READ frames name the owner's spans as a grid; 8: descriptors' window (memory shared in place);
# 9: device runtimes announced (HELLO, its reply, BEGIN), ACL's 65-byte IPC keys
MAX_LINKS = 512
ADMITTED: tuple[int, str] = (0, "")
SHM_ELSEWHERE = "transport shm forced, but the peer is not on this host"
TRANSPORT_CONFLICT = "the two ends force different transports"
AUTH_REQUIRED = "this cluster requires authentication (llm.AuthKey)"
AUTH_FAILED = "authentication failed"


@dataclass(frozen=True, slots=True)
class Refused:
    """The handshake fails with ``code``/``msg``; ``bye``: the client was admitted already, so it tells the server
    to drop its end."""

    code: int
    msg: str
    bye: bool = False


# -- admission -------------------------------------------------------------------------------------------------
def admit(version: int, cluster: int, target: int, *, own_id: int, links: Collection[int],
          linking: Collection[int], max_links: int = MAX_LINKS) -> tuple[int, str]:
    """Server side: whether cluster ``cluster``'s HELLO (``version``, addressed to ``target``) is admitted by
    cluster ``own_id``, which has ``links`` and is ``linking`` to others (at most ``max_links`` in all):
    :data:`ADMITTED` or (code, message)."""
    if version != PROTOCOL_VERSION:
        return int(S.LLM_LINK_FAILED), f"protocol version {version} is not supported ({PROTOCOL_VERSION})"
    if target != own_id:
        return int(S.LLM_LINK_FAILED), f"this is cluster {own_id}, not {target}"
    if cluster == own_id:
        return int(S.LLM_PARAM_INVALID), "a cluster cannot link to itself"
    if cluster in links or cluster in linking:
        return int(S.LLM_ALREADY_LINK), f"cluster {cluster} is already linked"
    if len(links) + len(linking) >= max_links:
        return int(S.LLM_CLUSTER_NUM_EXCEED_LIMIT), f"at most {max_links} links"
    return ADMITTED


def may_link(remote_id: int, *, own_id: int, links: Collection[int], linking: Collection[int],
             max_links: int = MAX_LINKS) -> LLMStatusCode:
    """Client side, before connecting: ``LLM_SUCCESS`` or why cluster ``own_id`` cannot link to ``remote_id``."""
    if remote_id in links or remote_id in linking:
        return S.LLM_ALREADY_LINK
    if remote_id == own_id:
        return S.LLM_PARAM_INVALID
    if len(links) + len(linking) >= max_links:
        return S.LLM_CLUSTER_NUM_EXCEED_LIMIT
    return S.LLM_SUCCESS


# -- data plane ------------------------------------------------------------------------------------------------
def plane_for(same_host: bool, transport: Transport) -> Plane:
    """``tcp`` when forced or when the peer is on another host, else ``shm``."""
    if transport == Transport.TCP or not same_host:
        return "tcp"
    return "shm"


def choose_plane(own: Transport, peer: Transport, same_host: bool) -> Plane | None:
    """The plane of a link between an end set to ``own`` and one set to ``peer`` (both ends decide alike):
    either end forcing ``nixl`` gives ``nixl``; None: the ends force different transports, or either forces
    ``shm`` but the peer is not on this host (``LLM_LINK_FAILED``, :func:`plane_refusal` says which)."""
    forced = (own, peer)
    if Transport.NIXL in forced:
        return "nixl" if {own, peer} <= {Transport.NIXL, Transport.AUTO} else None
    if Transport.SHM in forced and not same_host:
        return None
    return plane_for(same_host, Transport.TCP if Transport.TCP in forced else Transport.AUTO)


def plane_refusal(own: Transport, peer: Transport) -> str:
    """Why :func:`choose_plane` found no plane."""
    return SHM_ELSEWHERE if Transport.NIXL not in (own, peer) else f"{TRANSPORT_CONFLICT} ({own} and {peer})"


def client_plane(chosen: Plane, server: Plane) -> Plane:
    """The client's plane: its own choice, unless the server chose ``tcp`` (it cannot use this host's shared
    memory, so both ends use TCP)."""
    return "tcp" if server == "tcp" and chosen != "nixl" else chosen


# -- authentication --------------------------------------------------------------------------------------------
def authenticate(key: bytes, table: auth.ChallengeTable, routing_id: bytes, hello: Hello, server_id: int,
                 now: float) -> HelloChallenge | Refused | tuple[bytes, bytes]:
    """Server side, with a key: the challenge to answer a first HELLO with; once the client proved it holds the
    key (second HELLO), the (client nonce, server nonce) of the link; else a refusal.  ``table`` keeps the
    challenges issued per connection (``routing_id``); ``now`` is ``time.monotonic()``."""
    client_nonce = hello.cn
    if hello.cp is None:
        if client_nonce is None:
            return Refused(int(S.LLM_LINK_FAILED), AUTH_REQUIRED)
        server_nonce = table.issue(routing_id, client_nonce, now)
        return HelloChallenge(server_nonce,
                              auth.proof(key, "server", client_nonce, server_nonce, hello.cluster, server_id))
    issued = table.take(routing_id, now)
    if issued is None or issued[0] != client_nonce or not auth.verify(
            auth.proof(key, "client", issued[0], issued[1], hello.cluster, server_id), hello.cp):
        return Refused(int(S.LLM_LINK_FAILED), AUTH_FAILED)
    return issued


def answer_challenge(key: bytes | None, hello: Hello, challenge: HelloChallenge | None) -> Hello | Refused | None:
    """Client side, on the server's answer to the first ``hello`` (``challenge``: None when it admitted the link
    at once): None to go on with that admission, the second HELLO (with the client proof) to send, or a refusal.
    ``hello.cn`` is this client's nonce."""
    server_id = hello.target
    if challenge is None:
        if key is not None:
            return Refused(int(S.LLM_LINK_FAILED),
                           f"cluster {server_id} does not authenticate (no llm.AuthKey): refusing the link", bye=True)
        return None
    if key is None:
        return Refused(int(S.LLM_LINK_FAILED),
                       f"cluster {server_id} requires authentication: set llm.AuthKey / LLMConfig.auth_key")
    client_nonce, server_nonce = hello.cn, challenge.challenge
    if client_nonce is None or len(server_nonce) != auth.NONCE_BYTES or not auth.verify(
            auth.proof(key, "server", client_nonce, server_nonce, hello.cluster, server_id), challenge.sp):
        return Refused(int(S.LLM_LINK_FAILED), f"cluster {server_id} does not hold the same auth key")
    client_proof = auth.proof(key, "client", client_nonce, server_nonce, hello.cluster, server_id)
    return dataclasses.replace(hello, sn=server_nonce, cp=client_proof)


# -- TCP data connections --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DataConnections:
    """Client side: open ``count`` connections to ``port`` of the server, each presenting ``token``."""

    port: int
    token: bytes
    count: int


def data_connections(reply: HelloReply, key: bytes | None,
                     nonces: tuple[bytes, bytes] | None) -> DataConnections | str:
    """Client side of a TCP link: the data connections the server admits, or what is wrong with its offer.  On an
    authenticated link (``key`` and the handshake's ``nonces``) the token is derived, never sent."""
    count, offer = reply.dconns, reply.data
    if count is None or not 1 <= count <= MAX_DATA_CONNECTIONS:
        return f"the peer offers a bad number of data connections: {count!r}"
    token = offer.token if offer is not None else None
    if offer is not None and token is None and nonces is not None and key is not None:
        token = auth.data_token(key, *nonces)
    if offer is None or token is None:
        return "the peer offers no TCP data connections"
    return DataConnections(offer.port, token, count)
