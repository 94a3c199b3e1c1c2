"""One link's control-plane message pipe (:class:`Channel`) and the owner of an instance's background tasks
(:class:`TaskSet`).

A :class:`Channel` is a bidirectional message pipe over whatever sends its frames (a DEALER, or a ROUTER and a
routing id: see :mod:`.sockets`): either side sends requests (``"i"`` ids) and awaits replies through futures
keyed by request id; incoming requests go to a handler.  DEALER/ROUTER never lock-step, so a timed-out request
leaves the channel usable.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._aio import drop_cancellation
from ..errors import LLMException, LLMLinkError, LLMStatusCode
from ..protocol.codec import Kind, ProtocolError, encode_batch
from ..protocol.messages import Reply, Request, reply_to_wire, request_to_wire
from ..stats import MessageCounter

__all__ = ["Channel", "RequestHandler", "TaskSet"]

log = logging.getLogger("aiodatadist.control.channel")

FRAME_MESSAGES = 256  # messages per frame (receivers accept up to protocol.MAX_BATCH)

RequestHandler = Callable[["Channel", dict[str, Any]], Awaitable[dict[str, Any] | None]]
"""Handles a request; returns the reply body (``None``: no reply)."""


class TaskSet:
    """The owner of an instance's background tasks: tracked, cancelled and awaited together, and no failure lost.

    A task's failure (any exception but a cancellation) goes to the ``on_error`` callback given to
    :meth:`spawn`, where an expected failure is handled (a link's reader that fails drops its link).  A failure
    nobody handles (no callback, or the callback itself raised) is logged at once and kept: :meth:`close`
    cancels and awaits every task, then raises the kept failures as one ``ExceptionGroup``.

    Plain asyncio rather than ``asyncio.TaskGroup``/anyio task groups: those cancel every sibling when one child
    fails (a bug in one request handler would end the server's reader), and their scope is one ``async with``
    block, while these tasks live from ``init`` to ``finalize`` across many calls.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failures: list[BaseException] = []

    def spawn(self, coro: Awaitable[Any], name: str | None = None, *,
              on_error: Callable[[BaseException], object] | None = None) -> asyncio.Task[Any]:
        """Run ``coro`` as a task owned by this set (cancelled by :meth:`close`)."""
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._done, on_error))
        return task

    def _done(self, on_error: Callable[[BaseException], object] | None, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            drop_cancellation(task)  # (its owner may keep the task: not the frames of whoever cancelled it)
            return
        error = task.exception()
        if error is None:
            return
        if on_error is not None:
            try:
                on_error(error)
                return
            except Exception as exc:  # kept and raised by close(), like an unhandled failure
                log.error("the error handler of background task %s failed", task.get_name(), exc_info=exc)
                error = exc
        log.error("background task %s failed", task.get_name(), exc_info=error)
        self._failures.append(error)

    async def close(self) -> None:
        """Cancel every task (also those spawned meanwhile) and wait until all have ended; then raise the
        failures no ``on_error`` handled, if any, as an ``ExceptionGroup``."""
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # A task leaves the set in its done callback, which runs in a later loop iteration; and from Python
            # 3.12 a gather of tasks that have all ended returns without yielding to the loop, so without this
            # the loop would spin here forever on a task that ended just before.
            await asyncio.sleep(0)
        failures, self._failures = self._failures, []
        if failures:
            raise BaseExceptionGroup("background tasks failed", failures)


class Channel:
    """One link's message pipe (``send`` is bound to a DEALER or to a ROUTER + routing id; it raises
    ``LLMLinkError`` when the transport refuses a frame).

    Outgoing messages are queued and flushed once per event-loop iteration, so the many requests and replies of
    concurrent transfers share ZeroMQ frames (a frame costs thread hand-offs; a message in it costs ~nothing).
    Each message sent or received is counted by kind in ``counter`` (the instance's statistics of the remote
    cluster, ``LLMDataDist.stats().messages``).
    """

    def __init__(self, send: Callable[[Channel], Callable[[bytes], None]], handler: RequestHandler,
                 name: str, counter: MessageCounter | None = None) -> None:
        self.counter = counter if counter is not None else MessageCounter()
        self._send = send(self)
        self._handler = handler
        self.name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._outbox: list[dict[str, Any]] = []
        self.closed: LLMException | None = None
        self.context: Any = None  # the Link this channel belongs to
        self.on_failed: Callable[[LLMException], object] | None = None
        """Told when the transport reported a frame undeliverable (the peer is gone), after the channel closed."""

    def _post(self, message: dict[str, Any]) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self.flush)
        self._outbox.append(message)
        sent, kind = self.counter.sent, message["k"]
        sent[kind] = sent.get(kind, 0) + 1

    def flush(self) -> None:
        """Send what is queued as one frame (also called by ``close``, so that a last BYE goes out)."""
        if not self._outbox:
            return
        messages, self._outbox = self._outbox, []
        try:
            for start in range(0, len(messages), FRAME_MESSAGES):
                self._send(encode_batch(messages[start:start + FRAME_MESSAGES]))
        except LLMLinkError as exc:  # the transport refused the frame: the peer is gone
            self.failed(exc)
        except LLMException as exc:
            self.close(exc)

    def failed(self, error: LLMException) -> None:
        """The transport refused a frame (the send function raised ``LLMLinkError``): the peer is gone."""
        log.debug("send on %s failed: %s", self.name, error)
        self._outbox.clear()
        self.close(error)
        if self.on_failed is not None:
            self.on_failed(error)

    async def request(self, msg: Request) -> dict[str, Any]:
        """Send a request and await its reply (the whole decoded message: decode it with the reply type's
        ``from_wire``); a non-zero reply code raises ``LLMException``."""
        if self.closed is not None:
            raise self.closed
        req_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = future
        try:
            self._post(request_to_wire(msg, req_id))
            reply = await future
        finally:
            self._pending.pop(req_id, None)
        status = Reply.from_wire(reply)
        if status.code:
            raise LLMException(status.error, status_code=LLMStatusCode.from_code(status.code))
        return reply

    def notify(self, msg: Request) -> None:
        """Queue a request whose reply nobody awaits (replies to unknown ids are dropped)."""
        if self.closed is None:
            self._post(request_to_wire(msg, next(self._ids)))

    async def reply(self, req_id: int, body: dict[str, Any] | None = None, *, code: int = 0, msg: str = "") -> None:
        """Answer a request; a peer that has gone away meanwhile is not an error of ours."""
        if self.closed is None:
            self._post(reply_to_wire(req_id, body, code=code, msg=msg))

    def resolve(self, reply: dict[str, Any]) -> None:
        """Hand a reply to the request awaiting it (a reply nobody awaits any more is dropped)."""
        received = self.counter.received
        received[Kind.REPLY] = received.get(Kind.REPLY, 0) + 1
        future = self._pending.get(reply["r"])
        if future is not None and not future.done():
            future.set_result(reply)

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Route a decoded message: replies resolve futures, requests go to the handler."""
        if message["k"] == Kind.REPLY:
            self.resolve(message)
            return
        received, kind = self.counter.received, message["k"]
        received[kind] = received.get(kind, 0) + 1
        req_id = message["i"]
        try:
            body = await self._handler(self, message)
        except LLMException as exc:
            await self.reply(req_id, code=int(exc.status_code), msg=str(exc))
            return
        except ProtocolError as exc:
            await self.reply(req_id, code=int(LLMStatusCode.LLM_PARAM_INVALID), msg=f"malformed request: {exc}")
            return
        except Exception as exc:  # a bug must cost one request, never the link or the peer's deadline
            log.exception("handler of %s on %s failed", message["k"], self.name)
            await self.reply(req_id, code=int(LLMStatusCode.LLM_FAILED), msg=f"internal error: {exc!r}")
            return
        if body is not None:
            await self.reply(req_id, body)

    def close(self, error: LLMException | None = None) -> None:
        """Send what is queued, then fail every pending request with ``error`` (a link error by default)."""
        if self.closed is not None:
            return
        self.flush()
        if self.closed is not None:  # the flush itself found the peer gone
            return
        self.closed = error or LLMLinkError(f"link {self.name} is closed", status_code=LLMStatusCode.LLM_LINK_FAILED)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self.closed)
        self._pending.clear()
