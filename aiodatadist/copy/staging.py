"""Staging rings: page-locked host memory through which a TCP link moves device caches, and the process-wide
budget they are cut from.

A link that moves a device cache over TCP stages it: the sender's native I/O threads gather each chunk of device
spans into a slot of page-locked memory with one launch of the runtime's copy, then send the slot; the receiver's
threads receive into a slot and scatter it into device memory (``native/src/stage.c``, ``net.c``).  A ring is the
slots of one link and direction, allocated at the link's first device transfer that way, never at link time.

Every ring comes out of one budget of page-locked memory per process (``AIODATADIST_STAGING_BYTES``, 256 MiB by
default), reported by ``LLMDataDist.stats()``.  A ring gets the slots it asks for while the budget has them, fewer
when it is short; once the budget is spent, an instance's further links share one ring per direction (so that a
process's sending never waits for its own receiving), whose transfers wait for its slots instead of failing.  A
shared ring takes what the budget has left, at least one slot: the one allowance beyond the budget.  Everything
here goes through the device-runtime interface (:class:`~aiodatadist.copy.device_runtime.DeviceRuntime`): no
runtime's own calls.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Final

from ..errors import LLMException, LLMStatusCode
from ..native import STAGE_STATS, Lane, StageSlot, native_pool
from ..settings.environment import env_knobs
from ..stats import StagingStats
from .device_runtime import DeviceRuntime

__all__ = ["CHUNK_BYTES", "DEFAULT_BUDGET", "SLOTS_PER_CONNECTION", "StagingBudget", "StagingRing", "budget",
           "budget_stats"]

CHUNK_BYTES: Final = 2 << 20
"""A slot's size: the most a gather or a scatter moves in one launch, and the frame a staged sender cuts."""
SLOTS_PER_CONNECTION: Final = 2
"""Slots per data connection and direction: one being copied while the other is on the wire."""
LANE_CAPACITY: Final = 16384
"""Descriptors one launch of a slot takes (24 bytes each, page-locked and on the device); a chunk of more spans
is copied in several launches."""
DEFAULT_BUDGET: Final = 256 << 20
SHARED_SLOTS: Final = 2
"""Slots of a shared ring, where the budget has them."""

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_CAPSULE = b"aiodatadist.native.device_ops"


class StagingRing:
    """The page-locked slots of one link and direction (or a device's shared ring), and the native ring over
    them.  ``handle`` is what ``adt_net_set_stage`` takes; free with :meth:`close` once no I/O thread uses it."""

    def __init__(self, runtime: DeviceRuntime, slots: int, slot_bytes: int = CHUNK_BYTES, *,
                 shared: bool = False) -> None:
        lib = native_pool()
        if lib is None:
            raise LLMException("staging device memory needs the native helper (it is not built)",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        self._lib, self.runtime, self.slot_bytes, self.shared = lib, runtime, slot_bytes, shared
        self._table, device = runtime.device_table()  # kept: the native ring uses the table while it lives
        self._lanes: list[Lane] = []
        self._hosts: list[int] = []
        self.handle: int | None = None
        try:
            for _ in range(slots):
                self._lanes.append(runtime.open_lane(LANE_CAPACITY, slot_bytes))
                self._hosts.append(runtime.alloc_pinned(slot_bytes))
            array = (StageSlot * slots)()
            for i, (lane, host) in enumerate(zip(self._lanes, self._hosts)):
                slot = array[i]
                slot.lane.kernel, slot.lane.stream, slot.lane.staging = lane.kernel, lane.stream, lane.staging
                slot.lane.device_table, slot.lane.capacity, slot.lane.piece = lane.device_table, lane.capacity, lane.piece
                slot.lane.block, slot.lane.max_grid = lane.block, lane.max_grid
                slot.event, slot.host = lane.event, host
            self.handle = lib.adt_stage_new(_get_pointer(self._table, _CAPSULE), device, slot_bytes,
                                             ctypes.addressof(array), slots)
            if not self.handle:
                raise LLMException("cannot create a staging ring: out of memory", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)
        except BaseException:
            self._free_memory()
            raise

    @property
    def slots(self) -> int:
        return len(self._hosts)

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    def stats(self) -> tuple[int, int, int, int, int]:
        """Chunks moved through the ring, their bytes, waits for a free slot, device copies that failed, copies
        that overlapped another frame's time on the wire (a gather during the previous frame's send, a frame's
        last scatter during the next frame's receive)."""
        if self.handle is None:
            return (0, 0, 0, 0, 0)
        out = (ctypes.c_uint64 * STAGE_STATS)()
        self._lib.adt_stage_stats(self.handle, out)
        return int(out[0]), int(out[1]), int(out[2]), int(out[3]), int(out[4])

    def close(self) -> None:
        """Free the ring (no I/O thread may use it any more: its link's threads have ended)."""
        if self.handle is not None:
            self._lib.adt_stage_free(self.handle)
            self.handle = None
        self._free_memory()

    def _free_memory(self) -> None:
        runtime = self.runtime
        for host in self._hosts:
            runtime.free_pinned(host)
        for lane in self._lanes:
            runtime.close_lane(lane)
        self._hosts, self._lanes = [], []


class StagingBudget:
    """The process-wide budget of page-locked memory for staging rings."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._lock = threading.Lock()
        self._used = 0
        self._rings = 0
        # the shared rings, by (the runtime's id, receiving): the ring and the links using it
        self._shared: dict[tuple[int, bool], tuple[StagingRing, int]] = {}

    def ring(self, runtime: DeviceRuntime, wanted: int, receiving: bool) -> StagingRing:
        """A ring of ``wanted`` slots, fewer if the budget is short, or, once it is spent, the ring that the
        links of ``runtime`` (one instance's device) share in that direction; release it with :meth:`give_back`."""
        with self._lock:
            slots = min(wanted, (self.total - self._used) // CHUNK_BYTES)
            if slots <= 0:
                return self._shared_ring(runtime, receiving)
            self._used += slots * CHUNK_BYTES
            self._rings += 1
        try:
            return StagingRing(runtime, slots)
        except BaseException:
            with self._lock:
                self._used -= slots * CHUNK_BYTES
                self._rings -= 1
            raise

    def _shared_ring(self, runtime: DeviceRuntime, receiving: bool) -> StagingRing:
        """(Under the lock.)  A shared ring lives while a link uses it; it takes what the budget has left, at
        least one slot: the one allowance beyond the budget, one slot per instance and direction."""
        key = (id(runtime), receiving)
        found = self._shared.get(key)
        if found is None:
            slots = max(1, min(SHARED_SLOTS, (self.total - self._used) // CHUNK_BYTES))
            found = self._shared[key] = (StagingRing(runtime, slots, shared=True), 0)
            self._used += found[0].nbytes
        ring, users = found
        self._shared[key] = (ring, users + 1)
        return ring

    def give_back(self, ring: StagingRing) -> None:
        """A link is done with ``ring`` (its I/O threads have ended): a ring of its own is freed, a shared one once
        no link uses it any more."""
        with self._lock:
            if ring.shared:
                key = next(k for k, (r, _) in self._shared.items() if r is ring)
                users = self._shared[key][1] - 1
                if users:
                    self._shared[key] = (ring, users)
                    return
                del self._shared[key]
            else:
                self._rings -= 1
            self._used -= ring.nbytes
        ring.close()

    def stats(self) -> StagingStats:
        """The budget, what rings hold of it, how many there are, and how many links use a shared ring."""
        with self._lock:
            return StagingStats(self.total, self._used, self._rings, len(self._shared),
                                sum(n for _, n in self._shared.values()))


_budget: StagingBudget | None = None
_budget_lock = threading.Lock()


def budget_stats() -> StagingStats | None:
    """This process's staging budget now, or None while nothing was staged (no budget made yet)."""
    with _budget_lock:
        found = _budget
    return found.stats() if found is not None else None


def budget() -> StagingBudget:
    """This process's staging budget (``AIODATADIST_STAGING_BYTES``, read once)."""
    global _budget
    with _budget_lock:
        if _budget is None:
            _budget = StagingBudget(env_knobs().staging_bytes)
        return _budget
