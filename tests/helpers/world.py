"""The two-process world of ``integration/test_transfers.py`` and ``integration/test_links.py``.

Every such test has two real OS processes on 127.0.0.1 with random ports: an ``LLMDataDist`` in the test's own
process and event loop (a :class:`LocalSide`) and one in an ``aiodatadist.testing._agent`` child process driven through
:class:`aiodatadist.testing.PeerProcess` (a :class:`PeerSide`).  Both sides offer the same small async API, so a
transfer test is written once and run with either side as the requester and either side as the server.

Expected bytes are computed here with plain numpy from snapshots taken before the transfer; nothing in this
module uses ``aiodatadist.layout``, so the tests check the package's geometry instead of repeating it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aiodatadist.cache import Cache
from aiodatadist.testing import PeerError, PeerProcess, cluster_info, free_port
from aiodatadist.testing._agent import make_key
from helpers.data import fill_pattern
from helpers.ids import new_cluster_id
from helpers.internals import registry_of

__all__ = [
    "SYNC_KV_TIMEOUT_MS",
    "U64_MAX",
    "CacheInfo",
    "LocalSide",
    "PeerSide",
    "Side",
    "World",
    "assert_bytes",
    "assert_changed",
    "block_runs",
    "blocks_key",
    "c2b_runs_expected",
    "eventually",
    "expect_code",
    "expected_after",
    "id_key",
    "local_instance",
    "new_cluster_id",
    "prefix_key",
    "req_key",
    "sha256",
    "slot_runs",
    "start_peer",
]

U64_MAX = 2**64 - 1
SYNC_KV_TIMEOUT_MS = 5000
S = LLMStatusCode


def sha256(data: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(data).view(np.uint8).tobytes()).hexdigest()


# -- key specs (the dict form understood by aiodatadist.testing._agent.make_key) ---------------------------------------

def req_key(owner: int, req_id: int, model_id: int = 0) -> dict[str, Any]:
    return {"type": "req", "cluster_id": owner, "req_id": req_id, "model_id": model_id}


def prefix_key(owner: int, prefix_id: int, model_id: int = 0) -> dict[str, Any]:
    return {"type": "req", "cluster_id": owner, "req_id": U64_MAX, "model_id": model_id, "prefix_id": prefix_id}


def id_key(owner: int, cache_id: int, batch_index: int = 0) -> dict[str, Any]:
    return {"type": "id", "cluster_id": owner, "cache_id": cache_id, "batch_index": batch_index}


def blocks_key(owner: int, model_id: int = 0) -> dict[str, Any]:
    return {"type": "blocks", "cluster_id": owner, "model_id": model_id}


# -- caches --------------------------------------------------------------------------------------------------

@dataclass
class CacheInfo:
    """What a test knows about a cache it created on one side."""

    cache_id: int
    num_tensors: int
    shape: tuple[int, ...]
    dtype: str
    blocks: bool
    mem: str  # "allocate" or "register"

    @property
    def tensor_size(self) -> int:
        return int(np.prod(self.shape)) * DataType[self.dtype].np_dtype.itemsize

    @property
    def slots(self) -> int:
        return self.shape[0]

    @property
    def stride(self) -> int:
        """Bytes of one batch slot (contiguous) or one block (blocks cache)."""
        return self.tensor_size // self.slots


def _desc(num_tensors: int, shape: Sequence[int], dtype: str) -> CacheDesc:
    return CacheDesc(num_tensors, tuple(shape), DataType[dtype], Placement.HOST)


class Side:
    """One end of a link; subclasses run the operations in this process or in the peer process."""

    name = "?"
    cluster_id: int

    def __init__(self) -> None:
        self.caches: dict[int, CacheInfo] = {}
        self.bound_keys: list[list[int]] = []

    async def new_cache(self, num_tensors: int, shape: Sequence[int], *, mem: str = "allocate",
                        blocks: bool = False, keys: Sequence[Sequence[int]] = (), model_id: int | None = None,
                        dtype: str = "DT_UINT8", remote_accessible: bool | None = None,
                        seed: int | None = None) -> CacheInfo:
        """Allocate or register a host cache (``keys`` as ``[cluster_id, req_id, model_id, prefix_id]``),
        then fill it with pattern bytes of ``seed`` (if given)."""
        cache_id = await self._create(num_tensors, list(shape), mem=mem, blocks=blocks,
                                      keys=[list(k) for k in keys], model_id=model_id, dtype=dtype,
                                      remote_accessible=remote_accessible)
        info = CacheInfo(cache_id, num_tensors, tuple(shape), dtype, blocks, mem)
        self.caches[cache_id] = info
        self.bound_keys.extend(list(k) for k in keys)
        if seed is not None:
            await self.fill(info, seed)
        return info

    async def _create(self, num_tensors: int, shape: list[int], **kw: Any) -> int:
        raise NotImplementedError

    async def fill(self, cache: CacheInfo, seed: int) -> None:
        raise NotImplementedError

    async def snapshot(self, cache: CacheInfo) -> list[np.ndarray]:
        """Copies of every tensor's bytes (flat ``uint8``)."""
        raise NotImplementedError

    async def digests(self, cache: CacheInfo) -> list[str]:
        raise NotImplementedError

    async def transfer(self, op: str, cache: CacheInfo, key: dict[str, Any], **kw: Any) -> None:
        """``op`` in pull_cache/pull_blocks/push_cache/push_blocks; layer ranges as ``[start, stop]``."""
        raise NotImplementedError

    async def release(self, cache: CacheInfo, how: str | None = None) -> None:
        raise NotImplementedError

    async def remove_key(self, key: Sequence[int]) -> None:
        raise NotImplementedError

    async def links(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def link(self, cluster_id: int, port: int, timeout: int = 3000) -> tuple[int, list[int]]:
        raise NotImplementedError

    async def unlink(self, cluster_id: int, timeout: int = 3000, force: bool = False) -> tuple[int, list[int]]:
        raise NotImplementedError

    async def linked_to(self) -> set[int]:
        return {int(link["remote_cluster_id"]) for link in await self.links()}

    async def cleanup(self) -> None:
        """Release every cache and key this test created here (ignoring ones already released): an allocated
        cache lives on while a key is bound to it."""
        for info in list(self.caches.values()):
            try:
                await self.release(info)
            except (LLMException, PeerError, KeyError):
                pass
        self.caches.clear()
        for key in self.bound_keys:
            if len(key) >= 2 and not (key[1] == U64_MAX and (len(key) < 4 or key[3] == U64_MAX)):
                try:
                    await self.remove_key(key)
                except (LLMException, PeerError):
                    pass
        self.bound_keys.clear()


class LocalSide(Side):
    """An ``LLMDataDist`` in the test's own process and event loop."""

    name = "local"

    def __init__(self, dd: LLMDataDist, port: int | None = None) -> None:
        super().__init__()
        self.dd = dd
        self.cluster_id = dd.cluster_id
        self.port = port
        self.handles: dict[int, Cache] = {}
        self.buffers: dict[int, list[np.ndarray]] = {}

    @property
    def cm(self) -> Any:
        return self.dd.cache_manager

    async def _create(self, num_tensors: int, shape: list[int], *, mem: str, blocks: bool, keys: list[list[int]],
                      model_id: int | None, dtype: str, remote_accessible: bool | None) -> int:
        desc = _desc(num_tensors, shape, dtype)
        bkey = BlocksCacheKey(self.cluster_id, model_id) if model_id is not None else None
        ckeys = [CacheKey(*k) for k in keys]
        if mem == "allocate":
            assert remote_accessible is None, "allocated caches are always remote accessible"
            cache = self.cm.allocate_blocks_cache(desc, bkey) if blocks else self.cm.allocate_cache(desc, ckeys)
        else:
            arrays = [np.zeros(desc.size, dtype=np.uint8) for _ in range(num_tensors)]
            addrs = [int(a.ctypes.data) for a in arrays]
            if blocks:
                cache = self.cm.register_blocks_cache(desc, addrs, bkey, remote_accessible)
            else:
                cache = self.cm.register_cache(desc, addrs, ckeys, remote_accessible)
            self.buffers[cache.cache_id] = arrays
        self.handles[cache.cache_id] = cache
        return int(cache.cache_id)

    def handle(self, cache: CacheInfo) -> Cache:
        return self.handles[cache.cache_id]

    def views(self, cache: CacheInfo) -> list[np.ndarray]:
        """Live flat ``uint8`` views of the local cache's tensors."""
        return [t.view(np.uint8).reshape(-1) for t in self.handle(cache).tensors]

    async def fill(self, cache: CacheInfo, seed: int) -> None:
        fill_pattern(self.handle(cache), seed)

    async def snapshot(self, cache: CacheInfo) -> list[np.ndarray]:
        return [v.copy() for v in self.views(cache)]

    async def digests(self, cache: CacheInfo) -> list[str]:
        return [sha256(v) for v in self.views(cache)]

    async def transfer(self, op: str, cache: CacheInfo, key: dict[str, Any], **a: Any) -> None:
        handle = self.handle(cache)
        k = make_key(key)
        kw: dict[str, Any] = {}
        for name in ("src_layer_range", "dst_layer_range"):
            if a.get(name) is not None:
                kw[name] = range(*a[name])
        if "tensor_num_per_layer" in a:
            kw["tensor_num_per_layer"] = a["tensor_num_per_layer"]
        cm = self.cm
        if op == "pull_cache":
            await cm.pull_cache(k, handle, a.get("batch_index", 0), a.get("size", -1), **kw)
        elif op == "pull_blocks":
            await cm.pull_blocks(k, handle, a.get("src_blocks", []), a["dst_blocks"], **kw)
        elif op == "push_cache":
            await cm.push_cache(k, handle, a.get("batch_index", 0), **kw)
        elif op == "push_blocks":
            await cm.push_blocks(k, handle, a.get("src_blocks", []), a["dst_blocks"], **kw)
        else:
            raise ValueError(op)

    async def release(self, cache: CacheInfo, how: str | None = None) -> None:
        handle = self.handles.pop(cache.cache_id)
        self.caches.pop(cache.cache_id, None)
        if how == "unregister":
            self.cm.unregister_cache(handle.cache_id)
        elif handle.is_blocks_cache:
            self.cm.deallocate_blocks_cache(handle)
        else:
            self.cm.deallocate_cache(handle)
        self.buffers.pop(cache.cache_id, None)  # only after the release: the memory must outlive it

    async def remove_key(self, key: Sequence[int]) -> None:
        self.cm.remove_cache_key(CacheKey(*key))

    async def links(self) -> list[dict[str, Any]]:
        return self.dd.links()

    async def link(self, cluster_id: int, port: int, timeout: int = 3000) -> tuple[int, list[int]]:
        code, codes = await self.dd.link_clusters([cluster_info(cluster_id, port)], timeout)
        return int(code), [int(c) for c in codes]

    async def unlink(self, cluster_id: int, timeout: int = 3000, force: bool = False) -> tuple[int, list[int]]:
        code, codes = await self.dd.unlink_clusters([cluster_info(cluster_id, 1)], timeout, force)
        return int(code), [int(c) for c in codes]

    # -- owner-side state that only an in-process instance exposes --------------------------------------------
    def leases(self, remote_id: int) -> dict[int, Any]:
        """The owner-side leases of the link to ``remote_id`` (empty when no transfer holds a cache)."""
        links = self.dd._links
        assert links is not None
        link = links.links.get(remote_id)
        assert link is not None, f"cluster {self.cluster_id} has no link to {remote_id}"
        assert self.dd._transfers is not None
        return self.dd._transfers.state_of(link).leases

    def busy_caches(self) -> list[int]:
        """Ids of live caches that still hold leases or copy jobs."""
        return [e.cache_id for e in registry_of(self.cm).entries() if e.leases or e.jobs]

    async def finalize(self) -> None:
        self.handles.clear()
        self.caches.clear()
        self.bound_keys.clear()
        await self.dd.finalize()
        self.buffers.clear()


class PeerSide(Side):
    """An ``LLMDataDist`` in an ``aiodatadist.testing._agent`` child process."""

    name = "peer"

    def __init__(self, proc: PeerProcess) -> None:
        super().__init__()
        self.proc = proc
        self.cluster_id = -1
        self.port: int | None = None

    async def call(self, cmd: str, **args: Any) -> Any:
        return await self.proc.call(cmd, **args)

    async def reset(self, cluster_id: int | None = None, *, listen: bool = True,
                    options: dict[str, str] | None = None, role: str = "PROMPT") -> PeerSide:
        """Finalize the peer's instance and start a fresh one (a new cluster id, listening on a new port)."""
        await self.call("finalize")
        self.caches.clear()
        self.bound_keys.clear()
        self.cluster_id = cluster_id if cluster_id is not None else new_cluster_id()
        opts = {"llm.SyncKvCacheWaitTime": str(SYNC_KV_TIMEOUT_MS), **(options or {})}
        self.port = None
        if listen:
            self.port = free_port()
            opts["llm.listenIpInfo"] = f"127.0.0.1:{self.port}"
        await self.call("init", cluster_id=self.cluster_id, role=role, options=opts)
        return self

    async def _create(self, num_tensors: int, shape: list[int], *, mem: str, blocks: bool, keys: list[list[int]],
                      model_id: int | None, dtype: str, remote_accessible: bool | None) -> int:
        args: dict[str, Any] = {"num_tensors": num_tensors, "shape": shape, "dtype": dtype, "blocks": blocks,
                                "keys": keys}
        if model_id is not None:
            args["blocks_key"] = [self.cluster_id, model_id]
        if mem == "allocate":
            assert remote_accessible is None, "allocated caches are always remote accessible"
            result = await self.call("allocate", **args)
        else:
            result = await self.call("register", remote_accessible=remote_accessible, **args)
        return int(result["cache_id"])

    async def fill(self, cache: CacheInfo, seed: int) -> None:
        await self.call("fill", cache_id=cache.cache_id, seed=seed)

    async def snapshot(self, cache: CacheInfo) -> list[np.ndarray]:
        out = []
        for t in range(cache.num_tensors):
            data = await self.call("read", cache_id=cache.cache_id, tensor=t, offset=0, nbytes=cache.tensor_size)
            out.append(np.frombuffer(bytes.fromhex(data), dtype=np.uint8).copy())
        return out

    async def digests(self, cache: CacheInfo) -> list[str]:
        return list(await self.call("digest", cache_id=cache.cache_id))

    async def transfer(self, op: str, cache: CacheInfo, key: dict[str, Any], **kw: Any) -> None:
        await self.call("transfer", op=op, cache_id=cache.cache_id, key=key, **kw)

    async def release(self, cache: CacheInfo, how: str | None = None) -> None:
        self.caches.pop(cache.cache_id, None)
        await self.call("release", cache_id=cache.cache_id, how=how)

    async def remove_key(self, key: Sequence[int]) -> None:
        await self.call("remove_key", key=list(key))

    async def links(self) -> list[dict[str, Any]]:
        return list(await self.call("links"))

    async def link(self, cluster_id: int, port: int, timeout: int = 3000) -> tuple[int, list[int]]:
        code, codes = await self.call("link", cluster_id=cluster_id, port=port, timeout=timeout)
        return int(code), [int(c) for c in codes]

    async def unlink(self, cluster_id: int, timeout: int = 3000, force: bool = False) -> tuple[int, list[int]]:
        code, codes = await self.call("unlink", cluster_id=cluster_id, timeout=timeout, force=force)
        return int(code), [int(c) for c in codes]


async def start_peer() -> PeerSide:
    """A fresh peer process (not yet initialized: call :meth:`PeerSide.reset`)."""
    return PeerSide(await PeerProcess.start())


async def local_instance(cluster_id: int | None = None, *, listen: bool = False,
                         options: dict[str, str] | None = None, role: LLMRole = LLMRole.DECODER) -> LocalSide:
    """An initialized in-process instance (listening on a fresh port if ``listen``)."""
    dd = LLMDataDist(role, cluster_id if cluster_id is not None else new_cluster_id())
    opts = {"llm.SyncKvCacheWaitTime": str(SYNC_KV_TIMEOUT_MS), **(options or {})}
    port = None
    if listen:
        port = free_port()
        opts["llm.listenIpInfo"] = f"127.0.0.1:{port}"
    await dd.init(opts)
    return LocalSide(dd, port)


@dataclass
class World:
    """A linked local instance and peer; ``peer_listens`` says which one is the server."""

    local: LocalSide
    peer: PeerSide
    peer_listens: bool
    extra: list[LocalSide] = field(default_factory=list)

    @classmethod
    async def create(cls, peer: PeerSide, *, peer_listens: bool = True,
                     local_options: dict[str, str] | None = None,
                     peer_options: dict[str, str] | None = None) -> World:
        await peer.reset(listen=peer_listens, options=peer_options)
        local = await local_instance(listen=not peer_listens, options=local_options,
                                     role=LLMRole.DECODER if peer_listens else LLMRole.PROMPT)
        world = cls(local, peer, peer_listens)
        await world.link()
        return world

    @property
    def server(self) -> Side:
        return self.peer if self.peer_listens else self.local

    @property
    def client(self) -> Side:
        return self.local if self.peer_listens else self.peer

    def other(self, side: Side) -> Side:
        return self.peer if side is self.local else self.local

    def side(self, name: str) -> Side:
        return {"local": self.local, "peer": self.peer}[name]

    async def link(self) -> None:
        server = self.server
        port = server.port
        assert port is not None
        code, codes = await self.client.link(server.cluster_id, port)
        assert (code, codes) == (S.LLM_SUCCESS, [S.LLM_SUCCESS]), f"link failed: {code} {codes}"
        await eventually(self._both_linked, what="both sides list the link")

    async def _both_linked(self) -> bool:
        return (self.peer.cluster_id in await self.local.linked_to()
                and self.local.cluster_id in await self.peer.linked_to())

    async def ensure_linked(self) -> None:
        """Relink if an earlier test broke the link (so one failure does not cascade)."""
        if await self._both_linked():
            return
        for side in (self.local, self.peer):
            await side.unlink(self.other(side).cluster_id, force=True)
        await self.link()

    async def settled(self) -> None:
        """Both ends are idle again: the in-process instance holds no lease and no copy job for the link."""
        local, peer_id = self.local, self.peer.cluster_id
        await eventually(lambda: not local.leases(peer_id), what="owner-side leases of the link are released")
        await eventually(lambda: not local.busy_caches(), what="no local cache is leased or copied any more")
        links = local.dd._links
        assert links is not None
        link = links.links[peer_id]
        assert local.dd._transfers is not None
        assert not local.dd._transfers.state_of(link).running, "requester-side transfers are still running"
        await eventually(link.plane.idle, what="no transfer left on the link's data plane")

    async def cleanup(self) -> None:
        await self.local.cleanup()
        await self.peer.cleanup()

    async def close(self) -> None:
        for extra in self.extra:
            await extra.finalize()
        await self.local.finalize()
        await self.peer.call("finalize")
        self.peer.caches.clear()
        self.peer.bound_keys.clear()


# -- expected bytes ------------------------------------------------------------------------------------------

Run = tuple[int, int, int]  # (src_offset, dst_offset, length) within a tensor


def slot_runs(src_slot: int, src_stride: int, dst_slot: int, dst_stride: int, nbytes: int | None = None) -> list[Run]:
    n = dst_stride if nbytes is None else nbytes
    return [(src_slot * src_stride, dst_slot * dst_stride, n)]


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int], block: int) -> list[Run]:
    assert len(src_blocks) == len(dst_blocks)
    return [(s * block, d * block, block) for s, d in zip(src_blocks, dst_blocks)]


def c2b_runs_expected(src_slot: int, slot_bytes: int, dst_blocks: Sequence[int], block: int) -> list[Run]:
    runs = []
    for i, d in enumerate(dst_blocks):
        start = i * block
        runs.append((src_slot * slot_bytes + start, d * block, min(block, slot_bytes - start)))
    return runs


def expected_after(dst_before: list[np.ndarray], src: list[np.ndarray], tensor_pairs: Sequence[tuple[int, int]],
                   runs: Sequence[Run]) -> list[np.ndarray]:
    """``dst_before`` with ``runs`` copied from source tensor ``s`` into destination tensor ``d`` for every
    ``(s, d)`` in ``tensor_pairs``; every other byte stays as it was."""
    out = [t.copy() for t in dst_before]
    for s, d in tensor_pairs:
        for so, do, n in runs:
            assert n > 0 and so + n <= len(src[s]) and do + n <= len(out[d]), "bad expectation"
            out[d][do:do + n] = src[s][so:so + n]
    return out


def assert_bytes(actual: list[np.ndarray], expected: list[np.ndarray], what: str = "destination") -> None:
    """Byte-exact comparison with a message naming the first differing tensor and offset."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    for t, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, f"{what}: tensor {t} has {a.size} bytes, expected {e.size}"
        if not np.array_equal(a, e):
            bad = np.flatnonzero(a != e)
            raise AssertionError(f"{what}: tensor {t} differs at {len(bad)} byte(s), first at offset {bad[0]} "
                                 f"(got {a[bad[0]]}, expected {e[bad[0]]})")


def assert_changed(before: list[np.ndarray], expected: list[np.ndarray]) -> None:
    """Sanity check of a test's own expectation: the transfer must change the destination."""
    assert any(not np.array_equal(b, e) for b, e in zip(before, expected)), \
        "the expected result equals the old contents: this test could not detect a missing copy"


# -- async helpers -------------------------------------------------------------------------------------------

async def eventually(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (sync or async) until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting until {what}")
        await asyncio.sleep(0.01)


async def expect_code(awaitable: Awaitable[Any], code: LLMStatusCode) -> Exception:
    """Await and require an ``LLMException`` (local) or ``PeerError`` (peer) carrying ``code``."""
    try:
        await awaitable
    except LLMException as exc:
        assert exc.status_code == code, f"expected {code!r}, got {exc.status_code!r}: {exc}"
        return exc
    except PeerError as exc:
        assert exc.kind != "TypeError" and exc.status_code == code, \
            f"expected {code!r}, got {exc.kind} {exc.status_code!r}: {exc}"
        return exc
    pytest.fail(f"expected a failure with {code!r}, but the call succeeded")
