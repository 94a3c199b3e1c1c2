"""The library's event loop thread: where the blocking API (:mod:`aiodatadist.sync`) runs every call.

One process-wide :class:`Runner` (:data:`RUNNER`) owns at most one event loop thread (a daemon thread named
:data:`THREAD_NAME`) at a time:

* the thread starts on first use, is held by every initialized instance (:meth:`Runner.hold`) and by every
  call in flight, and stops (and is joined) when the last instance is let go (:meth:`Runner.unhold`) and no
  call is left;
* at interpreter exit (after the main thread finished, before non-daemon threads are joined) the instances
  still held are finalized and the loop thread is stopped; calls made after that raise ``LLM_FAILED``.

:meth:`Runner.call` runs a coroutine there and blocks until it ended (an interrupt cancels it, and re-raises
once the cancellation finished); :meth:`Runner.start` and :func:`submit` return a :class:`TransferFuture` at
once.  Nothing here knows the wrapped classes: an instance held is anything with ``finalize()``,
``is_initialized`` and ``cluster_id`` (:class:`Finalizable`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before ours: ours runs first (they run reversed)
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Protocol, TypeVar

from .._aio import exiting
from ..errors import LLMException, LLMStatusCode

__all__ = ["EXIT_TIMEOUT_S", "RUNNER", "THREAD_NAME", "Finalizable", "LoopThread", "Runner", "TransferFuture",
           "loop_thread", "submit"]

log = logging.getLogger("aiodatadist.sync")

T = TypeVar("T")
THREAD_NAME = "aiodatadist.sync"
"""The name of the loop thread."""
EXIT_TIMEOUT_S = 30.0
"""At interpreter exit: how long finalizing the instances left, and then stopping the loop, may take."""


class Finalizable(Protocol):
    """What an initialized instance is to the runner: :class:`aiodatadist.LLMDataDist` (the asyncio one)."""

    @property
    def cluster_id(self) -> int: ...

    @property
    def is_initialized(self) -> bool: ...

    async def finalize(self) -> None: ...


_local = threading.local()  # .loop_thread is True in a loop thread


def _in_loop_thread() -> bool:
    return bool(getattr(_local, "loop_thread", False))


def _not_from_loop_thread() -> None:
    if _in_loop_thread():
        raise LLMException("aiodatadist.sync called from its own event loop thread (a done callback of a "
                           "TransferFuture?); it would wait for itself", status_code=LLMStatusCode.LLM_FAILED)


class LoopThread:
    """One event loop, run by one daemon thread until :meth:`stop`."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.stopping = False  # set on the loop thread: calls that have not started yet fail
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        _local.loop_thread = True
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            try:  # what asyncio.run does on its way out: no task is left behind, nor an executor thread
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                if not exiting():
                    loop.run_until_complete(loop.shutdown_default_executor())
                else:  # that joins the executor from a new thread, which an exiting Python 3.12+ refuses
                    executor = getattr(loop, "_default_executor", None)
                    if executor is not None:
                        executor.shutdown(wait=True)
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def _stop_on_loop(self) -> None:
        self.stopping = True
        self.loop.stop()

    def stop(self, join: bool, timeout: float | None = None) -> None:
        """Stop the loop (from any thread); with ``join``, wait for the thread too (unless it is this one)."""
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self._stop_on_loop)
        if join and threading.current_thread() is not self.thread:
            self.thread.join(timeout)


class Runner:
    """The process-wide loop thread and who uses it: calls in flight and initialized instances."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._current: LoopThread | None = None
        self._uses = 0
        self._held: dict[Finalizable, None] = {}  # initialized instances (an ordered set)
        self._retired: list[LoopThread] = []  # loop threads that stopped themselves (joined at exit)
        self._exited = False
        self._hooked = False

    @property
    def thread(self) -> threading.Thread | None:
        """The loop thread now running (None when there is none)."""
        current = self._current
        return current.thread if current is not None else None

    def _acquire(self) -> LoopThread:
        with self._lock:
            if self._exited:
                raise LLMException("aiodatadist.sync: the interpreter is exiting",
                                   status_code=LLMStatusCode.LLM_FAILED)
            if self._current is None:
                self._hook_exit()
                self._current = LoopThread()
            self._uses += 1
            return self._current

    def _release(self) -> None:
        with self._lock:
            self._uses -= 1
            if self._uses > 0 or self._current is None:
                return
            last, self._current = self._current, None
            self._retired = [r for r in self._retired if r.thread.is_alive()]
            if _in_loop_thread():
                self._retired.append(last)
        # From a caller's thread the loop is joined here; from the loop thread itself (the done callback of a
        # submitted call) it stops on its own.
        last.stop(join=True)

    @contextlib.contextmanager
    def use(self) -> Iterator[LoopThread]:
        """Hold the loop thread (starting it if needed) for the ``with`` block; the last release stops it."""
        current = self._acquire()
        try:
            yield current
        finally:
            self._release()

    def hold(self, dd: Finalizable) -> None:
        """On the loop thread, inside a call: an initialized instance keeps the loop running."""
        with self._lock:
            if dd not in self._held:
                self._held[dd] = None
                self._uses += 1

    def unhold(self, dd: Finalizable) -> None:
        """On the loop thread, inside a call (which still holds the loop): the instance was finalized."""
        with self._lock:
            if dd not in self._held:
                return
            del self._held[dd]
        self._release()

    def start(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> TransferFuture[T]:
        """Run ``factory()`` on the loop thread; the future holds the loop until the coroutine ended."""
        _not_from_loop_thread()
        current = self._acquire()
        future: TransferFuture[T] = TransferFuture(current)
        try:
            current.loop.call_soon_threadsafe(future._start, factory, self._release)
        except BaseException:
            self._release()
            raise
        return future

    def call(self, factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``factory()`` on the loop thread and wait for it (see :func:`_wait`)."""
        _not_from_loop_thread()
        with self.use():  # so that the last release (and the join of the loop) happens on this thread
            return _wait(self.start(factory))

    # -- interpreter exit ------------------------------------------------------------------------------------
    def _hook_exit(self) -> None:
        """Called with the lock held, when a loop thread starts."""
        if self._hooked:
            return
        self._hooked = True
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("no threading._register_atexit")
            register(self.at_exit)  # runs before the interpreter joins non-daemon threads
        except RuntimeError:  # the interpreter is already shutting down its threads
            atexit.register(self.at_exit)

    def at_exit(self) -> None:
        """Finalize every instance still initialized, then stop the loop thread; later calls raise."""
        with self._lock:
            held = list(self._held)
            running = self._current is not None
        if held and running:
            try:
                self.start(lambda: _finalize_all(held, self)).result(timeout=EXIT_TIMEOUT_S)
            except BaseException as exc:  # noqa: BLE001 - the process is exiting; say why and go on
                log.warning("aiodatadist.sync: finalizing %d instance(s) at exit failed: %r", len(held), exc)
        with self._lock:
            self._exited = True
            last, self._current = self._current, None
            self._uses = 0
            self._held.clear()
            retired, self._retired = self._retired, []
        if last is not None:
            last.stop(join=True, timeout=EXIT_TIMEOUT_S)
        for thread in retired:
            thread.thread.join(EXIT_TIMEOUT_S)


async def _finalize_all(instances: list[Finalizable], runner: Runner) -> None:
    async def one(dd: Finalizable) -> None:
        try:
            await dd.finalize()
        except Exception as exc:  # noqa: BLE001 - one failure must not keep the others alive
            log.warning("aiodatadist.sync: finalizing cluster %d at exit failed: %r", dd.cluster_id, exc)
        finally:
            if not dd.is_initialized:
                runner.unhold(dd)

    await asyncio.gather(*(one(dd) for dd in instances))


RUNNER = Runner()
"""The process's one runner (every sync instance and call uses it)."""


def loop_thread() -> threading.Thread | None:
    """The loop thread now running, or None when no sync instance is initialized and no call is in flight."""
    return RUNNER.thread


def submit(factory: Callable[[], Coroutine[Any, Any, T]]) -> TransferFuture[T]:
    """Run the coroutine ``factory()`` on the library's loop thread; returns its future at once.

    For integrations that chain several asyncio calls without a thread waiting between them (link, then pull):
    the coroutine may use the asyncio instances behind sync ones (:attr:`aiodatadist.sync.LLMDataDist.aio`).
    ``factory`` is called on the loop thread.  Cancelling the future (:meth:`TransferFuture.cancel_and_wait`) cancels the
    coroutine; the future holds the loop thread until the coroutine ended."""
    return RUNNER.start(factory)


class TransferFuture(concurrent.futures.Future[T]):
    """A call started on the loop thread (``CacheManager.submit.<method>(...)``).

    * ``result()``/``exception()``: the coroutine's return value or exception (``LLMException``,
      ``TypeError``, ... exactly as the blocking call raises them).
    * ``cancel()``: the standard ``concurrent.futures`` semantics. It succeeds (``True``) only while the call
      has not started on the loop thread yet, and then the call never starts. Once the call is running it
      returns ``False`` and changes nothing.
    * ``cancel_and_wait()``: cancels the call whatever its state and returns once the coroutine has ended, with
      the guarantee of the asyncio API (nothing is written into the destination after it returned).
      It returns ``True`` if the call was cancelled (then ``result()`` raises
      ``concurrent.futures.CancelledError``), ``False`` if the call had already ended (its result or error
      stands).
    """

    def __init__(self, owner: LoopThread) -> None:
        super().__init__()
        self._owner = owner
        self._task: asyncio.Task[T] | None = None
        self._ended = threading.Event()  # the coroutine has ended, or will never start

    # -- on the loop thread ----------------------------------------------------------------------------------
    def _start(self, factory: Callable[[], Coroutine[Any, Any, T]], release: Callable[[], None]) -> None:
        if not self.set_running_or_notify_cancel():  # cancelled before it started
            self._ended.set()
            release()
            return
        if self._owner.stopping:
            self._ended.set()
            release()
            self.set_exception(LLMException("aiodatadist.sync: the loop thread stopped (interpreter exit)",
                                            status_code=LLMStatusCode.LLM_FAILED))
            return
        task = self._owner.loop.create_task(factory())
        self._task = task
        task.add_done_callback(lambda t: self._finished(t, release))

    def _finished(self, task: asyncio.Task[T], release: Callable[[], None]) -> None:
        # Release before the result is published: a blocking caller still holds its own use, so this release is
        # never the last one for it, and the caller's (on its own thread) joins the loop thread.
        release()
        self._ended.set()
        if task.cancelled():
            self.set_exception(concurrent.futures.CancelledError("the call was cancelled"))
            return
        exc = task.exception()
        if exc is None:
            self.set_result(task.result())
        else:
            self.set_exception(exc)

    def _cancel_task(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- any thread ------------------------------------------------------------------------------------------
    def cancel_and_wait(self) -> bool:
        """Cancel the call and wait until its coroutine ended; ``True`` if it was cancelled (see the class)."""
        if self.cancel():
            return True
        _not_from_loop_thread()
        if not self._ended.is_set():
            with contextlib.suppress(RuntimeError):  # the loop is closed: the task was cancelled on its way out
                self._owner.loop.call_soon_threadsafe(self._cancel_task)
            self._ended.wait()
        try:
            return isinstance(self.exception(), concurrent.futures.CancelledError)
        except concurrent.futures.CancelledError:
            return True


def _wait(future: TransferFuture[T]) -> T:
    """The result of a started call.  If the wait is interrupted (``KeyboardInterrupt``), the call is cancelled
    and the interrupt re-raised only once the coroutine ended (further interrupts meanwhile are ignored)."""
    try:
        return future.result()
    except BaseException:
        if not future._ended.is_set():
            while True:
                try:
                    future.cancel_and_wait()
                    break
                except KeyboardInterrupt:
                    continue
        raise

