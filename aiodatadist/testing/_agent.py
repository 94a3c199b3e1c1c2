"""A scriptable LLMDataDist in its own process, driven by JSON lines on stdin (see ``testing.PeerProcess``).

Run as ``python -m aiodatadist.testing._agent``.  Each request is a JSON line ``{"id", "cmd", "args"}``; each
command runs in its own task, so a long transfer does not block the next command.  Replies are JSON lines
``{"id", "result"}`` or ``{"id", "error", "message", "status_code"}`` on stdout (``error``: the exception's class
name; ``status_code``: for ``LLMException``s).  The agent exits (finalizing its instance) on ``exit`` or when its
stdin closes.

Commands (``cmd_<name>`` below documents each one's arguments and result; ``docs/testing.md`` has the table):

* lifetime: ``init``, ``finalize``, ``exit``;
* links: ``link``, ``unlink``, ``links``;
* caches: ``allocate``, ``register``, ``release``, ``remove_key``;
* bytes: ``fill``, ``poison``, ``write``, ``read``, ``read_b64``, ``digest``, ``block_digests``;
* transfers and notifications: ``transfer``, ``notify``, ``notification``, ``notification_stats``;
* misbehaving: ``sleep``, ``block``; and ``ping``.

Cache descriptions (``allocate``, ``register``): ``num_tensors``, ``shape``, ``dtype`` (a ``DataType`` name,
default ``DT_UINT8``), ``placement`` (``HOST`` by default); ``blocks`` (bool) with ``blocks_key``
``[cluster_id, model_id]``, or ``keys`` (a list of ``CacheKey`` field lists).  Keys of transfers are dicts:
``{"type": "blocks", "cluster_id", "model_id"}``, ``{"type": "id", "cluster_id", "cache_id", "batch_index"}`` or
``{"type": "key", "cluster_id", "req_id", "model_id", "prefix_id"}``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import mmap
import os
import sys
import time
from typing import Any

import numpy as np

from .._checks import U64_MAX
from ..cache import Cache
from ..datadist import LLMDataDist
from ..errors import LLMException
from ..types import BlocksCacheKey, CacheDesc, CacheKey, CacheKeyByIdAndIndex, DataType, LLMRole, Placement
from .addresses import cluster_info
from .data import fill_pattern, tensor_bytes, write_tensor


def make_key(spec: dict[str, Any]) -> CacheKey | CacheKeyByIdAndIndex | BlocksCacheKey:
    """The cache key a transfer's key dict names (the forms in the module's documentation)."""
    kind = spec["type"]
    if kind == "blocks":
        return BlocksCacheKey(spec["cluster_id"], spec.get("model_id", 0))
    if kind == "id":
        return CacheKeyByIdAndIndex(spec["cluster_id"], spec["cache_id"], spec.get("batch_index", 0))
    return CacheKey(spec["cluster_id"], spec["req_id"], spec.get("model_id", 0), spec.get("prefix_id", U64_MAX))


def _range(value: list[int] | None) -> range | None:
    return None if value is None else range(value[0], value[1])


class Agent:
    def __init__(self) -> None:
        self.dd: LLMDataDist | None = None
        self.caches: dict[int, Cache] = {}
        self.buffers: dict[int, list[np.ndarray]] = {}
        self.done = asyncio.Event()

    @property
    def cm(self) -> Any:
        assert self.dd is not None
        return self.dd.cache_manager

    def _desc(self, a: dict[str, Any]) -> CacheDesc:
        return CacheDesc(a["num_tensors"], tuple(a["shape"]), DataType[a.get("dtype", "DT_UINT8")],
                         Placement[a.get("placement", "HOST")])

    async def cmd_init(self, a: dict[str, Any]) -> Any:
        """``role`` (``PROMPT``/``DECODER``), ``cluster_id``, ``options`` (as for ``LLMDataDist.init``; with
        ``llm.listenIpInfo`` port 0 it binds a free port) -> ``{"pid", "listen": [host, port] or None}``."""
        self.dd = LLMDataDist(LLMRole[a.get("role", "PROMPT")], a["cluster_id"])
        await self.dd.init(a.get("options", {}))
        listen = self.dd.listen_address
        return {"pid": os.getpid(), "listen": list(listen) if listen is not None else None}

    async def cmd_ping(self, a: dict[str, Any]) -> Any:
        """-> ``"pong"`` (the agent's loop is alive)."""
        return "pong"

    async def cmd_link(self, a: dict[str, Any]) -> Any:
        """``cluster_id``, ``port``, ``host`` (127.0.0.1), ``timeout`` (ms, 3000) -> ``[code, [codes]]``."""
        assert self.dd is not None
        info = cluster_info(a["cluster_id"], a["port"], a.get("host", "127.0.0.1"))
        code, codes = await self.dd.link_clusters([info], a.get("timeout", 3000))
        return [int(code), [int(c) for c in codes]]

    async def cmd_unlink(self, a: dict[str, Any]) -> Any:
        """``cluster_id``, ``port``, ``timeout`` (ms), ``force`` -> ``[code, [codes]]``."""
        assert self.dd is not None
        code, codes = await self.dd.unlink_clusters([cluster_info(a["cluster_id"], a.get("port", 1))],
                                                    a.get("timeout", 3000), a.get("force", False))
        return [int(code), [int(c) for c in codes]]

    async def cmd_links(self, a: dict[str, Any]) -> Any:
        """-> ``LLMDataDist.links()``."""
        assert self.dd is not None
        return self.dd.links()

    async def cmd_allocate(self, a: dict[str, Any]) -> Any:
        """A cache description (see the module docstring) -> ``{"cache_id"}`` (an allocated cache)."""
        desc = self._desc(a)
        if a.get("blocks"):
            bk = a.get("blocks_key")
            cache = self.cm.allocate_blocks_cache(desc, BlocksCacheKey(*bk) if bk else None)
        else:
            cache = self.cm.allocate_cache(desc, [CacheKey(*k) for k in a.get("keys", [])])
        self.caches[cache.cache_id] = cache
        return {"cache_id": cache.cache_id}

    async def cmd_register(self, a: dict[str, Any]) -> Any:
        """A cache description, ``host_memory`` (register inside ``allocate_host_memory``), ``in_place`` (this
        process's memory, shared in place with ``share_host_memory``), ``remote_accessible``
        -> ``{"cache_id"}`` (a registered cache over zeroed memory of this process)."""
        desc = self._desc(a)
        if a.get("host_memory"):  # inside shareable memory from allocate_host_memory (one block per cache)
            memory = self.cm.allocate_host_memory(desc.size * desc.num_tensors)
            whole = memory.array()
            arrays = [whole[i * desc.size: (i + 1) * desc.size] for i in range(desc.num_tensors)]
        elif a.get("in_place"):  # this process's memory, tensors 64 bytes past a page and a page apart, shared in place
            page = mmap.PAGESIZE
            pitch = (desc.size + 2 * page) // page * page
            whole = np.zeros(desc.num_tensors * pitch + 2 * page, dtype=np.uint8)
            first = -whole.ctypes.data % page + 64
            arrays = [whole[first + i * pitch: first + i * pitch + desc.size] for i in range(desc.num_tensors)]
            self.cm.share_host_memory([(int(x.ctypes.data), desc.size) for x in arrays])
        else:
            arrays = [np.zeros(desc.size, dtype=np.uint8) for _ in range(desc.num_tensors)]
        addrs = [int(x.ctypes.data) for x in arrays]
        if a.get("blocks"):
            bk = a.get("blocks_key")
            cache = self.cm.register_blocks_cache(desc, addrs, BlocksCacheKey(*bk) if bk else None,
                                                  a.get("remote_accessible"))
        else:
            cache = self.cm.register_cache(desc, addrs, [CacheKey(*k) for k in a.get("keys", [])],
                                           a.get("remote_accessible"))
        self.caches[cache.cache_id] = cache
        self.buffers[cache.cache_id] = arrays
        return {"cache_id": cache.cache_id}

    async def cmd_fill(self, a: dict[str, Any]) -> Any:
        """``cache_id``, ``seed``: fill every tensor with ``testing.pattern(seed, tensor, size)`` bytes."""
        fill_pattern(self.caches[a["cache_id"]], a["seed"])
        return None

    # Bulk work on a cache runs in a thread: this process's event loop keeps serving transfers meanwhile, as a
    # serving framework's would (a loop blocked for tens of milliseconds delays every peer's requests).
    async def cmd_poison(self, a: dict[str, Any]) -> Any:
        """``cache_id``, ``value`` (0): set every byte of every tensor to ``value``."""
        cache = self.caches[a["cache_id"]]

        def poison() -> None:
            for t in range(cache.cache_desc.num_tensors):
                write_tensor(cache, t, np.full(cache.cache_desc.size, a.get("value", 0), dtype=np.uint8))

        await asyncio.to_thread(poison)
        return None

    async def cmd_digest(self, a: dict[str, Any]) -> Any:
        """``cache_id`` -> sha256 hex digest of each tensor."""
        cache = self.caches[a["cache_id"]]
        return await asyncio.to_thread(
            lambda: [hashlib.sha256(t.data).hexdigest() for t in tensor_bytes(cache)])

    async def cmd_read(self, a: dict[str, Any]) -> Any:
        """``cache_id``, ``tensor``, ``offset``, ``nbytes`` -> those bytes in hex."""
        t = tensor_bytes(self.caches[a["cache_id"]])[a["tensor"]]
        return t[a["offset"]: a["offset"] + a["nbytes"]].tobytes().hex()

    async def cmd_write(self, a: dict[str, Any]) -> Any:
        """``cache_id``, ``tensor``, ``offset`` (0), ``data`` (base64): write those bytes into the tensor."""
        cache = self.caches[a["cache_id"]]
        data = np.frombuffer(base64.b64decode(a["data"]), dtype=np.uint8)
        tensor = tensor_bytes(cache)[a["tensor"]]
        offset = a.get("offset", 0)
        if offset < 0 or offset + data.size > tensor.size:
            raise ValueError(f"{data.size} bytes at offset {offset} do not fit a tensor of {tensor.size}")
        tensor[offset: offset + data.size] = data
        write_tensor(cache, a["tensor"], tensor)
        return None

    async def cmd_read_b64(self, a: dict[str, Any]) -> Any:
        """``cache_id``, ``tensor``, ``offset`` (0), ``nbytes`` (to the end) -> those bytes in base64."""
        t = tensor_bytes(self.caches[a["cache_id"]])[a["tensor"]]
        offset = a.get("offset", 0)
        end = t.size if a.get("nbytes") is None else offset + a["nbytes"]
        return base64.b64encode(t[offset:end].tobytes()).decode()

    async def cmd_block_digests(self, a: dict[str, Any]) -> Any:
        """sha256 of each ``block_bytes`` piece of tensor ``tensor`` (large caches, without moving the bytes)."""
        cache = self.caches[a["cache_id"]]
        t = (await asyncio.to_thread(tensor_bytes, cache))[a["tensor"]].reshape(-1, a["block_bytes"])
        return await asyncio.to_thread(lambda: [hashlib.sha256(block).hexdigest() for block in t])

    async def cmd_release(self, a: dict[str, Any]) -> Any:
        """``cache_id``, ``how`` (``"unregister"`` or deallocate): release a cache."""
        cache = self.caches.pop(a["cache_id"])
        if a.get("how") == "unregister":
            self.cm.unregister_cache(cache.cache_id)
        elif cache.is_blocks_cache:
            self.cm.deallocate_blocks_cache(cache)
        else:
            self.cm.deallocate_cache(cache)
        return None

    async def cmd_remove_key(self, a: dict[str, Any]) -> Any:
        """``key`` (``CacheKey`` fields): ``remove_cache_key``."""
        self.cm.remove_cache_key(CacheKey(*a["key"]))
        return None

    async def cmd_transfer(self, a: dict[str, Any]) -> Any:
        """``op`` (``pull_cache``, ``pull_blocks``, ``push_cache``, ``push_blocks``), ``cache_id`` (the local
        cache), ``key`` (see the module docstring), ``src_blocks``/``dst_blocks``, ``batch_index``, ``size``,
        ``src_layer_range``/``dst_layer_range`` (``[start, stop]``), ``tensor_num_per_layer``, ``notify`` (hex)."""
        cache = self.caches[a["cache_id"]]
        key = make_key(a["key"])
        kw: dict[str, Any] = {}
        for name in ("src_layer_range", "dst_layer_range"):
            if a.get(name) is not None:
                kw[name] = _range(a[name])
        if "tensor_num_per_layer" in a:
            kw["tensor_num_per_layer"] = a["tensor_num_per_layer"]
        if a.get("notify") is not None:  # hex
            kw["notify"] = bytes.fromhex(a["notify"])
        op = a["op"]
        if op == "pull_cache":
            await self.cm.pull_cache(key, cache, a.get("batch_index", 0), a.get("size", -1), **kw)
        elif op == "pull_blocks":
            await self.cm.pull_blocks(key, cache, a.get("src_blocks", []), a["dst_blocks"], **kw)
        elif op == "push_cache":
            await self.cm.push_cache(key, cache, a.get("batch_index", 0), **kw)
        elif op == "push_blocks":
            await self.cm.push_blocks(key, cache, a.get("src_blocks", []), a["dst_blocks"], **kw)
        else:
            raise ValueError(f"unknown op {op}")
        return None

    async def cmd_notify(self, a: dict[str, Any]) -> Any:
        """``cluster_id``, ``message`` (hex): ``LLMDataDist.notify``."""
        assert self.dd is not None
        await self.dd.notify(a["cluster_id"], bytes.fromhex(a["message"]))
        return None

    async def cmd_notification(self, a: dict[str, Any]) -> Any:
        """The next notification as ``[cluster_id, message hex]`` (None: none within ``timeout`` seconds)."""
        assert self.dd is not None
        got = await self.dd.get_notification(a.get("timeout"))
        return None if got is None else [got.cluster_id, got.message.hex()]

    async def cmd_notification_stats(self, a: dict[str, Any]) -> Any:
        """``cluster_id`` -> ``[sent, received, dropped]``."""
        assert self.dd is not None
        n = self.dd.stats().notifications_of(a["cluster_id"])
        return [n.sent, n.received, n.dropped]

    async def cmd_served(self, a: dict[str, Any]) -> Any:
        """``cluster_id``, ``direction`` -> what that peer's transfers asked of this instance through its event
        loop (``LLMDataDist.stats().served_of``): ``{"operations", "succeeded"}``, or None."""
        assert self.dd is not None
        served = self.dd.stats().served_of(a["cluster_id"], a["direction"])
        return None if served is None else {"operations": served.operations, "succeeded": served.succeeded}

    async def cmd_sleep(self, a: dict[str, Any]) -> Any:
        """``seconds``: answer after that long (the loop keeps running)."""
        await asyncio.sleep(a["seconds"])
        return None

    async def cmd_block(self, a: dict[str, Any]) -> Any:
        """Keep this process's event loop busy for ``seconds`` (a busy engine: its native I/O threads still run)."""
        time.sleep(a["seconds"])  # noqa: ASYNC251 - blocking the loop is the point
        return None

    async def cmd_finalize(self, a: dict[str, Any]) -> Any:
        """Finalize the instance (``init`` may follow)."""
        if self.dd is not None:
            await self.dd.finalize()
        return None

    async def cmd_exit(self, a: dict[str, Any]) -> Any:
        """Finalize and exit the process."""
        await self.cmd_finalize(a)
        self.done.set()
        return None


async def _main() -> None:
    agent = Agent()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout
    tasks: set[asyncio.Task[None]] = set()

    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    async def run(msg: dict[str, Any]) -> None:
        try:
            result = await getattr(agent, "cmd_" + msg["cmd"])(msg.get("args", {}))
            send({"id": msg["id"], "result": result})
        except LLMException as exc:
            send({"id": msg["id"], "error": type(exc).__name__, "message": str(exc),
                  "status_code": int(exc.status_code)})
        except Exception as exc:  # noqa: BLE001 - every error goes back to the test that asked
            send({"id": msg["id"], "error": type(exc).__name__, "message": str(exc)})

    async def read_commands() -> None:
        while line := await reader.readline():
            task = asyncio.ensure_future(run(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        agent.done.set()

    reading = asyncio.ensure_future(read_commands())
    await agent.done.wait()
    reading.cancel()
    await agent.cmd_finalize({})


if __name__ == "__main__":
    asyncio.run(_main())
