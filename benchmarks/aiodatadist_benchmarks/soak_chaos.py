"""``python -m aiodatadist soak --chaos``: the soak's random transfers while the prompt process is killed,
restarted, stopped and cut off.

The decoder (this process) links to the prompt through a fault-injecting TCP proxy in a process of its own
(:mod:`aiodatadist_benchmarks.soak_proxy`), which carries the control connection.  After a warm-up, a controller
injects one event at a time, at random moments (every 5-20 s, seeded; ``--chaos-every S``: every ``S`` s), the
first always a kill:

* ``kill``: SIGKILL the prompt process, start a new one (same cluster id, a new port behind the proxy, the same
  caches and patterns);
* ``sigstop``: SIGSTOP the prompt for a random time below ``sync_kv_timeout`` (0.1-1.5 s) or beyond it
  (2.5-5 s), then SIGCONT;
* ``proxy_stall``: hold every control byte for such a time, then deliver it;
* ``proxy_cut``: reset the control connection and refuse new ones for 0.1-2 s;
* ``data_cut``: shut down the decoder's TCP data connections to the prompt (``shutdown(2)`` on a duplicate of
  their descriptors: the library's threads see the connection break).  The data listener's port is ephemeral
  and announced in the handshake, so the proxy cannot carry them.  Only where the link has data connections
  (``--transport tcp``); elsewhere the event is a ``proxy_cut``;
* ``port_churn``: for 1-4 s, a hostile process (:mod:`aiodatadist_benchmarks.port_churn`, ``mixed``) opens and drops
  connections to the prompt's listen port as fast as it can: ZeroMQ clients that say nothing, random bytes,
  greetings cut short, random msgpack maps.  The link and its transfers must carry on meanwhile, and a link made
  after it must be admitted.

A relinker in the decoder calls ``link_clusters`` again whenever its link to the prompt is gone (the library
drops it when the connection breaks) and the prompt is ready (its caches filled: a link to a half-built prompt
would let a pull read unfilled bytes).  Events stop a settle period before the end (10 % of the run, 3-30 s).

**What is checked.**  As in the plain soak, every completed transfer is compared byte for byte, except the
pushes whose prompt process was restarted between poisoning and digest (counted as *unverified*: the bytes
went to a process that is gone).  Every transfer call must return within 100 ms of its deadline (its own
``asyncio.timeout``, its cancellation or ``sync_kv_timeout``), every ``link_clusters`` within 100 ms of its
``timeout``.  Failures are allowed only with the codes a dying or stalled peer explains: ``CANCELLED``,
``LLM_TIMEOUT``, ``LLM_LINK_FAILED``, ``LLM_NOT_YET_LINK``, ``LLM_KV_CACHE_NOT_EXIST``.  The decoder's open
descriptors, threads, mappings (lines of ``/proc/self/maps``; those of memfds separately), memfd descriptors and
RSS are sampled with the workers paused after the warm-up, after every event (for the record), and at the end
once relinked; from the warm-up to the end the counts may grow by a small tolerance at most and RSS by less than
5 %.  The run fails (exit status 1) on any corrupted transfer, unexpected failure, late call, growth beyond
those bounds, a link that did not come back within 30 s of an event, or a run without any event.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiodatadist import LLMConfig, LLMDataDist, LLMRole, LLMStatusCode
from aiodatadist.testing import PeerError, PeerProcess, cluster_info, free_port
from aiodatadist.testing.netcut import cut_data_connections

from . import soak
from .soak import (
    DECODER,
    EXPECTED_FAILURES,
    INTERRUPT_RANGE_S,
    LATE_LIMIT_S,
    LOOP_PROBE_S,
    MODE_WEIGHTS,
    MODES,
    PROMPT,
    SYNC_KV_TIMEOUT_MS,
    Progress,
    _counts,
    _figures,
    _library_stats,
    _memory,
    _problems,
    _PromptCaches,
    _Rig,
    _rss_kib,
    _Soak,
    _start_prompt,
    _summary,
)

__all__ = ["chaos_summary", "run_chaos_soak"]

CHAOS_EVERY_S = (5.0, 20.0)  # the pause before each event, drawn uniformly
EVENT_WEIGHTS = {"kill": 0.3, "sigstop": 0.15, "proxy_stall": 0.15, "proxy_cut": 0.15, "data_cut": 0.15,
                 "port_churn": 0.1}
SHORT_STALL_S = (0.1, 1.5)  # below sync_kv_timeout
LONG_STALL_S = (2.5, 5.0)  # beyond it
CUT_S = (0.1, 2.0)
CHURN_S = (1.0, 4.0)
CHURN_PROBE_ID = 7_000_001  # a decoder linking once after a port churn
CHURN_LINK_MS = 1000
LINK_TIMEOUT_MS = 3000
RELINK_POLL_S = 0.02
RELINK_RETRY_S = 0.1
RECOVERY_LIMIT_S = 30.0  # an event after which the link is not back by then is a failure
QUIESCE_LIMIT_S = 10.0  # how long a sample waits for the workers to pause
SAMPLE_SETTLE_S = 0.3  # paused workers, then this long before a sample: background teardown finishes
LINK_DOWN = ("LLM_NOT_YET_LINK", "LLM_LINK_FAILED")  # a worker getting one waits RELINK_POLL_S: no busy loop
CHAOS_EXPECTED_FAILURES = (*EXPECTED_FAILURES, "LLM_LINK_FAILED", "LLM_NOT_YET_LINK", "LLM_KV_CACHE_NOT_EXIST")
# How much each count may grow from the warm-up to the end: a descriptor or mapping that a pending allocation or
# the interpreter takes at the moment of sampling, never one per restart (a run has dozens of them).
RESOURCE_TOLERANCE = {"fds": 4, "threads": 2, "mappings": 16, "memfds": 0, "memfd_mappings": 0}


def _resources() -> dict[str, Any]:
    """Open descriptors, threads, mappings, memfd descriptors, memfd mappings and RSS (KiB) of this process."""
    fds = os.listdir("/proc/self/fd")
    memfds = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            memfds += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    with open("/proc/self/maps") as f:
        maps = f.readlines()
    tasks = os.listdir("/proc/self/task")
    names = Counter(re.sub(r"[-_ ]?\d+(?: \(.*\))?$", "", t.name) for t in threading.enumerate())
    names["(native)"] = len(tasks) - sum(names.values())
    return {"fds": len(fds), "threads": len(tasks), "mappings": len(maps),
            "memfds": memfds, "memfd_mappings": sum("/memfd:" in line for line in maps),
            "rss_kib": _rss_kib(os.getpid()) or 0, "thread_names": dict(names)}


class _Proxy:
    """The fault proxy's process (:mod:`aiodatadist_benchmarks.soak_proxy`), driven over its stdin."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc, self.port = proc, port
        self._lock = asyncio.Lock()

    @classmethod
    async def start(cls, target_port: int) -> _Proxy:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiodatadist_benchmarks.soak_proxy", str(target_port),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if not line.strip().isdigit():
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"soak: the fault proxy did not start ({line!r})")
        return cls(proc, int(line))

    async def command(self, line: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self._lock:
            self.proc.stdin.write(f"{line}\n".encode())
            await self.proc.stdin.drain()
            answer = await asyncio.wait_for(self.proc.stdout.readline(), 10)
        if answer.strip() != b"ok":
            raise RuntimeError(f"soak: the fault proxy refused {line!r}: {answer!r}")

    async def close(self) -> None:
        if self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class _Prompt:
    """The current prompt process.  ``epoch`` counts kills; ``ready`` is clear from a kill until the new process
    has filled its caches.  Agent commands go to the current process (``PeerError`` while it is restarting)."""

    def __init__(self, peer: PeerProcess, port: int, caches: _PromptCaches) -> None:
        self.peer, self.port, self.caches = peer, port, caches
        self.epoch = 0
        self.ready = asyncio.Event()
        self.ready.set()

    async def call(self, cmd: str, **args: Any) -> Any:
        if not self.ready.is_set():
            raise PeerError("Restarting", "the prompt process is being restarted", None)
        return await self.peer.call(cmd, **args)


@dataclass
class _Event:
    """One injected fault."""

    kind: str
    at_s: float  # since the start of the run
    hold_s: float = 0.0  # how long the stall or cut lasted
    detail: str = ""
    recovered_s: float | None = None  # from the event's start until the link was up and the prompt ready
    first_done_s: float | None = None  # from the event's start until a transfer begun after recovery completed
    started: float = field(default=0.0, repr=False)  # loop time
    recovered: float = field(default=math.inf, repr=False)  # loop time

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "at_s": round(self.at_s, 3), "hold_s": round(self.hold_s, 3),
                "detail": self.detail, "recovered_s": self.recovered_s, "first_done_s": self.first_done_s}


class _Tally(soak._Tally):
    """The plain soak's tally; problems described on stderr carry the moment (seconds into the run)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = 0.0
        self.late: list[tuple[float, float]] = []  # (seconds into the run, ms) of every call > 20 ms late

    def record_call(self, mode: str, latency_s: float, late_s: float, failure: str | None) -> None:
        super().record_call(mode, latency_s, late_s, failure)
        if late_s > 0.02:
            self.late.append((round(asyncio.get_running_loop().time() - self.started, 3), round(late_s * 1e3, 1)))

    def report_problem(self, kind: str, text: str) -> None:
        super().report_problem(kind, f"[{asyncio.get_running_loop().time() - self.started:.2f} s] {text}")


class _ChaosSoak(_Soak):
    """The plain soak's workers and checks, plus the chaos controller, the relinker and resource samples."""

    def __init__(self, rig: _Rig, prompt: _Prompt, dd: LLMDataDist, proxy: _Proxy, concurrency: int, seed: int,
                 progress: Progress, *, transport: str, every: float | None, kinds: list[str] | None) -> None:
        super().__init__(rig, prompt.peer, concurrency, seed, progress)
        self.tally = self._tally = _Tally()
        self._prompt, self._dd, self._proxy = prompt, dd, proxy
        self._transport, self._every, self._kinds = transport, every, kinds
        self._rng = np.random.default_rng([seed, 1 << 20])
        self._gate = asyncio.Event()
        self._gate.set()
        self._active = 0
        self._pending_first: list[_Event] = []
        self.events: list[_Event] = []
        self.samples: list[dict[str, Any]] = []
        self.unverified = 0
        self.done_after_last_restart = 0
        self.last_restart_ready: float | None = None
        self.relinks = 0
        self.link_calls: Counter[str] = Counter()
        self.link_late_worst_s = -math.inf
        self.link_late_calls = 0
        self.never_recovered: list[str] = []
        self.problems: list[str] = []  # failures of the harness itself (a restart that did not work, ...)
        self.started = 0.0
        self.loop_lags: list[tuple[float, float]] = []  # (seconds into the run, lag in ms) of every lag > 50 ms

    def rss(self) -> dict[str, int]:
        pids = {"decoder": os.getpid(), "prompt": self._prompt.peer.pid}
        return {name: kib for name, pid in pids.items() if (kib := _rss_kib(pid)) is not None}

    def linked(self) -> bool:
        return any(link["remote_cluster_id"] == PROMPT for link in self._dd.links())

    # -- the run ---------------------------------------------------------------------------------------------
    async def run(self, seconds: float) -> float:
        loop = asyncio.get_running_loop()
        self.started = self._tally.started = started = loop.time()
        end = started + seconds
        warmup = min(max(2.0, 0.05 * seconds), seconds / 2)
        settle = min(max(3.0, 0.1 * seconds), 30.0)
        helpers = [asyncio.ensure_future(self._report_progress(started)),
                   asyncio.ensure_future(self._watch_loop()),
                   asyncio.ensure_future(self._relinker())]
        controller = asyncio.ensure_future(self._controller(started + warmup, end - settle))
        try:
            async with asyncio.TaskGroup() as group:
                for w in range(self._concurrency):
                    group.create_task(self._worker(w, np.random.default_rng([self._seed, w]), end))
            duration = loop.time() - started
            await controller  # ends by itself: no event starts after end - settle
            if not await self._wait_linked(RECOVERY_LIMIT_S):
                self.problems.append(f"the decoder was not linked to the prompt {RECOVERY_LIMIT_S:g} s after the "
                                     "workers stopped")
            self.samples.append(await self._sample("end"))
        finally:
            controller.cancel()
            for task in helpers:
                task.cancel()
            await asyncio.gather(controller, *helpers, return_exceptions=True)
        return duration

    async def _watch_loop(self) -> None:
        """The plain soak's probe of this event loop's wake-up delay, also noting when it exceeded 50 ms."""
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LOOP_PROBE_S)
            lag = loop.time() - before - LOOP_PROBE_S
            self.tally.worst_loop_lag_s = max(self.tally.worst_loop_lag_s, lag)
            if lag > 0.05:
                self.loop_lags.append((round(before - self.started, 3), round(lag * 1e3, 1)))

    @staticmethod
    async def _start_executor_threads() -> None:
        """Start every thread of the loop's default executor (``asyncio.to_thread``, ``run_in_executor``): it starts
        them one by one as the load requires, so that a warm-up sample could otherwise see fewer than the end."""
        count = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's default max_workers
        await asyncio.gather(*(asyncio.to_thread(time.sleep, 0.05) for _ in range(count)))

    async def _wait_linked(self, limit: float) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + limit
        while not (self._prompt.ready.is_set() and self.linked()):
            if loop.time() > give_up:
                return False
            await asyncio.sleep(RELINK_POLL_S)
        return True

    async def _sample(self, label: str) -> dict[str, Any]:
        """The decoder's resources with every worker paused (none has a transfer or check in flight)."""
        loop = asyncio.get_running_loop()
        self._gate.clear()
        try:
            give_up = loop.time() + QUIESCE_LIMIT_S
            while self._active and loop.time() < give_up:
                await asyncio.sleep(0.01)
            busy = self._active
            await asyncio.sleep(SAMPLE_SETTLE_S)
            gc.collect()
            sample = {"label": label, "at_s": round(loop.time() - self.started, 3), "busy_workers": busy,
                      **_resources()}
        finally:
            self._gate.set()
        return sample

    # -- the relinker ----------------------------------------------------------------------------------------
    async def _relinker(self) -> None:
        loop = asyncio.get_running_loop()
        info = cluster_info(PROMPT, self._proxy.port)
        while True:
            await asyncio.sleep(RELINK_POLL_S)
            if not self._prompt.ready.is_set() or self.linked():
                continue
            start = loop.time()
            code, _ = await self._dd.link_clusters([info], timeout=LINK_TIMEOUT_MS)
            late = loop.time() - start - LINK_TIMEOUT_MS / 1000
            self.link_calls[code.name] += 1
            self.link_late_worst_s = max(self.link_late_worst_s, late)
            if late > LATE_LIMIT_S:
                self.link_late_calls += 1
                self.tally.report_problem("LATE", f"link_clusters returned {late * 1e3:.1f} ms after its timeout "
                                          f"({code.name})")
            if code == LLMStatusCode.LLM_SUCCESS:
                self.relinks += 1
            else:
                await asyncio.sleep(RELINK_RETRY_S)

    # -- the controller --------------------------------------------------------------------------------------
    async def _controller(self, first_at: float, last_at: float) -> None:
        loop = asyncio.get_running_loop()
        await self._start_executor_threads()
        await asyncio.sleep(max(0.0, first_at - loop.time()))
        self.samples.append(await self._sample("warm-up"))
        self.rss_start = {"decoder": self.samples[0]["rss_kib"]}
        kinds = list(EVENT_WEIGHTS)
        weights = np.array(list(EVENT_WEIGHTS.values()))
        while True:
            pause = self._every if self._every is not None else float(self._rng.uniform(*CHAOS_EVERY_S))
            if loop.time() + pause > last_at:
                return
            await asyncio.sleep(pause)
            if self._kinds is not None:
                kind = self._kinds[len(self.events) % len(self._kinds)]
            elif not self.events:
                kind = "kill"
            else:
                kind = kinds[int(self._rng.choice(len(kinds), p=weights / weights.sum()))]
            event = _Event(kind, loop.time() - self.started, started=loop.time())
            self.events.append(event)
            try:
                await self._inject(event)
            except Exception as exc:  # noqa: BLE001 - the harness failed: report it, end the chaos
                self.problems.append(f"{event.kind} at {event.at_s:.1f} s failed: {exc!r}")
                self.tally.report_problem("UNEXPECTED", f"chaos event {event.kind}:\n{traceback.format_exc()}")
                return
            if not await self._wait_linked(RECOVERY_LIMIT_S):
                self.never_recovered.append(f"{event.kind} at {event.at_s:.1f} s")
                self._progress(f"the link did not come back within {RECOVERY_LIMIT_S:g} s after {event.kind}")
                return
            event.recovered = loop.time()
            event.recovered_s = round(event.recovered - event.started, 3)
            self._pending_first.append(event)
            if event.kind == "kill":
                self.last_restart_ready = loop.time()
                self.done_after_last_restart = 0
            self._progress(f"{event.kind} at {event.at_s:.1f} s ({event.detail}): linked again after "
                           f"{event.recovered_s:.2f} s")
            self.samples.append(await self._sample(f"after {event.kind} at {event.at_s:.1f} s"))

    def _hold(self, long_share: float = 0.5) -> float:
        span = LONG_STALL_S if self._rng.random() < long_share else SHORT_STALL_S
        return float(self._rng.uniform(*span))

    async def _inject(self, event: _Event) -> None:
        prompt = self._prompt
        if event.kind == "data_cut":
            cut = cut_data_connections(prompt.peer.pid, prompt.port)
            if cut:
                event.detail = f"{cut} data connections shut down"
                return
            event.kind = "proxy_cut"  # this link has no TCP data connections
        if event.kind == "kill":
            await self._restart(event)
        elif event.kind == "port_churn":
            await self._churn(event)
        elif event.kind == "sigstop":
            event.hold_s = self._hold()
            event.detail = f"prompt stopped for {event.hold_s:.2f} s"
            os.kill(prompt.peer.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(event.hold_s)
            finally:
                os.kill(prompt.peer.pid, signal.SIGCONT)
        else:
            event.hold_s = self._hold() if event.kind == "proxy_stall" else float(self._rng.uniform(*CUT_S))
            mode = "stall" if event.kind == "proxy_stall" else "cut"
            event.detail = f"control connection {'stalled' if mode == 'stall' else 'cut'} for {event.hold_s:.2f} s"
            await self._proxy.command(mode)
            try:
                await asyncio.sleep(event.hold_s)
            finally:
                await self._proxy.command("pass")

    async def _churn(self, event: _Event) -> None:
        event.hold_s = float(self._rng.uniform(*CHURN_S))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiodatadist_benchmarks.port_churn", "mixed", str(self._prompt.port),
            f"{event.hold_s:.3f}", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        words = out.split()
        made = words[-1].decode() if words[-2:-1] == [b"done"] else "?"
        if proc.returncode != 0:
            raise RuntimeError(f"the port churn process failed ({proc.returncode}): {err.decode()[-800:]}")
        event.detail = f"{made} hostile connections to the listen port in {event.hold_s:.2f} s"
        async with LLMDataDist(LLMRole.DECODER, CHURN_PROBE_ID) as probe:  # a new link is admitted at once
            await probe.init({})
            code, _ = await probe.link_clusters([cluster_info(PROMPT, self._prompt.port)], timeout=CHURN_LINK_MS)
            if code != LLMStatusCode.LLM_SUCCESS:
                self.problems.append(f"a link after {event.detail} failed: {code.name}")
            else:
                await probe.unlink_clusters([cluster_info(PROMPT, self._prompt.port)], timeout=CHURN_LINK_MS)

    async def _restart(self, event: _Event) -> None:
        prompt = self._prompt
        old = prompt.peer
        prompt.ready.clear()
        prompt.epoch += 1
        old.kill()
        await old.proc.wait()
        await old.close()
        peer = await PeerProcess.start()
        port = free_port()
        try:
            caches = await _start_prompt(peer, port, self._transport, self._concurrency, 16 * self._seed)
        except BaseException:
            await peer.close()
            raise
        prompt.peer, prompt.port = peer, port
        if caches != prompt.caches:  # the transfers name the first process's cache ids
            raise RuntimeError(f"the restarted prompt allocated other cache ids: {caches} != {prompt.caches}")
        await self._proxy.command(f"target {port}")
        event.detail = f"pid {old.pid} killed, pid {peer.pid} on port {port}"
        prompt.ready.set()

    # -- the workers -----------------------------------------------------------------------------------------
    async def _worker(self, worker: int, rng: np.random.Generator, end: float) -> None:
        loop = asyncio.get_running_loop()
        previous = "none"
        while loop.time() < end:
            await self._gate.wait()
            self._active += 1
            try:
                previous = await self._one(worker, rng, previous)
            finally:
                self._active -= 1
            await asyncio.sleep(0)

    async def _one(self, worker: int, rng: np.random.Generator, previous: str) -> str:
        """One transfer, verified unless its prompt process was restarted meanwhile; returns its description."""
        loop = asyncio.get_running_loop()
        prompt = self._prompt
        transfer = self._rig.random_transfer(worker, rng)
        remote = transfer.kind.startswith("push")  # its destination lives in the prompt process
        epoch, checkable = prompt.epoch, True
        try:
            await transfer.destination.poison()
        except (PeerError, OSError):
            checkable = False  # the prompt is restarting: make the call all the same
        mode = MODES[int(rng.choice(len(MODES), p=MODE_WEIGHTS))]
        limit = math.exp(rng.uniform(*np.log(INTERRUPT_RANGE_S)))
        how = f"{transfer.detail} ({mode}{f' after {limit * 1e3:.2f} ms' if mode != 'plain' else ''})"
        begun = loop.time()
        failure = await self._attempt(transfer.call, mode, limit, how)
        if failure is None:
            bad: list[int] | None = None
            if checkable and prompt.epoch == epoch:
                try:
                    bad = await transfer.destination.mismatches(transfer.move)
                except (PeerError, OSError):
                    bad = None
                if remote and prompt.epoch != epoch:
                    bad = None  # the digest may come from the new process
            if bad is None:
                self.unverified += 1
            elif bad:
                self.tally.corrupted += 1
                self.tally.report_problem("CORRUPTED", f"{how}: tensors {bad} differ; "
                                          f"this worker's previous transfer: {previous}")
            else:
                self._completed(transfer.kind, transfer.move.nbytes, begun)
        elif failure in LINK_DOWN:
            await asyncio.sleep(RELINK_POLL_S)  # the link is being restored: no busy loop meanwhile
        elif failure not in EXPECTED_FAILURES:  # allowed or not, say when and what (the first ten of each kind)
            self.tally.report_problem(f"FAILED {failure}", f"{how} (prompt epoch {epoch} -> {prompt.epoch})")
        return f"{how}: {failure or 'completed'}"

    def _completed(self, kind: str, nbytes: int, begun: float) -> None:
        self.tally.done[kind] += 1
        self.tally.bytes_moved += nbytes
        if self.last_restart_ready is not None and begun >= self.last_restart_ready:
            self.done_after_last_restart += 1
        now = asyncio.get_running_loop().time()
        for event in [e for e in self._pending_first if begun >= e.recovered]:
            event.first_done_s = round(now - event.started, 3)
            self._pending_first.remove(event)


def _growth(samples: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    start, end = samples[0], samples[-1]
    return {name: {"warm_up": start[name], "end": end[name], "growth": end[name] - start[name],
                   "tolerance": tolerance, "max": max(s[name] for s in samples)}
            for name, tolerance in RESOURCE_TOLERANCE.items()}


async def run_chaos_soak(seconds: float, *, concurrency: int = 16, transport: str = "auto", seed: int = 1,
                         every: float | None = None, kinds: list[str] | None = None,
                         progress: Progress = lambda _: None) -> dict[str, Any]:
    """Run the chaos soak (see the module docstring) and return its figures."""
    port = free_port()
    peer = await PeerProcess.start()
    proxy: _Proxy | None = None
    prompt: _Prompt | None = None
    try:
        caches = await _start_prompt(peer, port, transport, concurrency, 16 * seed)
        prompt = _Prompt(peer, port, caches)
        proxy = await _Proxy.start(port)
        async with LLMDataDist(LLMRole.DECODER, DECODER) as dd:
            cfg = LLMConfig()
            cfg.sync_kv_timeout = SYNC_KV_TIMEOUT_MS
            cfg.transport = transport
            await dd.init(cfg.generate_options())
            code, _ = await dd.link_clusters([cluster_info(PROMPT, proxy.port)], timeout=20000)
            if code != LLMStatusCode.LLM_SUCCESS:
                raise RuntimeError(f"soak: link failed: {code}")
            plane = dd.links()[0]["plane"]
            soak = _ChaosSoak(_Rig(prompt, dd, caches, 16 * seed), prompt, dd, proxy, concurrency, seed, progress,
                              transport=transport, every=every, kinds=kinds)
            progress(f"prompt pid {peer.pid} linked over {plane} through the fault proxy (pid {proxy.proc.pid}); "
                     f"{concurrency} workers for {seconds:g} s, chaos "
                     + (f"every {every:g} s" if every is not None else "every 5-20 s"))
            duration = await soak.run(seconds)
            library = _library_stats(dd)
    finally:
        if prompt is not None:
            peer = prompt.peer
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer.pid, signal.SIGCONT)
        await peer.close()
        if proxy is not None:
            await proxy.close()
    settings = {"seconds": seconds, "concurrency": concurrency, "transport": transport, "plane": plane, "seed": seed,
                "chaos": True, "chaos_every_s": every, "chaos_events": kinds}
    samples = soak.samples
    end_rss = {"decoder": samples[-1]["rss_kib"]} if samples else {}
    figures = _figures(soak, duration, end_rss, settings)
    figures["rss"] = _memory(soak.rss_start or end_rss, end_rss)
    events = Counter(e.kind for e in soak.events)
    recovered = [e.recovered_s for e in soak.events if e.recovered_s is not None]
    first_done = [e.first_done_s for e in soak.events if e.first_done_s is not None]
    figures.update({
        "library_stats": library, "events": [e.to_json() for e in soak.events], "event_counts": dict(events),
        "restarts": events.get("kill", 0), "relinks": soak.relinks, "link_calls": dict(soak.link_calls),
        "link_late_worst_ms": soak.link_late_worst_s * 1e3 if soak.link_calls else None,
        "link_late_over_100ms": soak.link_late_calls, "unverified": soak.unverified,
        "done_after_last_restart": soak.done_after_last_restart,
        "recovery_worst_s": max(recovered, default=None), "first_done_worst_s": max(first_done, default=None),
        "never_recovered": soak.never_recovered, "resources": samples,
        "late_over_20ms": soak._tally.late, "loop_lags_over_50ms": soak.loop_lags,
        "resource_growth": _growth(samples) if len(samples) >= 2 else {},
    })
    figures["problems"] = _chaos_problems(figures, soak.problems)
    figures["ok"] = not figures["problems"]
    return figures


def _chaos_problems(f: dict[str, Any], harness: list[str]) -> list[str]:
    problems = [*harness, *_problems(f, CHAOS_EXPECTED_FAILURES)]
    if not f["events"]:
        problems.append("no chaos event fitted in the run (more --seconds, or --chaos-every)")
    if f["link_late_over_100ms"]:
        problems.append(f"{f['link_late_over_100ms']} link_clusters calls returned > 100 ms after their timeout")
    problems.extend(f"the link did not come back within {RECOVERY_LIMIT_S:g} s after {what}"
                    for what in f["never_recovered"])
    if not f["resource_growth"]:
        problems.append("no resource samples (the run ended before its warm-up)")
    problems.extend(f"decoder {name} grew by {g['growth']} ({g['warm_up']} -> {g['end']}, tolerance {g['tolerance']})"
                    for name, g in f["resource_growth"].items() if g["growth"] > g["tolerance"])
    return problems


def chaos_summary(f: dict[str, Any]) -> list[str]:
    lines = _summary(f)
    head, result = lines[:-1], lines[-1]
    head[0] += f", chaos every {f['chaos_every_s']:g} s" if f["chaos_every_s"] else ", chaos every 5-20 s"
    growth = f["resource_growth"]
    resources = ", ".join(f"{name} {g['warm_up']} -> {g['end']} ({g['growth']:+d}, max {g['max']})"
                          for name, g in growth.items())
    worst = f["link_late_worst_ms"]
    link_late = ("n/a" if worst is None else f"{worst:.1f} ms after" if worst >= 0 else f"{-worst:.1f} ms before")
    chaos = [
        f"chaos events       {len(f['events'])} ({_counts(f['event_counts'])})",
        (f"relinks            {f['relinks']}: link_clusters {_counts(f['link_calls'])}; the latest returned {link_late} "
         f"its timeout, {f['link_late_over_100ms']} > 100 ms after"),
        (f"recovery           link back at worst {_opt(f['recovery_worst_s'])} after an event began; first "
         f"transfer done at worst {_opt(f['first_done_worst_s'])} after"),
        f"after last restart {f['done_after_last_restart']} transfers done and verified",
        f"unverified         {f['unverified']} pushes (their prompt process was restarted before the digest)",
        f"decoder resources  {resources or 'not sampled'} (warm-up -> end)",
        f"lateness           {_histogram([ms for _, ms in f['late_over_20ms']], LATE_BINS_MS)} calls late by (ms)",
        (f"loop lags          {_histogram([ms for _, ms in f['loop_lags_over_50ms']], LAG_BINS_MS)} wake-ups of "
         "this event loop late by (ms): a busy machine delays every return"),
    ]
    return [*head, *chaos, result]


LATE_BINS_MS = (20, 50, 100, 200, 500)
LAG_BINS_MS = (50, 100, 200, 500)


def _histogram(values: list[float], bins: tuple[int, ...]) -> str:
    """How many ``values`` fall in each of ``bins`` (lower edges, the first one the smallest value recorded)."""
    counts = np.histogram(values, bins=[*bins, math.inf])[0] if values else np.zeros(len(bins), dtype=int)
    labels = [f"{lo}-{hi}" for lo, hi in itertools.pairwise(bins)] + [f">{bins[-1]}"]
    return ", ".join(f"{label}: {int(n)}" for label, n in zip(labels, counts, strict=True))


def _opt(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} s"
