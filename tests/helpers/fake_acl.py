"""An emulated Ascend NPU for machines without one (CI): a fake ``libascendcl.so`` built from
``fake_libascendcl.c``.

It is a named fake of CANN's ACL runtime, the one part that cannot exist on a machine without an NPU: "device"
memory is shared host memory (memfd, so that IPC export keys import in other processes through
``/proc/<pid>/fd/<fd>``), each stream is a thread.  It refuses what CANN's documentation says the real runtime
refuses, with the real codes (``/work/shared/research/ascend_acl.md``, sections 1 and 4), so code that passes
against it uses the runtime as documented; it says nothing about speed, nor about what the documentation leaves
open.  The rules:

* ``aclInit`` first (else 100001), a second one answers 100002 and only counts (``aclFinalizeReference``
  counts down and writes the count); after ``aclFinalize`` everything is 100001 again;
* a current context per thread: ``aclrtSetDevice`` makes the device's default context (one per process, shared,
  reference-counted) current on the calling thread only; every memory, stream, event, copy, IPC or query call on
  a thread without one fails with 107002; a stream of another device with 107003;
* ``aclrtMalloc``: contents not zeroed (0xA5), the size rounded up to 32 bytes plus 32, 2 MiB pages (and start)
  for ``HUGE_FIRST`` above 1 MiB and ``HUGE_ONLY``, 4 KiB otherwise; ``aclrtPointerGetAttributes`` and
  ``aclrtMemGetAddressRange`` report them (also for imported memory and ``aclrtMallocHost`` memory);
* copies check their ends against their kind (107000); an asynchronous copy whose host end is not page-locked
  (``aclrtMallocHost``, ``aclrtHostRegisterV2``) runs synchronously in the calling thread once the stream is idle,
  as ACL does; ``aclrtMemcpyBatchAsync`` takes one direction, host to device or device to host (else 100000 and
  ``*failIndex``), and copies in reverse order (it is unordered); ``aclrtMemcpy2dAsync`` has its width and height
  limits; on memory imported from another device: no ``DEFAULT`` kind, no H2D/D2H, no synchronous D2D;
* a failed task (``fake_fault``, or a span no longer in known memory: 507053) is kept on its stream until
  ``aclrtStreamAbort`` (``aclrtStreamQuery`` and the synchronizes return it, and set the calling thread's
  ``aclGetRecentErrMsg``); with ``ACL_STOP_ON_FAILURE`` every later task, event records included, is discarded;
* events: ``aclrtQueryEventStatus`` says COMPLETE as 1, the deprecated ``aclrtQueryEvent`` as 0; an event stands
  for its latest record; an unrecorded one is complete; events carry no error (a discarded record never
  completes; only the timeout-less ``aclrtSynchronizeEvent`` returns, with the stream's code, instead of hanging);
* IPC: 65-byte keys; the exported range starts on a page of one allocation and is whole pages or reaches its end;
  ranges are exported once; the importer's bare TGID (``aclrtDeviceGetBareTgid``) must be whitelisted unless the
  key was exported with ``DISABLE_PID_VALIDATION``; a process cannot import its own key, nor one key twice; the
  exporter's ``aclrtIpcMemClose`` is refused (507022) while an importer still has it open, and ``aclrtFree``
  while its key is open.

Knobs (environment; ``FAKE_ACL_INIT`` and ``FAKE_ACL_DEVICES`` are read by ``aclInit``, the others at each use):
``FAKE_ACL_DEVICES`` (2), ``FAKE_ACL_MEM_LIMIT`` (bytes per device, 16 GiB; beyond it ``aclrtMalloc`` fails with
207001), ``FAKE_ACL_INIT`` (a code ``aclInit`` returns, e.g. 100039 for a stub library), ``FAKE_ACL_VERSION`` (9:
ACL 1.17.0 / CANN "9.0.0"; 8: 1.16.0 / "8.5.0", and ``aclrtMemGetAddressRange`` answers 200001),
``FAKE_ACL_NO_HOST_REGISTER_V2``, ``FAKE_ACL_NO_BATCH`` (207000 from those calls), ``FAKE_ACL_DELAY_US`` (each
stream task sleeps that long first), ``FAKE_ACL_TGID_OFFSET`` (the bare TGID is ``getpid()`` plus it, as in a
container).

Hooks (``ctypes``): ``int fake_hold`` (while set, each stream task waits before it runs, at most 60 s),
``fake_fault(code)`` (every copy task fails with ``code`` until ``fake_reset()``), and the counters
``fake_sync_copies`` (``aclrtMemcpy`` and asynchronous copies that ran in the caller), ``fake_async_copies`` (copy
tasks queued on a stream), ``fake_batches`` (successful ``aclrtMemcpyBatchAsync`` calls) and
``fake_set_device_calls``.
"""

from __future__ import annotations

from pathlib import Path

from helpers.fake_cuda import compile_fake

SOURCE = Path(__file__).with_name("fake_libascendcl.c")


def build_fake_libascendcl(folder: Path) -> Path | None:
    """Compile the fake into ``folder/libascendcl.so``; None without a C compiler."""
    return compile_fake(SOURCE, folder / "libascendcl.so")
