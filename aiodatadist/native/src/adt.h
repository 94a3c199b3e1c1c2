/* What the C files of aiodatadist's native helper share: every function one file exports to another, declared
 * once here, with the types and constants they share.  Everything else in a file is static.
 *
 *   spans.c   the span copier: plain and streaming stores, streams copied in lanes, the copy paths' measurements
 *   grid.c    a plan's (tensor x run) grid: its byte stream copied within this process or across processes
 *             (covering reads), or listed as the GPU copy kernel's descriptor table
 *   pool.c    the worker pool and its jobs (span lists and grids), each announced on a pipe when it ends
 *   frames.c  frames on a stream socket: spans gathered into sendmsg, received straight into spans
 *   net.c     the TCP data plane of a link: connections, their I/O threads, transfers, the cache directory
 *   lanes.c   a lane's descriptor table: the merged spans of a gather or scatter (for the runtimes' tables)
 *   cuda.c    the CUDA driver behind the device-runtime table (adt_device_ops)
 *   acl.c     Ascend's ACL runtime behind the same table, and its span copies (per span or batched)
 *   stage.c   staging rings: page-locked slots through which the TCP plane moves device memory (via the table)
 *   module.c  the CPython module: its methods table and their argument parsing
 *
 * Calls between files go one way: module -> pool -> grid -> spans, module -> grid, net, cuda and acl, net ->
 * frames and stage, cuda and acl -> lanes
 * (tests/unit/test_native_tree.py checks that every call into another file is declared here and that the files'
 * call graph has no cycle).  Only module.c includes Python.h.
 *
 * Python reaches each function one way.  ADT_API: through ctypes, with the signature that
 * aiodatadist/native/bindings.py declares (tests/unit/test_native_bindings.py checks it against the prototype
 * here).  ADT_INTERNAL: from other C files only (module.c's methods among them); hidden from the library's
 * dynamic symbols, so that ctypes cannot find it, and called directly instead of through the PLT.
 */
#ifndef AIODATADIST_ADT_H
#define AIODATADIST_ADT_H

/* Before any system header (every file includes this one first, module.c after Python.h, which defines it too):
 * process_vm_readv/writev, SCHED_BATCH. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define ADT_API __attribute__((visibility("default")))
#define ADT_INTERNAL __attribute__((visibility("hidden")))

/* ---- the span copier (spans.c) ---------------------------------------------------------------------------- */

/* `streaming` values: streaming stores in lanes (for copies from memory: bulk transfers, or many queued together),
 * or one span at a time (STREAM_ALONE: a copy that streams only because a worker's share spills out of its core's
 * cache; its source is likely in the shared cache, where lanes gain nothing: a 2 MiB pull of such a source took
 * 0.120-0.147 ms with four lanes, 0.096-0.133 one span at a time, four pairs of `bench small` runs in turn). */
#define STREAM_LANES 1
#define STREAM_ALONE 2

/* Streaming copies run several spans at once, a line of each in turn ("lanes", four by default).  One stream keeps
 * few misses in flight for its thread (the hardware prefetcher follows it, and starts over at every span); several
 * keep more, so a thread copies faster.  Two threads, 8192 scattered 32 KiB spans (C harness, a 2-vCPU Intel VM,
 * 64-byte stores, medians of 15 in turn), huge pages / 4 KiB pages: a span at a time 17.6 / 17.4 GB/s, two at once
 * 22.4 / 21.2, three 23.5 / 22.4, four 24.7 / 23.0; a contiguous copy 18.4 / 18.0 in one stream, 23.4 / 21.7 in
 * two.  A lane's destination is 64-byte aligned and its length whole lines: adt_lanes_add copies a span's head and
 * tail itself. */
#define MAX_LANES 8
typedef struct {
    char *d[MAX_LANES];
    const char *s[MAX_LANES];
    size_t n[MAX_LANES];
    size_t id[MAX_LANES];   /* the span each lane belongs to (adt_copy_spans' return value) */
    int k, cap;             /* lanes queued, and how many run together (1: a span at a time) */
} lanes;

#define TINY_SPAN 64u   /* copy_small's limit */

#if defined(__SSE2__)
#include <emmintrin.h>
#define STREAM_FENCE() _mm_sfence()
#define SPIN_PAUSE() _mm_pause()
#else
#define STREAM_FENCE() ((void)0)
#define SPIN_PAUSE() ((void)0)
#endif

/* Copies of at most 64 bytes (KV spans of tiny blocks, one per layer and block) without a call into libc: every
 * byte is loaded before any is stored, so overlapping ranges copy as memmove would.  A libc call per span costs
 * more than the copy itself at these sizes.  Here rather than in spans.c so that every file's per-span loops
 * inline it; 0 where it does not copy (longer spans, or a build without SSE2). */
static inline int copy_small(char *d, const char *s, size_t n)
{
#if defined(__SSE2__)
    if (n > 64) return 0;
    if (n >= 32) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + n - 32)), e = _mm_loadu_si128((const __m128i *)(s + n - 16));
        _mm_storeu_si128((__m128i *)d, a); _mm_storeu_si128((__m128i *)(d + 16), b);
        _mm_storeu_si128((__m128i *)(d + n - 32), c); _mm_storeu_si128((__m128i *)(d + n - 16), e);
    } else if (n >= 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)s), b = _mm_loadu_si128((const __m128i *)(s + n - 16));
        _mm_storeu_si128((__m128i *)d, a); _mm_storeu_si128((__m128i *)(d + n - 16), b);
    } else if (n >= 8) {
        uint64_t a, b;
        memcpy(&a, s, 8); memcpy(&b, s + n - 8, 8); memcpy(d, &a, 8); memcpy(d + n - 8, &b, 8);
    } else {
        char tmp[8];
        for (size_t i = 0; i < n; i++) tmp[i] = s[i];
        for (size_t i = 0; i < n; i++) d[i] = tmp[i];
    }
    return 1;
#else
    (void)d; (void)s; (void)n;
    return 0;
#endif
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

ADT_API long adt_copy_spans(const uint64_t *dst, const uint64_t *src, const uint64_t *len, size_t n, int streaming,
                            const volatile int32_t *stop);
ADT_API int adt_stream_stores(int width);
ADT_API int adt_stream_lanes(int count);
ADT_API int adt_stream_copy_limit(uint64_t dst, uint64_t src, uint64_t n, int threads);
ADT_API int adt_streaming_beats_cache(uint64_t bytes);
/* The lanes of a streaming copy (`streaming` as adt_copy_spans takes it: 1 or 2). */
ADT_INTERNAL lanes adt_lanes_for(int streaming);
ADT_INTERNAL int adt_lanes_add(lanes *b, char *d, const char *s, size_t n, size_t id, const volatile int32_t *stop);
ADT_INTERNAL int adt_lanes_run(lanes *b, int all, const volatile int32_t *stop);
ADT_INTERNAL int adt_copy_after_lanes(lanes *b, char *d, const char *s, size_t n, const volatile int32_t *stop);

/* ---- plan grids (grid.c) ---------------------------------------------------------------------------------- */

#define PVM_BATCH 1024          /* iovecs per process_vm_readv/writev */
#define PVM_BYTES (1u << 20)    /* about as many bytes per call: stops are polled between calls */

/* A (tensor x run) grid, its spans tensor-major (see grid.c); its memory is the grid's own. */
typedef struct adt_grid adt_grid;

/* The run holding byte `rem` of a tensor's share of a grid: the last r with prefix[r] <= rem (prefix: the nr + 1
 * running sums of the runs' lengths; zero-length runs are skipped over). */
static inline size_t run_at(const uint64_t *prefix, size_t nr, uint64_t rem)
{
    size_t lo = 0, hi = nr;
    while (hi - lo > 1) { size_t mid = lo + (hi - lo) / 2; if (prefix[mid] <= rem) lo = mid; else hi = mid; }
    return lo;
}

ADT_INTERNAL adt_grid *adt_grid_new(const uint64_t *src_addrs, size_t na, const uint64_t *dst_addrs, size_t nb,
                                    const int64_t *src_tensor, const int64_t *dst_tensor, size_t nt,
                                    const uint64_t *run_src, const uint64_t *run_dst, const uint64_t *run_len,
                                    size_t nr, uint64_t src_delta, uint64_t dst_delta, uint64_t piece, int *err);
ADT_INTERNAL void adt_grid_free(adt_grid *g);
ADT_INTERNAL uint64_t adt_grid_bytes(const adt_grid *g);
ADT_INTERNAL int adt_grid_copy(const adt_grid *g, uint64_t b0, uint64_t b1, int mode, int pid, int streaming,
                               const volatile int32_t *stop);
ADT_INTERNAL size_t adt_grid_table(const adt_grid *g, uint64_t *out, size_t words, size_t *merged, uint64_t *longest);

/* ---- the worker pool (pool.c) ----------------------------------------------------------------------------- */

ADT_API void *adt_pool_new(int nthreads, int nice, uint64_t spin_ns, uint64_t stream_bytes);
ADT_API void adt_pool_free(void *pool);
ADT_API void *adt_job_submit(void *pool, const uint64_t *dst, const uint64_t *src, const uint64_t *len,
                             const int64_t *bounds, size_t nchunks, int mode, int pid, int streaming, int notify_fd);
ADT_API void adt_job_cancel(void *pool, void *job);
ADT_API int adt_job_streams(void *job);
ADT_API void adt_job_free(void *job);
ADT_INTERNAL void *adt_pool_submit_grid(void *pool, adt_grid *g, uint64_t chunk, int mode, int pid, int streaming,
                                        int notify_fd);
ADT_INTERNAL int adt_job_reap(void *job, int *error);

/* ---- socket frames (frames.c) ----------------------------------------------------------------------------- */

ADT_API int adt_send_frame(int fd, const uint8_t *header, size_t hlen, const uint64_t *addr, const uint64_t *len,
                           int64_t lo, int64_t hi);
ADT_API int adt_send_grid(int fd, const uint8_t *header, size_t hlen, const uint64_t *bases, size_t nt,
                          const uint64_t *offs, const uint64_t *lens, size_t nr, const uint64_t *prefix, uint64_t b0,
                          uint64_t b1);
ADT_API long adt_recv_frame(int fd, const uint64_t *addr, const uint64_t *len, const uint64_t *ends, size_t n,
                            uint64_t off, uint64_t nbytes, const volatile int32_t *stop, uint8_t *scratch,
                            size_t scratch_len, int poll_ms, uint64_t *consumed);

/* ---- the TCP data plane (net.c) --------------------------------------------------------------------------- */

ADT_API void *adt_net_new(int notify_fd, int64_t *dir, size_t dir_rows, uint64_t frame);
ADT_API int adt_net_attach(void *net, int fd);
ADT_API void *adt_net_receive(void *net, uint64_t key);
ADT_API void adt_net_flush(void *net);
ADT_API void *adt_net_fence(void *net, uint64_t key);
ADT_API int adt_net_cancel(void *net, void *job, int how);
ADT_API int adt_net_job_state(void *net, void *job, int *error, int *status);
ADT_API void adt_net_job_free(void *job);
ADT_API int adt_net_connections(void *net);
ADT_API void adt_net_served(void *net, uint64_t *out);
ADT_API void adt_net_close(void *net);
ADT_API void adt_net_free(void *net);
ADT_API void adt_net_set_stage(void *net, int receiving, void *stage);
ADT_API int adt_dir_withdraw(int64_t *words, int64_t row, int bound_ms);
/* `staged`: the grid is device memory, moved through the link's staging ring of that direction (adt_net_set_stage). */
ADT_INTERNAL void *adt_net_send(void *net, uint64_t key, const uint64_t *bases, size_t nt, const uint64_t *offs,
                                const uint64_t *lens, size_t nr, int staged);
ADT_INTERNAL int adt_net_set_destination(void *net, void *job, const uint64_t *bases, size_t nt,
                                         const uint64_t *offs, const uint64_t *lens, size_t nr, int staged);
ADT_INTERNAL void *adt_net_read(void *net, uint64_t key, int64_t row, uint64_t stamp, uint64_t cache_id,
                                int64_t model_id, const uint64_t *bases, size_t ntensors, const uint64_t *offsets,
                                const uint64_t *lengths, size_t nruns, const uint64_t *local_bases,
                                const uint64_t *local_offsets, int defer, int staged);
ADT_INTERNAL void *adt_net_write(void *net, uint64_t key, int64_t row, uint64_t stamp, uint64_t cache_id,
                                 int64_t model_id, const uint64_t *remote_bases, size_t nt,
                                 const uint64_t *remote_offs, const uint64_t *lens, size_t nr,
                                 const uint64_t *local_bases, const uint64_t *local_offs, int staged);
ADT_INTERNAL int adt_net_job_done(void *job);
ADT_INTERNAL int adt_net_job_reap(void *net, void *job, int *error, int *status);

/* ---- the device-runtime table (cuda.c fills it for CUDA) -------------------------------------------------- */

/* What a native I/O thread needs to drive a device without Python: bind itself to the device, copy spans between
 * device and host memory with one launch of the pointer-list copy kernel, record an event after the copy and
 * query it.  A runtime fills the table with its functions and its own state (`ctx`).  Handles (contexts, streams,
 * events, kernels) are void pointers and addresses are uint64_t, no runtime's types: another runtime (ACL on
 * Ascend) fills the same table.  Each operation returns 0, or the runtime's own error code, plus one of the flags
 * below where it says which step failed.  Python holds a table as a capsule named ADT_DEVICE_OPS_CAPSULE (what
 * the module's cuda_bind returns); C code that takes the pointer out keeps the capsule alive while it uses it. */
#define ADT_DEVICE_OPS_CAPSULE "aiodatadist.native.device_ops"
#define ADT_DEVICE_BIND_FAILED (1 << 20)    /* plus bind's code (module.c adds it; then nothing else was called) */
#define ADT_DEVICE_STAGE_FAILED (1 << 21)   /* plus the code of copying the descriptor table (nothing launched) */
#define ADT_DEVICE_NO_ROOM (-1)             /* gather, scatter: more descriptors than the lane holds (nothing ran) */

/* query's answer. */
#define ADT_EVENT_READY 0     /* the work recorded before the event is done */
#define ADT_EVENT_PENDING 1   /* it is still running */
#define ADT_EVENT_FAILED 2    /* the query failed: *code says why */

/* One launch of the pointer-list copy kernel (aiodatadist/cuda/copy_kernel.cu: n spans' sources, destinations and
 * lengths read from device memory).  With `table_bytes`, its descriptor table is staged first: copied from `table`
 * to `staging` (page-locked host memory; `table` may be `staging` itself) and from there to `device_table`, on the
 * stream. */
typedef struct adt_device_launch {
    void *kernel;             /* the kernel, loaded for the device */
    unsigned grid, block;     /* CTAs, and threads per CTA (one dimension) */
    void *stream;
    void **params;            /* the kernel's parameters: its three descriptor arrays on the device, the span count */
    const void *table;
    size_t table_bytes;
    void *staging;
    uint64_t device_table;
} adt_device_launch;

/* A stream set up for gather and scatter: the kernel, room for `capacity` descriptors (24 bytes each) in
 * page-locked (`staging`) and device (`device_table`) memory, and the shape of its launches.  Its staging memory
 * is rewritten by its next gather or scatter: start one only once the stream is past the one before (record and
 * query an event), or give each copy in flight a lane of its own. */
typedef struct adt_device_lane {
    void *kernel;
    void *stream;
    void *staging;
    uint64_t device_table;
    size_t capacity;
    uint64_t piece;           /* longer spans are cut into pieces of this many bytes, shared out to CTAs (0: never) */
    unsigned block;           /* threads per CTA */
    unsigned max_grid;        /* CTAs at most (each loops over further pieces); 0: one per piece */
} adt_device_lane;

typedef struct adt_device_ops {
    void *ctx;
    /* Make `device` (CUDA: a context) current on the calling thread, unless it is already. */
    int (*bind)(void *ctx, void *device);
    /* One launch of the pointer-list kernel (adt_device_launch), on its stream. */
    int (*launch)(void *ctx, const adt_device_launch *launch);
    /* n spans (addr[i], len[i] bytes) copied back to back into `host` (page-locked memory, at the address the device
     * sees it at), in one launch on the lane's stream. */
    int (*gather)(void *ctx, const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                  uint64_t host);
    /* The reverse: n spans filled from `host`, back to back. */
    int (*scatter)(void *ctx, const adt_device_lane *lane, uint64_t host, const uint64_t *addr, const uint64_t *len,
                   size_t n);
    /* Record `event` on `stream`, after the work queued there so far. */
    int (*record)(void *ctx, void *event, void *stream);
    /* ADT_EVENT_READY, ADT_EVENT_PENDING or ADT_EVENT_FAILED; *code: the runtime's own result.  `stream` is the
     * one the event was recorded on: a runtime whose events carry no error (ACL) finds a failed copy there. */
    int (*query)(void *ctx, void *event, void *stream, int *code);
} adt_device_ops;

/* ---- staging rings (stage.c): page-locked slots through which the TCP plane moves device memory -------------- */

/* One slot of a ring: page-locked host memory (at the address the device sees it at), the lane its copies run on
 * (a stream of its own and the kernel's descriptor memory) and the event recorded after them. */
typedef struct adt_stage_slot {
    adt_device_lane lane;
    void *event;
    uint64_t host;
} adt_stage_slot;

typedef struct adt_stage adt_stage;
#define ADT_STAGE_STATS 5   /* chunks moved, their bytes, waits for a free slot, device copies that failed,
                             * copies that overlapped another frame's wire time */

ADT_API void *adt_stage_new(const adt_device_ops *ops, void *device, uint64_t slot_bytes, const adt_stage_slot *slots,
                            int n);
ADT_API void adt_stage_free(void *stage);
ADT_API void adt_stage_stats(void *stage, uint64_t *out);
ADT_INTERNAL uint64_t adt_stage_slot_bytes(const adt_stage *st);
ADT_INTERNAL uint64_t adt_stage_host(const adt_stage *st, int slot);
ADT_INTERNAL int adt_stage_take(adt_stage *st, int want, int *out, const volatile int32_t *stop);
ADT_INTERNAL void adt_stage_give(adt_stage *st, const int *slots, int n, uint64_t chunks, uint64_t bytes,
                                 uint64_t failed);
ADT_INTERNAL int adt_stage_bind(adt_stage *st);
ADT_INTERNAL void adt_stage_overlapped(adt_stage *st);
/* Launch the copy of n spans between device memory and a slot (to_host: gather into it, else scatter from it),
 * back to back from the slot's start; adt_stage_wait waits for it (never abandoned).  0 or the runtime's code. */
ADT_INTERNAL int adt_stage_copy(adt_stage *st, int slot, const uint64_t *addr, const uint64_t *len, size_t n,
                                int to_host);
ADT_INTERNAL int adt_stage_wait(adt_stage *st, int slot);

/* The CUDA driver functions a table is built from, in this order (their addresses, as ctypes found them in the
 * loaded libcuda): cuCtxGetCurrent, cuCtxSetCurrent, cuLaunchKernel, cuEventRecord, cuEventQuery,
 * cuMemcpyHtoDAsync_v2. */
#define ADT_CUDA_FNS 6
ADT_INTERNAL adt_device_ops *adt_cuda_ops_new(void *const fns[ADT_CUDA_FNS]);
ADT_INTERNAL void adt_cuda_ops_free(adt_device_ops *ops);

/* The descriptors of a gather or scatter of n spans (addr[i], len[i] bytes) between device memory and `host`
 * (the spans back to back there), merged where they continue each other and cut into the lane's pieces: sources
 * at out[0, count), destinations at out[count, 2 count), lengths at out[2 count, 3 count).  Without `out`, only
 * counted.  Returns the number of pieces. */
ADT_INTERNAL size_t adt_lane_table(const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                                   uint64_t host, int to_host, uint64_t *out, size_t count);

/* The ACL runtime functions a table is built from, in this order (their addresses, as ctypes found them in the
 * loaded libascendcl; aclrtMemcpyBatchAsync may be NULL): aclrtGetCurrentContext, aclrtSetCurrentContext,
 * aclrtMemcpyAsync, aclrtMemcpyBatchAsync, aclrtRecordEvent, aclrtQueryEventStatus, aclrtStreamQuery,
 * aclrtStreamAbort.  `device` is the NPU's ordinal (the batch copies' memory locations name it). */
#define ADT_ACL_FNS 8
ADT_INTERNAL adt_device_ops *adt_acl_ops_new(void *const fns[ADT_ACL_FNS], int device);
ADT_INTERNAL void adt_acl_ops_free(adt_device_ops *ops);
/* n spans of one table (sources at table[0, n), destinations at table[n, 2 n), lengths at table[2 n, 3 n)) queued
 * on `stream` with memcpy kind `kind` (ACL's aclrtMemcpyKind): device to device one aclrtMemcpyAsync per span,
 * host to device and device to host in batches (aclrtMemcpyBatchAsync, per span where the runtime refuses
 * batches).  0 or ACL's code (*failed: the spans queued before it). */
ADT_INTERNAL int adt_acl_copy(const adt_device_ops *ops, void *stream, int kind, const uint64_t *table, size_t n,
                              size_t *queued);

#endif
