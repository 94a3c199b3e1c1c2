"""Frames of the TCP data plane: a fixed header, then a slice of a transfer's byte stream, moved straight
between the socket and cache memory (scatter/gather; no intermediate buffer for the payload).

A transfer's byte stream is its spans in plan order.  Both ends compute the plan independently and may merge
adjacent spans differently (each only sees its own addresses), but merging never reorders bytes, so a byte offset
into the stream means the same byte on both ends.  The native helper does the syscalls (``sendmsg`` /
``recvmsg`` over up to 512 spans each); without it, the same loops run in Python over ``memoryview``s.
"""

from __future__ import annotations

import ctypes
import errno
import socket
import struct
from typing import Final

import numpy as np

from ..._arrays import UInt64Array
from ...native import NET_MAGIC, FrameType, native_pool

__all__ = ["DATA_HELLO", "FRAME_BYTES", "HEADER", "MAGIC", "STOP_POLL_MS", "T_DATA", "FrameError", "drop_payload",
           "recv_exact", "recv_frame", "send_frame"]

# magic, type, key (flag << 63 | transfer id), stream offset, payload bytes, two words for other frame types;
# the layout of adt_hdr in native/src/net.c (both implementations speak it: either end may lack the native
# helper).
HEADER: Final = struct.Struct("<IIQQQQQ")
MAGIC: Final = NET_MAGIC
T_DATA: Final = FrameType.DATA
FRAME_BYTES: Final = 4 << 20  # the largest DATA frame a sender cuts (both planes)
STOP_POLL_MS: Final = 5  # a receiver waiting mid-frame for a stalled peer looks at its job's stop this often
_ALWAYS = ctypes.c_int32(1)  # the stop word of a payload that is only dropped
DATA_HELLO: Final = struct.Struct("<I16s")  # first bytes of a data connection: magic, the link's token
RECV_PIECE: Final = 1 << 20


class FrameError(OSError):
    """The data connection failed or carried something that is not a frame."""


def send_frame(sock: socket.socket, header: bytes, addr: UInt64Array, length: UInt64Array, lo: int, hi: int) -> None:
    """Send ``header`` and then spans ``[lo, hi)`` (blocking; call from an I/O thread)."""
    lib = native_pool()
    if lib is not None:
        err = lib.adt_send_frame(sock.fileno(), header, len(header), addr.ctypes.data, length.ctypes.data, lo, hi)
        if err:
            raise FrameError(err, f"data connection send failed: {errno.errorcode.get(err, err)}")
        return
    views = [memoryview(header)] + [_view(int(a), int(n)) for a, n in zip(addr[lo:hi], length[lo:hi]) if n]
    try:
        while views:
            sent = sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]
    except OSError as exc:
        raise FrameError(exc.errno or errno.EIO, f"data connection send failed: {exc}") from None


def recv_frame(sock: socket.socket, addr: UInt64Array, length: UInt64Array, ends: UInt64Array, offset: int,
               nbytes: int, stop: int, scratch: ctypes.Array[ctypes.c_char]) -> tuple[int, int]:
    """Receive a frame's payload into the spans at stream ``offset``; returns the bytes written into them and
    the payload bytes read.

    Beyond the spans the rest is read and dropped.  Once the int32 at address ``stop`` is non-zero, it returns at
    once (with the native helper, which never waits inside a receive with the spans in its iovec, so a peer that
    stalls mid-frame does not hold them), and the caller drops the rest of the frame with :func:`drop_payload`
    once it let go of the destination (the stream stays in sync).  Raises :class:`FrameError` if the connection
    ends.
    """
    lib = native_pool()
    if lib is not None:
        consumed = ctypes.c_uint64(nbytes)
        got = lib.adt_recv_frame(sock.fileno(), addr.ctypes.data, length.ctypes.data, ends.ctypes.data, len(addr),
                                 offset, nbytes, stop, ctypes.addressof(scratch), len(scratch), STOP_POLL_MS,
                                 ctypes.byref(consumed))
        if got < 0:
            raise FrameError(-got, f"data connection receive failed: {errno.errorcode.get(-got, -got)}")
        return int(got), int(consumed.value)
    return _recv_frame_py(sock, addr, length, ends, offset, nbytes, stop, scratch), nbytes


def drop_payload(sock: socket.socket, nbytes: int, scratch: ctypes.Array[ctypes.c_char]) -> None:
    """Read ``nbytes`` of a frame's payload and drop them."""
    empty = np.zeros(0, dtype=np.uint64)
    lib = native_pool()
    if lib is None:
        _recv_frame_py(sock, empty, empty, empty, 0, nbytes, ctypes.addressof(_ALWAYS), scratch)
        return
    got = lib.adt_recv_frame(sock.fileno(), None, None, None, 0, 0, nbytes, ctypes.addressof(_ALWAYS),
                             ctypes.addressof(scratch), len(scratch), 0, None)
    if got < 0:
        raise FrameError(-got, f"data connection receive failed: {errno.errorcode.get(-got, -got)}")


def _view(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _recv_frame_py(sock: socket.socket, addr: UInt64Array, length: UInt64Array, ends: UInt64Array, offset: int,
                   nbytes: int, stop: int, scratch: ctypes.Array[ctypes.c_char]) -> int:
    stop_word = ctypes.c_int32.from_address(stop)
    drain = memoryview(scratch).cast("B")
    k = int(np.searchsorted(ends, offset, side="right"))
    inner = offset - (int(ends[k]) - int(length[k])) if k < len(addr) else 0
    left, written = nbytes, 0
    try:
        while left > 0:
            if stop_word.value or k >= len(addr):
                got = sock.recv_into(drain, min(left, len(drain)))
                if not got:
                    raise FrameError(errno.ECONNRESET, "data connection closed by the peer")
                left -= got
                continue
            take = min(int(length[k]) - inner, left, RECV_PIECE)
            got = sock.recv_into(_view(int(addr[k]) + inner, take), take)
            if not got:
                raise FrameError(errno.ECONNRESET, "data connection closed by the peer")
            left -= got
            written += got
            inner += got
            if inner == int(length[k]):
                k += 1
                inner = 0
    except FrameError:
        raise
    except OSError as exc:
        raise FrameError(exc.errno or errno.EIO, f"data connection receive failed: {exc}") from None
    return written


def recv_exact(sock: socket.socket, buf: bytearray) -> None:
    """Fill ``buf`` from the socket (a frame header); raises :class:`FrameError` if the connection ends."""
    view = memoryview(buf)
    got = 0
    try:
        while got < len(buf):
            n = sock.recv_into(view[got:], len(buf) - got, socket.MSG_WAITALL)
            if not n:
                raise FrameError(errno.ECONNRESET, "data connection closed by the peer")
            got += n
    except FrameError:
        raise
    except OSError as exc:
        raise FrameError(exc.errno or errno.EIO, f"data connection receive failed: {exc}") from None
