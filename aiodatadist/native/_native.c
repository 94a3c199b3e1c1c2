/* The native half of aiodatadist's copy engine, used through ctypes: a span copier (adt_copy_spans) and a
 * pool of worker threads that runs copy jobs without the GIL (adt_pool_*, adt_job_*).
 *
 * adt_copy_spans copies n spans dst[i] <- src[i] of len[i] bytes, checking a stop flag between spans, so that
 * one call can cover many spans and still stop promptly.  With `streaming` set, spans of 4 KiB and
 * more use non-temporal stores: bulk KV-cache transfers are far bigger than the caches, and skipping the
 * read-for-ownership of the destination is what makes scattered 32 KiB blocks copy as fast as one big memcpy.
 * Streaming spans are copied several at once (lanes, below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <pthread.h>

/* Streaming copies run several spans at once, a line of each in turn ("lanes", four by default).  One stream keeps
 * few misses in flight for its thread (the hardware prefetcher follows it, and starts over at every span); several
 * keep more, so a thread copies faster.  Two threads, 8192 scattered 32 KiB spans (C harness, a 2-vCPU Intel VM,
 * 64-byte stores, medians of 15 in turn), huge pages / 4 KiB pages: a span at a time 17.6 / 17.4 GB/s, two at once
 * 22.4 / 21.2, three 23.5 / 22.4, four 24.7 / 23.0; a contiguous copy 18.4 / 18.0 in one stream, 23.4 / 21.7 in
 * two.  A lane's destination is 64-byte aligned and its length whole lines: lanes_add copies a span's head and
 * tail itself. */
#define MAX_LANES 8
/* `streaming` values: streaming stores in lanes (for copies from memory: bulk transfers, or many queued together),
 * or one span at a time (STREAM_ALONE: a copy that streams only because a worker's share spills out of its core's
 * cache; its source is likely in the shared cache, where lanes gain nothing: a 2 MiB pull of such a source took
 * 0.120-0.147 ms with four lanes, 0.096-0.133 one span at a time, four pairs of `bench small` runs in turn). */
#define STREAM_LANES 1
#define STREAM_ALONE 2
static int lane_count = 4;   /* adt_stream_lanes */
typedef struct {
    char *d[MAX_LANES];
    const char *s[MAX_LANES];
    size_t n[MAX_LANES];
    size_t id[MAX_LANES];   /* the span each lane belongs to (adt_copy_spans' return value) */
    int k, cap;             /* lanes queued, and how many run together (1: a span at a time) */
} lanes;

/* One lanes_step per store width: m bytes (whole lines) of every lane, a line of each in turn.  The full set of
 * four is unrolled with its pointers in registers: fewer instructions per line let the core keep more lines in
 * flight (the pool's paged copy of 64 x 128 scattered 32 KiB blocks, three pairs of processes in turn: 19.7-22.1 GB/s
 * unrolled, 19.2-21.1 with the loop over lanes). */
#define LANES_STEP(name, target, line)                                                                         \
    target static void name(const lanes *b, size_t m)                                                          \
    {                                                                                                          \
        if (b->k == 4) {                                                                                       \
            char *d0 = b->d[0], *d1 = b->d[1], *d2 = b->d[2], *d3 = b->d[3];                                   \
            const char *s0 = b->s[0], *s1 = b->s[1], *s2 = b->s[2], *s3 = b->s[3];                             \
            for (size_t i = 0; i < m; i += 64) {                                                               \
                line(d0 + i, s0 + i); line(d1 + i, s1 + i); line(d2 + i, s2 + i); line(d3 + i, s3 + i);        \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        char *d[MAX_LANES];                                                                                    \
        const char *s[MAX_LANES];                                                                              \
        const int k = b->k;                                                                                    \
        memcpy(d, b->d, sizeof d);                                                                             \
        memcpy(s, b->s, sizeof s);                                                                             \
        for (size_t i = 0; i < m; i += 64)                                                                     \
            for (int q = 0; q < k; q++) line(d[q] + i, s[q] + i);                                              \
    }

#if defined(__SSE2__)
#include <emmintrin.h>
static inline void line_sse2(char *d, const char *s)
{
    __m128i x0 = _mm_loadu_si128((const __m128i *)s), x1 = _mm_loadu_si128((const __m128i *)(s + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(s + 32)), x3 = _mm_loadu_si128((const __m128i *)(s + 48));
    _mm_stream_si128((__m128i *)d, x0);
    _mm_stream_si128((__m128i *)(d + 16), x1);
    _mm_stream_si128((__m128i *)(d + 32), x2);
    _mm_stream_si128((__m128i *)(d + 48), x3);
}
LANES_STEP(lanes_step_sse2, , line_sse2)

/* Wider streaming stores need per-function target attributes and the CPU feature names below (GCC 8, clang). */
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8))
#define ADT_WIDE_STORES 1
#endif
#ifdef ADT_WIDE_STORES
#include <immintrin.h>
/* The same copy with 32- and 64-byte streaming stores, for CPUs that have them (chosen when the library loads, see
 * pick_copy_paths): fewer stores per cache line.  Two threads copying 8192 scattered 32 KiB spans (memfd memory, in
 * source order, C harness, twelve interleaved rounds on a 2-vCPU Intel VM, one span at a time): SSE2 16.1-16.4
 * GB/s, AVX2 3.3 % faster in every round, AVX-512 7 % faster in every round. */
__attribute__((target("avx2"))) static inline void line_avx2(char *d, const char *s)
{
    __m256i x0 = _mm256_loadu_si256((const __m256i *)s), x1 = _mm256_loadu_si256((const __m256i *)(s + 32));
    _mm256_stream_si256((__m256i *)d, x0);
    _mm256_stream_si256((__m256i *)(d + 32), x1);
}
LANES_STEP(lanes_step_avx2, __attribute__((target("avx2"))), line_avx2)

__attribute__((target("avx512f"))) static inline void line_avx512(char *d, const char *s)
{
    _mm512_stream_si512((__m512i *)d, _mm512_loadu_si512((const void *)s));
}
LANES_STEP(lanes_step_avx512, __attribute__((target("avx512f"))), line_avx512)
#endif

static void (*lanes_step)(const lanes *b, size_t m) = lanes_step_sse2;
#define STREAM_FENCE() _mm_sfence()
#define SPIN_PAUSE() _mm_pause()

static int chosen_width = 16;   /* bytes per streaming store, as chosen when the library loaded */
int adt_stream_stores(int width);

__attribute__((constructor)) static void pick_copy_paths(void)   /* when the library is loaded */
{
    __builtin_cpu_init();
    /* 512-bit stores only where they do not lower the clock of the core running them (Skylake-SP and Cascade Lake
     * lack AVX512-VBMI2; glibc avoids AVX-512 on them too).  The paged pull (64 x 128 scattered 32 KiB blocks from
     * another process, the width switched in turn, nine rounds of five pulls, a 2-vCPU Intel VM): 15.5 GB/s with
     * 16-byte stores, 16.1 with 32 and 16.8 with 64 (medians; each faster than 16 in eight rounds of nine). */
#ifdef ADT_WIDE_STORES
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vbmi2")) chosen_width = 64;
    else if (__builtin_cpu_supports("avx2")) chosen_width = 32;
#endif
    adt_stream_stores(chosen_width);
}
#else
static void lanes_step(const lanes *b, size_t m)
{
    for (int q = 0; q < b->k; q++) memcpy(b->d[q], b->s[q], m);
}
#define STREAM_FENCE() ((void)0)
#define SPIN_PAUSE() ((void)0)
#endif

/* Which streaming copy is used: 16, 32 or 64 bytes per store, or 0 for the one chosen when the library loaded.
 * Returns that width, or -1 (nothing changed) where this CPU or build lacks it (0: a build without SSE2, whose
 * one copy is memcpy).  For tests and benchmarks: set it while no copy runs. */
int adt_stream_stores(int width)
{
#if defined(__SSE2__)
    if (width == 0) width = chosen_width;
#ifdef ADT_WIDE_STORES
    if (width == 64 && __builtin_cpu_supports("avx512f")) lanes_step = lanes_step_avx512;
    else if (width == 32 && __builtin_cpu_supports("avx2")) lanes_step = lanes_step_avx2;
    else
#endif
    if (width == 16) lanes_step = lanes_step_sse2;
    else return -1;
    return width;
#else
    return width == 0 ? 0 : -1;
#endif
}

/* Copies of at most 64 bytes (KV spans of tiny blocks, one per layer and block) without a call into libc: every
 * byte is loaded before any is stored, so overlapping ranges copy as memmove would.  A libc call per span costs
 * more than the copy itself at these sizes. */
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

#define LANE_STEP (256u << 10)   /* bytes of each lane between two looks at the stop flag */
#define LANE_SPLIT (16u << 10)   /* a lone lane of lane_count times this or more is split */

/* How many streams a thread's streaming copy runs at once (1 to MAX_LANES; 0: only asks).  Returns the count now
 * used.  For tests and benchmarks: set it while no copy runs. */
int adt_stream_lanes(int count)
{
    if (count >= 1 && count <= MAX_LANES) lane_count = count;
    return lane_count;
}

static inline int ranges_meet(const char *a, size_t n, const char *b, size_t m) { return a < b + m && b < a + n; }

/* Whether copying d <- s (n bytes) before or after the queued lanes could change what either writes. */
static int lanes_conflict(const lanes *b, const char *d, const char *s, size_t n)
{
    for (int q = 0; q < b->k; q++)
        if (ranges_meet(d, n, b->d[q], b->n[q]) || ranges_meet(d, n, b->s[q], b->n[q])
            || ranges_meet(s, n, b->d[q], b->n[q]))
            return 1;
    return 0;
}

/* A lone lane long enough, whose source and destination do not meet, becomes `cap` lanes of equal parts. */
static void lanes_split(lanes *b)
{
    const int k = b->cap;
    size_t n = b->n[0], part = n / (size_t)k & ~(size_t)63;
    if (k < 2 || n < (size_t)k * LANE_SPLIT || (ranges_meet(b->d[0], n, b->s[0], n) && b->d[0] != b->s[0])) return;
    for (int q = k - 1; q >= 0; q--) {
        size_t off = part * (size_t)q;
        b->d[q] = b->d[0] + off;
        b->s[q] = b->s[0] + off;
        b->n[q] = q == k - 1 ? n - off : part;
        b->id[q] = b->id[0];
    }
    b->k = k;
}

/* Copies the lanes in lockstep until one of them is done, or with `all` until every one is (a lone lane split
 * first), dropping finished lanes; stop is polled every LANE_STEP bytes of each lane.  0, or -1 when stopped.
 * Equal spans thus start and end together: staggering them (a lane started a quarter of a span after the one
 * before, so that one stream restarts at a time) made the paged copy 10 % slower. */
static int lanes_run(lanes *b, int all, const volatile int32_t *stop)
{
    while (b->k > 0) {
        if (all && b->k == 1) lanes_split(b);
        size_t m = LANE_STEP;
        for (int q = 0; q < b->k; q++) if (b->n[q] < m) m = b->n[q];
        lanes_step(b, m);
        int kept = 0;
        for (int q = 0; q < b->k; q++) {
            if (b->n[q] == m) continue;
            b->d[kept] = b->d[q] + m; b->s[kept] = b->s[q] + m; b->n[kept] = b->n[q] - m; b->id[kept] = b->id[q];
            kept++;
        }
        int finished = kept < b->k;
        b->k = kept;
        if (stop && *stop) return -1;
        if (finished && !all) return 0;
    }
    return 0;
}

/* Queues span d <- s (n bytes, span `id`) for a streaming copy, copying its unaligned head and tail now; runs the
 * lanes once they are full, and first those it could conflict with.  A span that meets itself is copied at once
 * (memmove).  0, or -1 when stopped. */
static int lanes_add(lanes *b, char *d, const char *s, size_t n, size_t id, const volatile int32_t *stop)
{
    if (b->k && lanes_conflict(b, d, s, n) && lanes_run(b, 1, stop)) return -1;
    if (d != s && ranges_meet(d, n, s, n)) {
        memmove(d, s, n);
        return 0;
    }
    size_t head = (size_t)(-(uintptr_t)d & 63);
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t body = n & ~(size_t)63;
    memcpy(d + body, s + body, n - body);
    if (body == 0) return 0;
    b->d[b->k] = d; b->s[b->k] = s; b->n[b->k] = body; b->id[b->k] = id;
    return ++b->k >= b->cap ? lanes_run(b, 0, stop) : 0;
}

/* A plain copy of d <- s after the lanes it could conflict with (run first). */
static int copy_after_lanes(lanes *b, char *d, const char *s, size_t n, const volatile int32_t *stop)
{
    if (b->k && lanes_conflict(b, d, s, n) && lanes_run(b, 1, stop)) return -1;
    if (!copy_small(d, s, n)) memmove(d, s, n);
    return 0;
}

/* The lanes of a streaming copy (`streaming` as adt_copy_spans takes it: 1 or 2). */
static inline lanes lanes_for(int streaming)
{
    lanes b;
    b.k = 0;
    b.cap = streaming == STREAM_ALONE ? 1 : lane_count;
    return b;
}

/* `streaming`: 0 (plain stores), STREAM_LANES or STREAM_ALONE (spans of 4 KiB and more).  Returns the number of spans
 * copied: n, or fewer when *stop became non-zero (checked before every span and every
 * LANE_STEP bytes of a streaming copy, so a stop takes effect within about a megabyte; callers keep spans small):
 * every span before the returned index was copied.  stop may be NULL. */
long adt_copy_spans(const uint64_t *dst, const uint64_t *src, const uint64_t *len, size_t n, int streaming,
                    const volatile int32_t *stop)
{
    lanes b = lanes_for(streaming);
    size_t i;
    int stopped = 0;
    for (i = 0; i < n && !stopped; i++) {
        if (stop && *stop) break;
        char *d = (char *)(uintptr_t)dst[i];
        const char *s = (const char *)(uintptr_t)src[i];
        if (streaming && len[i] >= 4096) {
            stopped = lanes_add(&b, d, s, (size_t)len[i], i, stop);
        } else
            stopped = copy_after_lanes(&b, d, s, (size_t)len[i], stop);
    }
    if (!stopped && !(stop && *stop) && b.k) stopped = lanes_run(&b, 1, stop);
    if (streaming) STREAM_FENCE();
    size_t copied = stopped ? i - 1 : i;   /* the span being queued when the stop came may be incomplete */
    for (int q = 0; q < b.k; q++) if (b.id[q] < copied) copied = b.id[q];
    return (long)copied;
}

/* A streaming copy of n bytes on this thread (`streaming`: 1, split into lanes where long enough, or 2, one
 * stream); 0, or -1 when stopped. */
static int stream_lanes(char *d, const char *s, size_t n, int streaming, const volatile int32_t *stop)
{
    lanes b = lanes_for(streaming);
    if (lanes_add(&b, d, s, n, 0, stop) || lanes_run(&b, 1, stop)) return -1;
    return 0;
}

/* The benchmark's same-host limit (not used by transfers): n bytes from src to dst on `threads` threads, each
 * copying one contiguous share with streaming stores in lanes, the best this machine does for a big copy.  Returns
 * 0, or -1 when a thread could not start (the copy is then incomplete). */
typedef struct { char *d; const char *s; size_t n; } stream_share;

static void *stream_share_run(void *arg)
{
    stream_share *share = (stream_share *)arg;
    stream_lanes(share->d, share->s, share->n, STREAM_LANES, NULL);
    STREAM_FENCE();
    return NULL;
}

int adt_stream_copy_limit(uint64_t dst, uint64_t src, uint64_t n, int threads)
{
    enum { MAX_SHARES = 64 };
    pthread_t tids[MAX_SHARES];
    stream_share shares[MAX_SHARES];
    if (threads < 1) threads = 1;
    if (threads > MAX_SHARES) threads = MAX_SHARES;
    size_t per = (((size_t)n + (size_t)threads - 1) / (size_t)threads + 63) & ~(size_t)63;  /* >= 64, whole lines */
    int started = 0, rc = 0;
    for (int t = 0; t < threads; t++) {
        size_t lo = per * (size_t)t;
        if (lo >= n) break;
        size_t len = (size_t)n - lo < per ? (size_t)n - lo : per;
        shares[t] = (stream_share){(char *)(uintptr_t)(dst + lo), (const char *)(uintptr_t)(src + lo), len};
        if (t + 1 == threads || lo + len >= n) {  /* the last share runs on this thread */
            stream_share_run(&shares[t]);
            break;
        }
        if (pthread_create(&tids[started], NULL, stream_share_run, &shares[t]) != 0) { rc = -1; break; }
        started++;
    }
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    return rc;
}

/* ---------------------------------------------------------------------------------------------------------
 * A native worker pool.  Jobs are span lists cut into chunks; POSIX threads take chunks round-robin across
 * jobs and never touch Python, so copies overlap with the event loop instead of contending for the GIL.  A
 * finished (or stopped) job is announced by writing its address to the job's notify pipe; the event loop
 * then reaps (reap(), below) exactly the jobs that ended.  Modes: 0 = memcpy within this process, 1 = process_vm_readv (remote source),
 * 2 = process_vm_writev (remote destination).
 * --------------------------------------------------------------------------------------------------------- */
#include <pthread.h>
#include <semaphore.h>
#include <stdlib.h>
#include <errno.h>
#include <unistd.h>
#include <sys/uio.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>

/* Submitting and cancelling never take the workers' mutex: jobs are pushed on a lock-free stack and workers are
 * woken through a semaphore.  On a small, oversubscribed machine a worker preempted while holding a lock would
 * otherwise stall the event loop in every submit. */
typedef struct adt_job {
    const uint64_t *dst, *src, *len;   /* span arrays, kept alive by the caller until the job is freed */
    const int64_t *bounds;             /* nchunks + 1 chunk boundaries into the span arrays */
    size_t nchunks, next_chunk;        /* next_chunk, inflight: under the workers' mutex */
    int mode, pid, streaming, notify_fd;
    volatile int32_t stop;             /* set by anyone (atomically), polled between spans */
    int inflight, error;
    int done;                          /* published with release semantics once no worker touches the job */
    struct adt_job *next;              /* ready list (workers' mutex) */
    struct adt_job *next_in;           /* incoming stack (lock-free) */
    void *owned;                       /* memory of this job's own, freed with it (its grid) */
    struct grid *grid;                 /* a grid job: chunks are byte ranges of the grid's stream (bounds unused) */
    uint64_t chunk;                    /* a grid job's bytes per chunk */
    uint64_t nbytes;                   /* what it copies: counted in its pool's `queued` from submit to done */
} adt_job;

typedef struct adt_pool {
    pthread_mutex_t lock;
    sem_t work;
    adt_job *incoming;                 /* lock-free stack of submitted jobs */
    adt_job *head, *tail;              /* ready list, round-robin */
    int shutdown, nthreads, nice;
    int idle;                          /* workers asleep in sem_wait (atomic) */
    int spinner;                       /* 1 while one idle worker spins for new work (atomic) */
    uint64_t spin_ns;
    uint64_t queued;                   /* bytes of the jobs submitted and not done (atomic) */
    uint64_t stream_bytes;             /* a local job streams once queued bytes reach this (0: never so) */
    pthread_t threads[64];
} adt_pool;

#define PVM_BATCH 1024
#define PVM_BYTES (1u << 20)

/* A finished job is announced by writing its address (8 bytes: atomic on a pipe) to its notify pipe, so the
 * event loop learns which jobs ended without polling the others. */
static void announce(int fd, adt_job *j)
{
    uint64_t id = (uint64_t)(uintptr_t)j;
    ssize_t r;
    do { r = write(fd, &id, sizeof id); } while (r < 0 && errno == EINTR);
}

static int run_pvm(adt_job *j, int64_t lo, int64_t hi)
{
    struct iovec local[PVM_BATCH], remote[PVM_BATCH];
    const uint64_t *l = j->mode == 1 ? j->dst : j->src, *r = j->mode == 1 ? j->src : j->dst;
    int64_t a = lo;
    while (a < hi) {
        if (j->stop) return 0;
        /* One call moves at most PVM_BATCH spans and about PVM_BYTES: stops are polled between calls. */
        int64_t b = a;
        size_t want = 0;
        while (b < hi && b - a < PVM_BATCH && (b == a || want < PVM_BYTES)) {
            local[b - a].iov_base = (void *)(uintptr_t)l[b];
            remote[b - a].iov_base = (void *)(uintptr_t)r[b];
            local[b - a].iov_len = remote[b - a].iov_len = (size_t)j->len[b];
            want += (size_t)j->len[b];
            b++;
        }
        ssize_t got = j->mode == 1 ? process_vm_readv(j->pid, local, b - a, remote, b - a, 0)
                                   : process_vm_writev(j->pid, local, b - a, remote, b - a, 0);
        if (got < 0) return errno ? errno : EIO;
        if ((size_t)got != want) return EFAULT;  /* a remote range is not mapped (any more) */
        a = b;
    }
    return 0;
}

static void take_incoming(adt_pool *p)   /* under the mutex: append submitted jobs in submission order */
{
    adt_job *stack = __atomic_exchange_n(&p->incoming, NULL, __ATOMIC_ACQUIRE), *rev = NULL;
    while (stack) { adt_job *n = stack->next_in; stack->next_in = rev; rev = stack; stack = n; }
    while (rev) {
        adt_job *n = rev->next_in;
        rev->next = NULL;
        if (p->tail) p->tail->next = rev; else p->head = rev;
        p->tail = rev;
        rev = n;
    }
}

static void unlink_head(adt_pool *p, adt_job *j)   /* under the mutex; j is p->head */
{
    p->head = j->next;
    if (!p->head) p->tail = NULL;
    j->next = NULL;
}

static int finish_if_idle(adt_pool *p, adt_job *j)   /* under the mutex; 1: the caller must announce it */
{
    if (j->next_chunk >= j->nchunks && j->inflight == 0 && !__atomic_load_n(&j->done, __ATOMIC_RELAXED)) {
        __atomic_sub_fetch(&p->queued, j->nbytes, __ATOMIC_SEQ_CST);
        __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
        return 1;
    }
    return 0;
}

#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#include <sys/mman.h>

/* Whether streaming stores copy `bytes` faster than plain ones on this machine, where the bytes do not fit in
 * a core's private cache (`bytes` = that cache's size: source and destination together are twice it): 1 if so, 0
 * if not, -1 when the buffers cannot be had.  Each way is timed on this thread in its own steady state (the source
 * in the caches; the destination in them for plain stores, in memory for streaming ones), fastest of three copies
 * after one to settle: about 2 ms with a 2 MiB cache.  Where the shared cache is slow (a server CPU's
 * mesh: 15 GB/s for plain stores of 2 MiB on one core, 19 for streaming ones) a copy that spills out of the
 * private cache gains nothing from its stores staying cached and evicts everything else there, the event loop's
 * working set included; where it is fast (a 32 MiB L3 next to the cores) plain stores win by half. */
int adt_streaming_beats_cache(uint64_t bytes)
{
#if defined(__SSE2__)
    size_t n = ((size_t)bytes + 4095) & ~(size_t)4095;
    if (n == 0) return 0;
    char *src = NULL, *dst = NULL;
    if (posix_memalign((void **)&src, 2 << 20, n) || posix_memalign((void **)&dst, 2 << 20, n)) {
        free(src);
        return -1;
    }
#ifdef MADV_HUGEPAGE
    madvise(src, n, MADV_HUGEPAGE);   /* fewer page faults (where allowed): most of the time here otherwise */
    madvise(dst, n, MADV_HUGEPAGE);
#endif
    memset(src, 0x5a, n);
    memset(dst, 0xa5, n);
    uint64_t best[2] = {UINT64_MAX, UINT64_MAX};
    for (int way = 0; way < 2; way++) {
        for (int round = 0; round < 4; round++) {
            uint64_t t0 = now_ns();
            if (way) { stream_lanes(dst, src, n, STREAM_ALONE, NULL); STREAM_FENCE(); }
            else memcpy(dst, src, n);
            uint64_t t = now_ns() - t0;
            if (round > 0 && t < best[way]) best[way] = t;
        }
    }
    free(src);
    free(dst);
    return best[1] < best[0];
#else
    (void)bytes;
    return 0;
#endif
}

/* One idle worker at a time spins briefly (p->spin_ns) before sleeping: back-to-back small transfers then find
 * a worker awake, so the submitting event loop pays no wake-up (a futex wake of an idle vCPU costs tens of
 * microseconds on a VM); the other workers sleep.  Returns 1 if work arrived. */
static int spin_for_work(adt_pool *p)
{
    int expected = 0;
    if (p->spin_ns == 0
        || !__atomic_compare_exchange_n(&p->spinner, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
        return 0;
    uint64_t until = now_ns() + p->spin_ns;
    int found = 0;
    for (unsigned i = 0; !found; i++) {
        if (__atomic_load_n(&p->incoming, __ATOMIC_ACQUIRE) || __atomic_load_n(&p->head, __ATOMIC_RELAXED)
            || __atomic_load_n(&p->shutdown, __ATOMIC_ACQUIRE))
            found = 1;
        else if ((i & 63) == 0 && now_ns() > until)
            break;
        else
            SPIN_PAUSE();
    }
    /* Pairs with submit(): it pushes, then posts only if nobody spins; we stop spinning, then look again. */
    __atomic_store_n(&p->spinner, 0, __ATOMIC_SEQ_CST);
    if (!found && __atomic_load_n(&p->incoming, __ATOMIC_SEQ_CST)) found = 1;
    return found;
}

static int run_grid_chunk(adt_job *j, size_t c);

/* Whether the submitter wakes every worker a job needs (see submit), rather than one that wakes the others. */
static inline int wake_all(const adt_job *j)
{
    return j->nchunks > 1;
}

static void *worker(void *arg)
{
    adt_pool *p = (adt_pool *)arg;
    /* Copies yield to the event loop: batch scheduling, so that a woken worker does not preempt the loop thread,
     * and a lower priority (pool->nice), so that the loop is not starved where copies occupy every core.  Idle
     * cores are still used in full. */
    struct sched_param none = {0};
    pthread_setschedparam(pthread_self(), SCHED_BATCH, &none);
    if (p->nice > 0)
        setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), getpriority(PRIO_PROCESS, 0) + p->nice);
    for (;;) {
        pthread_mutex_lock(&p->lock);
        take_incoming(p);
        adt_job *j = p->head;
        if (!j) {
            int stop_now = __atomic_load_n(&p->shutdown, __ATOMIC_ACQUIRE);
            pthread_mutex_unlock(&p->lock);
            if (stop_now) break;
            if (spin_for_work(p)) continue;
            __atomic_add_fetch(&p->idle, 1, __ATOMIC_SEQ_CST);
            while (sem_wait(&p->work) < 0 && errno == EINTR) {}
            __atomic_sub_fetch(&p->idle, 1, __ATOMIC_SEQ_CST);
            continue;
        }
        unlink_head(p, j);
        if (__atomic_load_n(&j->stop, __ATOMIC_ACQUIRE)) {   /* cancelled or failed: drop what is left */
            j->next_chunk = j->nchunks;
            int fd = j->notify_fd, ann = finish_if_idle(p, j);
            pthread_mutex_unlock(&p->lock);
            if (ann) announce(fd, j);
            continue;
        }
        size_t c = j->next_chunk++;
        int more = p->head != NULL;
        if (j->next_chunk < j->nchunks) {     /* round-robin: the job goes to the back of the line */
            if (p->tail) p->tail->next = j; else p->head = j;
            p->tail = j;
            more = 1;
        }
        /* Other work left behind, but not a job whose submitter woke every worker it needs (then alone queued). */
        more = more && !(p->head == j && j->next == NULL && wake_all(j));
        j->inflight++;
        pthread_mutex_unlock(&p->lock);
        /* Chain wake-up, for work queued behind other jobs: each worker that leaves work behind wakes one more
         * sleeper (the submitter of a job of several chunks woke the workers it needs itself). */
        if (more && __atomic_load_n(&p->idle, __ATOMIC_SEQ_CST) > 0) sem_post(&p->work);

        int err = 0;
        if (j->grid) err = run_grid_chunk(j, c);
        else {
            int64_t lo = j->bounds[c], hi = j->bounds[c + 1];
            if (j->mode == 0)
                adt_copy_spans(j->dst + lo, j->src + lo, j->len + lo, (size_t)(hi - lo), j->streaming, &j->stop);
            else
                err = run_pvm(j, lo, hi);
        }

        pthread_mutex_lock(&p->lock);
        j->inflight--;
        if (err && !j->error) {
            j->error = err;
            __atomic_store_n(&j->stop, 1, __ATOMIC_RELEASE);
        }
        if (__atomic_load_n(&j->stop, __ATOMIC_ACQUIRE) && j->next_chunk < j->nchunks) {
            j->next_chunk = j->nchunks;       /* pending chunks are dropped; leave the ready list */
            adt_job **pp = &p->head, *prev = NULL;
            while (*pp && *pp != j) { prev = *pp; pp = &(*pp)->next; }
            if (*pp) { *pp = j->next; if (p->tail == j) p->tail = prev; j->next = NULL; }
        }
        int fd = j->notify_fd, ann = finish_if_idle(p, j);
        pthread_mutex_unlock(&p->lock);
        if (ann) announce(fd, j);
    }
    return NULL;
}

void *adt_pool_new(int nthreads, int nice, uint64_t spin_ns, uint64_t stream_bytes)
{
    adt_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->nice = nice;
    p->spin_ns = spin_ns;
    p->stream_bytes = stream_bytes;
    pthread_mutex_init(&p->lock, NULL);
    if (nthreads > 64) nthreads = 64;
    if (sem_init(&p->work, 0, 0) != 0) { pthread_mutex_destroy(&p->lock); free(p); return NULL; }
    for (int i = 0; i < nthreads; i++)
        if (pthread_create(&p->threads[p->nthreads], NULL, worker, p) == 0) p->nthreads++;
    if (p->nthreads == 0) { sem_destroy(&p->work); pthread_mutex_destroy(&p->lock); free(p); return NULL; }
    return p;
}

/* Finishes every queued chunk, joins the threads and frees the pool. */
void adt_pool_free(void *pool)
{
    adt_pool *p = (adt_pool *)pool;
    __atomic_store_n(&p->shutdown, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < p->nthreads; i++) sem_post(&p->work);
    for (int i = 0; i < p->nthreads; i++) pthread_join(p->threads[i], NULL);
    sem_destroy(&p->work);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

static void *submit(adt_pool *p, adt_job *j)
{
    if (j->nchunks == 0) {
        __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
        announce(j->notify_fd, j);
        return j;
    }
    /* A copy within this process's memory that would stay in the CPU caches (its caller did not ask for streaming
     * stores) streams anyway when the jobs queued with it add up to the caller's limit: together they cannot stay
     * cached, and each would evict the others on the way.  64 concurrent 4 MiB pulls on a 2-vCPU VM (an eighth of
     * its 480 MiB cache as the limit, three runs): 11.0-11.5 -> 14.0-14.7 GB/s, pushes likewise. */
    uint64_t before = __atomic_fetch_add(&p->queued, j->nbytes, __ATOMIC_SEQ_CST);
    if (j->mode == 0 && j->streaming != STREAM_LANES && p->stream_bytes && before + j->nbytes >= p->stream_bytes)
        j->streaming = STREAM_LANES;
    adt_job *top = __atomic_load_n(&p->incoming, __ATOMIC_RELAXED);
    do { j->next_in = top; } while (!__atomic_compare_exchange_n(&p->incoming, &top, j, 1, __ATOMIC_SEQ_CST,
                                                                  __ATOMIC_RELAXED));
    /* A spinning worker takes the job without any wake-up (see spin_for_work for why this cannot strand a job).
     * A job of several chunks needs several workers at once: the sleepers it needs are woken from here.  Woken by
     * the worker that took the first chunk (the chain in worker), a worker can be queued on that worker's busy CPU
     * and wait there while the other CPU idles: in up to a fifth of the 2 MiB pulls on 2 vCPUs one worker copied
     * both halves (eight runs of 1000: p90 211 -> 159 us, medians), and a 256 MiB paged copy submitted right after
     * other threads had used both CPUs ran at 14.5 / 20.4 GB/s (medians of 11, two runs) instead of 21.0-22.2,
     * one worker waiting milliseconds for the scheduler to move it.  The event loop pays a wake-up per worker. */
    int wake = !__atomic_load_n(&p->spinner, __ATOMIC_SEQ_CST);   /* always, as it cannot strand the job */
    if (wake_all(j)) {
        int more = (int)j->nchunks - 1, sleeping = __atomic_load_n(&p->idle, __ATOMIC_SEQ_CST) - wake;
        if (sleeping > 0) wake += more < sleeping ? more : sleeping;
    }
    for (int i = 0; i < wake; i++) sem_post(&p->work);
    return j;
}

void *adt_job_submit(void *pool, const uint64_t *dst, const uint64_t *src, const uint64_t *len,
                     const int64_t *bounds, size_t nchunks, int mode, int pid, int streaming, int notify_fd)
{
    adt_job *j = calloc(1, sizeof *j);
    if (!j) return NULL;
    j->dst = dst; j->src = src; j->len = len; j->bounds = bounds; j->nchunks = nchunks;
    j->mode = mode; j->pid = pid; j->streaming = streaming; j->notify_fd = notify_fd;
    for (int64_t i = 0, n = nchunks ? bounds[nchunks] : 0; i < n; i++) j->nbytes += len[i];
    return submit((adt_pool *)pool, j);
}

/* A (tensor x run) grid: span (t, r) copies run_len[r] bytes from src_base[t] + run_src[r] + src_delta to
 * dst_base[t] + run_dst[r] + dst_delta, tensor-major.  Its spans in that order form a byte stream; a grid job's
 * chunks are byte ranges of it, which workers walk themselves (no span list is built: the caller does no per-span
 * work and submitting costs the same for 64 spans or 8192).  Spans that continue each other on both sides are
 * merged, runs longer than `piece` are copied piece by piece, and the stop flag is polled between pieces (and
 * every 64 tiny spans). */
typedef struct grid {
    const uint64_t *src_base, *dst_base, *run_src, *run_dst, *run_len;   /* kept alive by the caller */
    uint64_t *prefix;                  /* nr + 1 running sums of run_len (owned by the job) */
    size_t nt, nr;
    uint64_t src_delta, dst_delta, per_tensor, total, piece;
} grid;

typedef struct {
    struct iovec local[PVM_BATCH], remote[PVM_BATCH];
    size_t k, want;
    int mode, pid, streaming;
    const volatile int32_t *stop;
    lanes lanes;                       /* streaming spans queued (mode 0) */
} copier;

static int pvm_flush(copier *c)
{
    if (c->k == 0) return 0;
    ssize_t got = c->mode == 1 ? process_vm_readv(c->pid, c->local, c->k, c->remote, c->k, 0)
                               : process_vm_writev(c->pid, c->local, c->k, c->remote, c->k, 0);
    size_t want = c->want;
    c->k = 0; c->want = 0;
    if (got < 0) return errno ? errno : EIO;
    return (size_t)got == want ? 0 : EFAULT;   /* a remote range is not mapped (any more) */
}

/* One merged span, in pieces of at most `piece` bytes; 0, an errno, or -1 when stopped. */
static int copy_span(copier *c, uint64_t s, uint64_t d, uint64_t l, uint64_t piece)
{
    while (l > 0) {
        if (c->stop && *c->stop) return -1;
        uint64_t k = l < piece ? l : piece;
        if (c->mode == 0) {
            char *dp = (char *)(uintptr_t)d;
            const char *sp = (const char *)(uintptr_t)s;
            if (c->streaming && k >= 4096 ? lanes_add(&c->lanes, dp, sp, (size_t)k, 0, c->stop)
                                          : copy_after_lanes(&c->lanes, dp, sp, (size_t)k, c->stop))
                return -1;
        } else {
            uint64_t local = c->mode == 1 ? d : s, remote = c->mode == 1 ? s : d;
            c->local[c->k].iov_base = (void *)(uintptr_t)local;
            c->remote[c->k].iov_base = (void *)(uintptr_t)remote;
            c->local[c->k].iov_len = c->remote[c->k].iov_len = (size_t)k;
            c->want += (size_t)k;
            if (++c->k == PVM_BATCH || c->want >= PVM_BYTES) {
                int err = pvm_flush(c);
                if (err) return err;
            }
        }
        s += k; d += k; l -= k;
    }
    return 0;
}

/* copy_span with the tiny local span inlined (the grid walk's hot path for small blocks). */
static inline int copy_span_fast(copier *c, uint64_t s, uint64_t d, uint64_t l, uint64_t piece)
{
    if (c->mode == 0 && l <= 64 && c->lanes.k == 0 && !(c->stop && *c->stop)
        && copy_small((char *)(uintptr_t)d, (const char *)(uintptr_t)s, (size_t)l))
        return 0;
    return copy_span(c, s, d, l, piece);
}

#define TINY_SPAN 64u   /* copy_small's limit */

/* The run holding byte `rem` of a tensor's share of a grid: the last r with prefix[r] <= rem (prefix: the nr + 1
 * running sums of the runs' lengths; zero-length runs are skipped over). */
static size_t run_at(const uint64_t *prefix, size_t nr, uint64_t rem)
{
    size_t lo = 0, hi = nr;
    while (hi - lo > 1) { size_t mid = lo + (hi - lo) / 2; if (prefix[mid] <= rem) lo = mid; else hi = mid; }
    return lo;
}

/* After a tensor's last run: on to the next tensor's first (its bases in *sb, *db); 0 when that was the last. */
static inline int next_tensor(const grid *g, size_t *r, size_t *t, uint64_t *sb, uint64_t *db)
{
    *r = 0;
    if (++*t == g->nt) return 0;
    *sb = g->src_base[*t] + g->src_delta; *db = g->dst_base[*t] + g->dst_delta;
    return 1;
}

/* Where byte b0 (< total) of a grid's stream is: tensor *t, run *r, *off bytes into it; that tensor's source and
 * destination bases (deltas added) in *sb and *db. */
static inline void grid_locate(const grid *g, uint64_t b0, size_t *t, size_t *r, uint64_t *off, uint64_t *sb,
                               uint64_t *db)
{
    *t = (size_t)(b0 / g->per_tensor);
    uint64_t rem = b0 - (uint64_t)*t * g->per_tensor;
    *r = run_at(g->prefix, g->nr, rem);
    *off = rem - g->prefix[*r];
    *sb = g->src_base[*t] + g->src_delta;
    *db = g->dst_base[*t] + g->dst_delta;
}

/* Copy bytes [b0, b1) of the grid's stream: 0, an errno, or -1 when stopped. */
static int grid_copy_range(const grid *g, uint64_t b0, uint64_t b1, copier *c)
{
    if (b0 >= b1 || g->per_tensor == 0) return 0;
    size_t t, r;
    uint64_t off, sb, db, pos = b0, cs = 0, cd = 0, cl = 0;
    grid_locate(g, b0, &t, &r, &off, &sb, &db);
    /* Locals, not g->...: the copies in between may alias anything, so the compiler would reload every field. */
    const uint64_t *run_src = g->run_src, *run_dst = g->run_dst, *run_len = g->run_len;
    const size_t nr = g->nr;
    const uint64_t piece = g->piece;
    const volatile int32_t *stop = c->stop;
    const int local = c->mode == 0;
    int err = 0;
    while (pos < b1) {
        if (local && off == 0 && run_len[r] <= TINY_SPAN && run_len[r] <= b1 - pos) {
            /* A stretch of whole tiny runs (KV blocks of a few tokens): each copied at once, without the merging
             * below, whose bookkeeping costs more than such a copy (8192 spans of 64 bytes, one thread: 54 -> 39 us).
             * The stop flag is polled every 64 of them. */
            if (cl && (err = copy_span(c, cs, cd, cl, piece))) return err;
            if (c->lanes.k && lanes_run(&c->lanes, 1, stop)) return -1;   /* the copies below ignore the lanes */
            cl = 0;
            for (size_t k = 0; r < nr; r++, k++) {
                uint64_t l = run_len[r];
                if (l > TINY_SPAN || l > b1 - pos) break;
                if ((k & 63) == 63 && stop && *stop) return -1;
                char *d = (char *)(uintptr_t)(db + run_dst[r]);
                const char *s = (const char *)(uintptr_t)(sb + run_src[r]);
                if (!copy_small(d, s, (size_t)l)) memmove(d, s, (size_t)l);
                pos += l;
            }
            if (r == nr && !next_tensor(g, &r, &t, &sb, &db)) break;
            continue;
        }
        uint64_t l = run_len[r] - off;
        if (l > b1 - pos) l = b1 - pos;
        if (l) {
            uint64_t s = sb + run_src[r] + off, d = db + run_dst[r] + off;
            if (cl && cs + cl == s && cd + cl == d) cl += l;
            else {
                if (cl && (err = copy_span_fast(c, cs, cd, cl, piece))) return err;
                cs = s; cd = d; cl = l;
            }
        }
        pos += l; off = 0;
        if (++r == nr && !next_tensor(g, &r, &t, &sb, &db)) break;
    }
    if (cl && (err = copy_span(c, cs, cd, cl, piece))) return err;
    if (c->mode != 0 && (c->stop == NULL || !*c->stop)) return pvm_flush(c);
    return 0;
}

/* process_vm_readv pins the remote pages of every iovec it is given, one by one: ~0.7 us a page on a 2-vCPU VM, so
 * 8192 scattered 64-byte spans (one page each) took 6.6 ms, 100x their bytes' copy.  Where a tensor's spans lie
 * close together, one read of the range covering them into a bounce buffer, then a local copy of each span, pins
 * each page once.  Reading the bytes between them is harmless: the range lies inside one of the owner's tensors.
 * A group of runs is read that way when it would take two iovecs or more and its covering range (at most
 * COVER_MAX bytes) has at most three quarters of the pages its iovecs would pin; otherwise its spans go out as
 * iovecs, adjacent ones merged, as grid_copy_range sends them. */
#define COVER_MAX (1u << 20)
#define PAGE_SHIFT_4K 12

static inline uint64_t pages_of(uint64_t start, uint64_t len)
{
    return ((start + len - 1) >> PAGE_SHIFT_4K) - (start >> PAGE_SHIFT_4K) + 1;
}

typedef struct {
    uint64_t lo, hi;   /* the covering range, offsets in the tensor */
    size_t end;        /* one past the group's last run */
    uint64_t stop_at;  /* the stream position after it */
    size_t iovecs;     /* its spans, adjacent ones merged */
    uint64_t pinned;   /* the pages those iovecs would pin */
} read_group;

/* The group of tensor runs from run r (off bytes into it, stream position pos; the tensor's source at sb) that a
 * covering read may take. */
static read_group group_at(const grid *g, size_t r, uint64_t off, uint64_t pos, uint64_t b1, uint64_t sb)
{
    read_group q = {UINT64_MAX, 0, r, pos, 0, 0};
    uint64_t ms = 0, md = 0, ml = 0;   /* the merged span being extended */
    for (; q.stop_at < b1 && q.end < g->nr; q.end++, off = 0) {
        uint64_t l = g->run_len[q.end] - off;
        if (l > b1 - q.stop_at) l = b1 - q.stop_at;
        if (!l) continue;
        uint64_t s = g->run_src[q.end] + off, d = g->run_dst[q.end] + off;
        uint64_t lo = s < q.lo ? s : q.lo, hi = s + l > q.hi ? s + l : q.hi;
        if (q.iovecs && hi - lo > COVER_MAX) break;
        if (ml && ms + ml == s && md + ml == d) {
            ml += l;
        } else {
            if (ml) q.pinned += pages_of(sb + ms, ml);
            ms = s; md = d; ml = l;
            q.iovecs++;
        }
        q.lo = lo; q.hi = hi;
        q.stop_at += l;
    }
    if (ml) q.pinned += pages_of(sb + ms, ml);
    return q;
}

/* Covering reads waiting for their one process_vm_readv (into consecutive places of the bounce buffer), and where
 * their spans go once it is done. */
typedef struct {
    struct iovec local[PVM_BATCH], remote[PVM_BATCH];
    struct { size_t r, end; uint64_t off, pos, lo, db; } group[PVM_BATCH];
    size_t n, used;
    char *bounce;
} cover_batch;

/* Each thread's batch and bounce buffer, kept for its next covering reads (a fresh 1 MiB buffer would be faulted
 * in page by page at every call: as long as the read itself) and freed when the thread exits. */
static pthread_key_t cover_key;
static pthread_once_t cover_once = PTHREAD_ONCE_INIT;

static void cover_free(void *p)
{
    cover_batch *cb = (cover_batch *)p;
    free(cb->bounce);
    free(cb);
}

static void cover_key_init(void) { (void)pthread_key_create(&cover_key, cover_free); }

static cover_batch *cover_batch_of_thread(void)
{
    pthread_once(&cover_once, cover_key_init);
    cover_batch *cb = (cover_batch *)pthread_getspecific(cover_key);
    if (cb) return cb;
    if (!(cb = calloc(1, sizeof *cb))) return NULL;
    if (!(cb->bounce = malloc(COVER_MAX)) || pthread_setspecific(cover_key, cb)) {
        free(cb->bounce);
        free(cb);
        return NULL;
    }
    return cb;
}

/* Read the batched covering ranges with one call, then copy each group's spans out of the bounce buffer. */
static int cover_flush(cover_batch *cb, const grid *g, uint64_t b1, int pid)
{
    size_t n = cb->n, used = cb->used;
    cb->n = cb->used = 0;   /* empty again, whatever the read gives */
    if (n == 0) return 0;
    ssize_t got = process_vm_readv(pid, cb->local, n, cb->remote, n, 0);
    if (got < 0) return errno ? errno : EIO;
    if ((size_t)got != used) return EFAULT;   /* the owner's range is not mapped (any more) */
    for (size_t i = 0; i < n; i++) {
        const char *from = (const char *)cb->local[i].iov_base;
        uint64_t off = cb->group[i].off, pos = cb->group[i].pos, lo = cb->group[i].lo, db = cb->group[i].db;
        for (size_t k = cb->group[i].r; k < cb->group[i].end; k++, off = 0) {
            uint64_t l = g->run_len[k] - off;
            if (l > b1 - pos) l = b1 - pos;
            char *d = (char *)(uintptr_t)(db + g->run_dst[k] + off);
            const char *s = from + (g->run_src[k] + off - lo);
            if (l && !copy_small(d, s, (size_t)l)) memcpy(d, s, (size_t)l);
            pos += l;
        }
    }
    return 0;
}

/* grid_copy_range for process_vm_readv (c->mode 1), reading close spans with covering reads, batched. */
static int grid_read_range(const grid *g, uint64_t b0, uint64_t b1, copier *c)
{
    if (b0 >= b1 || g->per_tensor == 0) return 0;
    size_t t, r;
    uint64_t off, sb, db, pos = b0, cs = 0, cd = 0, cl = 0;
    grid_locate(g, b0, &t, &r, &off, &sb, &db);
    cover_batch *cb = NULL;
    int err = 0;
    while (pos < b1 && !err) {
        if (c->stop && *c->stop) { err = -1; break; }
        read_group q = group_at(g, r, off, pos, b1, sb);
        uint64_t need = q.hi - q.lo;
        if (q.iovecs >= 2 && 4 * pages_of(sb + q.lo, need) <= 3 * q.pinned) {
            if (!cb && !(cb = cover_batch_of_thread())) { err = ENOMEM; break; }
            if ((cb->used + need > COVER_MAX || cb->n == PVM_BATCH) && (err = cover_flush(cb, g, b1, c->pid))) break;
            size_t i = cb->n++;
            cb->local[i].iov_base = cb->bounce + cb->used;
            cb->remote[i].iov_base = (void *)(uintptr_t)(sb + q.lo);
            cb->local[i].iov_len = cb->remote[i].iov_len = (size_t)need;
            cb->group[i].r = r; cb->group[i].end = q.end; cb->group[i].off = off; cb->group[i].pos = pos;
            cb->group[i].lo = q.lo; cb->group[i].db = db;
            cb->used += need;
            pos = q.stop_at;
        } else {
            for (size_t k = r; k < q.end && !err; k++, off = 0) {   /* as iovecs, adjacent spans merged */
                uint64_t l = g->run_len[k] - off;
                if (l > b1 - pos) l = b1 - pos;
                uint64_t s = sb + g->run_src[k] + off, d = db + g->run_dst[k] + off;
                pos += l;
                if (!l) continue;
                if (cl && cs + cl == s && cd + cl == d) { cl += l; continue; }
                if (cl) err = copy_span(c, cs, cd, cl, g->piece);
                cs = s; cd = d; cl = l;
            }
        }
        r = q.end; off = 0;
        if (r == g->nr && !next_tensor(g, &r, &t, &sb, &db)) break;
    }
    if (!err && cb) err = cover_flush(cb, g, b1, c->pid);
    if (cb) cb->n = cb->used = 0;   /* (reads left unflushed by an error are not the thread's next call's) */
    if (!err && cl) err = copy_span(c, cs, cd, cl, g->piece);
    if (!err && (c->stop == NULL || !*c->stop)) err = pvm_flush(c);
    return err;
}

/* Copy bytes [b0, b1) of a grid's stream the way the copier moves them. */
static int grid_move_range(const grid *g, uint64_t b0, uint64_t b1, copier *c)
{
    return c->mode == 1 ? grid_read_range(g, b0, b1, c) : grid_copy_range(g, b0, b1, c);
}

/* A grid of nt tensor pairs: pair k copies tensor src_tensor[k] of src_addrs (na addresses) to tensor dst_tensor[k]
 * of dst_addrs (nb).  The pairs' base addresses are gathered into the grid's own memory, so the caller keeps only
 * the run arrays alive.  NULL with *err = EINVAL (an index out of range) or ENOMEM. */
static grid *grid_new(const uint64_t *src_addrs, size_t na, const uint64_t *dst_addrs, size_t nb,
                      const int64_t *src_tensor, const int64_t *dst_tensor, size_t nt, const uint64_t *run_src,
                      const uint64_t *run_dst, const uint64_t *run_len, size_t nr, uint64_t src_delta,
                      uint64_t dst_delta, uint64_t piece, int *err)
{
    grid *g = malloc(sizeof *g + (nr + 1 + 2 * nt) * sizeof(uint64_t));
    if (!g) { *err = ENOMEM; return NULL; }
    uint64_t *prefix = (uint64_t *)(g + 1), *bases = prefix + nr + 1;
    for (size_t t = 0; t < nt; t++) {
        if (src_tensor[t] < 0 || dst_tensor[t] < 0 || (size_t)src_tensor[t] >= na || (size_t)dst_tensor[t] >= nb) {
            free(g);
            *err = EINVAL;
            return NULL;
        }
        bases[t] = src_addrs[src_tensor[t]];
        bases[nt + t] = dst_addrs[dst_tensor[t]];
    }
    prefix[0] = 0;
    for (size_t r = 0; r < nr; r++) prefix[r + 1] = prefix[r] + run_len[r];
    *g = (grid){bases, bases + nt, run_src, run_dst, run_len, prefix, nt, nr, src_delta, dst_delta,
                prefix[nr], prefix[nr] * (uint64_t)nt, piece ? piece : (1u << 20)};
    return g;
}

/* Runs chunk c of a grid job (a worker, without the mutex): 0 or an errno. */
static int run_grid_chunk(adt_job *j, size_t c)
{
    copier *cp = malloc(sizeof *cp);
    if (!cp) return ENOMEM;
    cp->k = 0; cp->want = 0; cp->mode = j->mode; cp->pid = j->pid; cp->streaming = j->streaming;
    cp->stop = &j->stop; cp->lanes = lanes_for(j->streaming);
    uint64_t b0 = (uint64_t)c * j->chunk, b1 = b0 + j->chunk < j->grid->total ? b0 + j->chunk : j->grid->total;
    int err = grid_move_range(j->grid, b0, b1, cp);
    if (!err && cp->lanes.k) err = lanes_run(&cp->lanes, 1, cp->stop);
    if (j->mode == 0 && j->streaming) STREAM_FENCE();
    free(cp);
    return err < 0 ? 0 : err;
}

/* Queue a grid job (the job owns g); NULL when out of memory (g freed). */
static adt_job *submit_grid(adt_pool *p, grid *g, uint64_t chunk, int mode, int pid, int streaming, int notify_fd)
{
    adt_job *j = calloc(1, sizeof *j);
    if (!j) { free(g); return NULL; }
    j->grid = g; j->owned = g; j->chunk = chunk;
    j->nchunks = g->total ? (size_t)((g->total + chunk - 1) / chunk) : 0;
    j->mode = mode; j->pid = pid; j->streaming = streaming; j->notify_fd = notify_fd;
    j->nbytes = g->total;
    return submit(p, j);
}

/* A grid copied on the calling thread (no worker, no announcement): for transfers so small that a worker's
 * wake-up and the event loop's pipe read would cost more than the copy.  Returns 0, or an errno (EFAULT: a remote
 * range is not mapped, or not any more). */
static int copy_grid_here(grid *g, int mode, int pid)
{
    copier *cp = malloc(sizeof *cp);
    if (!cp) return ENOMEM;
    cp->k = 0; cp->want = 0; cp->mode = mode; cp->pid = pid; cp->streaming = 0; cp->stop = NULL;
    cp->lanes = lanes_for(0);
    int err = grid_move_range(g, 0, g->total, cp);
    free(cp);
    return err;
}

/* Stop a job: no new chunk starts and running ones stop at their next span; the end is announced as usual
 * (by the worker that meets the job next, or that finishes its running chunk). */
void adt_job_cancel(void *pool, void *job)
{
    adt_pool *p = (adt_pool *)pool;
    adt_job *j = (adt_job *)job;
    __atomic_store_n(&j->stop, 1, __ATOMIC_RELEASE);
    /* Retire a job that no worker is running now, without waiting for a worker to reach it in the queue (busy
     * workers may take a while).  Only if the mutex is free: the event loop must never wait for a worker. */
    if (pthread_mutex_trylock(&p->lock) == 0) {
        take_incoming(p);
        int ann = 0, fd = j->notify_fd;
        if (!__atomic_load_n(&j->done, __ATOMIC_RELAXED)) {
            j->next_chunk = j->nchunks;
            adt_job **pp = &p->head, *prev = NULL;
            while (*pp && *pp != j) { prev = *pp; pp = &(*pp)->next; }
            if (*pp) { *pp = j->next; if (p->tail == j) p->tail = prev; j->next = NULL; }
            ann = finish_if_idle(p, j);
        }
        pthread_mutex_unlock(&p->lock);
        if (ann) { announce(fd, j); return; }
    }
    sem_post(&p->work);
}

/* Whether a queued job's local copy uses streaming stores (0, STREAM_LANES or STREAM_ALONE), as asked or as its pool
 * decided (see submit); for tests. */
int adt_job_streams(void *job) { return ((adt_job *)job)->streaming; }

void adt_job_free(void *job) { adt_job *j = (adt_job *)job; free(j->owned); free(j); }

/* ---------------------------------------------------------------------------------------------------------
 * TCP data plane: frames on blocking stream sockets, moved straight between the socket and cache memory.  A
 * frame is a fixed header followed by a payload that is a contiguous slice of a transfer's byte stream (its spans
 * in plan order).  Called from the data plane's I/O threads through ctypes (the GIL is released).
 * --------------------------------------------------------------------------------------------------------- */
#include <sys/socket.h>
#include <sys/time.h>

#define IOV_CAP 512
#define RECV_PIECE (1u << 20)

/* Spans shorter than SMALL_SPAN go through a bounce buffer, copied in user space: the kernel's cost per iovec
 * (~70 ns on loopback) is many times a small memcpy, so 8192 scattered 64-byte spans cost ~0.6 ms as iovecs and
 * ~0.05 ms gathered.  Larger spans are still sent and received in place.  The buffer (on the stack: the I/O
 * threads' stacks are the default 8 MiB) takes a whole frame share of tiny spans: every sendmsg wakes the
 * receiving thread, and 64 KiB writes made an 8192-span pull ~50 us slower on 2 vCPUs than 256 KiB ones. */
#define SMALL_SPAN 2048u
#define GATHER_BYTES (256u << 10)

static int send_all(int fd, struct iovec *iov, int n)   /* every byte of iov[0..n), or the errno */
{
    int i = 0;
    while (i < n) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov + i;
        m.msg_iovlen = (size_t)(n - i);
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        size_t left = (size_t)w;
        while (i < n && left >= iov[i].iov_len) { left -= iov[i].iov_len; i++; }
        if (i < n) { iov[i].iov_base = (uint8_t *)iov[i].iov_base + left; iov[i].iov_len -= left; }
    }
    return 0;
}

/* A frame being sent: iovecs (up to IOV_CAP), spans shorter than SMALL_SPAN gathered into a bounce buffer, a span
 * that continues the previous iovec extending it; sent (send_all) whenever either is full, and at the end. */
typedef struct {
    struct iovec iov[IOV_CAP];
    int n, gathering;
    size_t used;
    uint8_t gather[GATHER_BYTES];
} sendbuf;

static int sb_flush(sendbuf *b, int fd)
{
    int err = b->n ? send_all(fd, b->iov, b->n) : 0;
    b->n = 0; b->used = 0; b->gathering = 0;
    return err;
}

static void sb_open(sendbuf *b, const uint8_t *header, size_t hlen)
{
    b->n = 0; b->used = 0; b->gathering = 0;
    if (hlen) { b->iov[0].iov_base = (void *)header; b->iov[0].iov_len = hlen; b->n = 1; }
}

/* 0, or the errno that ended the connection.  Inlined: it runs once per span, and most spans are tiny. */
static inline __attribute__((always_inline)) int sb_add(sendbuf *b, int fd, const uint8_t *src, size_t l)
{
    int err;
    if (l == 0) return 0;
    if (l <= TINY_SPAN && b->gathering && b->used + l <= GATHER_BYTES) {   /* the common case, first */
        if (!copy_small((char *)(b->gather + b->used), (const char *)src, l)) memcpy(b->gather + b->used, src, l);
        b->iov[b->n - 1].iov_len += l;
        b->used += l;
        return 0;
    }
    if (l < SMALL_SPAN) {
        if ((b->used + l > GATHER_BYTES || (!b->gathering && b->n == IOV_CAP)) && (err = sb_flush(b, fd))) return err;
        uint8_t *to = b->gather + b->used;
        if (!copy_small((char *)to, (const char *)src, l)) memcpy(to, src, l);
        if (b->gathering) b->iov[b->n - 1].iov_len += l;
        else { b->iov[b->n].iov_base = to; b->iov[b->n].iov_len = l; b->n++; b->gathering = 1; }
        b->used += l;
        return 0;
    }
    if (b->n && !b->gathering && (const uint8_t *)b->iov[b->n - 1].iov_base + b->iov[b->n - 1].iov_len == src) {
        b->iov[b->n - 1].iov_len += l;
        return 0;
    }
    if (b->n == IOV_CAP && (err = sb_flush(b, fd))) return err;
    b->iov[b->n].iov_base = (void *)src; b->iov[b->n].iov_len = l; b->n++;
    b->gathering = 0;
    return 0;
}

/* Send `hlen` header bytes, then spans [lo, hi).  Returns 0, or the errno that ended the connection. */
int adt_send_frame(int fd, const uint8_t *header, size_t hlen, const uint64_t *addr, const uint64_t *len,
                   int64_t lo, int64_t hi)
{
    sendbuf b;
    sb_open(&b, header, hlen);
    for (int64_t i = lo; i < hi; i++) {
        int err = sb_add(&b, fd, (const uint8_t *)(uintptr_t)addr[i], (size_t)len[i]);
        if (err) return err;
    }
    return sb_flush(&b, fd);
}

/* Send `hlen` header bytes, then bytes [b0, b1) of a grid's stream: bases[t] + offs[r], lens[r] bytes, for each of
 * the nt tensors then each of the nr runs (`prefix`: the nr + 1 running sums of lens), walked straight into the
 * frame (no span list is built).  Returns 0, or the errno that ended the connection. */
int adt_send_grid(int fd, const uint8_t *header, size_t hlen, const uint64_t *bases, size_t nt, const uint64_t *offs,
                  const uint64_t *lens, size_t nr, const uint64_t *prefix, uint64_t b0, uint64_t b1)
{
    sendbuf b;
    sb_open(&b, header, hlen);
    uint64_t per = nr ? prefix[nr] : 0;
    if (b0 < b1 && per) {
        size_t t = (size_t)(b0 / per), r = run_at(prefix, nr, b0 - (uint64_t)t * per);
        uint64_t off = b0 - (uint64_t)t * per - prefix[r], pos = b0;
        while (pos < b1 && t < nt) {
            uint64_t l = lens[r] - off;
            if (l > b1 - pos) l = b1 - pos;
            int err = sb_add(&b, fd, (const uint8_t *)(uintptr_t)(bases[t] + offs[r] + off), (size_t)l);
            if (err) return err;
            pos += l; off = 0;
            if (++r == nr) { r = 0; t++; }
        }
    }
    return sb_flush(&b, fd);
}

/* The first span index in [k, hi) whose running end (`ends`) reaches `at`, or hi: a binary search, so that each
 * receive of a frame costs O(log n) in bookkeeping however many spans remain. */
static size_t first_end_at(const uint64_t *ends, size_t k, size_t hi, uint64_t at)
{
    while (k < hi) {
        size_t mid = k + (hi - k) / 2;
        if (ends[mid] >= at) hi = mid; else k = mid + 1;
    }
    return k;
}

/* Whether the next spans (from span k, `inner` bytes in) are small on average: the next IOV_CAP spans, or as
 * many as `left` bytes reach, hold fewer than SMALL_SPAN bytes each.  `ends`: running sums of the lengths. */
static int scatter_small(const uint64_t *ends, const uint64_t *len, size_t n, size_t k, uint64_t inner,
                         uint64_t left, size_t scratch_len)
{
    if (scratch_len < GATHER_BYTES || k >= n) return 0;
    uint64_t start = ends[k] - len[k] + inner;   /* stream offset of the next byte */
    size_t cap = n - k < IOV_CAP ? n : k + IOV_CAP;
    size_t last = first_end_at(ends, k, cap, start + left);   /* the span that holds the frame's last byte */
    size_t m = last < cap ? last - k + 1 : cap - k;
    uint64_t bytes = ends[k + m - 1] - start;
    if (bytes > left) bytes = left;
    return m > 1 && bytes < (uint64_t)SMALL_SPAN * m;
}

/* The bytes of the spans from span k (`inner` bytes in) that fit in `cap`, whole spans first, at least one. */
static uint64_t scatter_bytes(const uint64_t *ends, const uint64_t *len, size_t n, size_t k, uint64_t inner,
                              uint64_t cap)
{
    uint64_t start = ends[k] - len[k] + inner;
    size_t over = first_end_at(ends, k, n, start + cap + 1);   /* the first span that does not fit whole */
    uint64_t fit = over == k ? 0 : ends[over - 1] - start;
    return fit ? fit : cap;
}

/* Receive a frame's `nbytes` payload into the destination spans, starting at byte `off` of the transfer's stream
 * (`ends` = running sums of `len`, n spans).  At most RECV_PIECE bytes per recvmsg, so a stop (*stop set) takes
 * effect within one piece: from then on, and for bytes beyond the spans, the rest of the frame is read into
 * `scratch` and dropped, so the stream stays in sync and nothing more lands in the destination.
 *
 * `poll_ms` > 0: never wait more than `poll_ms` inside a receive (a peer that stalls mid-frame would otherwise hold
 * the destination until it sends again): the socket gets that receive timeout for the frame (SO_RCVTIMEO, two
 * syscalls per frame rather than a poll per wake-up), and *stop is looked at after each timeout.  `consumed`
 * (non-NULL): on a stop, return at once instead of
 * draining, with *consumed = the payload bytes read so far; the caller drops the rest of the frame itself, once
 * it let go of the destination.  Returns the bytes written into the destination, or -errno (-ECONNRESET when
 * the peer closed the stream). */
static long recv_frame(int fd, const uint64_t *addr, const uint64_t *len, const uint64_t *ends, size_t n,
                       uint64_t off, uint64_t nbytes, const volatile int32_t *stop, uint8_t *scratch,
                       size_t scratch_len, int timed, uint64_t *consumed)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {   /* the first span that ends after `off` */
        size_t mid = lo + (hi - lo) / 2;
        if (ends[mid] > off) hi = mid; else lo = mid + 1;
    }
    size_t k = lo;
    uint64_t inner = k < n ? off - (ends[k] - len[k]) : 0;
    uint64_t left = nbytes, written = 0;
    struct iovec iov[IOV_CAP];
    while (left > 0) {
        ssize_t r;
        if (consumed && stop && *stop) { *consumed = nbytes - left; return (long)written; }
        if ((stop && *stop) || k >= n) {
            size_t want = left < scratch_len ? (size_t)left : scratch_len;
            r = recv(fd, scratch, want, 0);
            if (r == 0) return -ECONNRESET;
            if (r < 0) {
                if (errno == EINTR || (timed && (errno == EAGAIN || errno == EWOULDBLOCK))) continue;
                return -(errno ? errno : EIO);
            }
            left -= (uint64_t)r;
            continue;
        }
        if (scratch && scatter_small(ends, len, n, k, inner, left, scratch_len)) {
            uint64_t want = scatter_bytes(ends, len, n, k, inner, left < scratch_len ? left : scratch_len);
            r = recv(fd, scratch, (size_t)want, 0);
            if (r == 0) return -ECONNRESET;
            if (r < 0) {
                if (errno == EINTR || (timed && (errno == EAGAIN || errno == EWOULDBLOCK))) continue;
                return -(errno ? errno : EIO);
            }
            uint64_t got = (uint64_t)r;
            const uint8_t *p = scratch;
            left -= got;
            written += got;
            while (got > 0) {   /* k < n: want never runs past the spans */
                while (inner == 0 && k < n && len[k] <= TINY_SPAN && len[k] <= got) {   /* whole tiny spans first */
                    char *to = (char *)(uintptr_t)addr[k];
                    if (!copy_small(to, (const char *)p, (size_t)len[k])) memcpy(to, p, (size_t)len[k]);
                    p += len[k]; got -= len[k]; k++;
                }
                if (got == 0) break;
                uint64_t take = len[k] - inner;
                if (take > got) take = got;
                char *to = (char *)(uintptr_t)(addr[k] + inner);
                if (!copy_small(to, (const char *)p, (size_t)take)) memcpy(to, p, (size_t)take);
                p += take; got -= take; inner += take;
                if (inner == len[k]) { k++; inner = 0; }
            }
            while (k < n && len[k] == inner) { k++; inner = 0; }
            continue;
        }
        int m = 0;
        uint64_t budget = left < RECV_PIECE ? left : RECV_PIECE, in = inner;
        for (size_t kk = k; budget > 0 && kk < n && m < IOV_CAP; kk++) {
            uint64_t take = len[kk] - in;
            if (take > budget) take = budget;
            if (take) {
                iov[m].iov_base = (void *)(uintptr_t)(addr[kk] + in);
                iov[m].iov_len = (size_t)take;
                m++;
            }
            budget -= take;
            in = 0;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)m;
        r = recvmsg(fd, &mh, 0);
        if (r == 0) return -ECONNRESET;
        if (r < 0) {
            if (errno == EINTR || (timed && (errno == EAGAIN || errno == EWOULDBLOCK))) continue;   /* look at *stop */
            return -(errno ? errno : EIO);
        }
        uint64_t got = (uint64_t)r;
        left -= got;
        written += got;
        while (k < n && (got > 0 || len[k] == inner)) {
            uint64_t rem = len[k] - inner;
            if (got >= rem) { got -= rem; k++; inner = 0; }
            else { inner += got; got = 0; }
        }
    }
    if (consumed) *consumed = nbytes;
    return (long)written;
}

long adt_recv_frame(int fd, const uint64_t *addr, const uint64_t *len, const uint64_t *ends, size_t n,
                    uint64_t off, uint64_t nbytes, const volatile int32_t *stop, uint8_t *scratch,
                    size_t scratch_len, int poll_ms, uint64_t *consumed)
{
    if (poll_ms <= 0) return recv_frame(fd, addr, len, ends, n, off, nbytes, stop, scratch, scratch_len, 0, consumed);
    struct timeval bound = {poll_ms / 1000, (poll_ms % 1000) * 1000}, none = {0, 0};
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound)) return -(errno ? errno : EIO);
    long got = recv_frame(fd, addr, len, ends, n, off, nbytes, stop, scratch, scratch_len, 1, consumed);
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none) && got >= 0) return -(errno ? errno : EIO);
    return got;
}

/* The plan functions called as Python functions (METH_FASTCALL, buffers taken as they are) rather than through
 * ctypes, whose argument conversion alone costs more than a small copy.  A plan's arrays come first:
 * src_addrs, dst_addrs (tensor addresses), src_tensor, dst_tensor (indices into them, one pair per grid row),
 * run_src, run_dst, run_len; all C-contiguous with 8-byte items. */
#define PLAN_ARRAYS 7

static int plan_buffers(PyObject *const *args, Py_buffer *b)
{
    for (int i = 0; i < PLAN_ARRAYS; i++) {
        if (PyObject_GetBuffer(args[i], &b[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            while (--i >= 0) PyBuffer_Release(&b[i]);
            return -1;
        }
        if (b[i].itemsize != 8) {
            PyErr_SetString(PyExc_ValueError, "plan arrays hold 8-byte integers");
            for (; i >= 0; i--) PyBuffer_Release(&b[i]);
            return -1;
        }
    }
    return 0;
}

/* The grid of a plan's buffers (released here; the run arrays must outlive the grid); NULL with an exception. */
static grid *plan_grid(PyObject *const *args, uint64_t src_delta, uint64_t dst_delta, uint64_t piece)
{
    Py_buffer b[PLAN_ARRAYS];
    if (plan_buffers(args, b) < 0) return NULL;
    size_t nt = (size_t)(b[2].len / 8), nr = (size_t)(b[4].len / 8);
    int err = 0;
    grid *g = NULL;
    if ((size_t)(b[3].len / 8) != nt || (size_t)(b[5].len / 8) != nr || (size_t)(b[6].len / 8) != nr) err = EINVAL;
    else g = grid_new(b[0].buf, (size_t)(b[0].len / 8), b[1].buf, (size_t)(b[1].len / 8), b[2].buf, b[3].buf, nt,
                      b[4].buf, b[5].buf, b[6].buf, nr, src_delta, dst_delta, piece, &err);
    for (int i = 0; i < PLAN_ARRAYS; i++) PyBuffer_Release(&b[i]);
    if (g == NULL) {
        if (err == ENOMEM) PyErr_NoMemory();
        else PyErr_SetString(PyExc_ValueError, "inconsistent plan arrays");
    }
    return g;
}

/* copy_grid(*plan arrays, src_delta, dst_delta, mode, pid) -> errno: a small plan copied on this thread. */
static PyObject *py_copy_grid(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != PLAN_ARRAYS + 4) { PyErr_SetString(PyExc_TypeError, "copy_grid takes 11 arguments"); return NULL; }
    uint64_t src_delta = PyLong_AsUnsignedLongLongMask(args[7]), dst_delta = PyLong_AsUnsignedLongLongMask(args[8]);
    long mode = PyLong_AsLong(args[9]), pid = PyLong_AsLong(args[10]);
    if (PyErr_Occurred()) return NULL;
    grid *g = plan_grid(args, src_delta, dst_delta, 0);
    if (g == NULL) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = copy_grid_here(g, (int)mode, (int)pid);
    Py_END_ALLOW_THREADS
    free(g);
    return PyLong_FromLong(err);
}

/* submit_grid(pool, *plan arrays, src_delta, dst_delta, chunk, piece, mode, pid, streaming, notify_fd) -> job
 * handle: a plan queued in the pool; the caller keeps the run arrays alive until the job is reaped. */
static PyObject *py_submit_grid(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != PLAN_ARRAYS + 9) { PyErr_SetString(PyExc_TypeError, "submit_grid takes 16 arguments"); return NULL; }
    adt_pool *pool = PyLong_AsVoidPtr(args[0]);
    uint64_t src_delta = PyLong_AsUnsignedLongLongMask(args[8]), dst_delta = PyLong_AsUnsignedLongLongMask(args[9]);
    uint64_t chunk = PyLong_AsUnsignedLongLongMask(args[10]), piece = PyLong_AsUnsignedLongLongMask(args[11]);
    long mode = PyLong_AsLong(args[12]), pid = PyLong_AsLong(args[13]), streaming = PyLong_AsLong(args[14]);
    long fd = PyLong_AsLong(args[15]);
    if (PyErr_Occurred()) return NULL;
    if (pool == NULL || chunk == 0 || piece == 0) {
        PyErr_SetString(PyExc_ValueError, "submit_grid: no pool, or a zero chunk or piece");
        return NULL;
    }
    grid *g = plan_grid(args + 1, src_delta, dst_delta, piece);
    if (g == NULL) return NULL;
    adt_job *j = submit_grid(pool, g, chunk, (int)mode, (int)pid, (int)streaming, (int)fd);
    if (j == NULL) return PyErr_NoMemory();
    return PyLong_FromVoidPtr(j);
}

/* Append the span (s, d, l) to a descriptor table of n entries as pieces of at most `piece` bytes (only counted
 * without `out`): sources at out[0, n), destinations at out[n, 2n), lengths at out[2n, 3n). */
static inline void table_add(uint64_t *out, size_t n, size_t *k, uint64_t s, uint64_t d, uint64_t l, uint64_t piece,
                             uint64_t *longest)
{
    while (l) {
        uint64_t p = l < piece ? l : piece;
        if (out) { out[*k] = s; out[n + *k] = d; out[2 * n + *k] = p; }
        (*k)++;
        if (p > *longest) *longest = p;
        s += p; d += p; l -= p;
    }
}

/* A grid's spans tensor-major, merged where they continue each other on both sides (zero-length runs skipped), as
 * a descriptor table of n entries (see table_add; none written without `out`).  Returns the number of pieces;
 * *merged: the spans before cutting, *longest: the longest piece. */
static size_t table_walk(const grid *g, uint64_t *out, size_t n, size_t *merged, uint64_t *longest)
{
    size_t k = 0, m = 0;
    uint64_t cs = 0, cd = 0, cl = 0;
    *longest = 0;
    for (size_t t = 0; t < g->nt; t++) {
        for (size_t r = 0; r < g->nr; r++) {
            uint64_t l = g->run_len[r];
            if (!l) continue;
            uint64_t s = g->src_base[t] + g->run_src[r], d = g->dst_base[t] + g->run_dst[r];
            if (cl && cs + cl == s && cd + cl == d) { cl += l; continue; }
            if (cl) { table_add(out, n, &k, cs, cd, cl, g->piece, longest); m++; }
            cs = s; cd = d; cl = l;
        }
    }
    if (cl) { table_add(out, n, &k, cs, cd, cl, g->piece, longest); m++; }
    *merged = m;
    return k;
}

/* grid_table(*plan arrays, piece, out) -> (pieces, merged spans, longest piece): a plan's spans as the GPU copy
 * kernel's descriptor table, written into `out` (uint64, writable) when 3 x pieces fit, else nothing written. */
static PyObject *py_grid_table(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != PLAN_ARRAYS + 2) { PyErr_SetString(PyExc_TypeError, "grid_table takes 9 arguments"); return NULL; }
    uint64_t piece = PyLong_AsUnsignedLongLongMask(args[PLAN_ARRAYS]);
    if (PyErr_Occurred()) return NULL;
    if (piece == 0) { PyErr_SetString(PyExc_ValueError, "grid_table: a zero piece"); return NULL; }
    Py_buffer out;
    if (PyObject_GetBuffer(args[PLAN_ARRAYS + 1], &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (out.itemsize != 8) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "grid_table: out holds 8-byte integers");
        return NULL;
    }
    grid *g = plan_grid(args, 0, 0, piece);
    if (g == NULL) { PyBuffer_Release(&out); return NULL; }
    size_t merged = 0;
    uint64_t longest = 0;
    size_t n = table_walk(g, NULL, 0, &merged, &longest);
    if (n && 3 * n <= (size_t)(out.len / 8)) table_walk(g, out.buf, n, &merged, &longest);
    free(g);
    PyBuffer_Release(&out);
    return Py_BuildValue("(nnK)", (Py_ssize_t)n, (Py_ssize_t)merged, (unsigned long long)longest);
}

/* A job handle given as a Python int; NULL with an exception set (``what``: the caller's name) if there is none. */
static void *job_arg(PyObject *arg, const char *what)
{
    void *job = PyLong_AsVoidPtr(arg);
    if (job == NULL && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: no job", what);
    return job;
}

/* reap(job) -> None while workers may touch the job, else (state, errno) with the job freed (the handle is then
 * invalid): state 1 = done, 2 = stopped (see JobState). */
static PyObject *py_reap(PyObject *self, PyObject *arg)
{
    (void)self;
    adt_job *j = job_arg(arg, "reap");
    if (j == NULL) return NULL;
    if (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) Py_RETURN_NONE;
    int state = __atomic_load_n(&j->stop, __ATOMIC_RELAXED) ? 2 : 1, err = j->error;
    adt_job_free(j);
    return Py_BuildValue("(ii)", state, err);
}

/* int_bounds(seq) -> (min, max) of a list or tuple of exact ints that fit an int64, else None (empty, another type
 * of item, bool included, or a bigger int: the caller's checks then look at each item).  Block lists are checked on
 * every call; this is their fast path. */
static PyObject *py_int_bounds(PyObject *self, PyObject *seq)
{
    (void)self;
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (n == 0) Py_RETURN_NONE;
    long long lo = 0, hi = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i])) Py_RETURN_NONE;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) Py_RETURN_NONE;
        if (i == 0 || v < lo) lo = v;
        if (i == 0 || v > hi) hi = v;
    }
    return Py_BuildValue("(LL)", lo, hi);
}

/* The TCP plane's one-sided calls (_net.c), called as Python functions for the same reason as the plan functions:
 * net_read and net_write(net, key, row, stamp, cache_id, model_id, remote_bases, remote_offsets, lengths,
 * local_bases, local_offsets) -> job handle (0: out of memory).  Both name both sides as grids of the same runs: the
 * owner's tensors' bases and the runs' offsets there, the runs' lengths, this side's tensors' bases and the runs'
 * offsets here (tensor t's run r pairs with tensor t's run r); the arrays (8-byte items) are copied by the callee. */
void *adt_net_read(void *net, uint64_t key, int64_t row, uint64_t stamp, uint64_t cache_id, int64_t model_id,
                   const uint64_t *bases, size_t ntensors, const uint64_t *offsets, const uint64_t *lengths,
                   size_t nruns, const uint64_t *local_bases, const uint64_t *local_offsets, int defer);
void *adt_net_write(void *net, uint64_t key, int64_t row, uint64_t stamp, uint64_t cache_id, int64_t model_id,
                    const uint64_t *remote_bases, size_t nt, const uint64_t *remote_offs, const uint64_t *lens,
                    size_t nr, const uint64_t *local_bases, const uint64_t *local_offs);
void *adt_net_send(void *net, uint64_t key, const uint64_t *bases, size_t nt, const uint64_t *offs,
                   const uint64_t *lens, size_t nr);
int adt_net_set_destination(void *net, void *job, const uint64_t *bases, size_t nt, const uint64_t *offs,
                            const uint64_t *lens, size_t nr);
int adt_net_job_state(void *net, void *job, int *error, int *status);
void adt_net_job_free(void *job);
int adt_net_job_done(void *job);

/* Take `count` grid arrays (C-contiguous, 8-byte items); -1 with an exception (none held then). */
static int grid_buffers(PyObject *const *args, int count, Py_buffer *b)
{
    for (int i = 0; i < count; i++) {
        if (PyObject_GetBuffer(args[i], &b[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 || b[i].itemsize != 8) {
            if (!PyErr_Occurred()) {
                PyBuffer_Release(&b[i]);
                PyErr_SetString(PyExc_ValueError, "grid arrays hold 8-byte ints");
            }
            while (--i >= 0) PyBuffer_Release(&b[i]);
            return -1;
        }
    }
    return 0;
}

static void release_buffers(Py_buffer *b, int count)
{
    for (int i = 0; i < count; i++) PyBuffer_Release(&b[i]);
}

static PyObject *net_one_sided(PyObject *const *args, Py_ssize_t nargs, int write)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, write ? "net_write takes 11 arguments" : "net_read takes 11 arguments");
        return NULL;
    }
    void *net = PyLong_AsVoidPtr(args[0]);
    uint64_t key = PyLong_AsUnsignedLongLongMask(args[1]), stamp = PyLong_AsUnsignedLongLongMask(args[3]);
    uint64_t cache_id = PyLong_AsUnsignedLongLongMask(args[4]);
    long long row = PyLong_AsLongLong(args[2]), model = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (net == NULL) { PyErr_SetString(PyExc_ValueError, "no data plane"); return NULL; }
    Py_buffer b[5];   /* remote bases, remote offsets, lengths, local bases, local offsets */
    if (grid_buffers(args + 6, 5, b) < 0) return NULL;
    size_t nt = (size_t)(b[0].len / 8), nr = (size_t)(b[1].len / 8);
    void *job = NULL;
    if ((size_t)(b[2].len / 8) != nr || (size_t)(b[3].len / 8) != nt || (size_t)(b[4].len / 8) != nr)
        PyErr_SetString(PyExc_ValueError, "grid arrays of different lengths");
    else if (write)
        job = adt_net_write(net, key, (int64_t)row, stamp, cache_id, (int64_t)model, b[0].buf, nt, b[1].buf,
                            b[2].buf, nr, b[3].buf, b[4].buf);
    else
        job = adt_net_read(net, key, (int64_t)row, stamp, cache_id, (int64_t)model, b[0].buf, nt, b[1].buf,
                           b[2].buf, nr, b[3].buf, b[4].buf, 1);
    release_buffers(b, 5);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromVoidPtr(job);
}

/* The two-sided calls, with one side as a grid (bases, offsets, lengths; see net_read):
 * net_send(net, key, bases, offsets, lengths) -> job handle (0: out of memory), and
 * net_set_destination(net, job, bases, offsets, lengths) -> 0 or ENOMEM. */
static PyObject *net_two_sided(PyObject *const *args, Py_ssize_t nargs, int send)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, send ? "net_send takes 5 arguments" : "net_set_destination takes 5 arguments");
        return NULL;
    }
    void *net = PyLong_AsVoidPtr(args[0]);
    uint64_t key = send ? PyLong_AsUnsignedLongLongMask(args[1]) : 0;
    void *job = send ? NULL : PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (net == NULL || (!send && job == NULL)) { PyErr_SetString(PyExc_ValueError, "no data plane or job"); return NULL; }
    Py_buffer b[3];   /* bases, offsets, lengths */
    if (grid_buffers(args + 2, 3, b) < 0) return NULL;
    size_t nt = (size_t)(b[0].len / 8), nr = (size_t)(b[1].len / 8);
    PyObject *out = NULL;
    if ((size_t)(b[2].len / 8) != nr) PyErr_SetString(PyExc_ValueError, "grid arrays of different lengths");
    else if (send) out = PyLong_FromVoidPtr(adt_net_send(net, key, b[0].buf, nt, b[1].buf, b[2].buf, nr));
    else out = PyLong_FromLong(adt_net_set_destination(net, job, b[0].buf, nt, b[1].buf, b[2].buf, nr));
    release_buffers(b, 3);
    return out;
}

static PyObject *py_net_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return net_two_sided(args, nargs, 1);
}

static PyObject *py_net_set_destination(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return net_two_sided(args, nargs, 0);
}

static PyObject *py_net_read(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return net_one_sided(args, nargs, 0);
}

static PyObject *py_net_write(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return net_one_sided(args, nargs, 1);
}

/* net_reap(net, job) -> (state, errno, owner status), the job freed: for a job its I/O threads announced ended. */
static PyObject *py_net_reap(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "net_reap takes 2 arguments"); return NULL; }
    void *net = PyLong_AsVoidPtr(args[0]), *job = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (net == NULL || job == NULL) { PyErr_SetString(PyExc_ValueError, "net_reap: no plane or job"); return NULL; }
    int err = 0, status = 0, state = adt_net_job_state(net, job, &err, &status);
    adt_net_job_free(job);
    return Py_BuildValue("(iii)", state, err, status);
}

/* net_done(job) -> whether a TCP job ended (then net_reap gives its outcome); for a job not reaped yet. */
static PyObject *py_net_done(PyObject *self, PyObject *arg)
{
    (void)self;
    void *job = job_arg(arg, "net_done");
    return job == NULL ? NULL : PyBool_FromLong(adt_net_job_done(job));
}

/* ---------------------------------------------------------------------------------------------------------
 * CUDA driver calls of a GPU copy's launch and completion, made here instead of through ctypes: the driver's
 * functions (found by ctypes in the loaded libcuda) are called with the arguments as plain ints, and the device's
 * context made current first when it is not (what Device.make_current does).  Each returns the CUresult, plus
 * CTX_FAILED when setting the context failed (then nothing else was called).
 * --------------------------------------------------------------------------------------------------------- */
typedef int (*cu_ctx_get_fn)(void **);
typedef int (*cu_ctx_set_fn)(void *);
typedef int (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                            void **, void **);
typedef int (*cu_record_fn)(void *, void *);
typedef int (*cu_query_fn)(void *);
typedef int (*cu_htod_fn)(uint64_t, const void *, size_t, void *);

typedef struct {
    cu_ctx_get_fn get_current;
    cu_ctx_set_fn set_current;
    cu_launch_fn launch;
    cu_record_fn record;
    cu_query_fn query;
    cu_htod_fn htod;
} cuda_fns;

#define CTX_FAILED (1L << 20)
#define STAGE_FAILED (1L << 21)
#define CUDA_FNS "aiodatadist.cuda_fns"

static void cuda_fns_free(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, CUDA_FNS)); }

/* cuda_bind(cuCtxGetCurrent, cuCtxSetCurrent, cuLaunchKernel, cuEventRecord, cuEventQuery, cuMemcpyHtoDAsync_v2)
 * -> a capsule. */
static PyObject *py_cuda_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "cuda_bind takes 6 function addresses"); return NULL; }
    void *f[6];
    for (int i = 0; i < 6; i++) {
        f[i] = PyLong_AsVoidPtr(args[i]);
        if (!f[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a CUDA function address is NULL");
            return NULL;
        }
    }
    cuda_fns *fns = PyMem_Malloc(sizeof *fns);
    if (!fns) return PyErr_NoMemory();
    fns->get_current = (cu_ctx_get_fn)f[0]; fns->set_current = (cu_ctx_set_fn)f[1];
    fns->launch = (cu_launch_fn)f[2]; fns->record = (cu_record_fn)f[3]; fns->query = (cu_query_fn)f[4];
    fns->htod = (cu_htod_fn)f[5];
    PyObject *capsule = PyCapsule_New(fns, CUDA_FNS, cuda_fns_free);
    if (!capsule) PyMem_Free(fns);
    return capsule;
}

/* The driver functions of a capsule and the context, after making the context current on this thread. */
static cuda_fns *cuda_enter(PyObject *const *args, long *failed)
{
    cuda_fns *fns = PyCapsule_GetPointer(args[0], CUDA_FNS);
    if (!fns) return NULL;
    void *ctx = PyLong_AsVoidPtr(args[1]), *current = NULL;
    if (!ctx && PyErr_Occurred()) return NULL;
    *failed = 0;
    if (fns->get_current(&current) != 0 || current != ctx) {
        int r = fns->set_current(ctx);
        if (r) *failed = CTX_FAILED | r;
    }
    return fns;
}

static int as_uint(PyObject *o, unsigned *out)
{
    unsigned long v = PyLong_AsUnsignedLong(o);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return -1;
    if (v > 0xffffffffUL) { PyErr_SetString(PyExc_OverflowError, "launch dimension out of range"); return -1; }
    *out = (unsigned)v;
    return 0;
}

/* cuda_launch(fns, ctx, function, grid, block, stream, params[, table, nbytes, host, dev]) -> CUresult:
 * cuLaunchKernel of a 1-D grid; with a table (an object with the buffer protocol, e.g. a C-contiguous array), its
 * first nbytes are copied to the page-locked staging buffer at host and from there to the device at dev, on the
 * stream (cuMemcpyHtoDAsync_v2; STAGE_FAILED plus its CUresult when that failed, and nothing was launched). */
static PyObject *py_cuda_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 && nargs != 11) { PyErr_SetString(PyExc_TypeError, "cuda_launch takes 7 or 11 arguments"); return NULL; }
    unsigned grid, block;
    void *function = PyLong_AsVoidPtr(args[2]), *stream = PyLong_AsVoidPtr(args[5]);
    void **params = (void **)PyLong_AsVoidPtr(args[6]);
    void *host = NULL;
    size_t nbytes = 0;
    uint64_t dev = 0;
    if (nargs == 11) {
        nbytes = PyLong_AsSize_t(args[8]);
        host = PyLong_AsVoidPtr(args[9]);
        dev = (uint64_t)PyLong_AsUnsignedLongLong(args[10]);
    }
    if (PyErr_Occurred() || as_uint(args[3], &grid) || as_uint(args[4], &block)) return NULL;
    Py_buffer table = {0};
    if (nbytes) {
        if (!host) { PyErr_SetString(PyExc_ValueError, "a table to stage needs a staging buffer"); return NULL; }
        if (PyObject_GetBuffer(args[7], &table, PyBUF_SIMPLE) < 0) return NULL;
        if ((size_t)table.len < nbytes) {
            PyBuffer_Release(&table);
            PyErr_SetString(PyExc_ValueError, "the table is shorter than the bytes to stage");
            return NULL;
        }
    }
    long failed, result;
    cuda_fns *fns = cuda_enter(args, &failed);
    if (!fns) result = -1;
    else if (failed) result = failed;
    else {
        int r = 0;
        if (nbytes) {
            memcpy(host, table.buf, nbytes);
            r = fns->htod(dev, host, nbytes, stream);
        }
        result = r ? STAGE_FAILED | r : fns->launch(function, grid, 1, 1, block, 1, 1, 0, stream, params, NULL);
    }
    if (nbytes) PyBuffer_Release(&table);
    return result == -1 ? NULL : PyLong_FromLong(result);
}

/* cuda_record(fns, ctx, event, stream) -> CUresult of cuEventRecord. */
static PyObject *py_cuda_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "cuda_record takes 4 arguments"); return NULL; }
    void *event = PyLong_AsVoidPtr(args[2]), *stream = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    long failed;
    cuda_fns *fns = cuda_enter(args, &failed);
    if (!fns) return NULL;
    return PyLong_FromLong(failed ? failed : fns->record(event, stream));
}

/* cuda_query(fns, ctx, event) -> CUresult of cuEventQuery (CUDA_ERROR_NOT_READY while the work before it runs). */
static PyObject *py_cuda_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "cuda_query takes 3 arguments"); return NULL; }
    void *event = PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) return NULL;
    long failed;
    cuda_fns *fns = cuda_enter(args, &failed);
    if (!fns) return NULL;
    return PyLong_FromLong(failed ? failed : fns->query(event));
}

static PyMethodDef native_methods[] = {
    {"copy_grid", (PyCFunction)(void (*)(void))py_copy_grid, METH_FASTCALL, "A small plan copied on this thread."},
    {"submit_grid", (PyCFunction)(void (*)(void))py_submit_grid, METH_FASTCALL, "A plan queued in a copy pool."},
    {"grid_table", (PyCFunction)(void (*)(void))py_grid_table, METH_FASTCALL, "A plan as a GPU descriptor table."},
    {"reap", py_reap, METH_O, "A finished job's (state, errno), freeing it; None while it runs."},
    {"int_bounds", py_int_bounds, METH_O, "(min, max) of a list or tuple of int64 ints, else None."},
    {"net_read", (PyCFunction)(void (*)(void))py_net_read, METH_FASTCALL, "A one-sided TCP read (deferred)."},
    {"net_write", (PyCFunction)(void (*)(void))py_net_write, METH_FASTCALL, "A one-sided TCP write."},
    {"net_send", (PyCFunction)(void (*)(void))py_net_send, METH_FASTCALL, "A two-sided TCP send of a grid."},
    {"net_set_destination", (PyCFunction)(void (*)(void))py_net_set_destination, METH_FASTCALL,
     "A two-sided TCP receive's destination grid."},
    {"net_reap", (PyCFunction)(void (*)(void))py_net_reap, METH_FASTCALL, "An ended TCP job's state, freeing it."},
    {"net_done", py_net_done, METH_O, "Whether a TCP job ended."},
    {"cuda_bind", (PyCFunction)(void (*)(void))py_cuda_bind, METH_FASTCALL, "CUDA driver functions, bound."},
    {"cuda_launch", (PyCFunction)(void (*)(void))py_cuda_launch, METH_FASTCALL, "cuLaunchKernel of a 1-D grid."},
    {"cuda_record", (PyCFunction)(void (*)(void))py_cuda_record, METH_FASTCALL, "cuEventRecord."},
    {"cuda_query", (PyCFunction)(void (*)(void))py_cuda_query, METH_FASTCALL, "cuEventQuery."},
    {NULL, NULL, 0, NULL},
};

/* Importable as a module so that the build and the loader can find it; the rest is used through ctypes. */
static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "_native", "aiodatadist span copier", -1,
                                           native_methods};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
