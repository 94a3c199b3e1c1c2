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

Each thing left is a :class:`Leak`; :meth:`LeakCheck.report` names each descriptor (its number, kind, target, a
socket's addresses, the Python object holding it), and :meth:`LeakCheck.allow` lets a test leave known leaks
(by kind, with a count, or by a predicate).
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeAlias

from ._fds import fd_detail, fd_holders, fd_kind

__all__ = ["RESOURCES", "Leak", "LeakCheck", "LeakMatch", "Resources"]

DEFAULT_IGNORED_THREADS = (r"asyncio_\d+", r"cuda[-\w]* \(native\)")
"""Thread names (regular expressions, matched whole) never counted as leaks: the worker threads of event loops'
default executors (they live as long as their loop), and the CUDA driver's (process-wide once initialized)."""
IGNORED_FDS = ("/dev/nvidia",)
"""Descriptors whose target starts so are never counted: the CUDA driver's (process-wide once initialized)."""
PRELOADED = ("numpy", "zmq", "aiodatadist.datadist")
"""Imported before the baseline: what they start on import (numpy's BLAS threads) is process-wide, not the
test's."""


RESOURCES = ("instance", "process", "thread", "fd", "mapping", "task")
"""What a :class:`Leak` can be, in the order of a report: an unfinalized ``LLMDataDist``, a child process, a
thread, a file descriptor, a shared-memory mapping, a pending task of the test's event loop."""


@dataclass(frozen=True)
class Leak:
    """One thing a test left behind, as :meth:`LeakCheck.leaks` finds it and an allowance
    (:meth:`LeakCheck.allow`) sees it."""

    resource: str
    """One of :data:`RESOURCES`."""
    kind: str
    """A descriptor's kind (``pipe``, ``socket``, ``eventfd``, ``epoll``, ``memfd``, ``file``, ...: see
    :func:`~aiodatadist.testing._fds.fd_kind`); for the other resources, the resource."""
    description: str
    """What it is: a descriptor's ``fd 12: pipe, read end (pipe:[4242])``, a thread's name, a child process's
    state and command line, an instance with its links."""
    fd: int | None = None
    """A descriptor's number."""
    target: str = ""
    """A descriptor's ``/proc/self/fd`` link (``socket:[4243]``, a path); a mapping's file."""
    detail: str = ""
    """A pipe's end, a socket's protocol and addresses (``tcp 127.0.0.1:40000 -> 127.0.0.1:39163``)."""
    holder: str | None = None
    """The Python object holding a descriptor (``socket.socket``, ``_io.BufferedReader '/tmp/x'``), ``""``
    when none does (``os.pipe()``, native code); None when not looked up (in reports only: the last look)."""

    def __str__(self) -> str:
        if self.holder is None:
            return self.description
        return f"{self.description}, " + (f"held by {self.holder}" if self.holder else "no Python object holds it")


LeakMatch: TypeAlias = "str | Callable[[Leak], bool]"
"""What :meth:`LeakCheck.allow` allows: a resource or kind (``"pipe"``, ``"socket"``, ``"fd"``, ``"thread"``,
...: it matches a :class:`Leak` whose ``resource`` or ``kind`` it is), or a predicate on a :class:`Leak`."""


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


def _fd_leak(fd: int, target: str) -> Leak:
    kind = fd_kind(fd, target)
    detail = fd_detail(fd, kind)
    what = f"{kind}, {detail}" if detail else kind
    return Leak("fd", kind, f"fd {fd}: {what} ({target})", fd=fd, target=target, detail=detail)


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


@dataclass
class _Allowance:
    match: LeakMatch
    count: int | None

    def matches(self, leak: Leak) -> bool:
        if isinstance(self.match, str):
            return self.match in (leak.resource, leak.kind)
        return bool(self.match(leak))


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class LeakCheck:
    """``check = LeakCheck(); check.start()`` before a test, ``leaks = await check.leaks()`` after it (on the
    same event loop); ``await check.assert_clean()`` raises ``AssertionError`` listing them
    (:meth:`report`).  ``check.allow(...)`` lets known leaks pass.  The pytest fixture ``leak_check`` does all
    this around a test."""

    def __init__(self, *, settle_s: float = 3.0, ignore_threads: Iterable[str] = DEFAULT_IGNORED_THREADS) -> None:
        self.settle_s = settle_s
        """How long teardown that ends after the test may take before what is left counts as leaked."""
        self._ignored = [re.compile(p) for p in ignore_threads]
        self._baseline: Resources | None = None
        self._baseline_instances: dict[int, weakref.ref[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._allowed: list[_Allowance] = []

    def allow(self, what: LeakMatch, count: int | None = None) -> None:
        """Let leaks matching ``what`` pass: a resource or a kind (``"pipe"``, ``"socket"``, ``"eventfd"``,
        ``"fd"`` for any descriptor, ``"thread"``, ``"process"``, ``"task"``, ...; see :class:`Leak`), or a
        predicate on a :class:`Leak` (``lambda leak: leak.kind == "socket" and ":6379" in leak.detail``).
        ``count``: at most that many of them (None: any number); more are reported.  Calls add up: each leak
        is taken by the first allowance, in the order given, that matches it and has room left."""
        if not isinstance(what, str) and not callable(what):
            raise TypeError(f"allow() takes a resource or kind (str) or a predicate on a Leak, not {what!r}")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
            raise ValueError(f"count must be None or an int >= 0, not {count!r}")
        self._allowed.append(_Allowance(what, count))

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

    def _leaks_now(self) -> list[Leak]:
        """Everything left since the baseline, allowed or not, in the order of :data:`RESOURCES`."""
        assert self._baseline is not None, "start() was not called"
        gc.collect()
        before, now = self._baseline, Resources.take(self._loop)
        pool_fds, pool_alive = _library_pool()
        out = [Leak("instance", "instance", d) for d in self._new_instances(now.instances)]
        out += [Leak("process", "process", now.children[k]) for k in sorted(now.children.keys()
                                                                             - before.children.keys())]
        out += [Leak("thread", "thread", name) for tid, name in sorted(now.threads.items())
                if tid not in before.threads and not any(p.fullmatch(name) for p in self._ignored)
                and not (pool_alive and name.startswith("aiodatadist-copy"))]
        for fd, target in sorted(now.fds.items()):
            if before.fds.get(fd) != target and fd not in pool_fds and not target.startswith(IGNORED_FDS):
                out.append(_fd_leak(fd, target))
        out += [Leak("mapping", "mapping", now.shared_memory[r], target=now.shared_memory[r])
                for r in sorted(now.shared_memory.keys() - before.shared_memory.keys())]
        out += [Leak("task", "task", now.tasks[k]) for k in now.tasks.keys() - before.tasks.keys()]
        return out

    def _not_allowed(self, found: list[Leak]) -> list[Leak]:
        room = [a.count for a in self._allowed]
        out = []
        for leak in found:
            for i, allowance in enumerate(self._allowed):
                left = room[i]
                if left != 0 and allowance.matches(leak):
                    room[i] = None if left is None else left - 1
                    break
            else:
                out.append(leak)
        return out

    def report(self, leaks: Sequence[Leak]) -> str:
        """The text of a failure for ``leaks`` (from :meth:`leaks`): a line per instance and per child process,
        a line per other resource (threads, mappings and tasks counted), and a line per descriptor under
        theirs."""
        lines = [str(leak) for leak in leaks if leak.resource in ("instance", "process")]
        for resource, what in (("thread", "thread"), ("fd", "file descriptor"), ("mapping", "shared-memory mapping"),
                               ("task", "pending task")):
            items = [leak for leak in leaks if leak.resource == resource]
            if not items:
                continue
            if resource == "fd":
                lines.append(f"{_plural(len(items), what)}:" + "".join(f"\n    {leak}" for leak in items))
            else:
                lines.append(f"{_plural(len(items), what)}: {_tally(str(leak) for leak in items)}")
        return "the test left these behind:\n  " + "\n  ".join(lines)

    async def leaks(self) -> list[Leak]:
        """What is left since :meth:`start` and not allowed (:meth:`allow`), once ``settle_s`` passed or nothing
        is left (checked every 20 ms meanwhile, letting the loop run); descriptors name the Python object that
        holds them (:attr:`Leak.holder`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_s
        while True:
            found = self._not_allowed(self._leaks_now())
            if not found or loop.time() >= deadline:
                break
            await asyncio.sleep(0.02)
        holders = fd_holders([leak.fd for leak in found if leak.fd is not None])
        return [replace(leak, holder=holders.get(leak.fd, "")) if leak.fd is not None else leak for leak in found]

    async def assert_clean(self) -> None:
        """Raise ``AssertionError`` listing what the test left behind (after cleaning it up: see
        :meth:`clean_up`)."""
        found = await self.leaks()
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
