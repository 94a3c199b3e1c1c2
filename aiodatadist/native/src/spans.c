/* The span copier: adt_copy_spans copies n spans dst[i] <- src[i] of len[i] bytes, checking a stop flag between
 * spans, so that one call can cover many spans and still stop promptly.  With `streaming` set, spans of 4 KiB and
 * more use non-temporal stores: bulk KV-cache transfers are far bigger than the caches, and skipping the
 * read-for-ownership of the destination is what makes scattered 32 KiB blocks copy as fast as one big memcpy.
 * Streaming spans are copied several at once (lanes, adt.h).  The grid walks (grid.c) queue their spans on the
 * same lanes; the measurements of the copy paths (adt_stream_copy_limit, adt_streaming_beats_cache) are here too.
 */
#include "adt.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

static int lane_count = 4;   /* adt_stream_lanes */

/* One lanes_step per store width: m bytes (whole lines) of every lane, a line of each in turn.  The full set of
 * four is unrolled with its pointers in registers: fewer instructions per line let the core keep more lines in
 * flight (the pool's paged copy of 64 x 128 scattered 32 KiB blocks, in one process, three pairs of processes in
 * turn with the loop over lanes: 19.2-21.1 -> 19.7-22.1 GB/s). */
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

static int chosen_width = 16;   /* bytes per streaming store, as chosen when the library loaded */

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
int adt_lanes_run(lanes *b, int all, const volatile int32_t *stop)
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
int adt_lanes_add(lanes *b, char *d, const char *s, size_t n, size_t id, const volatile int32_t *stop)
{
    if (b->k && lanes_conflict(b, d, s, n) && adt_lanes_run(b, 1, stop)) return -1;
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
    return ++b->k >= b->cap ? adt_lanes_run(b, 0, stop) : 0;
}

/* A plain copy of d <- s after the lanes it could conflict with (run first). */
int adt_copy_after_lanes(lanes *b, char *d, const char *s, size_t n, const volatile int32_t *stop)
{
    if (b->k && lanes_conflict(b, d, s, n) && adt_lanes_run(b, 1, stop)) return -1;
    if (!copy_small(d, s, n)) memmove(d, s, n);
    return 0;
}

/* The lanes of a streaming copy (`streaming` as adt_copy_spans takes it: 1 or 2). */
lanes adt_lanes_for(int streaming)
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
    lanes b = adt_lanes_for(streaming);
    size_t i;
    int stopped = 0;
    for (i = 0; i < n && !stopped; i++) {
        if (stop && *stop) break;
        char *d = (char *)(uintptr_t)dst[i];
        const char *s = (const char *)(uintptr_t)src[i];
        if (streaming && len[i] >= 4096) {
            stopped = adt_lanes_add(&b, d, s, (size_t)len[i], i, stop);
        } else
            stopped = adt_copy_after_lanes(&b, d, s, (size_t)len[i], stop);
    }
    if (!stopped && !(stop && *stop) && b.k) stopped = adt_lanes_run(&b, 1, stop);
    if (streaming) STREAM_FENCE();
    size_t copied = stopped ? i - 1 : i;   /* the span being queued when the stop came may be incomplete */
    for (int q = 0; q < b.k; q++) if (b.id[q] < copied) copied = b.id[q];
    return (long)copied;
}

/* A streaming copy of n bytes on this thread (`streaming`: 1, split into lanes where long enough, or 2, one
 * stream); 0, or -1 when stopped. */
static int stream_lanes(char *d, const char *s, size_t n, int streaming, const volatile int32_t *stop)
{
    lanes b = adt_lanes_for(streaming);
    if (adt_lanes_add(&b, d, s, n, 0, stop) || adt_lanes_run(&b, 1, stop)) return -1;
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
