"""The link handshake's rules, sans IO: admission, plane choice, the challenge both ways, the data connections.

A whole authenticated handshake runs here as bytes between two sets of pure functions, with the time passed in.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from aiodatadist.errors import LLMStatusCode
from aiodatadist.protocol import auth
from aiodatadist.protocol.codec import decode_batch, encode_batch
from aiodatadist.protocol.handshake import (
    ADMITTED,
    AUTH_FAILED,
    AUTH_REQUIRED,
    MAX_LINKS,
    PROTOCOL_VERSION,
    SHM_ELSEWHERE,
    DataConnections,
    Refused,
    admit,
    answer_challenge,
    authenticate,
    choose_plane,
    client_plane,
    data_connections,
    may_link,
    plane_for,
    plane_refusal,
    transport_of,
)
from aiodatadist.protocol.messages import (
    MAX_DATA_CONNECTIONS,
    DataOffer,
    Hello,
    HelloChallenge,
    HelloReply,
    hello_reply_from_wire,
    is_challenge,
    reply_to_wire,
    request_to_wire,
)
from aiodatadist.types import Transport

S = LLMStatusCode
SERVER, CLIENT = 1, 2
KEY = auth.derive_key("s3cret")
RID = b"c" + bytes(15)
T0 = 1000.0


def wire(message: dict[str, Any]) -> dict[str, Any]:
    [decoded] = decode_batch(encode_batch([message]))
    return decoded


def first_hello(cn: bytes | None = None) -> Hello:
    return Hello(PROTOCOL_VERSION, CLIENT, SERVER, 1, cn=cn if cn is not None else auth.new_nonce())


# -- admission -----------------------------------------------------------------------------------------------------
def test_constants() -> None:
    from aiodatadist.link import manager as links

    assert PROTOCOL_VERSION == 9  # 3: data types; 4: RESOLVE; 5: nixl, fds; 6: fence, WRITE; 7: WITHDRAW; 8: window;
    # 9: device runtimes, ACL keys
    assert MAX_LINKS == 512 == links.MAX_LINKS
    assert ADMITTED == (0, "")


def test_admit() -> None:
    def run(version: int = PROTOCOL_VERSION, cluster: int = CLIENT, target: int = SERVER, links: Any = (), linking: Any = ()) -> Any:
        return admit(version, cluster, target, own_id=SERVER, links=links, linking=linking)

    assert run() == ADMITTED
    assert run(version=1) == (int(S.LLM_LINK_FAILED), "protocol version 1 is not supported (9)")
    assert run(version=2) == (int(S.LLM_LINK_FAILED), "protocol version 2 is not supported (9)")  # no data types
    assert run(version=3) == (int(S.LLM_LINK_FAILED), "protocol version 3 is not supported (9)")  # no RESOLVE
    assert run(version=4) == (int(S.LLM_LINK_FAILED), "protocol version 4 is not supported (9)")  # no nixl plane
    assert run(version=5) == (int(S.LLM_LINK_FAILED), "protocol version 5 is not supported (9)")  # no FENCE, WRITE
    assert run(version=6) == (int(S.LLM_LINK_FAILED), "protocol version 6 is not supported (9)")  # no WITHDRAW
    assert run(version=7) == (int(S.LLM_LINK_FAILED), "protocol version 7 is not supported (9)")  # no window
    assert run(version=8) == (int(S.LLM_LINK_FAILED), "protocol version 8 is not supported (9)")  # 64-byte IPC only
    assert run(version=10)[0] == int(S.LLM_LINK_FAILED)
    assert run(target=3) == (int(S.LLM_LINK_FAILED), "this is cluster 1, not 3")
    assert run(cluster=SERVER) == (int(S.LLM_PARAM_INVALID), "a cluster cannot link to itself")
    assert run(links={CLIENT: object()}) == (int(S.LLM_ALREADY_LINK), "cluster 2 is already linked")
    assert run(linking={CLIENT}) == (int(S.LLM_ALREADY_LINK), "cluster 2 is already linked")
    assert run(links={5: None, 6: None}, linking={7}) == ADMITTED


def test_admission_rules_apply_in_order() -> None:
    """Version first, then the target, the self-link, an existing link, the link limit."""
    everything_wrong = admit(1, SERVER, 3, own_id=SERVER, links={SERVER: 0}, linking=set(range(MAX_LINKS)))
    assert everything_wrong[1].startswith("protocol version")
    assert admit(PROTOCOL_VERSION, SERVER, 3, own_id=SERVER, links=(), linking=())[1].startswith("this is cluster")
    assert admit(PROTOCOL_VERSION, SERVER, SERVER, own_id=SERVER, links={SERVER: 0}, linking=())[1] == "a cluster cannot link to " \
        "itself"
    full = set(range(100, 100 + MAX_LINKS))
    assert admit(PROTOCOL_VERSION, 100, SERVER, own_id=SERVER, links=full, linking=())[0] == int(S.LLM_ALREADY_LINK)


def test_the_link_limit_counts_links_and_linkings() -> None:
    links = dict.fromkeys(range(100, 100 + MAX_LINKS - 10))
    assert admit(PROTOCOL_VERSION, CLIENT, SERVER, own_id=SERVER, links=links, linking=set(range(10, 19))) == ADMITTED  # 511
    limit = (int(S.LLM_CLUSTER_NUM_EXCEED_LIMIT), f"at most {MAX_LINKS} links")
    assert admit(PROTOCOL_VERSION, CLIENT, SERVER, own_id=SERVER, links=links, linking=set(range(10, 20))) == limit  # 512
    assert admit(PROTOCOL_VERSION, CLIENT, SERVER, own_id=SERVER, links=dict.fromkeys(range(100, 100 + MAX_LINKS)),
                 linking=()) == limit


def test_may_link() -> None:
    def run(remote: int, links: Any = (), linking: Any = ()) -> LLMStatusCode:
        return may_link(remote, own_id=CLIENT, links=links, linking=linking)

    assert run(SERVER) == S.LLM_SUCCESS
    assert run(SERVER, links={SERVER: 0}) == S.LLM_ALREADY_LINK
    assert run(SERVER, linking={SERVER}) == S.LLM_ALREADY_LINK
    assert run(CLIENT) == S.LLM_PARAM_INVALID
    assert run(SERVER, links=dict.fromkeys(range(100, 100 + MAX_LINKS - 1))) == S.LLM_SUCCESS
    assert run(SERVER, links=dict.fromkeys(range(100, 100 + MAX_LINKS - 1)), linking={7}) == \
        S.LLM_CLUSTER_NUM_EXCEED_LIMIT
    # already linked wins over the rest (the client checks in that order)
    assert run(CLIENT, links={CLIENT: 0}) == S.LLM_ALREADY_LINK


# -- plane choice --------------------------------------------------------------------------------------------------
def test_transport_of() -> None:
    assert [transport_of(v) for v in ("auto", "shm", "tcp", "udp", None, 3, ["tcp"])] == [
        Transport.AUTO, Transport.SHM, Transport.TCP, Transport.AUTO, Transport.AUTO, Transport.AUTO, Transport.AUTO]


def test_plane_for() -> None:
    assert plane_for(True, Transport.AUTO) == "shm"
    assert plane_for(True, Transport.SHM) == "shm"
    assert plane_for(True, Transport.TCP) == "tcp"
    for transport in Transport:
        assert plane_for(False, transport) == "tcp"


#  own      peer     same host  -> plane (None: LLM_LINK_FAILED, shm forced but the peer is elsewhere)
PLANES = [
    ("auto", "auto", True, "shm"), ("auto", "auto", False, "tcp"),
    ("auto", "shm", True, "shm"), ("auto", "shm", False, None),
    ("auto", "tcp", True, "tcp"), ("auto", "tcp", False, "tcp"),
    ("shm", "auto", True, "shm"), ("shm", "auto", False, None),
    ("shm", "shm", True, "shm"), ("shm", "shm", False, None),
    ("shm", "tcp", True, "tcp"), ("shm", "tcp", False, None),
    ("tcp", "auto", True, "tcp"), ("tcp", "auto", False, "tcp"),
    ("tcp", "shm", True, "tcp"), ("tcp", "shm", False, None),
    ("tcp", "tcp", True, "tcp"), ("tcp", "tcp", False, "tcp"),
    # nixl: either end forcing it gives it; forced against shm or tcp it is refused (TRANSPORT_CONFLICT)
    ("nixl", "nixl", True, "nixl"), ("nixl", "nixl", False, "nixl"),
    ("nixl", "auto", True, "nixl"), ("nixl", "auto", False, "nixl"),
    ("auto", "nixl", True, "nixl"), ("auto", "nixl", False, "nixl"),
    ("nixl", "shm", True, None), ("nixl", "shm", False, None),
    ("shm", "nixl", True, None), ("shm", "nixl", False, None),
    ("nixl", "tcp", True, None), ("nixl", "tcp", False, None),
    ("tcp", "nixl", True, None), ("tcp", "nixl", False, None),
]


@pytest.mark.parametrize(("own", "peer", "same_host", "plane"), PLANES)
def test_plane_choice_table(own: str, peer: str, same_host: bool, plane: str | None) -> None:
    assert choose_plane(Transport(own), Transport(peer), same_host) == plane
    assert choose_plane(Transport(peer), Transport(own), same_host) == plane  # both ends decide alike


def test_the_plane_table_is_complete() -> None:
    names = [t.value for t in Transport]
    assert sorted((o, p, h) for o, p, h, _ in PLANES) == sorted(itertools.product(names, names, (True, False)))
    assert SHM_ELSEWHERE == "transport shm forced, but the peer is not on this host"


def test_the_server_can_make_the_client_use_tcp() -> None:
    assert client_plane("shm", "tcp") == "tcp"
    assert client_plane("shm", "shm") == "shm"
    assert client_plane("tcp", "shm") == "tcp"  # the client's own reasons stand
    assert client_plane("tcp", "tcp") == "tcp"
    assert client_plane("nixl", "nixl") == "nixl"


def test_a_refusal_says_why() -> None:
    assert plane_refusal(Transport.SHM, Transport.AUTO) == SHM_ELSEWHERE
    assert plane_refusal(Transport.NIXL, Transport.TCP) == "the two ends force different transports (nixl and tcp)"


# -- server side of the challenge ----------------------------------------------------------------------------------
def test_a_first_hello_gets_a_challenge() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = authenticate(KEY, table, RID, hello, SERVER, T0)
    assert isinstance(challenge, HelloChallenge)
    assert len(challenge.challenge) == auth.NONCE_BYTES
    assert challenge.sp == auth.proof(KEY, "server", hello.cn or b"", challenge.challenge, CLIENT, SERVER)
    assert len(table) == 1


@pytest.mark.parametrize("cn", [None, b"short"])
def test_a_hello_without_a_client_nonce_is_refused(cn: bytes | None) -> None:
    table = auth.ChallengeTable()
    hello = Hello.from_wire(wire(request_to_wire(dataclasses.replace(first_hello(), cn=cn), 1)))
    assert authenticate(KEY, table, RID, hello, SERVER, T0) == Refused(int(S.LLM_LINK_FAILED), AUTH_REQUIRED)
    assert len(table) == 0
    assert AUTH_REQUIRED == "this cluster requires authentication (llm.AuthKey)"


def proved(hello: Hello, challenge: HelloChallenge, key: bytes = KEY) -> Hello:
    assert hello.cn is not None
    return dataclasses.replace(hello, sn=challenge.challenge,
                               cp=auth.proof(key, "client", hello.cn, challenge.challenge, hello.cluster, SERVER))


def test_the_right_proof_gives_the_nonces() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = authenticate(KEY, table, RID, hello, SERVER, T0)
    assert isinstance(challenge, HelloChallenge)
    assert authenticate(KEY, table, RID, proved(hello, challenge), SERVER, T0 + 1) == (hello.cn, challenge.challenge)
    assert len(table) == 0


def refused(result: object) -> bool:
    return result == Refused(int(S.LLM_LINK_FAILED), AUTH_FAILED)


def challenged(table: auth.ChallengeTable, hello: Hello, now: float = T0, rid: bytes = RID) -> HelloChallenge:
    challenge = authenticate(KEY, table, rid, hello, SERVER, now)
    assert isinstance(challenge, HelloChallenge)
    return challenge


def test_a_wrong_proof_is_refused() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = challenged(table, hello)
    assert refused(authenticate(KEY, table, RID, proved(hello, challenge, auth.derive_key("guess")), SERVER, T0))


def test_a_challenge_is_single_use() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = challenged(table, hello)
    assert refused(authenticate(KEY, table, RID, dataclasses.replace(hello, sn=challenge.challenge, cp=b"x" * 32),
                                SERVER, T0))
    # the failed attempt used it up: even the right proof is refused now
    assert refused(authenticate(KEY, table, RID, proved(hello, challenge), SERVER, T0))


def test_a_challenge_expires() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = challenged(table, hello)
    assert authenticate(KEY, table, RID, proved(hello, challenge), SERVER, T0 + auth.CHALLENGE_TTL) != Refused(
        int(S.LLM_LINK_FAILED), AUTH_FAILED)  # at the deadline: still valid
    challenge = challenged(table, hello)
    assert refused(authenticate(KEY, table, RID, proved(hello, challenge), SERVER, T0 + auth.CHALLENGE_TTL + 0.001))


def test_a_challenge_is_bound_to_its_connection_and_nonce() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = challenged(table, hello)
    assert refused(authenticate(KEY, table, b"other", proved(hello, challenge), SERVER, T0))
    challenge = challenged(table, hello)
    other = dataclasses.replace(proved(hello, challenge), cn=auth.new_nonce())
    assert refused(authenticate(KEY, table, RID, other, SERVER, T0))  # the proof of another client nonce
    challenge = challenged(table, hello)
    assert refused(authenticate(KEY, table, RID, dataclasses.replace(proved(hello, challenge), cluster=3), SERVER, T0))


def test_a_proof_of_the_wrong_type_is_refused_not_challenged() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenged(table, hello)
    raw = {**request_to_wire(hello, 2), "cp": 12345}
    assert refused(authenticate(KEY, table, RID, Hello.from_wire(wire(raw)), SERVER, T0))


def test_a_second_hello_without_a_challenge_is_refused() -> None:
    hello = first_hello()
    assert refused(authenticate(KEY, auth.ChallengeTable(), RID, dataclasses.replace(hello, cp=b"x" * 32), SERVER,
                                T0))


# -- client side of the challenge ----------------------------------------------------------------------------------
def test_a_client_without_a_key_takes_an_unchallenged_admission() -> None:
    assert answer_challenge(None, first_hello(), None) is None


def test_a_client_with_a_key_refuses_a_server_without_one() -> None:
    result = answer_challenge(KEY, first_hello(), None)
    assert result == Refused(int(S.LLM_LINK_FAILED),
                             f"cluster {SERVER} does not authenticate (no llm.AuthKey): refusing the link", bye=True)


def test_a_client_without_a_key_refuses_a_challenge() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    result = answer_challenge(None, hello, challenged(table, hello))
    assert result == Refused(int(S.LLM_LINK_FAILED),
                             f"cluster {SERVER} requires authentication: set llm.AuthKey / LLMConfig.auth_key")


def test_a_client_refuses_a_server_with_another_key() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = challenged(table, hello)
    not_same = Refused(int(S.LLM_LINK_FAILED), f"cluster {SERVER} does not hold the same auth key")
    assert answer_challenge(auth.derive_key("other"), hello, challenge) == not_same
    assert answer_challenge(KEY, hello, HelloChallenge(challenge.challenge, b"forged")) == not_same
    assert answer_challenge(KEY, hello, HelloChallenge(challenge.challenge[:-1], challenge.sp)) == not_same
    # the server proof is bound to both ids: a proof made for another client is refused
    assert answer_challenge(KEY, dataclasses.replace(hello, cluster=9), challenge) == not_same


def test_the_client_answers_a_good_challenge_with_its_proof() -> None:
    table = auth.ChallengeTable()
    hello = first_hello()
    challenge = challenged(table, hello)
    second = answer_challenge(KEY, hello, challenge)
    assert isinstance(second, Hello)
    assert second == dataclasses.replace(hello, sn=challenge.challenge, cp=second.cp)
    assert second.cp == auth.proof(KEY, "client", hello.cn or b"", challenge.challenge, CLIENT, SERVER)


def test_a_whole_authenticated_handshake_in_bytes() -> None:
    """Client and server exchange frames (encoded, decoded) and end up with the same data-connection token."""
    table = auth.ChallengeTable()
    hello = Hello(PROTOCOL_VERSION, CLIENT, SERVER, 1, Transport.TCP, cn=auth.new_nonce(), reads=True)
    # client -> server
    received = Hello.from_wire(wire(request_to_wire(hello, 1)))
    assert admit(received.version, received.cluster, received.target, own_id=SERVER, links=(), linking=()) == ADMITTED
    challenge = authenticate(KEY, table, RID, received, SERVER, T0)
    assert isinstance(challenge, HelloChallenge)
    # server -> client
    answer = wire(challenge.reply_to_wire(1))
    assert is_challenge(answer)
    parsed = hello_reply_from_wire(answer)
    assert isinstance(parsed, HelloChallenge)
    second = answer_challenge(KEY, hello, parsed)
    assert isinstance(second, Hello)
    # client -> server
    nonces = authenticate(KEY, table, RID, Hello.from_wire(wire(request_to_wire(second, 2))), SERVER, T0 + 0.5)
    assert isinstance(nonces, tuple)
    plane = choose_plane(Transport.AUTO, received.transport, same_host=True)
    assert plane == "tcp"
    admission = HelloReply(SERVER, 0, plane=plane, data=DataOffer(40000), dconns=3)  # no token on the wire
    # server -> client
    reply = hello_reply_from_wire(wire(reply_to_wire(2, admission.to_wire())))
    assert isinstance(reply, HelloReply) and not is_challenge(reply.to_wire())
    assert client_plane(choose_plane(Transport.TCP, reply.transport, True) or "shm", reply.plane) == "tcp"
    plan = data_connections(reply, KEY, (hello.cn or b"", parsed.challenge))
    assert plan == DataConnections(40000, auth.data_token(KEY, *nonces), 3)


# -- TCP data connections ------------------------------------------------------------------------------------------
def test_data_connections() -> None:
    token = b"t" * 16
    nonces = (b"c" * 32, b"s" * 32)
    derived = auth.data_token(KEY, *nonces)

    def run(data: DataOffer | None, dconns: int | None, key: bytes | None = None,
            with_nonces: bool = False) -> DataConnections | str:
        return data_connections(HelloReply(1, data=data, dconns=dconns), key, nonces if with_nonces else None)

    assert run(DataOffer(5000, token), 2) == DataConnections(5000, token, 2)
    assert run(DataOffer(5000, token), 2, KEY, True) == DataConnections(5000, token, 2)  # a sent token is used
    assert run(DataOffer(5000), MAX_DATA_CONNECTIONS, KEY, True) == DataConnections(5000, derived,
                                                                                   MAX_DATA_CONNECTIONS)
    no_offer = "the peer offers no TCP data connections"
    assert run(DataOffer(5000), 2) == no_offer  # no token and nothing to derive it from
    assert run(DataOffer(5000), 2, KEY) == no_offer
    assert run(DataOffer(5000), 2, None, True) == no_offer
    assert run(None, 2, KEY, True) == no_offer
    for count in (None, 0, MAX_DATA_CONNECTIONS + 1):
        assert run(DataOffer(5000, token), count) == f"the peer offers a bad number of data connections: {count!r}"
    assert str(run(None, None)).startswith("the peer offers a bad number")  # the count is checked first


def test_what_a_malformed_offer_decodes_to() -> None:
    """The admission's offer is checked only when the link uses TCP: malformed, it decodes to nothing."""
    reply = HelloReply.from_wire({"cluster": 1, "data": [70000, b"t" * 16], "dconns": 99})
    assert (reply.data, reply.dconns) == (None, None)
    assert isinstance(data_connections(reply, None, None), str)
