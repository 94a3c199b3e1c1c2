"""What a test leaves behind (:class:`LeakCheck`): unfinalized ``LLMDataDist`` instances and their links, child
processes, threads, file descriptors, shared-memory mappings and event-loop tasks (Linux ``/proc``).

A baseline is taken before the test and compared after it, so whatever existed before (module- or
session-scoped fixtures, the event loop, pytest's own files) never counts.  Teardown that finishes a moment after
the test (a thread joining, a peer's task ending) gets ``settle_s`` to finish: the check passes as soon as
nothing is left, and reports what is still there after that.  Process-wide resources started on first use are
allowed: the worker threads of event loops' default executors (``asyncio_N``, which live as long as their loop),
the threads and pipes of the library's copy executor while an instance still holds it (it is shared), the CUDA
driver's threads and descriptors; and the modules that start threads on import (numpy's BLAS pool) are imported
before the baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import re
import signal
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LeakCheck", "Resources"]

DEFAULT_IGNORED_THREADS = (r"asyncio_\d+", r"cuda[-\w]* \(native\)")
"""Thread names (regular expressions, matched whole) never counted as leaks: the worker threads of event loops'
default executors (they live as long as their loop), and the CUDA driver's (process-wide once initialized)."""
IGNORED_FDS = ("/dev/nvidia",)
"""Descriptors whose target starts so are never counted: the CUDA driver's (process-wide once initialized)."""
PRELOADED = ("numpy", "zmq", "aiodatadist.datadist")
"""Imported before the baseline: what they start on import (numpy's BLAS threads) is process-wide, not the
test's."""


@dataclass
class Resources:
    """One look at this process: each resource by identity, with a description for the report."""

    instances: dict[int, str] = field(default_factory=dict)  # id(LLMDataDist) -> description (initialized ones)
    children: dict[tuple[int, str], str] = field(default_factory=dict)  # (pid, start time) -> description
    threads: dict[int, str] = field(default_factory=dict)  # native thread id -> name
    fds: dict[int, str] = field(default_factory=dict)  # descriptor -> what it refers to
    shared_memory: dict[str, str] = field(default_factory=dict)  # mapping (address range) -> file
    tasks: dict[int, str] = field(default_factory=dict)  # id(task) -> description (pending tasks of the loop)

    @classmethod
    def take(cls, loop: asyncio.AbstractEventLoop | None = None) -> Resources:
        """Look now (``loop``: whose pending tasks to list; none without a loop)."""
        return cls(_instances(), _children(), _threads(), _fds(), _shared_memory(), _tasks(loop))


def _live_instances() -> list[Any]:
    """Every ``LLMDataDist`` alive in this process (none if the module was never imported)."""
    module = sys.modules.get("aiodatadist.datadist")
    if module is None:
        return []
    kind = module.LLMDataDist
    # type(), not isinstance(): isinstance reads __class__, which some objects turn into a warning or an error
    return [obj for obj in gc.get_objects() if issubclass(type(obj), kind)]


def _instances() -> dict[int, str]:
    return {id(dd): _describe_instance(dd) for dd in _live_instances() if dd.is_initialized}


def _describe_instance(dd: Any) -> str:
    try:
        links = [f"{link['remote_cluster_id']} ({link['side']}, {link['endpoint']})" for link in dd.links()]
    except Exception:  # noqa: BLE001 - a report must not fail on a broken instance
        links = []
    where = f", linked to {', '.join(links)}" if links else ", no links"
    return f"{dd!r} was not finalized{where}"


_STATES = {"Z": "exited, not reaped", "T": "stopped", "t": "stopped"}


def _children() -> dict[tuple[int, str], str]:
    me = os.getpid()
    out: dict[tuple[int, str], str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[1]) != me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            cmdline = ""
        state = _STATES.get(fields[0], "running")
        out[(int(entry), fields[19])] = f"child process {entry} ({state}): " \
                                        f"{cmdline or stat[stat.index('(') : stat.rindex(')') + 1]}"
    return out


def _threads() -> dict[int, str]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        name = names.get(tid)
        if name is None:
            try:
                with open(f"/proc/self/task/{entry}/comm") as f:
                    name = f"{f.read().strip()} (native)"
            except OSError:
                continue  # it just ended
        out[tid] = name
    return out


def _fds() -> dict[int, str]:
    out = {}
    for entry in os.listdir("/proc/self/fd"):
        try:
            out[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue  # the descriptor of the listing itself, or one closed meanwhile
    return out


def _shared_memory() -> dict[str, str]:
    out = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and (parts[5].startswith("/memfd:") or parts[5].startswith("/dev/shm/")):
                out[parts[0]] = parts[5].strip()
    return out


def _tasks(loop: asyncio.AbstractEventLoop | None) -> dict[int, str]:
    if loop is None:
        return {}
    current = asyncio.current_task(loop) if loop.is_running() else None
    return {id(t): _describe_task(t) for t in asyncio.all_tasks(loop) if t is not current and not t.done()}


def _describe_task(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return f"{task.get_name()} ({getattr(coro, '__qualname__', type(coro).__name__)})"


def _tally(items: Iterable[str]) -> str:
    """``a x2, b`` (in order of first appearance)."""
    counts = Counter(items)
    return ", ".join(f"{item} x{n}" if n > 1 else item for item, n in counts.items())


def _fd_kind(target: str) -> str:
    """What a descriptor refers to, without the per-object part (``socket``, not ``socket:[1234]``)."""
    return re.sub(r":\[\d+\]$", "", target)


def _library_pool() -> tuple[set[int], bool]:
    """The descriptors of the library's shared copy executor, and whether it is alive (then its threads are
    allowed too): it is process-wide and lives while any instance holds it."""
    copy = sys.modules.get("aiodatadist.copy")
    shared = getattr(copy, "_shared", None) if copy is not None else None
    if shared is None:
        return set(), False
    fds: set[int] = set()
    for notifier in list(getattr(shared, "_notifiers", {}).values()):
        ends = (getattr(notifier, "read_fd", None), getattr(notifier, "fd", None))
        fds.update(fd for fd in ends if fd is not None)
    return fds, True


class LeakCheck:
    """``check = LeakCheck(); check.start()`` before a test, ``problems = await check.problems()`` after it
    (on the same event loop, or anywhere without ``loop``); ``await check.assert_clean()`` raises
    ``AssertionError`` listing them.  The pytest fixture ``leak_check`` does all this around a test."""

    def __init__(self, *, settle_s: float = 3.0, ignore_threads: Iterable[str] = DEFAULT_IGNORED_THREADS) -> None:
        self.settle_s = settle_s
        """How long teardown that ends after the test may take before what is left counts as leaked."""
        self._ignored = [re.compile(p) for p in ignore_threads]
        self._baseline: Resources | None = None
        self._baseline_instances: dict[int, weakref.ref[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def ignore_thread(self, pattern: str) -> None:
        """Never count threads whose name matches ``pattern`` (a regular expression, matched whole)."""
        self._ignored.append(re.compile(pattern))

    def start(self) -> None:
        """Take the baseline (and note the running event loop, if any, whose tasks to watch), after importing
        :data:`PRELOADED`."""
        for name in PRELOADED:
            importlib.import_module(name)
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        gc.collect()
        self._baseline = Resources.take(self._loop)
        # ids are compared while the objects live: keep weak references to them
        self._baseline_instances = {id(dd): weakref.ref(dd) for dd in _live_instances()}

    def _new_instances(self, now: dict[int, str]) -> list[str]:
        out = []
        for ident, description in now.items():
            ref = self._baseline_instances.get(ident)
            if ref is None or ref() is None:
                out.append(description)
        return out

    def _problems_now(self) -> list[str]:
        """One line per instance and per child process, one per other kind of resource (counted)."""
        assert self._baseline is not None, "start() was not called"
        gc.collect()
        before, now = self._baseline, Resources.take(self._loop)
        pool_fds, pool_alive = _library_pool()
        out = self._new_instances(now.instances)
        out += [now.children[k] for k in now.children.keys() - before.children.keys()]
        threads = [name for tid, name in sorted(now.threads.items()) if tid not in before.threads
                   and not any(p.fullmatch(name) for p in self._ignored)
                   and not (pool_alive and name.startswith("aiodatadist-copy"))]
        fds = [target for fd, target in sorted(now.fds.items()) if before.fds.get(fd) != target
               and fd not in pool_fds and not target.startswith(IGNORED_FDS)]
        memfds = [t for t in fds if t.startswith("/memfd:")]
        others = [_fd_kind(t) for t in fds if not t.startswith("/memfd:")]
        mappings = [now.shared_memory[r] for r in sorted(now.shared_memory.keys() - before.shared_memory.keys())]
        tasks = [now.tasks[k] for k in now.tasks.keys() - before.tasks.keys()]
        for what, items in (("threads", threads), ("file descriptors", others),
                            ("shared-memory descriptors", memfds), ("shared-memory mappings", mappings),
                            ("pending tasks", tasks)):
            if items:
                out.append(f"{len(items)} {what}: {_tally(items)}")
        return out

    def report(self, problems: list[str]) -> str:
        """The text of a failure for ``problems`` (from :meth:`problems`)."""
        return "the test left these behind:\n  " + "\n  ".join(problems)

    async def problems(self) -> list[str]:
        """What is left since :meth:`start`, once ``settle_s`` passed or nothing is left (checked every 20 ms
        meanwhile, letting the loop run)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_s
        while True:
            found = self._problems_now()
            if not found or loop.time() >= deadline:
                return found
            await asyncio.sleep(0.02)

    async def assert_clean(self) -> None:
        """Raise ``AssertionError`` listing what the test left behind (after cleaning it up: see
        :meth:`clean_up`)."""
        found = await self.problems()
        if found:
            await self.clean_up()
            raise AssertionError(self.report(found))

    async def clean_up(self) -> None:
        """Finalize the instances left initialized (those on this event loop) and SIGKILL the child processes
        left, so that one test's leak does not spill into the next ones."""
        assert self._baseline is not None
        for dd in _live_instances():
            if dd.is_initialized and self._new_instances({id(dd): ""}):
                with contextlib.suppress(Exception, TimeoutError):
                    async with asyncio.timeout(5):
                        await dd.finalize()
        for pid, _ in _children().keys() - self._baseline.children.keys():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
