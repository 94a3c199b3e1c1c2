"""The compiled helper (the C files under ``native/src/``) as ctypes sees it: loading, the foreign functions'
signatures, and the codes, modes and layouts that Python and C share.

Each C function is bound one way: the ``ADT_API`` prototypes of ``src/adt.h`` through ctypes, with the signatures
:func:`bind` declares (``tests/unit/native/test_native_bindings.py`` checks them against the header), the rest through the
module's methods (:func:`aiodatadist.native.native_extension`).  Every number the C code switches on or returns to
Python is named here, once, with the C definition it mirrors; change both sides together.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

__all__ = [
    "ANY_MODEL",
    "DIR_DEVICE",
    "DIR_WORDS",
    "KEY_FLAG_SHIFT",
    "NET_MAGIC",
    "STAGE_STATS",
    "TID_MASK",
    "CopyMode",
    "DeviceLane",
    "DirWord",
    "FrameType",
    "JobState",
    "Lane",
    "OwnerStatus",
    "StageSlot",
    "Streaming",
    "bind",
    "load",
]

log = logging.getLogger("aiodatadist.native")


class Streaming(IntEnum):
    """Whether a local copy job streams: the ``streaming`` of ``adt_job_submit``/``submit_grid``/``adt_copy_spans``
    (``STREAM_LANES``/``STREAM_ALONE`` in ``src/adt.h``)."""

    PLAIN = 0
    """Plain stores: the bytes stay in the CPU caches for whoever reads them next."""
    LANES = 1
    """Streaming stores, four spans at a time: a copy from memory (a bulk transfer, or many queued together)."""
    ALONE = 2
    """Streaming stores, a span at a time: a copy whose source is likely still in the shared cache."""


class CopyMode(IntEnum):
    """How a copy job moves its spans: the ``mode`` of ``adt_job_submit``/``submit_grid`` (``adt_job.mode``
    in ``src/pool.c``, compared with the literals 0, 1 and 2 there and in ``src/grid.c``)."""

    MEMCPY = 0
    """Both ends are mapped in this process (``memmove``, or streaming stores)."""
    PVM_READ = 1
    """The source lies in process ``pid`` (``process_vm_readv``)."""
    PVM_WRITE = 2
    """The destination lies in process ``pid`` (``process_vm_writev``)."""


class JobState(IntEnum):
    """What ``reap`` (``adt_job_reap`` in ``src/pool.c``) and ``adt_net_job_state`` (``src/net.c``) return
    (literals there: "0 = running, 1 = finished, 2 = stopped early, 3 = stopped and fenced")."""

    RUNNING = 0
    FINISHED = 1
    STOPPED = 2
    FENCED = 3
    """A stopped send (or a fence job) whose FENCE the peer acknowledged on every connection."""


class OwnerStatus(IntEnum):
    """Why an owner refused a one-sided read or write: the status code of its ERROR frame (``adt_hdr.offset``),
    returned by ``serve_read``/``serve_write`` in ``src/net.c`` and reported in ``*status`` by ``adt_net_job_state`` (0: none)."""

    NONE = 0
    RELEASED = 1
    """The directory row was released, never published, re-keyed, or answers to another model id."""
    OUT_OF_MEMORY = 2
    """The owner could not allocate the job."""
    OUT_OF_RANGE = 3
    """A requested span lies outside the cache."""
    DEVICE = 4
    """A device copy of a staged transfer failed (``STATUS_DEVICE``); a job that failed on this side also carries
    the device runtime's code, ``status >> 8``."""


class FrameType(IntEnum):
    """``adt_hdr.type`` of a TCP data-plane frame (``#define T_DATA``... in ``src/net.c``)."""

    DATA = 1
    READ = 2
    ERROR = 3
    ABORT = 4
    FENCE = 5
    """A cut-short send: no more frames of the key follow on this connection."""
    FENCE_ACK = 6
    """The receiving end: nothing of the key is written from that connection any more."""
    WRITE = 7
    """One-sided push: the owner-side spans of the frame's slice, then its bytes (validated like a READ)."""
    WRITE_ACK = 8
    """The owner: a WRITE's bytes landed."""


NET_MAGIC: Final = 0xADD7F4A4
"""``adt_hdr.magic`` of every frame, and the first word of a data connection's hello (``#define NET_MAGIC``)."""
KEY_FLAG_SHIFT: Final = 63
"""A frame's key is ``flag << 63 | transfer id`` (``adt_hdr.key``)."""
TID_MASK: Final = (1 << KEY_FLAG_SHIFT) - 1
"""The transfer id bits of a frame key."""
ANY_MODEL: Final = -1
"""``model_id`` of ``adt_net_read`` that accepts whatever model id the directory row holds (``serve_read``)."""

DIR_WORDS: Final = 9
"""int64 words per cache directory row (``#define DIR_WORDS`` in ``src/net.c``)."""


class DirWord(IntEnum):
    """The words of a cache directory row that ``src/net.c`` reads (``w[0]``... in ``serve_read``, ``dir_enter``,
    ``adt_dir_withdraw``).  A row's memory is either one range, ``[BASE, BASE + SIZE)`` (``TABLE`` 0), or
    ``TENSORS`` tensors of ``SIZE`` bytes each at the ascending, non-overlapping start addresses of the table
    at address ``TABLE`` (kept alive by the owner until the row is withdrawn)."""

    STAMP = 0
    CACHE = 1
    MODEL = 2
    TABLE = 3
    BASE = 4
    SIZE = 5
    BUSY = 6
    """Threads serving a frame of the row (``dir_enter``/``dir_leave``); a release waits for 0, bounded."""
    TENSORS = 7
    FLAGS = 8
    """:data:`DIR_DEVICE` where the row's memory is device memory (served through the link's staging rings)."""


DIR_DEVICE: Final = 1
"""``DirWord.FLAGS``: the row's memory is device memory (``#define DIR_DEVICE`` in ``src/net.c``)."""


class DeviceLane(ctypes.Structure):
    """``adt_device_lane`` (``src/adt.h``): a stream set up for the pointer-list kernel's gathers and scatters."""

    _fields_ = [("kernel", ctypes.c_void_p), ("stream", ctypes.c_void_p), ("staging", ctypes.c_void_p),
                ("device_table", ctypes.c_uint64), ("capacity", ctypes.c_size_t), ("piece", ctypes.c_uint64),
                ("block", ctypes.c_uint), ("max_grid", ctypes.c_uint)]


class StageSlot(ctypes.Structure):
    """``adt_stage_slot`` (``src/adt.h``): one slot of a staging ring, its lane, event and page-locked memory."""

    _fields_ = [("lane", DeviceLane), ("event", ctypes.c_void_p), ("host", ctypes.c_uint64)]


@dataclass(frozen=True)
class Lane:
    """What the native I/O threads need to gather spans of device memory into page-locked host memory, or scatter
    them from it, with one launch of the runtime's copy (``adt_device_lane`` in ``native/src/adt.h``, plus the
    event recorded after each copy).  Handles are the runtime's, as ints."""

    kernel: int
    stream: int
    staging: int  # page-locked memory for ``capacity`` descriptors (24 bytes each)
    device_table: int  # device memory for as many
    capacity: int
    piece: int  # longer spans are cut into pieces of this many bytes (0: never)
    block: int
    max_grid: int
    event: int


STAGE_STATS: Final = 5
"""Words of ``adt_stage_stats``: chunks moved, their bytes, waits for a free slot, device copies that failed."""


def bind(lib: ctypes.CDLL) -> None:
    """Declare the signatures of the helper's functions that ctypes calls (``ADT_API`` in ``src/adt.h``): ctypes
    would otherwise pass and return C ints, truncating pointers (``tests/unit/native/test_native_bindings.py`` checks that
    these are the header's, every one of them)."""
    vp, c_int, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    u64, i64 = ctypes.c_uint64, ctypes.c_int64
    lib.adt_copy_spans.argtypes = [vp, vp, vp, sz, c_int, vp]
    lib.adt_copy_spans.restype = ctypes.c_long
    lib.adt_stream_copy_limit.argtypes, lib.adt_stream_copy_limit.restype = [u64, u64, u64, c_int], c_int
    lib.adt_stream_stores.argtypes, lib.adt_stream_stores.restype = [c_int], c_int
    lib.adt_stream_lanes.argtypes, lib.adt_stream_lanes.restype = [c_int], c_int
    lib.adt_streaming_beats_cache.argtypes, lib.adt_streaming_beats_cache.restype = [u64], c_int
    lib.adt_pool_new.argtypes, lib.adt_pool_new.restype = [c_int, c_int, u64, u64], vp
    lib.adt_job_streams.argtypes, lib.adt_job_streams.restype = [vp], c_int
    lib.adt_pool_free.argtypes, lib.adt_pool_free.restype = [vp], None
    lib.adt_job_submit.argtypes = [vp, vp, vp, vp, vp, sz, c_int, c_int, c_int, c_int]
    lib.adt_job_submit.restype = vp
    lib.adt_send_frame.argtypes = [c_int, vp, sz, vp, vp, i64, i64]
    lib.adt_send_frame.restype = c_int
    lib.adt_send_grid.argtypes = [c_int, vp, sz, vp, sz, vp, vp, sz, vp, u64, u64]
    lib.adt_send_grid.restype = c_int
    lib.adt_recv_frame.argtypes = [c_int, vp, vp, vp, sz, u64, u64, vp, vp, sz, c_int, vp]
    lib.adt_recv_frame.restype = ctypes.c_long
    lib.adt_dir_withdraw.argtypes, lib.adt_dir_withdraw.restype = [vp, i64, c_int], c_int
    lib.adt_net_new.argtypes, lib.adt_net_new.restype = [c_int, vp, sz, u64], vp
    lib.adt_net_attach.argtypes, lib.adt_net_attach.restype = [vp, c_int], c_int
    lib.adt_net_receive.argtypes, lib.adt_net_receive.restype = [vp, u64], vp
    lib.adt_net_job_state.argtypes, lib.adt_net_job_state.restype = [vp, vp, vp, vp], c_int
    lib.adt_net_job_free.argtypes, lib.adt_net_job_free.restype = [vp], None
    lib.adt_net_flush.argtypes, lib.adt_net_flush.restype = [vp], None
    lib.adt_net_fence.argtypes, lib.adt_net_fence.restype = [vp, u64], vp
    lib.adt_net_cancel.argtypes, lib.adt_net_cancel.restype = [vp, vp, c_int], c_int
    lib.adt_net_connections.argtypes, lib.adt_net_connections.restype = [vp], c_int
    lib.adt_net_served.argtypes, lib.adt_net_served.restype = [vp, ctypes.POINTER(ctypes.c_uint64)], None
    lib.adt_net_close.argtypes, lib.adt_net_close.restype = [vp], None
    lib.adt_net_free.argtypes, lib.adt_net_free.restype = [vp], None
    lib.adt_net_set_stage.argtypes, lib.adt_net_set_stage.restype = [vp, c_int, vp], None
    lib.adt_stage_new.argtypes = [vp, vp, u64, vp, c_int]  # (slots: an array of StageSlot)
    lib.adt_stage_new.restype = vp
    lib.adt_stage_free.argtypes, lib.adt_stage_free.restype = [vp], None
    lib.adt_stage_stats.argtypes, lib.adt_stage_stats.restype = [vp, ctypes.POINTER(ctypes.c_uint64)], None
    lib.adt_job_cancel.argtypes, lib.adt_job_cancel.restype = [vp, vp], None
    lib.adt_job_free.argtypes, lib.adt_job_free.restype = [vp], None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled helper with its signatures bound, or ``None`` where it is not built or unusable (once per
    process; the reason is logged)."""
    spec = importlib.util.find_spec("aiodatadist.native._native")
    if spec is None or spec.origin is None:
        log.info("native span copier not built; using ctypes.memmove per span")
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        bind(lib)  # a stale build that lacks a function is not used
    except (OSError, AttributeError) as exc:
        log.warning("native helper %s unusable (%s); using the Python fallback", spec.origin, exc)
        return None
    return lib
