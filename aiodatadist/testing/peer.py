"""An ``LLMDataDist`` in a child process, driven by JSON-line commands (:class:`PeerProcess`).

The child is :mod:`aiodatadist.testing._agent`; its commands are listed there and in ``docs/testing.md``.
Replies are read by a thread of this process, and each caller is woken on its own event loop, so a peer started
by a session- or module-scoped fixture may be used from tests running on any loop (or from several threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Generator
from types import EllipsisType, TracebackType
from typing import IO, Any, Self

from ..errors import LLMStatusCode
from ._crossloop import OneShot
from ._opening import Opening

__all__ = ["PeerError", "PeerProcess", "ProcessHandle"]

_JOIN_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 5.0

class PeerError(Exception):
    """A command failed in the peer process (``status_code`` is set for ``LLMException``s); ``kind`` is the
    exception's class name there, or ``ProcessExited`` when the peer is gone."""

    def __init__(self, kind: str, message: str, status_code: int | None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.status_code = LLMStatusCode.from_code(status_code) if status_code is not None else None


class ProcessHandle:
    """The child process: ``pid``, ``returncode`` (None while it runs), ``kill()``, ``await wait()``."""

    def __init__(self, popen: subprocess.Popen[bytes], exited: OneShot[int]) -> None:
        self._popen = popen
        self._exited = exited

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    def kill(self) -> None:
        """SIGKILL (a no-op once it exited)."""
        self.send_signal(signal.SIGKILL)

    def send_signal(self, signum: int) -> None:
        if not self._exited.done():
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(signum)

    async def wait(self) -> int:
        """Wait until the process exited (from any event loop); its exit status (``-signal`` when killed)."""
        return await self._exited.wait()


class Exit(Awaitable[int]):
    """What :meth:`PeerProcess.kill` returns: awaiting it waits for the exit and gives the exit status; not
    awaiting it is fine too (the process is killed either way)."""

    def __init__(self, handle: ProcessHandle) -> None:
        self._handle = handle

    def __await__(self) -> Generator[Any, None, int]:
        return self._handle.wait().__await__()


class Stopped(Awaitable[None]):
    """What :meth:`PeerProcess.stop` returns: awaiting it waits until every thread of the child has stopped (a
    signal is delivered asynchronously: a thread busy on another CPU may run on for a moment), or the child
    exited; ``TimeoutError`` after 5 s."""

    def __init__(self, pid: int, exited: OneShot[int]) -> None:
        self._pid, self._exited = pid, exited

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        async with asyncio.timeout(_STOP_TIMEOUT_S):
            while not self._exited.done() and not _all_stopped(self._pid):
                await asyncio.sleep(0.001)


def _all_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (or gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # that thread ended
        if stat[stat.rindex(")") + 2] not in "TtZX":
            return False
    return True


class PeerProcess:
    """An ``LLMDataDist`` in a child process (``python -m aiodatadist.testing._agent``), driven by commands.

    ``async with PeerProcess.start() as peer`` (or ``peer = await PeerProcess.start()`` ... ``await
    peer.close()``); ``await peer.init(cluster_id)`` makes it a prompt listening on a free port and returns
    ``(host, port)``; ``await peer.call(cmd, **args)`` runs any command of :mod:`aiodatadist.testing._agent`.
    Every method may be awaited from any event loop, not only the one that started the peer.
    """

    def __init__(self, popen: subprocess.Popen[bytes], call_timeout: float | None = None) -> None:
        """Use :meth:`start`."""
        self._popen = popen
        self.call_timeout = call_timeout
        """Default ``reply_timeout`` of :meth:`call` (seconds; None: wait as long as the peer lives)."""
        self.listen_address: tuple[str, int] | None = None
        """``(host, port)`` the peer's instance listens on, once :meth:`init` made it a server."""
        self._lock = threading.Lock()
        self._ids = 0
        self._pending: dict[int, OneShot[Any]] = {}
        self._exited: OneShot[int] = OneShot()
        self.proc = ProcessHandle(popen, self._exited)
        """The child process itself (``pid``, ``returncode``, ``kill()``, ``await wait()``)."""
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        assert popen.stdin is not None and popen.stdout is not None
        # Daemon threads: a test that forgets to close the peer must not hang the interpreter's exit (the
        # reader ends when the child's stdout closes, the writer when told to or when the child is gone).
        self._reader = threading.Thread(target=self._read, args=(popen.stdout,), daemon=True,
                                        name=f"aiodatadist-peer-{popen.pid}-reader")
        self._writer = threading.Thread(target=self._write, args=(popen.stdin,), daemon=True,
                                        name=f"aiodatadist-peer-{popen.pid}-writer")
        self._reader.start()
        self._writer.start()

    @classmethod
    def start(cls, *, env: dict[str, str] | None = None,
              call_timeout: float | None = None) -> Opening[PeerProcess]:
        """Start the child process (with ``env`` added to this process's environment).  Await the result, or
        use it as an async context manager (which closes the peer on exit)."""

        def spawn() -> PeerProcess:
            popen = subprocess.Popen([sys.executable, "-m", "aiodatadist.testing._agent"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env={**os.environ, **(env or {})})
            return cls(popen, call_timeout)

        async def start() -> PeerProcess:
            return await asyncio.to_thread(spawn)  # a fork of a big test process takes a while

        return Opening(start)

    # -- the child -----------------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once the child exited (``-signal`` when killed), else None."""
        return self.proc.returncode

    def kill(self) -> Exit:
        """SIGKILL the child now; ``await peer.kill()`` also waits until it exited (returns its exit status)."""
        self.proc.kill()
        return Exit(self.proc)

    def stop(self) -> Stopped:
        """SIGSTOP the child: it answers nothing, and its sockets stay open, until :meth:`cont`.  ``await
        peer.stop()`` also waits until every thread of it has stopped (usually at once)."""
        self.proc.send_signal(signal.SIGSTOP)
        return Stopped(self.pid, self._exited)

    def cont(self) -> None:
        """SIGCONT a child stopped by :meth:`stop`."""
        self.proc.send_signal(signal.SIGCONT)

    async def wait(self) -> int:
        """Wait until the child exited; its exit status."""
        return await self._exited.wait()

    # -- commands ------------------------------------------------------------------------------------------
    async def call(self, cmd: str, *, reply_timeout: Any = ..., **args: Any) -> Any:
        """Run command ``cmd`` with ``args`` in the peer and return its result.

        Raises :class:`PeerError` when the command failed there or the peer exited, and ``TimeoutError`` when no
        reply came within ``reply_timeout`` seconds (default :attr:`call_timeout`); the command may still run
        in the peer then, and its late reply is dropped.  Cancelling the caller drops the reply the same way.
        """
        # reply_timeout is typed Any so that callers may pass ``**args`` of any value type; checked here
        if isinstance(reply_timeout, EllipsisType):
            timeout = self.call_timeout
        elif reply_timeout is None or type(reply_timeout) in (int, float):
            timeout = reply_timeout
        else:
            raise TypeError(f"reply_timeout must be seconds (a number) or None, not {reply_timeout!r}")
        reply: OneShot[Any] = OneShot()
        with self._lock:
            self._ids += 1
            ident = self._ids
            if self._exited.done():
                raise PeerError("ProcessExited", f"peer process {self.pid} exited ({self.returncode})", None)
            self._pending[ident] = reply
        self._outbox.put((json.dumps({"id": ident, "cmd": cmd, "args": args}) + "\n").encode())
        try:
            if timeout is None:
                return await reply.wait()
            try:
                async with asyncio.timeout(timeout):
                    return await reply.wait()
            except TimeoutError:
                raise TimeoutError(f"peer process {self.pid} did not answer {cmd!r} within {timeout} s") from None
        finally:
            with self._lock:
                self._pending.pop(ident, None)

    async def init(self, cluster_id: int, role: str = "PROMPT", *, listen: str | None = "127.0.0.1:0",
                   options: dict[str, str] | None = None,
                   reply_timeout: float | None | EllipsisType = ...) -> tuple[str, int] | None:
        """Initialize the peer's instance (``role`` ``"PROMPT"`` or ``"DECODER"``) with ``options``; with
        ``listen`` (``"host:port"``, port 0: a free one) it listens there.  Returns ``(host, port)`` it listens
        on (also in :attr:`listen_address`), None when it does not listen."""
        opts = dict(options or {})
        if listen is not None:
            opts["llm.listenIpInfo"] = listen
        result = await self.call("init", role=role, cluster_id=cluster_id, options=opts,
                                 reply_timeout=reply_timeout)
        address = result.get("listen")
        self.listen_address = (str(address[0]), int(address[1])) if address else None
        return self.listen_address

    async def close(self, timeout: float = 10.0) -> None:
        """Ask the peer to finalize and exit; kill it if it has not within ``timeout`` seconds.  Idempotent."""
        if not self._exited.done():
            self.cont()  # a stopped peer could not answer
            with contextlib.suppress(PeerError, TimeoutError):
                await self.call("exit", reply_timeout=timeout)
            try:
                async with asyncio.timeout(timeout):
                    await self.wait()
            except TimeoutError:
                self.kill()
                await self.wait()
        self._outbox.put(None)
        # Both threads end at once now (the child's stdout is closed): join them, so that nothing of the peer
        # is left when this returns.
        await asyncio.to_thread(self._join)

    def _join(self) -> None:
        for thread in (self._reader, self._writer):
            if thread is not threading.current_thread():
                thread.join(_JOIN_TIMEOUT_S)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def __repr__(self) -> str:
        state = "running" if self.returncode is None else f"exited {self.returncode}"
        return f"PeerProcess(pid={self.pid}, {state}, listen={self.listen_address})"

    # -- threads -------------------------------------------------------------------------------------------
    def _write(self, stdin: IO[bytes]) -> None:
        try:
            while (line := self._outbox.get()) is not None:
                stdin.write(line)
                stdin.flush()
        except OSError:  # the child is gone: the reader fails what is pending
            pass
        finally:
            with contextlib.suppress(OSError):
                stdin.close()

    def _read(self, stdout: IO[bytes]) -> None:
        try:
            for line in stdout:
                self._deliver(line)
        finally:
            stdout.close()
            returncode = self._popen.wait()
            with self._lock:
                pending, self._pending = self._pending, {}
            gone = PeerError("ProcessExited", f"peer process {self.pid} exited ({returncode})", None)
            for reply in pending.values():
                reply.set_exception(gone)
            self._exited.set_result(returncode)
            self._outbox.put(None)  # the writer stops too

    def _deliver(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return  # not a reply (something the child printed)
        if not isinstance(msg, dict):
            return
        with self._lock:
            reply = self._pending.pop(msg.get("id", -1), None)
        if reply is None:
            return  # its caller timed out or was cancelled
        if "error" in msg:
            reply.set_exception(PeerError(str(msg["error"]), str(msg.get("message", "")), msg.get("status_code")))
        else:
            reply.set_result(msg.get("result"))
