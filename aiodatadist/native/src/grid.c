/* A plan's (tensor x run) grid: span (t, r) copies run_len[r] bytes from src_base[t] + run_src[r] + src_delta to
 * dst_base[t] + run_dst[r] + dst_delta, tensor-major.  Its spans in that order form a byte stream; a grid job's
 * chunks (pool.c) are byte ranges of it, which workers walk themselves (no span list is built: the caller does no
 * per-span work and submitting costs the same for 64 spans or 8192).  Spans that continue each other on both
 * sides are merged, runs longer than `piece` are copied piece by piece, and the stop flag is polled between pieces
 * (and every 64 tiny spans).  The same walk lists a grid as the GPU copy kernel's descriptor table.
 */
#include "adt.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/uio.h>

struct adt_grid {
    const uint64_t *src_base, *dst_base, *run_src, *run_dst, *run_len;   /* kept alive by the caller */
    uint64_t *prefix;                  /* nr + 1 running sums of run_len (in the grid's memory) */
    size_t nt, nr;
    uint64_t src_delta, dst_delta, per_tensor, total, piece;
};

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
            if (c->streaming && k >= 4096 ? adt_lanes_add(&c->lanes, dp, sp, (size_t)k, 0, c->stop)
                                          : adt_copy_after_lanes(&c->lanes, dp, sp, (size_t)k, c->stop))
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

/* After a tensor's last run: on to the next tensor's first (its bases in *sb, *db); 0 when that was the last. */
static inline int next_tensor(const adt_grid *g, size_t *r, size_t *t, uint64_t *sb, uint64_t *db)
{
    *r = 0;
    if (++*t == g->nt) return 0;
    *sb = g->src_base[*t] + g->src_delta; *db = g->dst_base[*t] + g->dst_delta;
    return 1;
}

/* Where byte b0 (< total) of a grid's stream is: tensor *t, run *r, *off bytes into it; that tensor's source and
 * destination bases (deltas added) in *sb and *db. */
static inline void grid_locate(const adt_grid *g, uint64_t b0, size_t *t, size_t *r, uint64_t *off, uint64_t *sb,
                               uint64_t *db)
{
    *t = (size_t)(b0 / g->per_tensor);
    uint64_t rem = b0 - (uint64_t)*t * g->per_tensor;
    *r = run_at(g->prefix, g->nr, rem);
    *off = rem - g->prefix[*r];
    *sb = g->src_base[*t] + g->src_delta;
    *db = g->dst_base[*t] + g->dst_delta;
}

/* Copy bytes [b0, b1) of the grid's stream: 0, an errno, or -1 when stopped.  Not inlined into its one caller
 * (adt_grid_copy), here and in grid_read_range: the walk then compiles to the code it had with a caller per use,
 * whereas inlined, its loop over tiny runs took a few percent longer (copy_grid of 8192 runs of 64 bytes). */
__attribute__((noinline)) static int grid_copy_range(const adt_grid *g, uint64_t b0, uint64_t b1, copier *c)
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
            if (c->lanes.k && adt_lanes_run(&c->lanes, 1, stop)) return -1;   /* the copies below ignore the lanes */
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
static read_group group_at(const adt_grid *g, size_t r, uint64_t off, uint64_t pos, uint64_t b1, uint64_t sb)
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
static int cover_flush(cover_batch *cb, const adt_grid *g, uint64_t b1, int pid)
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
__attribute__((noinline)) static int grid_read_range(const adt_grid *g, uint64_t b0, uint64_t b1, copier *c)
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
static int grid_move_range(const adt_grid *g, uint64_t b0, uint64_t b1, copier *c)
{
    return c->mode == 1 ? grid_read_range(g, b0, b1, c) : grid_copy_range(g, b0, b1, c);
}

/* A grid of nt tensor pairs: pair k copies tensor src_tensor[k] of src_addrs (na addresses) to tensor dst_tensor[k]
 * of dst_addrs (nb).  The pairs' base addresses are gathered into the grid's own memory, so the caller keeps only
 * the run arrays alive.  NULL with *err = EINVAL (an index out of range) or ENOMEM. */
adt_grid *adt_grid_new(const uint64_t *src_addrs, size_t na, const uint64_t *dst_addrs, size_t nb,
                       const int64_t *src_tensor, const int64_t *dst_tensor, size_t nt, const uint64_t *run_src,
                       const uint64_t *run_dst, const uint64_t *run_len, size_t nr, uint64_t src_delta,
                       uint64_t dst_delta, uint64_t piece, int *err)
{
    adt_grid *g = malloc(sizeof *g + (nr + 1 + 2 * nt) * sizeof(uint64_t));
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
    *g = (adt_grid){bases, bases + nt, run_src, run_dst, run_len, prefix, nt, nr, src_delta, dst_delta,
                    prefix[nr], prefix[nr] * (uint64_t)nt, piece ? piece : (1u << 20)};
    return g;
}

void adt_grid_free(adt_grid *g) { free(g); }

/* The bytes of a grid's stream. */
uint64_t adt_grid_bytes(const adt_grid *g) { return g->total; }

/* Copy bytes [b0, b1) of a grid's stream on this thread: mode 0 within this process (`streaming` as adt_copy_spans
 * takes it), 1 and 2 from and to process `pid`; stop may be NULL.  0, an errno (EFAULT: a remote range is not
 * mapped, or not any more), or -1 when stopped. */
int adt_grid_copy(const adt_grid *g, uint64_t b0, uint64_t b1, int mode, int pid, int streaming,
                  const volatile int32_t *stop)
{
    copier *cp = malloc(sizeof *cp);
    if (!cp) return ENOMEM;
    cp->k = 0; cp->want = 0; cp->mode = mode; cp->pid = pid; cp->streaming = streaming;
    cp->stop = stop; cp->lanes = adt_lanes_for(streaming);
    int err = grid_move_range(g, b0, b1, cp);
    if (!err && cp->lanes.k) err = adt_lanes_run(&cp->lanes, 1, cp->stop);
    if (mode == 0 && streaming) STREAM_FENCE();
    free(cp);
    return err;
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
static size_t table_walk(const adt_grid *g, uint64_t *out, size_t n, size_t *merged, uint64_t *longest)
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

/* A grid's spans as the GPU copy kernel's descriptor table (see table_walk), written into `out` when its 3 x pieces
 * fit in `words`, else nothing written.  Returns the number of pieces (*merged, *longest: as table_walk's). */
size_t adt_grid_table(const adt_grid *g, uint64_t *out, size_t words, size_t *merged, uint64_t *longest)
{
    size_t n = table_walk(g, NULL, 0, merged, longest);
    if (n && 3 * n <= words) table_walk(g, out, n, merged, longest);
    return n;
}
