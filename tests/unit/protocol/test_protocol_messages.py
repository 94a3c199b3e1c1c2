"""The typed wire messages, sans IO: values -> bytes -> values, golden dicts, malformed fields.

The golden dicts pin the wire format (the HELLO body and reply, the BEGIN/END/ABORT/FREED bodies and BEGIN reply,
the channel's reply envelope): it must not change, down to the key order, except deliberately with a new protocol
version.  A cache geometry (BEGIN's ``peer``, a descriptor's ``geometry``) carries the cache's data type as a fifth
element, so that caches of different data types with equal block sizes are refused (``[2, 8 * 4096, 8, True, 1]``
below: 1 = ``DT_FLOAT16``).  END has an optional ``note`` (absent when there is none) and NOTIFY is
``{"note": bytes}``; RESOLVE is ``{"addrs": [u64, ...]}``, answered with ``{"at": [[cid, tensor, slot, blocks,
model], ...]}``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest
from helpers.examples import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiodatadist.errors import LLMStatusCode
from aiodatadist.layout.plans import CacheGeometry, TransferParams
from aiodatadist.memory import SegmentIdentity
from aiodatadist.protocol.codec import Kind, ProtocolError, decode_batch, encode, encode_batch
from aiodatadist.protocol.handshake import PROTOCOL_VERSION
from aiodatadist.protocol.messages import (
    HOST_NONCE_BYTES,
    IPC_HANDLE_BYTES,
    MAX_ANNOUNCED_SEGMENTS,
    MAX_DATA_CONNECTIONS,
    MAX_IPC_ALLOCATIONS,
    MAX_NOTE_BYTES,
    Abort,
    Begin,
    BeginReply,
    Bye,
    DataOffer,
    Descriptor,
    End,
    EndReply,
    Freed,
    Hello,
    HelloChallenge,
    HelloReply,
    HostInfo,
    NixlReach,
    Notify,
    Ping,
    Reply,
    Request,
    WireKey,
    Withdraw,
    geometry_from_wire,
    geometry_to_wire,
    hello_reply_from_wire,
    ipc_from_wire,
    is_challenge,
    params_from_wire,
    params_to_wire,
    published_from_wire,
    range_from_wire,
    range_to_wire,
    reply_to_wire,
    request_from_wire,
    request_to_wire,
    segment_from_wire,
    segment_to_wire,
    segments_from_wire,
    transport_from_wire,
)
from aiodatadist.types import Transport

S = LLMStatusCode
U64_MAX = 2**64 - 1
I64_MAX = 2**63 - 1

PROBE = SegmentIdentity(pid=4242, fd=9, inode=5551, device=66, size=4096)
HOST = HostInfo("6c3f-boot", 4242, PROBE, 0x7F00_0000_1000, b"n" * 32)
HOST_WIRE = {"boot": "6c3f-boot", "pid": 4242, "probe": [4242, 9, 5551, 66, 4096, 0x7F00_0000_1000], "nonce": b"n" * 32}
SEG = SegmentIdentity(pid=4242, fd=11, inode=777, device=66, size=1 << 20)
SEG_BASE = 0x7F10_0000_0000
DIRECTORY = SegmentIdentity(pid=4242, fd=12, inode=778, device=66, size=1 << 16)
GEOMETRY = CacheGeometry(num_tensors=2, tensor_size=8 * 4096, slots=8, is_blocks=True, data_type=1)  # DT_FLOAT16
PARAMS = TransferParams(op="pull", api="blocks", src_blocks=(3, 5), dst_blocks=(0, 1), src_layer_range=range(1),
                        dst_layer_range=None, tensor_num_per_layer=2, size=-1, local_slot=0)
CN, SN, SP, CP = b"c" * 32, b"s" * 32, b"p" * 32, b"q" * 32
HANDLE_A, HANDLE_B = b"A" * 64, b"B" * 64


def pack(value: Any) -> bytes:
    return bytes(msgpack.packb(value, use_bin_type=True))


def through_the_wire(message: dict[str, Any]) -> dict[str, Any]:
    """Encode one message into a frame and decode it back (what the peer's reader sees)."""
    [decoded] = decode_batch(encode_batch([message]))
    return decoded


# -- golden dicts: exactly what the inline code built -------------------------------------------------------------
def test_hello_golden() -> None:
    hello = Hello(PROTOCOL_VERSION, cluster=1, target=2, role=1, transport=Transport.AUTO, host=HOST,
                  segs=((SEG, SEG_BASE),), directory=DIRECTORY, reads=True, cn=CN)
    # links.py _hello_body(remote_id) and {**body, "cn": client_nonce}
    body = {"v": PROTOCOL_VERSION, "cluster": 1, "to": 2, "role": 1, "host": HOST_WIRE, "transport": "auto",
            "segs": [[4242, 11, 777, 66, 1 << 20, SEG_BASE]], "dir": [4242, 12, 778, 66, 1 << 16], "reads": True}
    first = {**body, "cn": CN}
    assert hello.to_wire() == first and list(hello.to_wire()) == list(first)
    # the second HELLO of an authenticated link: {**body, "sn": server_nonce, "cp": client_proof}
    second = {**first, "sn": SN, "cp": CP}
    answered = dataclasses.replace(hello, sn=SN, cp=CP)
    assert answered.to_wire() == second and list(answered.to_wire()) == list(second)
    # Channel.request: {**body, "k": kind, "i": req_id}
    assert encode(request_to_wire(answered, 1)) == pack({**second, "k": "hello", "i": 1})
    assert PROTOCOL_VERSION == 9  # 3: data types; 4: RESOLVE; 5: nixl, fds; 6: fence, WRITE; 7: WITHDRAW; 8: window;
    # 9: device runtimes announced (HELLO, its reply, BEGIN), ACL keys


def test_hello_reply_golden() -> None:
    token = bytes(range(16))
    reply = HelloReply(cluster=2, role=0, host=HOST, transport=Transport.TCP, segs=(), directory=None, plane="tcp",
                       reads=True, data=DataOffer(40000, token), dconns=4)
    # links.py _on_hello: the reply dict, then reply["data"] = [port, token], reply["dconns"] = data_connections()
    expected: dict[str, Any] = {"cluster": 2, "role": 0, "host": HOST_WIRE, "transport": "tcp", "segs": [],
                                "dir": None, "plane": "tcp", "reads": True}
    expected["data"] = [40000, token]
    expected["dconns"] = 4
    assert reply.to_wire() == expected and list(reply.to_wire()) == list(expected)
    # an authenticated link: the token is derived on both ends, never sent
    authenticated = dataclasses.replace(reply, data=DataOffer(40000))
    assert authenticated.to_wire() == {**expected, "data": [40000]}
    # no data listener: neither key
    bare = dataclasses.replace(reply, data=None, dconns=None, plane="shm", transport=Transport.AUTO)
    assert bare.to_wire() == {"cluster": 2, "role": 0, "host": HOST_WIRE, "transport": "auto", "segs": [],
                              "dir": None, "plane": "shm", "reads": True}
    # Channel.reply: {**body, "k": "reply", "r": req_id, "code": 0, "msg": ""}
    assert encode(reply_to_wire(1, reply.to_wire())) == pack({**expected, "k": "reply", "r": 1, "code": 0, "msg": ""})


def test_hello_challenge_golden() -> None:
    challenge = HelloChallenge(SN, SP)
    # links.py _authenticate: server.reply_raw(routing_id, {...}) (no "msg")
    expected = {"k": "reply", "r": 7, "code": 0, "challenge": SN, "sp": SP}
    assert challenge.reply_to_wire(7) == expected and list(challenge.reply_to_wire(7)) == list(expected)
    assert encode(challenge.reply_to_wire(7)) == pack(expected)


def test_refusals_golden() -> None:
    # links.py: reply_raw(routing_id, {"k": Kind.REPLY, "r": req_id, "code": code, "msg": msg}); channel.py Server
    expected = {"k": "reply", "r": 3, "code": int(S.LLM_LINK_FAILED), "msg": "authentication failed"}
    built = reply_to_wire(3, code=int(S.LLM_LINK_FAILED), msg="authentication failed")
    assert built == expected and list(built) == list(expected)
    assert Reply(3, int(S.LLM_LINK_FAILED), "authentication failed").to_wire() == expected
    not_linked = {"k": "reply", "r": 9, "code": int(S.LLM_NOT_YET_LINK), "msg": "not linked"}
    assert encode(reply_to_wire(9, code=int(S.LLM_NOT_YET_LINK), msg="not linked")) == pack(not_linked)


def test_begin_golden() -> None:
    begin = Begin(tid=77, key=WireKey("blocks", 5, 0), peer=GEOMETRY, params=PARAMS, known=(3, 4))
    # transfer.py _run: {"tid", "key": wkey.to_wire(), "peer": geometry_to_wire(...), "known": [...],
    # **params_to_wire(params)}
    expected = {"tid": 77, "key": ["blocks", 5, 0], "peer": [2, 8 * 4096, 8, True, 1], "known": [3, 4],
                "op": "pull", "api": "blocks", "sb": [3, 5], "db": [0, 1], "sr": [0, 1], "dr": None, "n": 2,
                "size": -1, "slot": 0}
    assert begin.to_wire() == expected and list(begin.to_wire()) == list(expected)
    assert encode(request_to_wire(begin, 12)) == pack({**expected, "k": "begin", "i": 12})
    # a same-host push offers its source tensors (the owner may copy it itself): "src" last, absent otherwise
    push = dataclasses.replace(begin, params=PARAMS._replace(op="push"), src=(1 << 40, (1 << 40) + 4096))
    wire = push.to_wire()
    assert list(wire)[-1] == "src" and wire["src"] == [1 << 40, (1 << 40) + 4096]
    assert Begin.from_wire(wire) == push
    for bad in ([1], [1, -1], [1, True], [1, 2.0], [1, 1 << 64]):  # one per source tensor, each a uint64
        with pytest.raises(ProtocolError):
            Begin.from_wire({**wire, "src": bad})
    with pytest.raises(ProtocolError):  # a pull's source is the owner's
        Begin.from_wire({**begin.to_wire(), "src": [1, 2]})
    # ... and the shared-memory segment that holds them, if any: "sseg" after "src", only with it
    in_segment = dataclasses.replace(push, sseg=(SEG, SEG_BASE))
    wire = in_segment.to_wire()
    assert list(wire)[-2:] == ["src", "sseg"] and wire["sseg"] == [4242, 11, 777, 66, 1 << 20, SEG_BASE]
    assert Begin.from_wire(wire) == in_segment
    assert "sseg" not in dataclasses.replace(begin, sseg=(SEG, SEG_BASE)).to_wire()  # no source offered
    assert Begin.from_wire({**begin.to_wire(), "sseg": wire["sseg"]}).sseg is None  # ignored without "src"
    for bad in ([1, 2, 3], [4242, 11, 777, 66, 1 << 20, -1], "segment", [4242, 11, 777, 66, True, 0]):
        with pytest.raises(ProtocolError):
            Begin.from_wire({**wire, "sseg": bad})


def test_begin_reply_golden() -> None:
    addrs = np.array([SEG_BASE, SEG_BASE + 8 * 4096], dtype=np.uint64)
    reply = BeginReply(cid=3, slot=1, pub=(5, 99), desc=Descriptor(GEOMETRY, addrs, (SEG, SEG_BASE)))
    # transfer.py _begin: {"cid", "slot"}, reply["pub"] = list(entry.published), reply["desc"] = {...}
    expected = {"cid": 3, "slot": 1, "pub": [5, 99],
                "desc": {"geometry": [2, 8 * 4096, 8, True, 1], "addrs": [SEG_BASE, SEG_BASE + 8 * 4096],
                         "segment": [4242, 11, 777, 66, 1 << 20, SEG_BASE]}}
    assert reply.to_wire() == expected and list(reply.to_wire()) == list(expected)
    assert list(reply.to_wire()["desc"]) == ["geometry", "addrs", "segment"]
    assert all(type(a) is int for a in reply.to_wire()["desc"]["addrs"])  # .tolist(): plain ints
    # a device cache: reply["desc"]["ipc"] = ipc_export(...) ([handle, base, size] lists)
    device = BeginReply(3, 0, None, Descriptor(GEOMETRY, addrs, None, ((HANDLE_A, 4096, 1 << 20),)))
    assert device.to_wire() == {"cid": 3, "slot": 0, "desc": {
        "geometry": [2, 8 * 4096, 8, True, 1], "addrs": [SEG_BASE, SEG_BASE + 8 * 4096], "segment": None,
        "ipc": [[HANDLE_A, 4096, 1 << 20]]}}
    # known descriptor, unpublished cache
    assert BeginReply(3, 0).to_wire() == {"cid": 3, "slot": 0}
    # a push the owner copied itself before answering
    assert BeginReply(3, 0, copies=True).to_wire() == {"cid": 3, "slot": 0, "copies": True}
    assert BeginReply.from_wire({"cid": 3, "slot": 0, "copies": True}).copies
    assert not BeginReply.from_wire({"cid": 3, "slot": 0, "copies": 1}).copies  # only True says so
    # the nixl plane: the owner agent's metadata for the cache, its memory type and device
    nixl = BeginReply(3, 0, None, Descriptor(GEOMETRY, addrs, None, nixl=NixlReach(b"md", "DRAM", 0)))
    assert nixl.to_wire()["desc"]["nixl"] == [b"md", "DRAM", 0]
    assert BeginReply.from_wire(nixl.to_wire()) == nixl


@pytest.mark.parametrize("reach", [[], [b"", "DRAM", 0], ["md", "DRAM", 0], [b"md", "HBM", 0], [b"md", "DRAM", -1],
                                   [b"md", "VRAM", 1 << 16], [b"md", "DRAM"], {"md": b"x"}])
def test_a_malformed_nixl_reach_is_refused(reach: object) -> None:
    wire = Descriptor(GEOMETRY, np.array([1, 2], dtype=np.uint64)).to_wire()
    with pytest.raises(ProtocolError):
        Descriptor.from_wire({**wire, "nixl": reach})


def test_end_golden() -> None:
    assert End(5, True, confirm=True).to_wire() == {"tid": 5, "ok": True, "confirm": True}
    assert End(5, False).to_wire() == {"tid": 5, "ok": False}
    assert End(5, True).to_wire() == {"tid": 5, "ok": True}
    assert encode(request_to_wire(End(5, True), 2)) == pack({"tid": 5, "ok": True, "k": "end", "i": 2})
    # the owner's answer to a streamed END: channel.reply(i, {"waited": ms}, code=code, msg=text)
    expected = {"waited": 1.25, "k": "reply", "r": 2, "code": int(S.LLM_LINK_FAILED), "msg": "broken"}
    assert reply_to_wire(2, EndReply(1.25).to_wire(), code=int(S.LLM_LINK_FAILED), msg="broken") == expected
    assert EndReply().to_wire() == {}


def test_notification_forms_golden() -> None:
    assert End(5, True, note=b"req 7 done").to_wire() == {"tid": 5, "ok": True, "note": b"req 7 done"}
    assert End(5, True, confirm=True, note=b"").to_wire() == {"tid": 5, "ok": True, "confirm": True, "note": b""}
    assert encode(request_to_wire(End(5, True, note=b"x"), 2)) == pack(
        {"tid": 5, "ok": True, "note": b"x", "k": "end", "i": 2})
    assert Notify(b"hi").to_wire() == {"note": b"hi"}
    assert encode(request_to_wire(Notify(b"hi"), 7)) == pack({"note": b"hi", "k": "notify", "i": 7})
    assert request_from_wire({"k": "notify", "i": 7, "note": b"hi"}) == Notify(b"hi")
    assert End.from_wire({"tid": 1, "ok": True}).note is None  # absent: no notification
    # the NOTIFY answer is an empty reply
    assert reply_to_wire(7, {}) == {"k": "reply", "r": 7, "code": 0, "msg": ""}


def test_notifications_are_bounded() -> None:
    assert MAX_NOTE_BYTES == 4096
    biggest = b"n" * MAX_NOTE_BYTES
    assert Notify.from_wire({"note": biggest}).note == biggest
    assert End.from_wire({"tid": 1, "ok": True, "note": biggest}).note == biggest
    for bad in (biggest + b"n", "text", 5, True, [b"x"], bytearray(b"x")):
        with pytest.raises(ProtocolError):
            Notify.from_wire({"note": bad})
        with pytest.raises(ProtocolError):
            End.from_wire({"tid": 1, "ok": True, "note": bad})
    with pytest.raises(ProtocolError):
        Notify.from_wire({})  # a NOTIFY without a note is malformed
    through = decode_batch(encode(request_to_wire(Notify(biggest), 1)))[0]
    assert request_from_wire(through) == Notify(biggest)


def test_small_requests_golden() -> None:
    assert Abort(9).to_wire() == {"tid": 9}
    assert encode(request_to_wire(Abort(9), 4)) == pack({"tid": 9, "k": "abort", "i": 4})
    assert encode(request_to_wire(Withdraw(9, 3), 6)) == pack({"tid": 9, "cid": 3, "k": "withdraw", "i": 6})
    # transfer.py announce_freed: {"cid"}, body["seg"] = [inode, device], body["ipc"] = sorted(entry.exported)
    freed = Freed(3, (777, 66), tuple(sorted({HANDLE_B, HANDLE_A})))
    assert freed.to_wire() == {"cid": 3, "seg": [777, 66], "ipc": [HANDLE_A, HANDLE_B]}
    assert Freed(3, (777, 66)).to_wire() == {"cid": 3, "seg": [777, 66]}
    assert Freed(3, None, (HANDLE_A,)).to_wire() == {"cid": 3, "ipc": [HANDLE_A]}
    assert Ping().to_wire() == {} and Bye().to_wire() == {}
    assert encode(request_to_wire(Ping(), 5)) == pack({"k": "ping", "i": 5})
    assert encode(request_to_wire(Bye(), 6)) == pack({"k": "bye", "i": 6})
    assert reply_to_wire(5, Ping().to_wire()) == {"k": "reply", "r": 5, "code": 0, "msg": ""}  # PING's answer {}


def test_shared_wire_forms_golden() -> None:
    assert WireKey("req", -1, 2**64 - 1).to_wire() == ["req", -1, 2**64 - 1]
    assert geometry_to_wire(GEOMETRY) == [2, 8 * 4096, 8, True, 1]
    assert segment_to_wire(SEG, SEG_BASE) == [4242, 11, 777, 66, 1 << 20, SEG_BASE]
    assert segment_to_wire(None, 0) is None
    assert range_to_wire(range(2, 5)) == [2, 5] and range_to_wire(None) is None
    assert params_to_wire(PARAMS) == {"op": "pull", "api": "blocks", "sb": [3, 5], "db": [0, 1], "sr": [0, 1],
                                      "dr": None, "n": 2, "size": -1, "slot": 0}
    assert HOST.to_wire() == HOST_WIRE


def test_the_host_probe_form_is_what_a_host_probe_announces() -> None:
    from aiodatadist.transport.same_host import HostProbe

    probe = HostProbe()
    try:
        announced = probe.info().to_wire()
        assert HostInfo.from_wire(announced).to_wire() == announced
    finally:
        probe.close()


def test_bounds_shared_with_other_layers() -> None:
    from aiodatadist.cuda.driver import CU_IPC_HANDLE_SIZE
    from aiodatadist.transport import same_host
    from aiodatadist.transport.tcp import python_connections

    assert MAX_DATA_CONNECTIONS == python_connections.MAX_DATA_CONNECTIONS
    assert IPC_HANDLE_BYTES == CU_IPC_HANDLE_SIZE
    assert MAX_ANNOUNCED_SEGMENTS == same_host.MAX_ANNOUNCED_SEGMENTS
    assert HOST_NONCE_BYTES == same_host.NONCE_BYTES
    assert MAX_IPC_ALLOCATIONS == 4096


# -- round trips ---------------------------------------------------------------------------------------------------
u64 = st.integers(0, U64_MAX)
i64 = st.integers(-(2**63), I64_MAX)
any_int = st.integers(-(2**63), U64_MAX)
segment_ids = st.builds(SegmentIdentity, u64, u64, u64, u64, u64)
segments = st.tuples(segment_ids, u64)
geometries = st.builds(lambda n, slots, stride, blocks: CacheGeometry(n, slots * stride, slots, blocks),
                       st.integers(1, 64), st.integers(1, 4096), st.integers(1, 2**30), st.booleans())
wire_keys = st.builds(WireKey, st.sampled_from(["id", "blocks", "req", "prefix"]), any_int, any_int)
ranges = st.one_of(st.none(), st.builds(range, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)))
block_lists = st.lists(st.integers(0, I64_MAX), max_size=6).map(tuple)
params = st.builds(TransferParams, op=st.sampled_from(["pull", "push"]), api=st.sampled_from(["cache", "blocks"]),
                   src_blocks=block_lists, dst_blocks=block_lists, src_layer_range=ranges, dst_layer_range=ranges,
                   tensor_num_per_layer=st.integers(1, 2**32 - 1), size=st.integers(-1, I64_MAX),
                   local_slot=st.integers(0, 2**32 - 1))
hosts = st.builds(HostInfo, st.text(max_size=40), any_int, st.builds(SegmentIdentity, any_int, any_int, any_int,
                                                                     any_int, any_int),
                  any_int, st.binary(min_size=HOST_NONCE_BYTES, max_size=HOST_NONCE_BYTES))
transports = st.sampled_from(list(Transport))
nonces = st.binary(min_size=32, max_size=32)
handles = st.binary(min_size=IPC_HANDLE_BYTES, max_size=IPC_HANDLE_BYTES)

hellos = st.builds(
    Hello, version=any_int, cluster=u64, target=u64, role=st.integers(0, 3), transport=transports,
    host=st.none() | hosts, segs=st.lists(segments, max_size=4).map(tuple), directory=st.none() | segment_ids,
    reads=st.booleans(), cn=st.none() | nonces, sn=st.none() | st.binary(max_size=40),
    cp=st.none() | st.binary(max_size=40))
data_offers = st.builds(DataOffer, st.integers(1, 65535), st.none() | st.binary(min_size=16, max_size=16))
hello_replies = st.builds(
    HelloReply, cluster=u64, role=i64, host=st.none() | hosts, transport=transports,
    segs=st.lists(segments, max_size=4).map(tuple), directory=st.none() | segment_ids,
    plane=st.sampled_from(["shm", "tcp"]), reads=st.booleans(), data=st.none() | data_offers,
    dconns=st.none() | st.integers(1, MAX_DATA_CONNECTIONS))
challenges = st.builds(HelloChallenge, nonces, st.binary(max_size=40))
begins = st.builds(Begin, tid=u64, key=wire_keys, peer=geometries, params=params,
                   known=st.lists(st.integers(1, I64_MAX), max_size=6).map(tuple))
notes = st.binary(max_size=MAX_NOTE_BYTES)
ends = st.builds(End, tid=u64, ok=st.booleans(), confirm=st.booleans(), note=st.none() | notes)
notifies = st.builds(Notify, notes)
aborts = st.builds(Abort, u64)
withdraws = st.builds(Withdraw, u64, st.integers(1, I64_MAX))
freeds = st.builds(Freed, st.integers(1, I64_MAX), st.none() | st.tuples(any_int, any_int),
                   st.lists(handles, max_size=4).map(tuple))
requests: st.SearchStrategy[Request] = st.one_of(
    hellos, begins, ends, aborts, withdraws, freeds, st.just(Ping()), st.just(Bye()), notifies)


@st.composite
def descriptors(draw: st.DrawFn) -> Descriptor:
    geometry = draw(geometries)
    ipc = draw(st.none() | st.lists(st.tuples(handles, st.integers(1, 2**62), st.integers(1, 2**62)), min_size=1,
                                    max_size=4).map(lambda items: tuple(sorted(items, key=lambda i: i[1]))))
    if draw(st.booleans()):
        addrs = draw(st.lists(u64, min_size=geometry.num_tensors, max_size=geometry.num_tensors))
        return Descriptor(geometry, np.array(addrs, dtype=np.uint64), None, ipc)
    base = draw(st.integers(0, 2**62))
    slack = draw(st.integers(0, 2**20))
    size = geometry.tensor_size * geometry.num_tensors + slack
    starts = draw(st.lists(st.integers(0, size - geometry.tensor_size), min_size=geometry.num_tensors,
                           max_size=geometry.num_tensors))
    identity = SegmentIdentity(*draw(st.tuples(u64, u64, u64, u64)), size)
    return Descriptor(geometry, np.array([base + s for s in starts], dtype=np.uint64), (identity, base), ipc)


begin_replies = st.builds(BeginReply, cid=st.integers(1, I64_MAX), slot=st.integers(0, 2**32 - 1),
                          pub=st.none() | st.tuples(u64, u64), desc=st.none() | descriptors())
end_replies = st.builds(EndReply, st.none() | st.floats(allow_nan=False))
replies = st.builds(Reply, u64, st.integers(-(2**63), I64_MAX), st.text(max_size=30))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests, u64)
def test_every_request_round_trips(message: Request, req_id: int) -> None:
    decoded = through_the_wire(request_to_wire(message, req_id))
    assert decoded["k"] == message.KIND and decoded["i"] == req_id
    assert type(message).from_wire(decoded) == message
    assert request_from_wire(decoded) == message


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(hello_replies, challenges, begin_replies, end_replies), u64)
def test_every_reply_body_round_trips(body: Any, req_id: int) -> None:
    wire = body.reply_to_wire(req_id) if isinstance(body, HelloChallenge) else reply_to_wire(req_id, body.to_wire())
    decoded = through_the_wire(wire)
    assert type(body).from_wire(decoded) == body
    assert Reply.from_wire(decoded) == Reply(req_id, 0, None if isinstance(body, HelloChallenge) else "")
    if isinstance(body, (HelloReply, HelloChallenge)):
        assert hello_reply_from_wire(decoded) == body


@settings(max_examples=examples(100), deadline=None)
@given(replies)
def test_the_reply_envelope_round_trips(reply: Reply) -> None:
    assert Reply.from_wire(through_the_wire(reply.to_wire())) == reply


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(requests, u64), min_size=1, max_size=12))
def test_a_batch_of_requests_round_trips(batch: list[tuple[Request, int]]) -> None:
    decoded = decode_batch(encode_batch([request_to_wire(m, i) for m, i in batch]))
    assert [request_from_wire(m) for m in decoded] == [m for m, _ in batch]
    assert [m["i"] for m in decoded] == [i for _, i in batch]


def test_a_descriptor_compares_its_addresses_by_value() -> None:
    a = Descriptor(GEOMETRY, np.array([1, 2], dtype=np.uint64))
    assert a == Descriptor(GEOMETRY, np.array([1, 2], dtype=np.uint64))
    assert a != Descriptor(GEOMETRY, np.array([1, 3], dtype=np.uint64))
    assert BeginReply(1, 0, None, a) == BeginReply(1, 0, None, Descriptor(GEOMETRY, np.array([1, 2], np.uint64)))


# -- what a minimal peer sends -------------------------------------------------------------------------------------
def test_a_bare_hello_decodes_with_defaults() -> None:
    """The fields a raw client (tests/integration/test_hostile.py) sends; the rest is optional."""
    hello = Hello.from_wire({"k": "hello", "i": 1, "v": 2, "cluster": 77, "to": 1, "role": 0, "transport": "auto"})
    assert hello == Hello(2, 77, 1, 0)
    assert (hello.host, hello.segs, hello.directory, hello.reads, hello.cn, hello.cp) == (None, (), None, False,
                                                                                          None, None)


def test_a_bare_admission_decodes_with_defaults() -> None:
    reply = HelloReply.from_wire({"k": "reply", "r": 1, "code": 0, "msg": "", "cluster": 5})
    assert reply == HelloReply(5)
    assert (reply.role, reply.transport, reply.plane, reply.data, reply.dconns) == (0, Transport.AUTO, "shm",
                                                                                    None, None)


def test_replies_to_hello_are_told_apart() -> None:
    assert is_challenge({"challenge": SN, "sp": SP}) and not is_challenge({"cluster": 1})
    assert not is_challenge({"challenge": None, "cluster": 1})
    assert hello_reply_from_wire({"challenge": SN, "sp": SP}) == HelloChallenge(SN, SP)
    assert hello_reply_from_wire({"cluster": 1}) == HelloReply(1)


def test_reply_codes_and_messages() -> None:
    assert Reply.from_wire({"r": 1, "code": 0, "msg": ""}) == Reply(1, 0, "")
    assert Reply.from_wire({"r": 1}) == Reply(1, 0, None)  # e.g. the challenge: no code error, no message
    assert Reply.from_wire({"r": 1}).error == "peer reported an error"
    assert Reply.from_wire({"r": 1, "code": 501, "msg": "no"}).error == "no"
    assert Reply.from_wire({"r": 1, "code": 501, "msg": 5}).msg == "5"
    assert Reply.from_wire({"r": 1, "code": 501, "msg": None}).msg == "None"  # str() of whatever came
    for raw, code in [(None, 0), (False, 0), ("", 0), (0.0, 0), ([], 0), ("x", -1), (1.5, -1), ([1], -1), (True, 1),
                      (-7, -7)]:
        assert Reply.from_wire({"r": 1, "code": raw}).code == code, raw
    with pytest.raises(ProtocolError):
        Reply.from_wire({"code": 0})


# -- malformed fields ----------------------------------------------------------------------------------------------
VALID_HELLO = {"v": 2, "cluster": 1, "to": 2, "role": 0, "transport": "auto"}
VALID_BEGIN = {"tid": 5, "key": ["blocks", 0, 0], "peer": [2, 8 * 4096, 8, True, 1], "known": [], "op": "pull",
               "api": "blocks", "sb": [1], "db": [2], "sr": None, "dr": None, "n": 2, "size": -1, "slot": 0}
VALID_BEGIN_REPLY = {"cid": 3, "slot": 0}
BAD_INTS = [None, True, 1.0, "1", b"1", [1]]

MALFORMED: list[tuple[type[Any], dict[str, Any], str, list[Any]]] = [
    (Hello, VALID_HELLO, "v", BAD_INTS),
    (Hello, VALID_HELLO, "cluster", [*BAD_INTS, -1]),
    (Hello, VALID_HELLO, "to", [*BAD_INTS, -1]),
    (Hello, VALID_HELLO, "role", [*BAD_INTS, -1, 4]),
    (Hello, VALID_HELLO, "transport", [None, 1, True, b"auto", ["auto"]]),
    (Begin, VALID_BEGIN, "tid", [*BAD_INTS, -1]),
    (Begin, VALID_BEGIN, "key", [None, [], ["blocks", 0], ["blocks", 0, 0, 0], ["other", 0, 0], ["id", True, 0],
                                 ["id", 0, 1.0], ["id", -(2**63) - 1, 0], ("id", 0, 0), "id"]),
    (Begin, VALID_BEGIN, "peer", [None, [2, 8, 8], [2, 8, 8, 1], [0, 8, 8, True, 4], [2, 0, 8, True, 4], [2, 8, 0, True, 4],
                                  [2, 9, 8, True, 4], [-2, 8, 8, True, 4], [2, 2**63, 1, True, 4], [True, 8, 8, True, 4]]),
    (Begin, VALID_BEGIN, "known", [[0], [2**63], [True], [1.0], [-1], 5, "x"]),
    (Begin, VALID_BEGIN, "op", [None, "get", 1, b"pull"]),
    (Begin, VALID_BEGIN, "api", [None, "block", 1]),
    (Begin, VALID_BEGIN, "sb", [[-1], [2**63], [True], [None], 1, "x"]),
    (Begin, VALID_BEGIN, "db", [[-1], [2**63], [False], [1.5]]),
    (Begin, VALID_BEGIN, "sr", [[0], [0, 1, 2], [-1, 2], [0, 2**32], [True, 2], "0:1", 1]),
    (Begin, VALID_BEGIN, "dr", [[0], [1.0, 2], [0, None]]),
    (Begin, VALID_BEGIN, "n", [*BAD_INTS, 0, 2**32]),
    (Begin, VALID_BEGIN, "size", [*BAD_INTS, -2, 2**63]),
    (Begin, VALID_BEGIN, "slot", [*BAD_INTS, -1, 2**32]),
    (End, {"tid": 1, "ok": True}, "tid", [*BAD_INTS, -1]),
    (End, {"tid": 1, "ok": True}, "ok", [None, 1, 0, "true", [True]]),
    (Abort, {"tid": 1}, "tid", [*BAD_INTS, -1]),
    (Withdraw, {"tid": 1, "cid": 1}, "tid", [*BAD_INTS, -1]),
    (Withdraw, {"tid": 1, "cid": 1}, "cid", [*BAD_INTS, 0, 2**63]),
    (Notify, {"note": b"x"}, "note", [None, "x", 1, True, [b"x"], b"x" * (MAX_NOTE_BYTES + 1)]),
    (Freed, {"cid": 1}, "cid", [*BAD_INTS, 0, 2**63]),
    (BeginReply, VALID_BEGIN_REPLY, "cid", [*BAD_INTS, 0, 2**63]),
    (BeginReply, VALID_BEGIN_REPLY, "slot", [*BAD_INTS, -1, 2**32]),
    (BeginReply, VALID_BEGIN_REPLY, "pub", [[1], [1, 2, 3], [-1, 2], [1, True], [1.0, 2], "x", 5]),
    (BeginReply, VALID_BEGIN_REPLY, "desc", [5, [], "x", {}, {"geometry": [2, 8, 8, True, 4]},
                                             {"geometry": [2, 8, 8, True, 4], "addrs": [1]},
                                             {"geometry": [2, 8, 8, True, 4], "addrs": [1, -1]},
                                             {"geometry": [2, 8, 8, True, 4], "addrs": [1, True]},
                                             {"geometry": [2, 8, 8, True, 4], "addrs": [1, 2], "segment": [1, 2]},
                                             {"geometry": [2, 8, 8, True, 4], "addrs": [1, 2], "ipc": []}]),
    (HelloReply, {"cluster": 1}, "cluster", [*BAD_INTS, -1]),
    (HelloChallenge, {"challenge": SN, "sp": SP}, "challenge", [b"s" * 31, b"s" * 33, "s" * 32, 5, [SN]]),
    (HelloChallenge, {"challenge": SN, "sp": SP}, "sp", [None, "p", 5, [SP]]),
    (Reply, {"r": 1}, "r", [*BAD_INTS, -1]),
]


@pytest.mark.parametrize(("cls", "valid", "name", "bad"), MALFORMED,
                         ids=[f"{c.__name__}-{n}" for c, _, n, _ in MALFORMED])
def test_a_malformed_field_is_a_protocol_error(cls: type[Any], valid: dict[str, Any], name: str,
                                               bad: list[Any]) -> None:
    cls.from_wire(valid)  # the valid message decodes
    for value in bad:
        with pytest.raises(ProtocolError):
            cls.from_wire({**valid, name: value})
    required = name not in ("known", "sb", "db", "sr", "dr", "pub", "desc")
    if required:
        with pytest.raises(ProtocolError):
            cls.from_wire({k: v for k, v in valid.items() if k != name})
    else:
        cls.from_wire({k: v for k, v in valid.items() if k != name})  # optional: absent is fine


def test_descriptor_checks() -> None:
    geometry = [2, 4096, 4, False, 4]  # 4 = DT_UINT8 (since protocol version 3)
    base = 1 << 30
    segment = [1, 2, 3, 4, 3 * 4096, base]
    ok = {"geometry": geometry, "addrs": [base, base + 2 * 4096], "segment": segment}
    assert Descriptor.from_wire(ok).segment == (SegmentIdentity(1, 2, 3, 4, 3 * 4096), base)
    for addrs in ([base - 1, base], [base, base + 2 * 4096 + 1], [base], [base, base, base]):
        with pytest.raises(ProtocolError, match="outside|addrs"):
            Descriptor.from_wire({**ok, "addrs": addrs})
    # without a segment, any addresses (caller-registered memory reached by process_vm_readv)
    assert Descriptor.from_wire({"geometry": geometry, "addrs": [0, U64_MAX], "segment": None}).segment is None
    # the segment must be six unsigned integers
    for bad in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, -1], [1, 2, 3, 4, 5, True], [1, 2, 3, 4, 5, 2**64 - 1, 0]):
        with pytest.raises(ProtocolError):
            Descriptor.from_wire({**ok, "segment": bad})


def test_ipc_allocations() -> None:
    assert ipc_from_wire(None) is None
    assert ipc_from_wire([[HANDLE_B, 200, 10], [HANDLE_A, 100, 10]]) == ((HANDLE_A, 100, 10), (HANDLE_B, 200, 10))
    assert len(ipc_from_wire([[HANDLE_A, 1, 1]] * MAX_IPC_ALLOCATIONS) or ()) == MAX_IPC_ALLOCATIONS
    for bad in ([], [[HANDLE_A, 1, 1]] * (MAX_IPC_ALLOCATIONS + 1), "x", [[HANDLE_A[:63], 1, 1]],
                [["A" * 64, 1, 1]], [[HANDLE_A, 0, 1]], [[HANDLE_A, 1, 0]], [[HANDLE_A, 2**63, 2**63]],
                [[HANDLE_A, 1, True]], [[HANDLE_A, 1]], [(HANDLE_A, 1, 1)]):
        with pytest.raises(ProtocolError):
            ipc_from_wire(bad)
    assert ipc_from_wire([[HANDLE_A, 2**63, 2**63 - 1]]) == ((HANDLE_A, 2**63, 2**63 - 1),)


def test_shared_forms_bounds() -> None:
    assert WireKey.from_wire(["id", -(2**63), U64_MAX]) == WireKey("id", -(2**63), U64_MAX)
    assert geometry_from_wire([1, I64_MAX, 1, False, 27]) == CacheGeometry(1, I64_MAX, 1, False, 27)
    for bad in ([1, 64, 1, False], [1, 64, 1, False, None], [1, 64, 1, False, True], [1, 64, 1, False, 2**63],
                [1, 64, 1, False, 4, 0]):  # version 2's four elements are refused: the data type is required
        with pytest.raises(ProtocolError):
            geometry_from_wire(bad)
    assert segment_from_wire(None) is None
    assert segment_from_wire([0, 0, 0, 0, 0, U64_MAX]) == (SegmentIdentity(0, 0, 0, 0, 0), U64_MAX)
    assert range_from_wire(None) is None and range_from_wire([5, 2]) == range(5, 2)  # empty ranges are the plan's
    assert range_from_wire([0, 2**32 - 1]) == range(2**32 - 1)
    assert published_from_wire([0, U64_MAX]) == (0, U64_MAX)
    assert params_from_wire(VALID_BEGIN) == TransferParams("pull", "blocks", (1,), (2,), None, None, 2, -1, 0)
    assert params_from_wire({**VALID_BEGIN, "sb": None, "db": None}).src_blocks == ()


# -- lenient fields: tolerated as before, they decode to a neutral value -------------------------------------------
HOSTILE = [None, True, 99, -1, 1.5, "x", b"x", [], [1, 2], {"a": 1}, [[1, 2, 3, 4, 5]], {"boot": 1}]


def test_lenient_hello_fields() -> None:
    for value in HOSTILE:
        hello = Hello.from_wire({**VALID_HELLO, "host": value, "segs": value, "dir": value, "reads": value,
                                 "cn": value, "sn": value})
        assert hello.host is None and hello.directory is None and hello.reads is (value is True)
        assert hello.cn is None and hello.sn == (value if isinstance(value, bytes) else None)
        assert hello.segs == ()
    assert Hello.from_wire({**VALID_HELLO, "cn": b"c" * 31}).cn is None  # a client nonce is 32 bytes
    assert Hello.from_wire({**VALID_HELLO, "transport": "carrier pigeon"}).transport == Transport.AUTO
    assert Hello.from_wire({**VALID_HELLO, "transport": "tcp"}).transport == Transport.TCP
    # a proof that is there but not bytes is a failed proof, never "no proof" (which asks for a challenge)
    for proof in (5, "x", [CP], True):
        assert Hello.from_wire({**VALID_HELLO, "cp": proof}).cp == b""
    assert Hello.from_wire({**VALID_HELLO, "cp": None}).cp is None


def test_lenient_hello_reply_fields() -> None:
    for value in HOSTILE:
        reply = HelloReply.from_wire({"cluster": 1, "host": value, "transport": value, "segs": value, "dir": value,
                                      "plane": value, "reads": value, "data": value, "dconns": value})
        assert reply.host is None and reply.transport == Transport.AUTO and reply.segs == ()
        assert reply.directory is None and reply.plane == "shm" and reply.reads is (value is True)
        assert reply.data is None and reply.dconns is None
    for role, expected in [(None, 0), ("1", 0), (1.0, 0), (True, 1), (2, 2), (-5, -5), (2**40, 2**40)]:
        assert HelloReply.from_wire({"cluster": 1, "role": role}).role == expected
    for dconns, count in [(0, None), (1, 1), (MAX_DATA_CONNECTIONS, MAX_DATA_CONNECTIONS),
                             (MAX_DATA_CONNECTIONS + 1, None), (True, None), (2.0, None)]:
        assert HelloReply.from_wire({"cluster": 1, "dconns": dconns}).dconns == count


def test_data_offers() -> None:
    token = b"t" * 16
    assert DataOffer.from_wire([1]) == DataOffer(1) and DataOffer.from_wire([65535, token]) == DataOffer(65535, token)
    for bad in ([], [0], [65536], [True], [1.0], [1, b"t" * 15], [1, "t" * 16], [1, token, 3], (1, token), 1):
        with pytest.raises(ProtocolError):
            DataOffer.from_wire(bad)


def test_host_probes() -> None:
    assert HostInfo.from_wire(HOST_WIRE) == HOST
    assert HostInfo.from_wire({**HOST_WIRE, "extra": 1}) == HOST
    # types only, as probe_peer checked them: any ints (even bools) in the probe, a 32-byte nonce
    assert HostInfo.from_wire({**HOST_WIRE, "probe": [True, -1, 0, 0, 2**70, 0]}).address == 0
    for name, bad in [("boot", 1), ("pid", "1"), ("probe", [1, 2, 3, 4, 5]), ("probe", [1, 2, 3, 4, 5, 1.0]),
                      ("probe", None), ("nonce", "n" * 32), ("nonce", b"n" * 31)]:
        with pytest.raises(ProtocolError):
            HostInfo.from_wire({**HOST_WIRE, name: bad})
    for bad in (None, [], "x", 5, {k: v for k, v in HOST_WIRE.items() if k != "pid"}):
        with pytest.raises(ProtocolError):
            HostInfo.from_wire(bad)


def test_announced_segments() -> None:
    good = [1, 2, 3, 4, 5, 6]
    parsed = (SegmentIdentity(1, 2, 3, 4, 5), 6)
    assert segments_from_wire([good, None, [1], "x", [-1, 2, 3, 4, 5, 6], good]) == (parsed, parsed)
    assert segments_from_wire({"a": good}) == ()
    announced = [[-1] * 6] * MAX_ANNOUNCED_SEGMENTS + [good]  # only the first MAX_ANNOUNCED_SEGMENTS are looked at
    assert segments_from_wire(announced) == ()
    assert len(segments_from_wire([good] * (MAX_ANNOUNCED_SEGMENTS + 5))) == MAX_ANNOUNCED_SEGMENTS


def test_lenient_freed_fields() -> None:
    for value in HOSTILE:
        freed = Freed.from_wire({"cid": 1, "seg": value, "ipc": value})
        assert freed.seg == ((1, 2) if value == [1, 2] else None) and freed.ipc == ()
    assert Freed.from_wire({"cid": 1, "seg": [1, True]}).seg is None
    freed = Freed.from_wire({"cid": 1, "ipc": [HANDLE_A, b"x", 5, HANDLE_B[:63], HANDLE_B]})
    assert freed.ipc == (HANDLE_A, HANDLE_B)  # the valid handles only
    assert len(Freed.from_wire({"cid": 1, "ipc": [HANDLE_A] * (MAX_IPC_ALLOCATIONS + 3)}).ipc) == MAX_IPC_ALLOCATIONS


def test_lenient_end_fields() -> None:
    for value in (None, 1, "true", [True], False):
        assert End.from_wire({"tid": 1, "ok": True, "confirm": value}).confirm is False
    for value in (None, 1, "1.0", True):
        assert EndReply.from_wire({"waited": value}).waited is None
    assert EndReply.from_wire({"waited": 0.5}).waited == 0.5


def test_transport_from_wire() -> None:
    for value, expected in [("auto", Transport.AUTO), ("shm", Transport.SHM), ("tcp", Transport.TCP),
                            ("TCP", Transport.AUTO), (None, Transport.AUTO), (1, Transport.AUTO),
                            (["tcp"], Transport.AUTO), ({"tcp": 1}, Transport.AUTO), (b"tcp", Transport.AUTO)]:
        assert transport_from_wire(value) is expected


def test_request_dispatch() -> None:
    assert request_from_wire({"k": "ping", "i": 1}) == Ping()
    assert request_from_wire({"k": Kind.ABORT, "i": 1, "tid": 4}) == Abort(4)
    for kind in ("reply", "nonsense", None):
        with pytest.raises(ProtocolError, match="not a request"):
            request_from_wire({"k": kind, "r": 1})


# -- hostile input: a decoder returns a value or raises ProtocolError, nothing else --------------------------------
scalars = st.one_of(st.none(), st.booleans(), any_int, st.floats(allow_nan=True), st.text(max_size=8),
                    st.binary(max_size=70), nonces, handles,
                    st.sampled_from(["id", "blocks", "pull", "push", "cache", "tcp", "shm", "auto"]))
hostile = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=7),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                       max_leaves=16)
FIELD_NAMES = sorted({*VALID_BEGIN, *VALID_HELLO, "ok", "confirm", "cid", "seg", "ipc", "pub", "desc", "host",
                      "segs", "dir", "reads", "cn", "sn", "cp", "plane", "data", "dconns", "waited", "challenge",
                      "sp", "r", "code", "msg", "note"})
DECODERS: list[Any] = [Hello, Begin, End, Abort, Freed, Ping, Bye, Notify, HelloReply, HelloChallenge, BeginReply,
                       EndReply, Reply]


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([{}, VALID_HELLO, VALID_BEGIN, VALID_BEGIN_REPLY, {"tid": 1, "ok": True}, {"cid": 1}]),
       st.dictionaries(st.sampled_from(FIELD_NAMES), hostile, max_size=4))
def test_decoders_raise_only_protocol_errors(base: dict[str, Any], fields: dict[str, Any]) -> None:
    message = {**base, **fields}
    for cls in DECODERS:
        try:
            cls.from_wire(message)
        except ProtocolError:
            pass


def test_resolve_golden_and_malformed() -> None:
    from aiodatadist.protocol.messages import MAX_RESOLVED_ADDRS, Located, Resolve, ResolveReply

    message = Resolve((0x1000, 0x2000))
    assert message.to_wire() == {"addrs": [0x1000, 0x2000]}
    assert encode(request_to_wire(message, 7)) == pack({"addrs": [0x1000, 0x2000], "k": "resolve", "i": 7})
    assert request_from_wire({"addrs": [0x1000, 0x2000], "k": "resolve", "i": 7}) == message
    reply = ResolveReply((Located(3, 4, 1, False, -1), Located(3, 5, 1, True, 2)))
    assert reply.to_wire() == {"at": [[3, 4, 1, 0, -1], [3, 5, 1, 1, 2]]}
    assert ResolveReply.from_wire(reply.to_wire()) == reply
    for bad in ({"addrs": []}, {"addrs": [-1]}, {"addrs": [1.5]}, {"addrs": list(range(MAX_RESOLVED_ADDRS + 1))},
                {}):
        with pytest.raises(ProtocolError):
            Resolve.from_wire(bad)
    for bad_reply in ({"at": [[1, 2, 3]]}, {"at": [[1, 2, 3, 0, "x"]]}, {"at": "no"}, {}):
        with pytest.raises(ProtocolError):
            ResolveReply.from_wire(bad_reply)


def test_a_descriptor_window_travels_and_bounds_the_tensors() -> None:
    """Memory shared in place: the window of each tensor the segment holds; the tensors' own starts may lie before
    the segment (their partial head page is not in it), the window's bytes may not."""
    addrs = np.array([SEG_BASE - 64, SEG_BASE + 9 * 4096 - 64], dtype=np.uint64)
    shared = Descriptor(GEOMETRY, addrs, (SEG, SEG_BASE), window=(64, 8 * 4096 - 4096 + 64))
    wire = shared.to_wire()
    assert wire["window"] == [64, 7 * 4096 + 64]
    assert Descriptor.from_wire(wire) == shared
    assert Descriptor.from_wire(wire) != Descriptor(GEOMETRY, addrs, (SEG, SEG_BASE), window=(64, 4096))
    with pytest.raises(ProtocolError):  # without the window, the first tensor starts outside the segment
        Descriptor.from_wire({key: value for key, value in wire.items() if key != "window"})
    for bad in ([0], [10, 5], [-1, 5], [0, 8 * 4096 + 1], ["0", 5], {"low": 0}, [0, 64]):
        with pytest.raises(ProtocolError):
            Descriptor.from_wire({**wire, "window": bad})
