"""Helpers for async test suites (ours and users'): loopback ports, linked pairs, peer processes, test data.

``linked_pair()`` gives a prompt (server) and a decoder (client) in this process and event loop.
``PeerProcess`` runs an ``LLMDataDist`` in a separate OS process driven by JSON commands (see
:mod:`aiodatadist.testing._agent`), for tests that need two real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from ..cache import Cache
from ..config import LLMConfig
from ..datadist import LLMDataDist
from ..errors import LLMException, LLMStatusCode
from ..types import LLMClusterInfo, LLMRole, Placement

__all__ = ["PeerError", "PeerProcess", "cluster_info", "fill_pattern", "free_port", "linked_pair", "pattern",
           "tensor_bytes", "write_tensor"]


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cluster_info(remote_cluster_id: int, port: int, ip: str = "127.0.0.1") -> LLMClusterInfo:
    """An ``LLMClusterInfo`` for a server listening on ``ip:port``."""
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_cluster_id
    info.append_local_ip_info(ip, 0)
    info.append_remote_ip_info(ip, port)
    return info


@contextlib.asynccontextmanager
async def linked_pair(prompt_id: int = 1, decoder_id: int = 2, *, sync_kv_timeout: int = 5000,
                      config: LLMConfig | None = None) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    """A listening prompt and a decoder linked to it, both in this event loop; finalized on exit."""
    port = free_port()
    prompt = LLMDataDist(LLMRole.PROMPT, prompt_id)
    decoder = LLMDataDist(LLMRole.DECODER, decoder_id)
    server_options = dict((config or LLMConfig()).generate_options())
    server_options["llm.listenIpInfo"] = f"127.0.0.1:{port}"
    server_options["llm.SyncKvCacheWaitTime"] = str(sync_kv_timeout)
    client_cfg = LLMConfig()
    client_cfg.sync_kv_timeout = sync_kv_timeout
    if config is not None:
        client_cfg.transport = config.transport
    async with prompt, decoder:
        await prompt.init(server_options)
        await decoder.init(dict(client_cfg.generate_options()))
        code, _ = await decoder.link_clusters([cluster_info(prompt_id, port)], timeout=5000)
        if code != LLMStatusCode.LLM_SUCCESS:
            raise LLMException(f"linked_pair: link failed with {code}", status_code=code)
        yield prompt, decoder


def pattern(seed: int, tensor_index: int, nbytes: int) -> np.ndarray:
    """Deterministic test bytes (never 0) for tensor ``tensor_index`` of a cache filled with ``seed``."""
    rng = np.random.default_rng([seed, tensor_index])
    return rng.integers(1, 256, size=nbytes, dtype=np.uint8)


def fill_pattern(cache: Cache, seed: int) -> list[np.ndarray]:
    """Fill every tensor of a cache (host or device) with :func:`pattern` bytes; returns the bytes per tensor."""
    out = [pattern(seed, t, cache.cache_desc.size) for t in range(cache.cache_desc.num_tensors)]
    for t, data in enumerate(out):
        write_tensor(cache, t, data)
    return out


def _device_of(cache: Cache) -> Any:
    owner = cache._owner
    if owner is None or not hasattr(owner, "_device"):
        raise LLMException("not a cache of a CacheManager", status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return owner._device().device


def write_tensor(cache: Cache, index: int, data: np.ndarray) -> None:
    """Overwrite tensor ``index`` of a cache (host or device) with ``data`` (its bytes, ``cache_desc.size``)."""
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.nbytes != cache.cache_desc.size:
        raise ValueError(f"{raw.nbytes} bytes for a tensor of {cache.cache_desc.size}")
    if cache.cache_desc.placement == Placement.DEVICE:
        _device_of(cache).copy_htod(cache.tensor_addrs[index], raw.ctypes.data, raw.nbytes)
    else:
        cache.tensors[index].view(np.uint8).reshape(-1)[:] = raw


def tensor_bytes(cache: Cache) -> list[np.ndarray]:
    """A host copy of every tensor's bytes (flat ``uint8``), for a host or a device cache."""
    if cache.cache_desc.placement != Placement.DEVICE:
        return [t.view(np.uint8).reshape(-1).copy() for t in cache.tensors]
    device, size = _device_of(cache), cache.cache_desc.size
    out = []
    for addr in cache.tensor_addrs:
        buf = np.empty(size, dtype=np.uint8)
        device.copy_dtoh(buf.ctypes.data, addr, size)
        out.append(buf)
    return out


class PeerError(Exception):
    """A command failed in the peer process (``status_code`` is set for ``LLMException``s)."""

    def __init__(self, kind: str, message: str, status_code: int | None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.status_code = LLMStatusCode.from_code(status_code) if status_code is not None else None


class PeerProcess:
    """An ``LLMDataDist`` in a child process, driven by JSON-line commands over its stdin/stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self._ids = 0
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, *, env: dict[str, str] | None = None) -> PeerProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiodatadist.testing._agent",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env={**os.environ, **(env or {})}, limit=1 << 24,
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            future = self._pending.pop(msg.get("id"), None)
            if future is None or future.done():
                continue
            if "error" in msg:
                future.set_exception(PeerError(msg["error"], msg.get("message", ""), msg.get("status_code")))
            else:
                future.set_result(msg.get("result"))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerError("ProcessExited", "peer process exited", None))
        self._pending.clear()

    async def call(self, cmd: str, **args: Any) -> Any:
        """Run a command in the peer and return its result (raises :class:`PeerError`)."""
        assert self.proc.stdin is not None
        self._ids += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[self._ids] = future
        try:
            self.proc.stdin.write((json.dumps({"id": self._ids, "cmd": cmd, "args": args}) + "\n").encode())
            await self.proc.stdin.drain()
        except BaseException:
            self._pending.pop(self._ids, None)
            future.cancel()  # the peer is gone: nobody will ever resolve (or retrieve) it
            raise
        return await future

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the peer to finalize and exit; kill it if it does not in time."""
        if self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.call("exit"), timeout)
            except (PeerError, TimeoutError, ConnectionError, BrokenPipeError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.kill()
                await self.proc.wait()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
