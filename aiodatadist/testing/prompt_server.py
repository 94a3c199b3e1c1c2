"""A prompt in another process, for tests of code that links to prompts (:class:`PromptServer`).

``async with PromptServer.start() as server`` runs a PROMPT ``LLMDataDist`` in a child process, listening on a
free port of 127.0.0.1, with named blocks caches filled with random bytes.  The test knows those bytes without
reading them (:meth:`PromptServer.expected`), reads the real ones (:meth:`PromptServer.read`), writes new ones,
and kills, stops or restarts the process.  Every method works from any event loop (see :class:`PeerProcess`).
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..types import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, Placement
from ._opening import Opening
from .addresses import cluster_info_for, new_cluster_id
from .data import pattern
from .peer import Exit, PeerProcess, Stopped

__all__ = ["PromptAddress", "PromptServer", "RemoteCache", "default_cache_desc"]


def default_cache_desc() -> CacheDesc:
    """The cache a :class:`PromptServer` has unless told otherwise: 4 tensors of 16 blocks of 1 KiB (host)."""
    return CacheDesc(4, (16, 1024), DataType.DT_UINT8, Placement.HOST)


class PromptAddress(NamedTuple):
    """Where a prompt listens, and its cluster id: what a decoder needs to link to it."""

    host: str
    port: int
    cluster_id: int

    def cluster_info(self) -> LLMClusterInfo:
        return cluster_info_for(self.cluster_id, self.host, self.port)


@dataclass(frozen=True)
class RemoteCache:
    """A blocks cache of a :class:`PromptServer`: pull it with ``key``; block ``b`` of tensor ``t`` is row ``b``
    of ``expected(name)[t]``."""

    name: str
    cache_id: int
    desc: CacheDesc
    key: BlocksCacheKey

    @property
    def num_blocks(self) -> int:
        return int(self.desc.shape[0])

    @property
    def block_bytes(self) -> int:
        return self.desc.size // self.num_blocks


@dataclass
class _Content:
    """What a cache holds, as the test knows it: a seed's pattern, or bytes written since (materialized)."""

    seed: int | None = None
    tensors: list[np.ndarray] | None = None


class PromptServer:
    """A PROMPT instance in a child process, with named blocks caches (model ids 0, 1, ... in ``caches``'
    order); see the module docstring.  Start it with :meth:`start`."""

    def __init__(self, peer: PeerProcess, cluster_id: int, descs: Mapping[str, CacheDesc], *, host: str,
                 options: Mapping[str, str], env: Mapping[str, str] | None, call_timeout: float | None) -> None:
        """Use :meth:`start`."""
        self.peer = peer
        """The :class:`PeerProcess` (replaced by :meth:`restart`): any agent command via ``peer.call``."""
        self.cluster_id = cluster_id
        self.host = host
        self.port = 0
        self.caches: dict[str, RemoteCache] = {}
        """The caches by name."""
        self.restarted: list[Callable[[PromptServer], object]] = []
        """Called with this server after every :meth:`restart` (e.g. a fault proxy follows a new port)."""
        self._descs = {name: desc.copy() for name, desc in descs.items()}
        self._content = {name: _Content() for name in descs}
        self._options = dict(options)
        self._env = dict(env) if env is not None else None
        self._call_timeout = call_timeout

    @classmethod
    def start(cls, cluster_id: int | None = None, *, caches: Mapping[str, CacheDesc] | None = None,
              fill: bool = True, options: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None,
              host: str = "127.0.0.1", port: int = 0, call_timeout: float | None = 60.0) -> Opening[PromptServer]:
        """Start a prompt (cluster ``cluster_id``, a fresh one by default) listening on ``host:port`` (port 0: a
        free one, then in :attr:`port`), with ``caches`` (name -> ``CacheDesc``; default ``{"kv":
        default_cache_desc()}``), each filled with random bytes unless ``fill`` is False (zeros then).

        ``options`` are added to its ``init`` options (e.g. ``{"llm.Transport": "tcp"}``), ``env`` to its
        environment; ``call_timeout`` bounds each command (seconds).  Await the result, or ``async with`` it.
        """

        async def open_() -> PromptServer:
            descs = dict(caches) if caches is not None else {"kv": default_cache_desc()}
            peer = await PeerProcess.start(env=dict(env) if env is not None else None, call_timeout=call_timeout)
            server = cls(peer, cluster_id if cluster_id is not None else new_cluster_id(), descs, host=host,
                         options=options or {}, env=env, call_timeout=call_timeout)
            try:
                await server._boot(port)
                if fill:
                    for name in descs:
                        await server.fill(name)
            except BaseException:
                await server.close()
                raise
            return server

        return Opening(open_)

    async def _boot(self, port: int) -> None:
        address = await self.peer.init(self.cluster_id, listen=f"{self.host}:{port}", options=self._options)
        assert address is not None
        self.port = address[1]
        for model_id, (name, desc) in enumerate(self._descs.items()):
            created = await self.peer.call(
                "allocate", num_tensors=desc.num_tensors, shape=list(desc.shape), dtype=desc.data_type.name,
                placement=desc.placement.name, blocks=True, blocks_key=[self.cluster_id, model_id])
            self.caches[name] = RemoteCache(name, int(created["cache_id"]), desc.copy(),
                                            BlocksCacheKey(self.cluster_id, model_id))

    # -- where it is ---------------------------------------------------------------------------------------
    @property
    def address(self) -> PromptAddress:
        """``(host, port, cluster_id)``."""
        return PromptAddress(self.host, self.port, self.cluster_id)

    def cluster_info(self) -> LLMClusterInfo:
        """The ``LLMClusterInfo`` to link to this prompt directly."""
        return self.address.cluster_info()

    @property
    def pid(self) -> int:
        return self.peer.pid

    @property
    def alive(self) -> bool:
        return self.peer.returncode is None

    # -- bytes ---------------------------------------------------------------------------------------------
    async def fill(self, name: str = "kv", seed: int | None = None) -> int:
        """Fill every tensor of cache ``name`` with :func:`~aiodatadist.testing.pattern` bytes of ``seed`` (a
        random one by default); returns the seed."""
        seed = random.getrandbits(31) if seed is None else seed
        await self.peer.call("fill", cache_id=self.caches[name].cache_id, seed=seed)
        self._content[name] = _Content(seed=seed)
        return seed

    async def poison(self, name: str = "kv", value: int = 0) -> None:
        """Set every byte of cache ``name`` to ``value``."""
        cache = self.caches[name]
        await self.peer.call("poison", cache_id=cache.cache_id, value=value)
        tensors = [np.full(cache.desc.size, value, np.uint8) for _ in range(cache.desc.num_tensors)]
        self._content[name] = _Content(tensors=tensors)

    async def write(self, name: str, tensor: int, data: bytes | np.ndarray, offset: int = 0) -> None:
        """Write ``data`` (its bytes) into tensor ``tensor`` of cache ``name`` at byte ``offset``."""
        raw = np.frombuffer(bytes(data), np.uint8) if isinstance(data, bytes) else \
            np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        await self.peer.call("write", cache_id=self.caches[name].cache_id, tensor=tensor, offset=offset,
                             data=base64.b64encode(raw.tobytes()).decode())
        tensors = self._materialize(name)
        tensors[tensor][offset: offset + raw.size] = raw

    async def read(self, name: str = "kv", blocks: Sequence[int] | None = None) -> list[np.ndarray]:
        """The bytes cache ``name`` holds now, read from the process: per tensor, ``(len(blocks), block_bytes)``
        ``uint8`` rows (every block by default)."""
        cache = self.caches[name]
        out = []
        for t in range(cache.desc.num_tensors):
            data = await self.peer.call("read_b64", cache_id=cache.cache_id, tensor=t)
            out.append(_rows(np.frombuffer(base64.b64decode(data), np.uint8), cache, blocks))
        return out

    def expected(self, name: str = "kv", blocks: Sequence[int] | None = None) -> list[np.ndarray]:
        """What cache ``name`` holds, as filled and written through this handle (computed here, not read): per
        tensor, ``(len(blocks), block_bytes)`` ``uint8`` rows (every block by default)."""
        return [_rows(t, self.caches[name], blocks) for t in self._tensors(name)]

    def _tensors(self, name: str) -> list[np.ndarray]:
        content, cache = self._content[name], self.caches[name]
        if content.tensors is not None:
            return content.tensors
        if content.seed is None:
            return [np.zeros(cache.desc.size, np.uint8) for _ in range(cache.desc.num_tensors)]
        return [pattern(content.seed, t, cache.desc.size) for t in range(cache.desc.num_tensors)]

    def _materialize(self, name: str) -> list[np.ndarray]:
        content = self._content[name]
        if content.tensors is None:
            content.tensors = [t.copy() for t in self._tensors(name)]
            content.seed = None
        return content.tensors

    # -- the process ---------------------------------------------------------------------------------------
    def kill(self) -> Exit:
        """SIGKILL the process; ``await server.kill()`` waits until it exited.  Links to it drop."""
        return self.peer.kill()

    def stop(self) -> Stopped:
        """SIGSTOP the process: it answers nothing (its sockets stay open) until :meth:`cont`; ``await
        server.stop()`` waits until it has stopped."""
        return self.peer.stop()

    def cont(self) -> None:
        """SIGCONT the process after :meth:`stop`."""
        self.peer.cont()

    async def restart(self, *, port: int | None = None) -> None:
        """Kill the process (if alive) and start a new one: the same cluster id, the same caches with the same
        bytes (as :meth:`expected` knows them), listening on ``port`` (default: the same port as before; 0: a
        free one).  Decoders must link again: their links to the old process dropped."""
        await self.peer.kill()
        await self.peer.close()
        self.peer = await PeerProcess.start(env=self._env, call_timeout=self._call_timeout)
        self.caches.clear()
        await self._boot(self.port if port is None else port)
        for name, content in self._content.items():
            if content.tensors is not None:
                for t, data in enumerate(content.tensors):
                    await self.peer.call("write", cache_id=self.caches[name].cache_id, tensor=t,
                                         data=base64.b64encode(data.tobytes()).decode())
            elif content.seed is not None:
                await self.peer.call("fill", cache_id=self.caches[name].cache_id, seed=content.seed)
        for callback in list(self.restarted):
            callback(self)

    async def close(self) -> None:
        """Finalize and end the process (killed if it does not exit in time).  Idempotent."""
        await self.peer.close()

    def __repr__(self) -> str:
        return f"PromptServer({self.host}:{self.port}, cluster {self.cluster_id}, pid {self.pid})"


def _rows(flat: np.ndarray, cache: RemoteCache, blocks: Sequence[int] | None) -> np.ndarray[Any, Any]:
    rows = flat.reshape(cache.num_blocks, cache.block_bytes)
    return rows.copy() if blocks is None else rows[np.asarray(list(blocks), dtype=np.int64)].copy()
