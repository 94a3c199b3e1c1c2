"""A ZeroMQ socket driven by the event loop itself (:class:`LoopSocket`): its descriptor watched with
``add_reader``, every send and receive non-blocking and synchronous.

pyzmq's asyncio sockets make a future for each send and receive and route readiness through several loop
callbacks.  On a 2-vCPU VM one request and its reply cost the main thread of each side about 170 us of CPU
that way, against about 90 us driven straight from the socket's descriptor (and 30 us with blocking calls).
Control messages are small and ZeroMQ queues them without limit (``SNDHWM`` 0), so a send never waits: the
frames go to ZeroMQ's queue at once or, where the socket has nowhere to queue them yet (a DEALER with no
connection pipe), into a backlog here that is sent as soon as the socket is writable.

ZeroMQ's descriptor is edge-triggered: it signals that the socket's state changed, and a send or receive may
consume that signal.  So the socket is read until it has nothing more, and after every send its events are
looked at again (``ZMQ_EVENTS``): a message that arrived meanwhile is read on the next loop iteration.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any, Final, cast

import zmq

__all__ = ["LoopSocket", "OnFrames"]

log = logging.getLogger("aiodatadist.control.loop_socket")

OnFrames = Callable[[list[Any]], None]
"""Called on the loop with each message received (its frames: ``bytes``, or ``zmq.Frame`` without copying)."""

READ_BATCH: Final = 256
"""Messages read in one go before the loop runs its other callbacks (the rest are read on its next iteration)."""

# Plain ints: pyzmq's flags are enum members, and an operation on one costs microseconds.
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_NOBLOCK: Final = int(zmq.NOBLOCK)
_EVENTS: Final = int(zmq.EVENTS)
_RCVMORE: Final = int(zmq.RCVMORE)
_SNDMORE: Final = int(zmq.SNDMORE)


class LoopSocket:
    """A ZeroMQ socket (created by :meth:`open`) read and written from its event loop without pyzmq's futures.

    Call :meth:`start` to have received messages handed to a callback, :meth:`send` to send one, and :meth:`close`
    (never the raw socket's ``close``) to stop watching its descriptor before the socket goes.  :attr:`raw` is the
    plain socket, for options and its monitor."""

    def __init__(self, raw: zmq.Socket[Any], *, copy: bool = True) -> None:
        self.raw = raw
        self._loop = asyncio.get_running_loop()
        self._fd: int = raw.FD
        self._copy = copy
        self._on_frames: OnFrames | None = None
        self._backlog: collections.deque[list[Any]] = collections.deque()
        self._loop.add_reader(self._fd, self._ready)
        self._watching = True

    @classmethod
    def open(cls, ctx: zmq.Context[Any], kind: int, *, copy: bool = True) -> LoopSocket:
        """A new socket of ``kind`` in ``ctx`` (a plain one, also from an asyncio context: the context keeps
        track of it as of its other sockets), watched by the running loop."""
        raw = ctx.socket(kind, socket_class=zmq.Socket)
        try:
            return cls(raw, copy=copy)
        except BaseException:
            raw.close(linger=0)
            raise

    @property
    def closed(self) -> bool:
        return bool(self.raw.closed)

    def start(self, on_frames: OnFrames) -> None:
        """Hand every message received from now on (and those already waiting) to ``on_frames``."""
        self._on_frames = on_frames
        self._loop.call_soon(self._ready)

    def stop(self) -> None:
        """Stop handing messages over (they stay queued in ZeroMQ)."""
        self._on_frames = None

    def send(self, frames: list[Any]) -> None:
        """Send one message (its frames) now, or queue it behind earlier ones the socket could not take yet.
        Raises ``zmq.ZMQError`` when ZeroMQ refuses it (e.g. a ROUTER's peer is gone: ``EHOSTUNREACH``)."""
        if self._backlog:
            self._backlog.append(frames)
            return
        try:
            _send(self.raw, frames)
        except zmq.Again:
            self._backlog.append(frames)
        finally:  # a refused send took ZeroMQ's pending commands too
            self._look_again()

    def _look_again(self) -> None:
        """After a send: read on the next iteration what arrived meanwhile (its signal may have been consumed)."""
        wanted = (_POLLIN if self._on_frames is not None else 0) | (_POLLOUT if self._backlog else 0)
        if wanted and _events(self.raw) & wanted:
            self._loop.call_soon(self._ready)

    def _ready(self) -> None:
        """The descriptor signalled (or a look-again): send the backlog if writable, read what is readable."""
        raw = self.raw
        if raw.closed:
            return
        try:
            if self._backlog and _events(raw) & _POLLOUT:
                self._send_backlog()
            self._read()  # (tried at once: a wake-up nearly always brings a message)
        except zmq.ZMQError as exc:  # the context is being terminated: the socket is going away
            log.debug("control socket: %s", exc)

    def _send_backlog(self) -> None:
        while self._backlog:
            try:
                _send(self.raw, self._backlog[0])
            except zmq.Again:
                return
            self._backlog.popleft()

    def _read(self) -> None:
        """Read while the socket has messages (after one, asking ``ZMQ_EVENTS`` is cheaper than the ``zmq.Again``
        a receive on an empty socket raises).  Either takes ZeroMQ's pending commands, which quiets the
        descriptor until something new happens."""
        raw, copy = self.raw, self._copy
        for _ in range(READ_BATCH):
            on_frames = self._on_frames
            if on_frames is None or raw.closed:
                return
            try:
                frames = _recv(raw, copy)
            except zmq.Again:
                return
            on_frames(frames)
            if raw.closed or not _events(raw) & _POLLIN:
                return
        self._loop.call_soon(self._ready)  # more may be waiting: after the loop's other callbacks

    def abandon(self) -> None:
        """Close from a finalizer (any thread; the loop may be gone): as :meth:`close` on the loop's thread, handed
        to the loop where it still runs elsewhere, else the socket alone (a closed loop watches nothing)."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self.close(linger=0)
            return
        if self._watching and self._loop.is_running():
            try:
                self._loop.call_soon_threadsafe(self.close, 0)
                return
            except RuntimeError:  # closed meanwhile
                pass
        self._watching = False
        if not self.raw.closed:
            self.raw.close(linger=0)

    def close(self, linger: int | None = None) -> None:
        """Stop watching the descriptor, then close the socket (``linger`` as ``zmq.Socket.close``); idempotent.
        The order matters: a descriptor closed while still watched could be reused by a new socket meanwhile."""
        self._on_frames = None
        if self._watching:
            self._watching = False
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
        if not self.raw.closed:
            self.raw.close(linger=linger)


def _events(raw: zmq.Socket[Any]) -> int:
    """``ZMQ_EVENTS``: what the socket can do now (``POLLIN``, ``POLLOUT``); reading it also takes ZeroMQ's
    pending commands, which resets its descriptor's signal."""
    return cast(int, raw.get(_EVENTS))


def _send(raw: zmq.Socket[Any], frames: list[Any]) -> None:
    """``send_multipart`` without its flag arithmetic on enum members (a multipart message is queued atomically:
    ``zmq.Again`` can come only with its first frame)."""
    last = len(frames) - 1
    for frame in frames[:last]:
        raw.send(frame, _NOBLOCK | _SNDMORE)
    raw.send(frames[last], _NOBLOCK)


def _recv(raw: zmq.Socket[Any], copy: bool) -> list[Any]:
    """``recv_multipart`` likewise (the rest of a message is there once its first frame is)."""
    frames = [raw.recv(_NOBLOCK, copy=copy)]
    while raw.get(_RCVMORE):
        frames.append(raw.recv(_NOBLOCK, copy=copy))
    return frames
