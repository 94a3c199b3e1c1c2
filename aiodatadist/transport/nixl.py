"""The NIXL data plane (``llm.Transport=nixl``): READ and WRITE through NIXL's UCX backend (RDMA, NVLink, TCP,
shared memory: whatever UCX finds), for peers on other hosts.

One :class:`NixlPlane` per instance owns one NIXL agent, with which the transfer layer registers every cache
(:mod:`aiodatadist.transfer.nixl_caches`); an owner sends the NIXL metadata of a cache's registration in that
cache's descriptor, so a requester learns it only over the admitted link, once per cache.  Each cache's
tensors are described once as a *prepared* descriptor list of its blocks (or batch slots), so a transfer only
names indices; a plan that is not made of whole blocks on both sides (``pull_cache`` with ``size``, a contiguous
slot into blocks) is described span by span instead.

One thread (``aiodatadist-nixl``) makes, posts and checks every transfer, and settles its future on the event
loop: the loop never polls, and never runs a NIXL call that scales with the transfer.  NIXL's own progress
thread is off (NIXL runs it without a pause, so it would take a core): this thread gives UCX its progress, every
:data:`POLL_S` while transfers run and every :data:`IDLE_PROGRESS_S` otherwise (a peer's reads of this
instance's memory over TCP, and connection set-up, need the owner's progress).  A cancelled transfer is
waited for until NIXL reports it done or failed (releasing an active handle does not stop UCX's worker threads
at once), up to :data:`STOP_BOUND` seconds; after that the job fails with ``LLMLinkError`` and the requester
drops the link (NIXL then closes the connection to that peer), so nothing lands in user memory after the call
returned.

NIXL (``pip install 'aiodatadist[nixl]'``) is imported only when an instance uses this plane.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import importlib.util
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import LLMException, LLMLinkError, LLMStatusCode
from ..layout.plans import CacheGeometry, CopyPlan, plan_to_spans
from .base import WaitingMixin

__all__ = ["INSTALL_HINT", "STOP_BOUND", "NixlJob", "NixlPlane", "Registration", "RemoteCache", "load_nixl",
           "nixl_available"]

log = logging.getLogger("aiodatadist.nixl")
S = LLMStatusCode
INSTALL_HINT = "pip install 'aiodatadist[nixl]' (NIXL 1.5 with its UCX backend: nixl-cu12)"
STOP_BOUND = 5.0  # seconds a cancelled transfer NIXL could not cancel is waited for before the link is dropped
POLL_S = 1e-4  # the NIXL thread checks its running transfers this often
IDLE_PROGRESS_S = 1e-3  # and, with none running, gives UCX progress this often for peers reading from us
DEFAULT_PARAMS: Mapping[str, str] = {"num_threads": "2", "split_batch_size": "16"}  # UCX: see docs/performance.md
NIXL_MODULES: tuple[str, ...] = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
"""NIXL's Python API, as the ``nixl`` package installs it, or as the ``nixl-cu12`` / ``nixl-cu13`` builds do alone."""


def load_nixl() -> ModuleType:
    """NIXL's Python API (the first of :data:`NIXL_MODULES` that imports); raises ``LLM_FEATURE_NOT_ENABLED``
    saying what to install."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout otherwise
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise LLMException(f"llm.Transport=nixl needs NIXL: {INSTALL_HINT} ({'; '.join(errors)})",
                       status_code=S.LLM_FEATURE_NOT_ENABLED)


def nixl_available() -> bool:
    """Whether NIXL is installed here (found, not imported)."""
    return any(importlib.util.find_spec(name.split(".")[0]) is not None for name in NIXL_MODULES)


@dataclass(eq=False)
class Registration:
    """A cache's tensors as this agent knows them: the NIXL registration, and the tensors as ``units`` pieces
    of ``unit`` bytes (blocks or batch slots), prepared on first use as the local side of a transfer."""

    addrs: npt.NDArray[np.uint64]
    regs: Any
    mem: str
    dev: int
    unit: int
    units: int
    local: Any = None


@dataclass(eq=False)
class RemoteCache:
    """A peer's cache as this agent reaches it: its prepared descriptor list (blocks or slots of its tensors)."""

    agent: str
    geometry: CacheGeometry
    addrs: npt.NDArray[np.uint64]
    mem: str
    dev: int
    metadata: bytes  # the owner agent's metadata for it (loaded again when the peer's view is rebuilt)
    prepared: Any


@dataclass(eq=False)
class NixlJob:
    """One READ (pull) or WRITE (push) on the NIXL thread; ``future`` settles once NIXL no longer touches the
    memory."""

    op: str
    build: Any  # () -> NIXL transfer handle, called on the NIXL thread
    future: asyncio.Future[None]
    cancel_error: BaseException | None = None
    cancelled: bool = False
    handle: Any = None
    stop_deadline: float = 0.0
    done: bool = False
    nbytes: int = 0
    stuck: bool = False  # cancelled, and NIXL neither cancelled nor finished it within STOP_BOUND
    failure: list[BaseException] = field(default_factory=list)


class NixlPlane(WaitingMixin[NixlJob]):
    """This instance's NIXL agent and the thread that runs its transfers."""

    def __init__(self, name: str, device_id: int = 0, params: Mapping[str, str] | None = None) -> None:
        api = load_nixl()
        self._device_id = device_id
        self.name = f"aiodatadist-{name}-{os.getpid()}-{secrets.token_hex(4)}"
        self._api = api
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = api.nixl_agent(self.name, config)
            self._agent.create_backend("UCX", dict(DEFAULT_PARAMS if params is None else params))
        except Exception as exc:
            ucx = ", ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("UCX_")) or "UCX defaults"
            raise LLMException(f"NIXL could not start its UCX backend ({ucx}): {type(exc).__name__}: {exc}",
                               status_code=S.LLM_FEATURE_NOT_ENABLED) from exc
        self._lock = threading.Condition()
        self._pending: list[NixlJob] = []
        self._running: list[NixlJob] = []
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="aiodatadist-nixl", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- registrations (event loop thread) -----------------------------------------------------------------
    def register(self, addrs: npt.NDArray[np.uint64], size: int, on_device: bool, unit: int,
                 units: int) -> Registration:
        """Register tensors of ``size`` bytes at ``addrs`` (device memory of this instance's GPU when
        ``on_device``), each made of ``units`` pieces of ``unit`` bytes."""
        mem, dev = ("VRAM", self._device_id) if on_device else ("DRAM", 0)
        try:
            regs = self._agent.register_memory(_regions(addrs, size, dev), mem)
        except Exception as exc:
            raise LLMException(f"NIXL could not register the memory: {exc}", status_code=S.LLM_FAILED) from exc
        return Registration(addrs, regs, mem, dev, unit, units)

    def deregister(self, registration: Registration) -> None:
        if self._closing:
            return
        try:
            if registration.local is not None:
                self._agent.release_dlist_handle(registration.local)
            self._agent.deregister_memory(registration.regs)
        except Exception as exc:  # noqa: BLE001
            log.warning("NIXL deregistration failed: %s", exc)

    def reach(self, registration: Registration) -> tuple[bytes, str, int]:
        """What a peer needs to reach registered memory: the agent metadata for it (this agent's connection
        info and the registration), its memory type and device."""
        metadata = bytes(self._agent.get_partial_agent_metadata(registration.regs, True))
        return metadata, registration.mem, registration.dev

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (its agent, and the caches it describes); returns the peer agent's name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise LLMLinkError(f"NIXL refused the peer's metadata: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, agent: str) -> None:
        """Forget a peer agent (its connections close)."""
        if self._closing:
            return
        try:
            self._agent.remove_remote_agent(agent)
        except Exception as exc:  # noqa: BLE001
            log.debug("NIXL could not remove peer agent %s: %s", agent, exc)

    def prepare_remote(self, agent: str, geometry: CacheGeometry, addrs: npt.NDArray[np.uint64],
                       mem: str, dev: int, metadata: bytes) -> RemoteCache:
        """A peer's cache as a prepared descriptor list (one row per tensor, ``slots`` units of ``stride``)."""
        try:
            prepared = self._agent.prep_xfer_dlist(agent, _strided(addrs, geometry.stride, geometry.slots, dev), mem)
        except Exception as exc:
            raise LLMLinkError(f"NIXL cannot reach the peer's cache: {exc}") from exc
        return RemoteCache(agent, geometry, addrs, mem, dev, metadata, prepared)

    def release_remote(self, remote: RemoteCache) -> None:
        if not self._closing:
            try:
                self._agent.release_dlist_handle(remote.prepared)
            except Exception as exc:  # noqa: BLE001
                log.debug("NIXL could not release a peer's descriptor list: %s", exc)

    # -- transfers -------------------------------------------------------------------------------------------
    def start(self, plan: CopyPlan, registration: Registration, remote: RemoteCache, pull: bool) -> NixlJob:
        """Start moving ``plan`` between the requester's registered tensors and ``remote``: a READ when
        ``pull``, else a WRITE."""
        if self._closing:
            raise LLMLinkError("the NIXL plane is closed")
        local_addrs = registration.addrs
        op = "READ" if pull else "WRITE"
        local_side = "dst" if pull else "src"
        indices = _unit_indices(plan, registration.unit, registration.units, remote.geometry, local_side)
        agent = self._agent
        if indices is not None:
            if registration.local is None:
                registration.local = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", _strided(local_addrs, registration.unit, registration.units, registration.dev),
                    registration.mem)
            local_idx, remote_idx = indices
            prepared = registration.local

            def build() -> Any:
                return agent.make_prepped_xfer(op, prepared, local_idx, remote.prepared, remote_idx)
        else:
            spans = plan_to_spans(plan, *((remote.addrs, local_addrs) if pull else (local_addrs, remote.addrs)))
            mine, theirs = (spans.dst, spans.src) if pull else (spans.src, spans.dst)
            local_descs, remote_descs = _descs(mine, spans.length, registration.dev), _descs(theirs, spans.length,
                                                                                               remote.dev)

            def build() -> Any:
                return agent.initialize_xfer(op, agent.get_xfer_descs(local_descs, registration.mem),
                                             agent.get_xfer_descs(remote_descs, remote.mem), remote.agent)
        job = NixlJob(op, build, asyncio.get_running_loop().create_future(), nbytes=plan.total_bytes)
        job.future.add_done_callback(_retrieved)
        if plan.total_bytes == 0:
            job.done = True
            job.future.set_result(None)
            return job
        with self._lock:
            self._pending.append(job)
            self._lock.notify()
        return job

    def cancel(self, job: NixlJob, error: BaseException | None = None) -> None:
        """Stop ``job``: one not posted yet never starts; a posted one is waited for (up to :data:`STOP_BOUND`)."""
        with self._lock:
            if job.done or job.cancelled:
                return
            job.cancelled = True
            job.cancel_error = error
            self._lock.notify()

    def close(self) -> None:
        """Stop the thread (running jobs fail) and let go of the agent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify()
        self._thread.join(STOP_BOUND + 1)

    # -- the NIXL thread -------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._lock:
                if not self._pending and not self._running and not self._closing:
                    self._lock.wait(IDLE_PROGRESS_S)
                new, self._pending = self._pending, []
                closing = self._closing
            for job in new:
                self._post(job)
            if closing:
                for job in self._running:
                    job.cancelled = True
                    job.cancel_error = job.cancel_error or LLMLinkError("the NIXL plane was closed")
            for job in list(self._running):
                self._check(job)
            if closing and not self._running:
                return
            if not self._running and not new:
                self._progress()
            if self._running:
                time.sleep(POLL_S)

    def _progress(self) -> None:
        try:
            self._agent.get_new_notifs()  # drives the UCX workers: answers peers' requests and wire-up
        except Exception as exc:  # noqa: BLE001
            log.debug("NIXL progress failed: %s", exc)

    def _post(self, job: NixlJob) -> None:
        if job.cancelled:
            self._finish(job, job.cancel_error or asyncio.CancelledError())
            return
        try:
            job.handle = job.build()
            state = self._agent.transfer(job.handle)
        except Exception as exc:  # noqa: BLE001
            self._finish(job, LLMLinkError(f"NIXL {job.op} could not be posted: {exc}"))
            return
        if state == "PROC":
            self._running.append(job)
        else:
            self._finish(job, None if state == "DONE" else LLMLinkError(f"NIXL {job.op} failed"))

    def _check(self, job: NixlJob) -> None:
        try:
            state = self._agent.check_xfer_state(job.handle)
        except Exception as exc:  # noqa: BLE001
            state, job.failure = "ERR", [exc]
        if state == "PROC" and job.cancelled:
            # Not released while active: NIXL may report a cancelled handle released while UCX's worker
            # threads still move its bytes (seen: writes after the call returned).  It is waited for instead.
            now = time.monotonic()
            if not job.stop_deadline:
                job.stop_deadline = now + STOP_BOUND
            elif now > job.stop_deadline:
                log.error("a cancelled NIXL %s did not stop within %.0f s", job.op, STOP_BOUND)
                job.stuck = True
                self._running.remove(job)
                self._settle(job, LLMLinkError(f"a cancelled NIXL {job.op} did not stop within {STOP_BOUND:.0f} s"))
            return
        if state == "PROC":
            return
        self._running.remove(job)
        if state == "DONE":
            self._finish(job, job.cancel_error if job.cancelled else None)
        else:
            detail = f": {job.failure[0]}" if job.failure else ""
            self._finish(job, LLMLinkError(f"NIXL {job.op} failed{detail}"))

    def _try_release(self, job: NixlJob) -> bool:
        try:
            self._agent.release_xfer_handle(job.handle)
        except Exception:  # noqa: BLE001 - NIXL could not cancel it (yet): it is waited for
            return False
        job.handle = None
        return True

    def _finish(self, job: NixlJob, error: BaseException | None) -> None:
        if job.handle is not None and not self._try_release(job):
            log.warning("NIXL did not release a finished %s handle", job.op)
        self._settle(job, error)

    def _settle(self, job: NixlJob, error: BaseException | None) -> None:
        job.done = True
        loop = job.future.get_loop()
        if loop.is_closed():
            return
        loop.call_soon_threadsafe(_set, job.future, error)


_LIVE: weakref.WeakSet[NixlPlane] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """An instance never finalized: stop its plane's thread before the interpreter exits (NIXL's agent torn down
    under a running thread aborts the process: "terminate called without an active exception")."""
    for plane in list(_LIVE):
        plane.close()


def _set(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _retrieved(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _regions(addrs: npt.NDArray[np.uint64], size: int, dev: int) -> npt.NDArray[np.uint64]:
    """Registration rows ``(address, length, device)``: the tensors' exact bytes, touching ones merged.  Never
    rounded to pages: a peer's NIXL looks a descriptor up in the region that starts closest below it, so
    regions of different caches must not overlap."""
    starts = np.sort(addrs.astype(np.uint64))
    ends = starts + np.uint64(size)
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] > np.maximum.accumulate(ends)[:-1]
    lo = starts[new]
    hi = np.maximum.reduceat(ends, np.flatnonzero(new))
    return np.stack([lo, hi - lo, np.full_like(lo, dev)], axis=1)


def _strided(addrs: npt.NDArray[np.uint64], unit: int, units: int, dev: int) -> npt.NDArray[np.uint64]:
    """NIXL's compressed descriptor rows ``(address, length, device, stride, count)``: ``units`` consecutive
    pieces of ``unit`` bytes per tensor."""
    rows = np.empty((len(addrs), 5), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = unit
    rows[:, 2] = dev
    rows[:, 3] = unit
    rows[:, 4] = units
    return rows


def _descs(addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64], dev: int) -> npt.NDArray[np.uint64]:
    return np.stack([addrs, lengths, np.full_like(addrs, dev)], axis=1)


def _unit_indices(plan: CopyPlan, unit: int, local_slots: int, remote: CacheGeometry,
                  local_side: str) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None:
    """The plan as (local, remote) indices into both prepared lists (``tensor * slots + unit``), or None when it
    is not made of whole units of one size on both sides."""
    runs = plan.runs
    if unit <= 0 or unit != remote.stride or len(runs.length) == 0:
        return None
    if np.any(runs.src_offset % unit) or np.any(runs.dst_offset % unit) or np.any(runs.length % unit):
        return None
    counts = runs.length // unit
    step = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    src_units = np.repeat(runs.src_offset // unit, counts) + step  # every unit of every run, in order
    dst_units = np.repeat(runs.dst_offset // unit, counts) + step
    src_slots, dst_slots = (remote.slots, local_slots) if local_side == "dst" else (local_slots, remote.slots)
    src = (plan.src_tensor[:, None] * src_slots + src_units[None, :]).reshape(-1)
    dst = (plan.dst_tensor[:, None] * dst_slots + dst_units[None, :]).reshape(-1)
    if src.size and max(int(src.max()), int(dst.max())) > np.iinfo(np.int32).max:
        return None
    local, far = (dst, src) if local_side == "dst" else (src, dst)
    return local.astype(np.int32), far.astype(np.int32)

