"""Hostile bytes on the TCP data connections, for both I/O thread implementations: the native helper
(``llm.Net`` "native") and the Python fallback ("python").

Two targets, on real linked instances in this process:

* **the owner** (:func:`test_the_owner_survives_hostile_data_frames`): a hostile peer links like any client (a raw
  ZeroMQ HELLO), opens a data connection with the token the server offered and BEGINs two pushes, so that the
  owner grants two destinations (a block of each tensor of one cache: the *target* of the case's frames, and the
  *probe*).  Then it sends one case: a valid frame cut at every byte (the connection closed there), the same
  truncated and followed by the next frame, frames of wrong lengths, DATA beyond or wrapping around the granted
  stream, READ and WRITE frames whose spans are outside, straddle or wrap around the published caches (or name a
  stale row), frames for unknown jobs and of unknown types, and seeded random mutations of valid frame sequences.
  Each case is followed by a probe frame (64 bytes for the probe push): it lands iff the connection stayed in
  step.  One hostile link per case.
* **the requester** (:func:`test_the_requester_survives_hostile_data_frames`): a victim decoder's link gets one
  more data connection, as a man in the middle would give it, which carries frames for the victim's pull while it
  runs (sent as soon as its receiving end exists, before its BEGIN goes out): the pull completes or fails with an
  ``LLMException``, never anything else, and fails where the frame can only be wrong.

After every case: no crash, no hang (every wait is bounded), nothing written outside what was granted (every
other byte of the caches, guard caches among them, filled with pattern bytes and compared byte-exact), a WRITE's
bytes exactly where it said, a READ served exactly the cache's bytes, and the answer the case expects where one
is defined.  After all of them: fresh well-behaved decoders (both implementations) link and pull byte-exact, and
no lease is held.

Deterministic: every case comes from ``numpy.random.default_rng`` with a fixed seed.  ``AIODATADIST_FUZZ_SEED``
sets another seed, ``AIODATADIST_FUZZ_SCALE`` multiplies the random cases (``scripts/fuzz_long.py`` runs this file
for N minutes with random seeds).  ``pytest -s`` shows how many frames of each kind were tried.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from helpers.data import fill_pattern, row_views
from helpers.internals import registry_of

from aiodatadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.layout.plans import CacheGeometry
from aiodatadist.native import FrameType, native_available
from aiodatadist.protocol.handshake import PROTOCOL_VERSION
from aiodatadist.protocol.messages import geometry_to_wire
from aiodatadist.testing import cluster_info, free_port
from aiodatadist.transport.tcp.frames import DATA_HELLO, HEADER, MAGIC

S = LLMStatusCode
T = FrameType
SEED = int(os.environ.get("AIODATADIST_FUZZ_SEED", "0") or 0) or 482024
SCALE = float(os.environ.get("AIODATADIST_FUZZ_SCALE", "1") or 1)
NATIVE = pytest.mark.skipif(not native_available(), reason="the native helper is not built")
IMPLEMENTATIONS = [pytest.param("native", marks=NATIVE), "python"]

BLOCKS, BLOCK = 8, 4096
DESC = CacheDesc(2, (BLOCKS, BLOCK), DataType.DT_UINT8, Placement.HOST)
TENSOR = BLOCKS * BLOCK
GEOMETRY = geometry_to_wire(CacheGeometry(2, TENSOR, BLOCKS, True, DESC.data_type.value))
TARGET, PROBE = 2, 5  # the blocks of `dst` the hostile peer's two pushes are granted
TARGET_TID, PROBE_TID = 1, 2  # their transfer ids (a push's frames carry the requester's id, flag 0)
STREAM = 2 * BLOCK  # bytes of each push: its block of tensor 0, then of tensor 1
PROBE_BYTES = 64
READ_KEY, WRITE_KEY = 7, 9  # the hostile peer's one-sided jobs (it never has more than one of each)
U64 = 2**64
NO_MODEL = U64 - 1  # -1: a READ or WRITE that names no model
WAIT = 5.0  # seconds any one step may take before the case counts as hung
SRC_MODEL, DST_MODEL, WDST_MODEL = 0, 1, 2  # the owner's published caches: BlocksCacheKey(1, model)


# -- frames ------------------------------------------------------------------------------------------------------
def header(kind: int, key: int, offset: int, length: int, a: int = 0, b: int = 0, magic: int = MAGIC) -> bytes:
    return HEADER.pack(magic % 2**32, kind % 2**32, key % U64, offset % U64, length % U64, a % U64, b % U64)


def data_frame(key: int, offset: int, payload: bytes, length: int | None = None) -> bytes:
    return header(T.DATA, key, offset, len(payload) if length is None else length) + payload


def words(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}Q", *(v % U64 for v in values))


def read_frame(row: int, stamp: int, cache_id: int, bases: list[int], offs: list[int], lens: list[int],
               model: int = NO_MODEL, length: int | None = None) -> bytes:
    body = words(model, len(bases), len(offs), *bases, *offs, *lens)
    return header(T.READ, READ_KEY, stamp, len(body) if length is None else length, row, cache_id) + body


def write_frame(row: int, stamp: int, cache_id: int, spans: list[tuple[int, int]], payload: bytes,
                model: int = NO_MODEL, count: int | None = None, length: int | None = None) -> bytes:
    body = words(model, len(spans) if count is None else count, *(v for span in spans for v in span)) + payload
    return header(T.WRITE, WRITE_KEY, stamp, len(body) if length is None else length, row, cache_id) + body


@dataclass
class Answer:
    kind: int
    key: int
    offset: int
    payload: bytes


def parse_answers(stream: bytes) -> list[Answer]:
    """The frames the owner sent back (DATA carries a payload, the others none); an unfinished tail is left."""
    out, at = [], 0
    while len(stream) - at >= HEADER.size:
        magic, kind, key, offset, length, _, _ = HEADER.unpack_from(stream, at)
        assert magic == MAGIC, f"the owner sent something that is not a frame at byte {at}"
        size = HEADER.size + (length if kind == T.DATA else 0)
        if len(stream) - at < size:
            break
        out.append(Answer(kind, key, offset, stream[at + HEADER.size:at + size]))
        at += size
    return out


# -- the owner under attack --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """A published cache of the owner, as a one-sided READ or WRITE names it."""

    row: int
    stamp: int
    cache_id: int
    base: int  # its segment (what the row says the cache's memory is)
    size: int
    tensors: tuple[int, ...]


Span = tuple[int, int]  # (address, bytes) in the owner


@dataclass
class Case:
    """One hostile case: ``frames`` (the bytes) and what must come of them.

    ``expect`` (per implementation): "break" (the connection is dropped before the probe), "sync" (nothing comes
    back, the probe lands), ("error", status), ("data", source spans) (a READ served exactly those bytes),
    ("ack", bytes) (a WRITE acknowledged), "fence_ack", or absent (anything safe).  ``wrote``: what lands in the
    owner's memory (address, bytes), exactly; ``may_write``: where else a WRITE of the case may land (its spans;
    "any": anywhere in ``wdst``, for mutations).  ``probe``: the probe frame follows (not after a cut: the
    connection ends there)."""

    kind: str
    frames: bytes
    expect: dict[str, Any] = field(default_factory=dict)
    probe: bool = True
    wrote: list[tuple[int, bytes]] = field(default_factory=list)
    may_write: list[Span] | str = field(default_factory=list)


@dataclass
class Owner:
    """The server under attack, its caches (as flat per-tensor copies of what each must hold) and rows."""

    server: LLMDataDist
    port: int
    impl: str
    caches: dict[str, Cache]
    rows: dict[str, Row]
    expected: dict[str, list[np.ndarray[Any, Any]]]
    context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    next_cluster: int = 10_000

    def flat(self, name: str) -> list[np.ndarray[Any, Any]]:
        return [t.reshape(-1).view(np.uint8) for t in self.caches[name].tensors]

    def pieces(self, address: int, n: int) -> list[tuple[str, int, int, int, int]]:
        """Where ``n`` bytes at ``address`` are in the owner's caches: (cache, tensor, offset there, offset in the
        bytes, length) for each tensor they cover; every byte must be in one."""
        out, covered = [], 0
        for name in self.caches:
            for t, tensor in enumerate(self.flat(name)):
                base = tensor.ctypes.data
                lo, hi = max(address, base), min(address + n, base + tensor.size)
                if lo < hi:
                    out.append((name, t, lo - base, lo - address, hi - lo))
                    covered += hi - lo
        assert covered == n, f"{address:#x} + {n} is not inside the caches' tensors"
        return out

    def read(self, address: int, n: int) -> bytes:
        out = bytearray(n)
        for name, t, at, start, length in self.pieces(address, n):
            out[start:start + length] = self.flat(name)[t][at:at + length].tobytes()
        return bytes(out)


class HostilePeer:
    """One hostile link: a raw ZeroMQ client that says hello, one data connection with the offered token, and
    the two pushes BEGun (the target's and the probe's)."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.cluster = owner.next_cluster
        owner.next_cluster += 1
        self.ctl = owner.context.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.data: socket.socket | None = None
        self._ids = 0

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        self._ids += 1
        message["i"] = self._ids
        await self.ctl.send(msgpack.packb(message, use_bin_type=True))
        async with asyncio.timeout(WAIT):
            while True:
                decoded = msgpack.unpackb(await self.ctl.recv(), raw=False, strict_map_key=False)
                for reply in decoded if isinstance(decoded, list) else [decoded]:
                    if isinstance(reply, dict) and reply.get("r") == self._ids:
                        return reply

    async def open(self) -> socket.socket:
        owner = self.owner
        self.ctl.connect(f"tcp://127.0.0.1:{owner.port}")
        hello = await self.request({"k": "hello", "v": PROTOCOL_VERSION, "cluster": self.cluster, "to": 1,
                                    "role": 0, "transport": "tcp"})
        assert hello["code"] == 0 and hello["plane"] == "tcp", hello
        data_port, token = hello["data"]
        loop = asyncio.get_running_loop()
        sock = self.data = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", data_port))
        await loop.sock_sendall(sock, DATA_HELLO.pack(MAGIC, token))
        links = owner.server._links.links
        deadline = time.monotonic() + WAIT
        while not ((link := links.get(self.cluster)) is not None and link.plane.connections >= 1):
            assert time.monotonic() < deadline, "the owner did not adopt the data connection"
            await asyncio.sleep(0.0005)
        for tid, block in ((TARGET_TID, TARGET), (PROBE_TID, PROBE)):
            reply = await self.request({"k": "begin", "tid": tid, "key": ["blocks", DST_MODEL, 0], "peer": GEOMETRY,
                                        "known": [], "op": "push", "api": "blocks", "sb": [0], "db": [block],
                                        "sr": None, "dr": None, "n": 2, "size": -1, "slot": 0})
            assert reply["code"] == 0, reply  # the owner granted `block` of each tensor of dst
        return sock

    async def close(self) -> None:
        if self.data is not None:
            self.data.close()
        self.ctl.close()


def _answered(answers: list[Answer], expect: Any) -> bool:
    """Whether what the case waits for (before it ends the stream) came back."""
    if isinstance(expect, tuple) and expect[0] == "data":
        want = sum(n for _, n in expect[1])
        return sum(len(a.payload) for a in answers if a.kind == T.DATA) >= want or any(a.kind != T.DATA
                                                                                      for a in answers)
    return bool(answers)


async def run_owner_case(owner: Owner, case: Case, probe_bytes: bytes) -> tuple[list[Answer], bool]:
    """One hostile link, one case; returns the frames the owner sent back and whether the probe landed."""
    peer = HostilePeer(owner)
    probe_at = owner.flat("dst")[0][PROBE * BLOCK:PROBE * BLOCK + PROBE_BYTES]
    loop = asyncio.get_running_loop()
    got = bytearray()
    expect = case.expect.get(owner.impl)
    try:
        sock = await peer.open()
        eof = asyncio.Event()

        async def reader() -> None:
            while True:
                try:
                    chunk = await loop.sock_recv(sock, 1 << 16)
                except OSError:
                    chunk = b""
                if not chunk:
                    eof.set()
                    return
                got.extend(chunk)

        reading = asyncio.create_task(reader())
        try:
            with contextlib.suppress(OSError):  # the owner may drop the connection before it read everything
                async with asyncio.timeout(WAIT):
                    await loop.sock_sendall(sock, case.frames + (data_frame(PROBE_TID, 0, probe_bytes)
                                                                 if case.probe else b""))
            if expect not in (None, "break", "sync"):
                # Answers are sent by the owner's sender threads, which stop once the stream ends: wait for them.
                deadline = time.monotonic() + WAIT
                while not eof.is_set() and not _answered(parse_answers(bytes(got)), expect):
                    assert time.monotonic() < deadline, f"{case.kind}: no answer in {WAIT} s"
                    await asyncio.sleep(0.0005)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)  # the end of the stream: the owner drops the link
            async with asyncio.timeout(WAIT):
                await eof.wait()
        except TimeoutError:
            raise AssertionError(f"{case.kind} ({owner.impl}): the owner kept the connection {WAIT} s after it "
                                 "ended (hung?)") from None
        finally:
            reading.cancel()
        deadline = time.monotonic() + WAIT
        while peer.cluster in owner.server._links.links:
            assert time.monotonic() < deadline, f"{case.kind} ({owner.impl}): the hostile link was not dropped"
            await asyncio.sleep(0.0005)
    finally:
        await peer.close()
    return parse_answers(bytes(got)), bytes(probe_at) == probe_bytes


def check_answers(owner: Owner, case: Case, answers: list[Answer], landed: bool) -> None:
    expect = case.expect.get(owner.impl)
    what = f"{case.kind} ({owner.impl})"
    if expect == "break":
        assert not landed, f"{what}: the connection stayed in step after a frame it cannot take ({answers})"
    if expect in (None, "break"):
        return
    assert landed, f"{what}: the connection fell out of step (or broke) on a frame it takes ({answers})"
    if expect == "sync":
        assert not answers, f"{what}: unexpected answers {answers}"
    elif expect == "fence_ack":
        assert [a.kind for a in answers] == [T.FENCE_ACK], f"{what}: {answers}"
    elif expect[0] == "data":
        assert answers and all(a.kind == T.DATA and a.key == READ_KEY for a in answers), f"{what}: {answers}"
        served = b"".join(a.payload for a in sorted(answers, key=lambda a: a.offset))
        assert served == b"".join(owner.read(a, n) for a, n in expect[1]), \
            f"{what}: the READ was served other bytes than the cache's"
    elif expect[0] == "error":
        assert len(answers) == 1 and answers[0].kind == T.ERROR and answers[0].offset == expect[1] \
            and answers[0].key in (READ_KEY, WRITE_KEY), f"{what}: {answers}"
    elif expect[0] == "ack":
        assert [(a.kind, a.key, a.offset) for a in answers] == [(T.WRITE_ACK, WRITE_KEY, expect[1])], \
            f"{what}: {answers}"


def check_owner_memory(owner: Owner, case: Case, landed: bool, probe_bytes: bytes) -> None:
    """Nothing changed outside what the owner granted: the target block may hold anything the case's frames
    said, the probe its 64 bytes if they landed, wdst exactly what the case wrote (and, where it may write,
    anything)."""
    allowed: dict[tuple[str, int], np.ndarray[Any, Any]] = {
        (name, t): np.zeros(TENSOR, dtype=bool) for name in owner.caches for t in range(2)}
    for t in range(2):
        allowed["dst", t][TARGET * BLOCK:(TARGET + 1) * BLOCK] = True
    if landed:
        owner.expected["dst"][0][PROBE * BLOCK:PROBE * BLOCK + PROBE_BYTES] = np.frombuffer(probe_bytes, np.uint8)
    if case.may_write == "any":
        for t in range(2):
            allowed["wdst", t][:] = True
            allowed["dst", t][PROBE * BLOCK:(PROBE + 1) * BLOCK] = True  # (a mutated key may be the probe's)
    else:
        for address, n in case.may_write:
            for name, t, at, _, length in owner.pieces(address, n):
                allowed[name, t][at:at + length] = True
    for address, data in case.wrote:
        for name, t, at, start, length in owner.pieces(address, len(data)):
            owner.expected[name][t][at:at + length] = np.frombuffer(data[start:start + length], np.uint8)
    for name in owner.caches:
        for t, now in enumerate(owner.flat(name)):
            wrong = (now != owner.expected[name][t]) & ~allowed[name, t]
            if wrong.any():
                first = int(np.argmax(wrong))
                raise AssertionError(f"{case.kind} ({owner.impl}): {int(wrong.sum())} bytes of {name} tensor {t} "
                                     f"changed outside what the owner granted, first at byte {first} (block "
                                     f"{first // BLOCK})")
            owner.expected[name][t][:] = now  # what was granted: taken as it is now


def owner_cases(owner: Owner, rng: np.random.Generator) -> list[Case]:
    """Every case against ``owner``, in a fixed order (their random bytes from ``rng``)."""
    src, dst, wdst = owner.rows["src"], owner.rows["dst"], owner.rows["wdst"]
    guard = owner.flat("guard0")[0].ctypes.data
    cases: list[Case] = []
    both = {"native": "break", "python": "break"}
    synced = {"native": "sync", "python": "sync"}

    def native(expect: Any) -> dict[str, Any]:
        return {"native": expect, "python": "break"}  # one-sided frames: the Python threads drop the link

    def data(n: int) -> bytes:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    # valid frames: a slice of the target push, a READ of src, a WRITE into wdst
    read_grid = ([src.tensors[0], src.tensors[1]], [TARGET * BLOCK + 8], [100])
    read_spans = [(b + o, n) for b in read_grid[0] for o, n in zip(read_grid[1], read_grid[2])]
    write_at = wdst.tensors[1] + 3 * BLOCK + 5
    write_bytes = data(64)
    valid = {
        "data": Case("valid", data_frame(TARGET_TID, 1000, data(64)), synced),
        "read": Case("valid", read_frame(src.row, src.stamp, src.cache_id, *read_grid), native(("data", read_spans))),
        "write": Case("valid", write_frame(wdst.row, wdst.stamp, wdst.cache_id, [(write_at, 64)], write_bytes),
                      native(("ack", 64)), wrote=[(write_at, write_bytes)] if owner.impl == "native" else []),
    }
    cases.extend(valid.values())
    # cut: the connection closed after every byte of each valid frame (0: before the first); then the same
    # first bytes followed by the probe (truncated: the owner reads the probe as the rest of the frame)
    for frame in valid.values():
        for cut in range(len(frame.frames)):
            cases.append(Case("cut", frame.frames[:cut], both, probe=False, may_write=[(write_at, 64)]))
        for cut in range(1, len(frame.frames)):
            cases.append(Case("truncated", frame.frames[:cut], may_write=[(write_at, 64)]))

    # wrong lengths: a DATA frame saying more or fewer bytes than it carries
    body = bytes(64)  # read as a header, a word of it is never the magic
    for length, carried, expect in ((0, 0, "sync"), (32, 64, "break"), (63, 64, "break"), (65, 64, "break"),
                                    (2**31, 64, "break"), (2**63, 64, "break"), (U64 - 1, 64, "break")):
        cases.append(Case("length", data_frame(TARGET_TID, 0, body[:carried], length=length),
                          {"native": expect, "python": expect}))
    # ... and DATA beyond the granted stream, straddling its end, wrapping around 2**64
    for offset, length in ((STREAM, 64), (STREAM - 32, 64), (U64 - 32, 64), (U64 - 1, 1), (2**63, 64),
                           (0, STREAM + 1), (1, STREAM), (STREAM - 1, 2)):
        cases.append(Case("beyond", data_frame(TARGET_TID, offset, data(min(length, STREAM + 1)), length=length)))
    # READ frames whose length does not fit their words (the owner must not believe either)
    good_read = valid["read"].frames
    for length in (0, 7, 16, 25, 8 * 6 + 4, 8 * (3 + 3 * (1 << 20)) + 8, U64 - 8, 2**63):
        frame = header(T.READ, READ_KEY, src.stamp, length, src.row, src.cache_id) + good_read[HEADER.size:]
        cases.append(Case("length", frame[:HEADER.size + min(length, 64)], both))
    for nt, nr in (((1 << 20) + 1, 1), (1, (1 << 20) + 1), (1 << 11, 1 << 10), (2**63, 2**63), (2**62, 4),
                   (3, 1), (0, 2)):
        cases.append(Case("length", header(T.READ, READ_KEY, src.stamp, 8 * 6, src.row, src.cache_id)
                          + words(NO_MODEL, nt, nr, src.tensors[0], 0, 64), both))
    # WRITE frames whose span count or length does not fit
    for count, length in ((0, 8), ((1 << 20) + 1, 64), (5, 16 + 16 * 4), (2**62, 64), (2**60 + 1, 64), (1, 24)):
        cases.append(Case("length", write_frame(wdst.row, wdst.stamp, wdst.cache_id, [], b"", count=count,
                                                length=length) + b"\x00" * max(0, length - 16), both))
    # ... or whose spans hold other than the bytes it carries: refused, its bytes dropped (still in step)
    for spans, carried in (([(wdst.tensors[0], 64)], data(32)), ([(wdst.tensors[0], 16)], data(64)),
                           ([], data(10))):
        cases.append(Case("length", write_frame(wdst.row, wdst.stamp, wdst.cache_id, spans, carried),
                          native(("error", 3))))
    cases.append(Case("length", write_frame(wdst.row, wdst.stamp, wdst.cache_id, [], b""), native(("ack", 0))))

    # READ grids against src's row: inside, at the edges, straddling, elsewhere, wrapping
    base, size, end = src.base, src.size, src.base + src.size
    t0, t1 = src.tensors
    reads: list[tuple[list[int], list[int], list[int], bool]] = [
        ([t0], [0], [BLOCK], True),
        ([end - 64], [0], [64], True),
        ([base], [size - 1], [1], True),
        ([t0] * 3, [0, 100, 200], [50, 50, 50], True),
        ([t0, t1], [TENSOR - 64], [64], True),
        ([end - 50], [0], [100], False),
        ([base - 16], [0], [32], False),
        ([base], [size - 10], [20], False),
        ([base], [size + 1], [0], False),
        ([base], [0], [size + 1], False),
        ([guard], [0], [64], False),
        ([wdst.base], [0], [64], False),
        ([U64 - 8], [0], [16], False),
        ([base], [U64 - 8], [16], False),
        ([base], [8], [U64 - 1], False),
        ([base], [U64 - 1], [U64 - 1], False),
        ([base + 8], [U64 - 8], [64], False),
        ([0], [base], [64], False),
        ([t0, end], [0], [8], False),
        ([t0, t1], [0, size - 64], [8, 64], False),
        ([t0, t1], [0, 2**63], [8, 2**63], False),
    ]
    for bases, offs, lens, inside in reads:
        spans = [(b + o, n) for b in bases for o, n in zip(offs, lens)]
        cases.append(Case("read_span", read_frame(src.row, src.stamp, src.cache_id, bases, offs, lens),
                          native(("data", spans) if inside else ("error", 3))))
    # a READ of nothing is served with nothing (no answer at all)
    cases.append(Case("read_span", read_frame(src.row, src.stamp, src.cache_id, [end], [0], [0]), native("sync")))
    # stale or foreign rows, stamps, cache ids and models, for a READ (of src) and a WRITE (into wdst)
    for row_of, stamp_of, cache_of, model, ok in (
            ("", "+1", "", NO_MODEL, False), ("", "0", "", NO_MODEL, False), ("-1", "", "", NO_MODEL, False),
            ("4096", "", "", NO_MODEL, False), ("2**63", "", "", NO_MODEL, False), ("other", "", "", NO_MODEL, False),
            ("", "", "other", NO_MODEL, False), ("", "", "", 12345, False), ("", "", "", None, True)):
        for own, other, span in ((src, wdst, (t0 + 64, 64)), (wdst, src, (wdst.tensors[0] + 64, 64))):
            row = {"": own.row, "-1": -1, "4096": 4096, "2**63": 2**63, "other": other.row}[row_of]
            stamp = {"": own.stamp, "+1": own.stamp + 1, "0": 0}[stamp_of]
            cache_id = own.cache_id if cache_of == "" else other.cache_id
            mid = (SRC_MODEL if own is src else WDST_MODEL) if model is None else model
            if own is src:
                cases.append(Case("stale", read_frame(row, stamp, cache_id, [span[0]], [0], [span[1]], model=mid),
                                  native(("data", [span]) if ok else ("error", 1))))
            else:
                payload = data(64)
                cases.append(Case("stale", write_frame(row, stamp, cache_id, [span], payload, model=mid),
                                  native(("ack", 64) if ok else ("error", 1)),
                                  wrote=[(span[0], payload)] if ok and owner.impl == "native" else []))

    # WRITE spans against wdst's row
    wbase, wsize = wdst.base, wdst.size
    wend = wbase + wsize
    dst_target = dst.tensors[0] + TARGET * BLOCK
    writes: list[tuple[list[Span], bool]] = [
        ([(wbase, 64)], True),
        ([(wend - 64, 64)], True),
        ([(wbase + 100, 16), (wbase + 300, 48)], True),
        ([(wend, 0), (wbase, 64)], True),
        ([(wdst.tensors[0] + TENSOR - 32, 64)], True),  # (the cache's tensors are one segment)
        ([(wend - 32, 64)], False),
        ([(wbase - 32, 64)], False),
        ([(wend, 64)], False),
        ([(wbase, 32), (wend - 16, 32)], False),
        ([(guard, 64)], False),
        ([(t0, 64)], False),
        ([(dst_target, 64)], False),
        ([(U64 - 32, 64)], False),
        ([(wbase, U64 - 1)], False),
        ([(wbase + 64, U64 - 64), (wbase, 128)], False),
        ([(wbase, 2**63), (wbase, 2**63 + 64)], False),
        ([(0, 64)], False),
    ]
    for spans, inside in writes:
        payload = data(64)
        wrote, at = [], 0
        for address, n in spans:
            if inside and n:
                wrote.append((address, payload[at:at + n]))
            at += n
        cases.append(Case("write_span", write_frame(wdst.row, wdst.stamp, wdst.cache_id, spans, payload),
                          native(("ack", 64) if inside else ("error", 3)),
                          wrote=wrote if owner.impl == "native" else []))

    # unknown jobs, other frames, unknown types, wrong magic
    for key in (0, 3, 1 << 63 | TARGET_TID, U64 - 1, int(rng.integers(0, 2**62)) << 1 | 1 << 63):
        cases.append(Case("unknown_job", data_frame(key, 0, body), synced))
        cases.append(Case("unknown_job", data_frame(key, U64 - 8, body), synced))
    for kind, key, expect in ((T.ERROR, 1234, "sync"), (T.ABORT, 1234, "sync"), (T.FENCE_ACK, 1234, "sync"),
                              (T.WRITE_ACK, 1234, "sync"), (T.ERROR, TARGET_TID, "sync"),
                              (T.ABORT, TARGET_TID, "sync"), (T.FENCE, 4321, "fence_ack"),
                              (T.FENCE, TARGET_TID, "fence_ack"), (T.FENCE_ACK, TARGET_TID, "sync"),
                              (T.WRITE_ACK, WRITE_KEY, "sync"), (T.ERROR, READ_KEY, "sync")):
        cases.append(Case("other_frame", header(kind, key, 7, 0), native(expect)))
    for kind in (0, 9, 255, 2**31, 2**32 - 1):
        cases.append(Case("unknown_type", header(kind, TARGET_TID, 0, 0), both))
    for magic in (0, MAGIC ^ 1, MAGIC ^ 2**31, 0xFFFFFFFF):
        cases.append(Case("bad_magic", header(T.DATA, TARGET_TID, 0, 64, magic=magic) + body, both))

    # seeded mutations of sequences of valid frames
    pool = INTERESTING + [src.base, end, size, wbase, wend, t1, src.row, wdst.row, src.stamp, wdst.stamp,
                          src.cache_id, wdst.cache_id, TARGET_TID, PROBE_TID]
    sources = [valid["data"].frames, valid["read"].frames, valid["write"].frames,
               data_frame(1 << 63 | 77, 0, data(32)), header(T.FENCE_ACK, 5, 0, 0)]
    for _ in range(int(200 * SCALE)):
        frames = [bytearray(sources[int(i)]) for i in rng.integers(0, len(sources), int(rng.integers(1, 4)))]
        for op in rng.integers(0, 5, int(rng.integers(1, 4))):
            mutate(frames[int(rng.integers(0, len(frames)))], int(op), rng, pool)
        cases.append(Case("mutated", b"".join(bytes(f) for f in frames), may_write="any"))
    return cases


INTERESTING = [0, 1, 7, 8, 48, 63, 64, 4095, 4096, 8191, 8192, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, U64 - 64,
               U64 - 8, U64 - 1]


def mutate(frame: bytearray, op: int, rng: np.random.Generator, pool: list[int]) -> None:
    """One seeded mutation: bits flipped, a word of the header (or just after it) replaced by an interesting
    value (or one of the owner's addresses, rows, stamps, sizes, ids, give or take 2), the frame cut short, a
    piece doubled or dropped."""
    if not frame:
        return
    if op == 0:
        for at in rng.integers(0, len(frame), int(rng.integers(1, 5))):
            frame[int(at)] ^= 1 << int(rng.integers(0, 8))
    elif op == 1:
        at = 8 * int(rng.integers(0, max(1, min(len(frame), HEADER.size + 48) // 8)))
        value = (pool[int(rng.integers(0, len(pool)))] + int(rng.integers(-2, 3))) % U64
        frame[at:at + 8] = struct.pack("<Q", value)[:max(0, len(frame) - at)]
    elif op == 2:
        del frame[int(rng.integers(0, len(frame))):]
    elif op == 3:
        lo = int(rng.integers(0, len(frame)))
        frame[lo:lo] = frame[lo:int(rng.integers(lo, len(frame) + 1))]
    else:
        lo = int(rng.integers(0, len(frame)))
        del frame[lo:int(rng.integers(lo, len(frame) + 1))]


def _row(server: LLMDataDist, cache: Cache) -> Row:
    entry = next(e for e in registry_of(server.cache_manager).entries() if e.cache_id == cache.cache_id)
    assert entry.published is not None and entry.segment is not None and entry.tcp_readable
    row, stamp = entry.published
    return Row(row, stamp, cache.cache_id, int(entry.segment.address), int(entry.segment.size),
               tuple(int(a) for a in entry.addrs))


@contextlib.asynccontextmanager
async def owner_under_attack(impl: str) -> AsyncIterator[Owner]:
    port = free_port()
    cfg = LLMConfig()
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cfg.transport = "tcp"
    cfg.net = impl
    async with LLMDataDist(LLMRole.PROMPT, 1) as server:
        await server.init(dict(cfg.generate_options()))
        cm = server.cache_manager
        caches: dict[str, Cache] = {}
        for name, model in (("guard0", None), ("src", SRC_MODEL), ("guard1", None), ("dst", DST_MODEL),
                            ("guard2", None), ("wdst", WDST_MODEL), ("guard3", None)):  # guards between them
            caches[name] = cm.allocate_blocks_cache(DESC, None if model is None else BlocksCacheKey(1, model))
        expected = {}
        for i, (name, cache) in enumerate(caches.items()):
            fill_pattern(cache, 100 + i)
            expected[name] = [t.reshape(-1).view(np.uint8).copy() for t in cache.tensors]
        rows = {name: _row(server, caches[name]) for name in ("src", "dst", "wdst")}
        owner = Owner(server, port, impl, caches, rows, expected)
        try:
            yield owner
        finally:
            owner.context.term()


async def assert_still_serves(port: int, src: Cache, nets: tuple[str, ...]) -> None:
    """Fresh well-behaved decoders (one of each implementation) link and pull byte-exact, twice (between native
    ends the second pull is one-sided)."""
    src_rows = [v.copy() for v in row_views(src)]
    for i, net in enumerate(nets):
        if net == "native" and not native_available():
            continue
        cfg = LLMConfig()
        cfg.net = net
        async with LLMDataDist(LLMRole.DECODER, 900 + i) as good:
            await good.init(dict(cfg.generate_options()))
            assert (await good.link_clusters([cluster_info(1, port)], timeout=3000))[0] == S.LLM_SUCCESS
            dst = good.cache_manager.allocate_blocks_cache(DESC)
            for src_blocks, dst_blocks in (([6, 1], [7, 0]), ([3, 4, 5], [1, 2, 3])):
                await good.cache_manager.pull_blocks(BlocksCacheKey(1, SRC_MODEL), dst, src_blocks, dst_blocks)
                for t in range(2):
                    assert np.array_equal(row_views(dst)[t][dst_blocks], src_rows[t][src_blocks]), net


async def assert_no_leases(server: LLMDataDist) -> None:
    """Every lease a dropped link's transfers took is given back (their teardown runs after the link is gone)."""
    entries = registry_of(server.cache_manager).entries
    deadline = time.monotonic() + WAIT
    while any(entry.leases for entry in entries()):
        held = {entry.cache_id: entry.leases for entry in entries() if entry.leases}
        assert time.monotonic() < deadline, f"leases outlived the links that took them: {held}"
        await asyncio.sleep(0.005)


def summary(role: str, impl: str, tried: Counter[str], started: float) -> str:
    return (f"data-frame fuzz [{role}, {impl}] seed={SEED}: " + ", ".join(f"{k}={n}" for k, n in sorted(tried.items()))
            + f", total={sum(tried.values())} in {time.monotonic() - started:.1f} s")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
async def test_the_owner_survives_hostile_data_frames(impl: str) -> None:
    rng = np.random.default_rng([SEED, 1])  # the same cases for both implementations
    probes = np.random.default_rng([SEED, 2])
    tried: Counter[str] = Counter()
    started = time.monotonic()
    async with owner_under_attack(impl) as owner:
        for case in owner_cases(owner, rng):
            probe_bytes = probes.integers(1, 256, PROBE_BYTES, dtype=np.uint8).tobytes()
            answers, landed = await run_owner_case(owner, case, probe_bytes)
            tried[case.kind] += 1
            check_answers(owner, case, answers, landed)
            check_owner_memory(owner, case, landed, probe_bytes)
        assert not owner.server._links.links, "hostile links are still listed"
        await assert_no_leases(owner.server)
        await assert_still_serves(owner.port, owner.caches["src"], ("native", "python"))
        for name in owner.caches:
            for t, now in enumerate(owner.flat(name)):
                assert np.array_equal(now, owner.expected[name][t]), f"{name} changed afterwards"
    print("\n" + summary("owner", impl, tried, started))


# -- the requester under attack ----------------------------------------------------------------------------------
VICTIM_SRC, VICTIM_DST = [1, 3], [4, 6]  # the victim pulls src blocks 1, 3 into its blocks 4, 6
VICTIM_STREAM = 2 * len(VICTIM_SRC) * BLOCK
VICTIM_TIMEOUT_MS = 1500  # a pull held up by a frame that never ends fails with a timeout by then


@dataclass
class VictimCase:
    """Frames for the victim's pull, ``build(key, payload)`` from its receiving end's key: sent on the extra
    connection as soon as that end exists (``close``: the connection is closed right after them, else once the
    pull ended).

    ``expect`` (per implementation): "fail" (the pull raises an LLMException), "ok" (it completes byte-exact),
    "ok_granted" (it completes; its destination may hold the frame's bytes), "any" (fails, or completes with
    the frame's bytes in its destination), absent (fails, or completes byte-exact)."""

    kind: str
    build: Callable[[int, bytes], bytes]
    expect: dict[str, str] = field(default_factory=dict)
    close: bool = False
    payload: bytes = b""


def victim_cases(rng: np.random.Generator) -> list[VictimCase]:
    def data(n: int) -> bytes:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    def at(offset: int, length: int | None = None) -> Callable[[int, bytes], bytes]:
        return lambda key, payload: data_frame(key, offset, payload, length)

    def keyed(change: Callable[[int], int], offset: int = 0) -> Callable[[int, bytes], bytes]:
        return lambda key, payload: data_frame(change(key), offset, payload)

    def frame_of(kind: int, offset: int = 0, magic: int = MAGIC) -> Callable[[int, bytes], bytes]:
        return lambda key, _: header(kind, key, offset, 0, magic=magic)

    ok = {"native": "ok", "python": "ok"}
    granted = {"native": "ok_granted", "python": "ok_granted"}
    fail = {"native": "fail", "python": "fail"}
    anything = {"native": "any", "python": "any"}
    # frames the Python threads cannot take break the link: that fails the pull unless it completed (byte-exact)
    # first; the helper's threads fail every job of the link at once
    broke = {"native": "fail"}
    cases = [
        VictimCase("unknown_job", keyed(lambda k: k ^ 1 << 63), ok, payload=data(64)),
        VictimCase("unknown_job", keyed(lambda k: k + 1), ok, payload=data(64)),
        VictimCase("unknown_job", keyed(lambda k: k ^ 1 << 40, U64 - 8), ok, payload=data(64)),
        VictimCase("in_range", at(0), granted, payload=data(64)),
        VictimCase("in_range", at(VICTIM_STREAM - 64), granted, payload=data(64)),
        VictimCase("beyond", at(VICTIM_STREAM), fail, payload=data(64)),
        VictimCase("beyond", at(VICTIM_STREAM - 32), fail, payload=data(64)),
        VictimCase("beyond", at(U64 - 32), fail, payload=data(64)),
        VictimCase("beyond", at(U64 - 1), fail, payload=data(1)),
        VictimCase("beyond", at(2**63), fail, payload=data(64)),
        VictimCase("length", at(0, 2**63), fail, close=True, payload=data(64)),  # cut: more was said
        VictimCase("length", at(0, 32), anything, payload=data(64)),  # the rest read as a header: the link breaks
        VictimCase("stalled", at(0, 128), fail, payload=data(64)),  # the rest never comes: the pull times out
        VictimCase("bad_magic", frame_of(T.DATA, magic=MAGIC ^ 4), broke),
        VictimCase("unknown_type", frame_of(99), broke),
        VictimCase("other_frame", frame_of(T.ERROR, 3), broke),  # native: the owner refused
        VictimCase("other_frame", frame_of(T.FENCE), broke),  # native: the job is stopped
        VictimCase("other_frame", frame_of(T.ABORT), {"native": "ok"}),
        VictimCase("other_frame", frame_of(T.WRITE_ACK, 2**40), {"native": "ok"}),
        VictimCase("other_frame", frame_of(T.FENCE_ACK), {"native": "ok"}),
        VictimCase("other_frame", lambda key, _: read_frame(0, 12345, 1, [4096], [0], [64])),
    ]
    # the connection cut inside the frame's header (the link breaks at once) or inside its payload
    payload = data(64)
    for cut in (0, 1, 8, 24, 47, 48, 49, 80, HEADER.size + len(payload) - 1):
        cases.append(VictimCase("cut", lambda key, body, c=cut: data_frame(key, 0, body)[:c],
                                {"native": "fail" if cut >= HEADER.size else "", "python": "any"}, close=True,
                                payload=payload))
    # seeded mutations of a frame for the pull (then the connection closes: nothing waits for more)
    pool = INTERESTING + [VICTIM_STREAM, VICTIM_STREAM - 1, BLOCK]
    for _ in range(int(12 * SCALE)):
        ops = [int(op) for op in rng.integers(0, 5, int(rng.integers(1, 4)))]
        seed = int(rng.integers(0, 2**63))

        def build(key: int, body: bytes, ops: list[int] = ops, seed: int = seed) -> bytes:
            frame = bytearray(data_frame(key, int(seed % VICTIM_STREAM), body))
            r = np.random.default_rng(seed)
            for op in ops:
                mutate(frame, op, r, [*pool, key, key ^ 1 << 63])
            return bytes(frame)

        cases.append(VictimCase("mutated", build, anything, close=True, payload=data(int(rng.integers(0, 200)))))
    return cases


def header_taken(fd: int, sent: int) -> None:
    """Block (the event loop too: the pull goes on only after this) until the victim's receiver thread read the
    first frame's header off its connection, and a little longer, for it to find the frame's job: what happens
    next does not depend on how soon a busy machine runs that thread."""
    if sent < HEADER.size:
        return  # (it waits for the rest of the header)
    deadline = time.monotonic() + WAIT
    unread = array.array("i", [0])
    while True:
        fcntl.ioctl(fd, termios.FIONREAD, unread)
        if unread[0] <= sent - HEADER.size:
            break
        assert time.monotonic() < deadline, "the victim's receiver thread does not read its connection"
        time.sleep(0.0002)
    time.sleep(0.002)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    return ours, theirs


async def ensure_linked(victim: LLMDataDist, port: int) -> None:
    deadline = time.monotonic() + WAIT
    while 1 not in victim._links.links:
        code = (await victim.link_clusters([cluster_info(1, port)], timeout=3000))[0]
        if code == S.LLM_SUCCESS and 1 in victim._links.links:
            return
        assert time.monotonic() < deadline, f"the victim cannot link again: {code}"
        await asyncio.sleep(0.01)


async def unlink(victim: LLMDataDist, port: int) -> None:
    """The attacker's connection is gone: so goes the link (the next case links again)."""
    if 1 in victim._links.links:
        await victim.unlink_clusters([cluster_info(1, port)], timeout=1000, force=True)
    deadline = time.monotonic() + WAIT
    while 1 in victim._links.links:
        assert time.monotonic() < deadline, "the victim's link was not dropped"
        await asyncio.sleep(0.001)


async def run_victim_case(victim: LLMDataDist, port: int, case: VictimCase, dst: Cache) -> str:
    """One case on a fresh link; returns "ok" or "fail" (an LLMException; anything else propagates)."""
    await ensure_linked(victim, port)
    plane = victim._links.links[1].plane
    conns = plane.conns
    ours, theirs = tcp_pair()
    fd = theirs.fileno()
    conns.attach(theirs)  # one more data connection of the link, the attacker's
    injected: list[int] = []
    expect_receive = plane.expect

    def expect(tid: int, pull: bool) -> Any:
        job = expect_receive(tid, pull)
        if job is not None and not injected:  # before BEGIN goes out: the frames wait for the destination
            injected.append(job.key)
            frames = case.build(job.key, case.payload)
            ours.sendall(frames)
            header_taken(fd, len(frames))
            if case.close:
                ours.close()
        return job

    plane.expect = expect
    try:
        async with asyncio.timeout(3 * VICTIM_TIMEOUT_MS / 1000 + WAIT):
            await victim.cache_manager.pull_blocks(BlocksCacheKey(1, SRC_MODEL), dst, VICTIM_SRC, VICTIM_DST)
        outcome = "ok"
    except LLMException as exc:
        assert str(exc), f"{case.kind}: an LLMException without a message"
        outcome = "fail"
    except TimeoutError:
        raise AssertionError(f"{case.kind}: the victim's pull hung") from None
    finally:
        del plane.expect
        ours.close()
    assert injected, f"{case.kind}: the pull never had a receiving end"
    await unlink(victim, port)
    return outcome


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
async def test_the_requester_survives_hostile_data_frames(impl: str) -> None:
    """The victim runs ``impl``, the owner the other implementation (so that the pull goes through the owner and
    the victim sends nothing on its connections: the attacker's one only receives what it asked for)."""
    rng = np.random.default_rng([SEED, 3])
    tried: Counter[str] = Counter()
    started = time.monotonic()
    port = free_port()
    server_cfg = LLMConfig()
    server_cfg.listen_ip_info = f"127.0.0.1:{port}"
    server_cfg.transport = "tcp"
    server_cfg.net = "python" if impl == "native" else ("native" if native_available() else "python")
    victim_cfg = LLMConfig()
    victim_cfg.net = impl
    victim_cfg.sync_kv_timeout = VICTIM_TIMEOUT_MS
    async with LLMDataDist(LLMRole.PROMPT, 1) as server, LLMDataDist(LLMRole.DECODER, 2) as victim:
        await server.init(dict(server_cfg.generate_options()))
        await victim.init(dict(victim_cfg.generate_options()))
        src = server.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, SRC_MODEL))
        fill_pattern(src, 7)
        source = [v.copy() for v in row_views(src)]
        guards = [victim.cache_manager.allocate_blocks_cache(DESC) for _ in range(2)]
        dst = victim.cache_manager.allocate_blocks_cache(DESC)
        guards.append(victim.cache_manager.allocate_blocks_cache(DESC))
        for i, guard in enumerate(guards):
            fill_pattern(guard, 200 + i)
        guard_bytes = [[v.copy() for v in row_views(g)] for g in guards]
        for i, case in enumerate(victim_cases(rng)):
            before = fill_pattern(dst, 1000 + i)
            outcome = await run_victim_case(victim, port, case, dst)
            tried[case.kind] += 1
            expect = case.expect.get(impl) or ""
            what = f"{case.kind} #{i} ({impl} victim)"
            if expect == "fail":
                assert outcome == "fail", f"{what}: the pull completed"
            elif expect in ("ok", "ok_granted"):
                assert outcome == "ok", f"{what}: the pull failed"
            views = row_views(dst)
            for t in range(2):
                rows = before[t].reshape(BLOCKS, -1)
                others = [b for b in range(BLOCKS) if b not in VICTIM_DST]
                assert np.array_equal(views[t][others], rows[others]), f"{what}: bytes outside the destination"
                if outcome == "ok" and expect in ("ok", ""):
                    assert np.array_equal(views[t][VICTIM_DST], source[t][VICTIM_SRC]), f"{what}: wrong bytes"
            for g, expected in zip(guards, guard_bytes):
                for t, view in enumerate(row_views(g)):
                    assert np.array_equal(view, expected[t]), f"{what}: a guard cache changed"
        # the victim links again and pulls byte-exact; so do fresh decoders; the owner holds no lease
        await ensure_linked(victim, port)
        await victim.cache_manager.pull_blocks(BlocksCacheKey(1, SRC_MODEL), dst, VICTIM_SRC, VICTIM_DST)
        for t in range(2):
            assert np.array_equal(row_views(dst)[t][VICTIM_DST], source[t][VICTIM_SRC])
        await assert_still_serves(port, src, ("native", "python"))
        await unlink(victim, port)
        await assert_no_leases(server)
    print("\n" + summary("requester", impl, tried, started))
