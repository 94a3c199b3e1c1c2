/* The native TCP data plane of one link: connections, their I/O threads and the transfers on them.
 *
 * Every connection has a receiver thread and a sender thread; none of them ever touches Python.  Frames start
 * with a fixed header (adt_hdr).  Transfers are jobs keyed by (flag, transfer id):
 *   - a receive job owns destination spans; DATA frames carry a slice of its byte stream (offset, length) and
 *     land straight in the spans (scatter recvmsg);
 *   - a send job owns its source as a grid (a list of spans is a grid of one tensor), whose byte stream is cut
 *     into frames of at most `frame` bytes; the sender of a frame walks the grid straight into its iovecs and
 *     bounce buffer (no span list is built).  Sender threads take frames round-robin across send jobs, so
 *     concurrent transfers share every connection fairly;
 *   - a one-sided READ (pull by a resolved key) registers a receive job and queues a READ frame naming the
 *     owner's spans as a grid (the owner's tensor bases, the runs' offsets and lengths: a few words however many
 *     spans); the owner's receiver thread validates every span against its cache directory (live
 *     stamp, spans inside the cache's memory: its segment, or each of its tensors) and queues a *serve* job that sends them back as DATA frames, with no Python
 *     and no control-plane round trip on the owner.  A serve job re-checks the stamp before each frame and
 *     marks the row busy while reading it, so a release (adt_dir_withdraw) waits for at most one frame (bounded).
 * A job's end is announced by writing its address to the link's notify pipe (as for the copy pool).
 *
 * A *staged* job's memory is device memory (a DEVICE cache): its bytes go through the link's staging ring of
 * that direction (stage.c).  The sender of a staged send gathers each frame into a slot with one launch, polls
 * the copy's event and sends the slot (frames are then at most a slot long); with a second slot it gathers the
 * job's next frame while the first is on the wire.  A receiver takes a staged frame into slots piece by piece and
 * scatters each into the destination with one launch, receiving the next piece while the last one is scattered;
 * the frame counts as landed only once every scatter of it is done, so a stopped job ends only after the device
 * stopped writing for it.  A failed device copy fails the job with STATUS_DEVICE (and the runtime's code), and
 * tells the peer with an ERROR frame; nothing of the frame goes on the wire.
 */
#include "adt.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define NET_MAGIC 0xADD7F4A4u
#define T_DATA 1u
#define T_READ 2u
#define T_ERROR 3u
#define T_ABORT 4u
#define T_FENCE 5u           /* a cut-short send: "no more frames of this key follow on this connection" */
#define T_FENCE_ACK 6u       /* the receiving end: "nothing of this key is written from that connection any more" */
#define T_WRITE 7u           /* one-sided push: owner-side spans and their bytes, validated against the directory */
#define T_WRITE_ACK 8u       /* the owner: a WRITE's bytes landed (offset: how many) */
#define MAX_CONNS 16
#define MAX_READ_SPANS (1u << 20)
#define SCRATCH (1u << 20)
#define STOP_POLL_MS 5       /* a receiver waiting mid-frame for a stalled peer looks at its job's stop this often */
#define CTRL_BATCH 64        /* control frames a sender thread sends in one sendmsg */
#define DIR_WORDS 9          /* directory row: stamp, cache id, model id, tensor table, base, size, busy, tensors,
                              * flags */
#define DIR_DEVICE 1         /* flags: the row's memory is device memory (served through the staging rings) */
#define STATUS_DEVICE 4      /* a device copy failed (a job's status: this, plus the runtime's code << 8 locally) */

/* A READ's payload: words model id (-1: any), ntensors, nruns, then the owner's tensor bases [ntensors], the runs'
 * offsets [nruns] and lengths [nruns].  Its spans, in stream order: base[t] + offset[r], length[r] for each t, then
 * each r (the plan's order, as the requester's own spans). */
#define READ_HEAD 3

typedef struct {
    uint32_t magic, type;
    uint64_t key;            /* flag << 63 | transfer id */
    uint64_t offset;         /* DATA: stream offset; READ, WRITE: stamp; ERROR: status code; WRITE_ACK: bytes */
    uint64_t length;         /* DATA: payload bytes; READ: grid bytes; WRITE: span list and data bytes */
    uint64_t a, b;           /* READ, WRITE: directory row, cache id */
} adt_hdr;

typedef struct net_job {
    int kind;                /* 0 receive, 1 send, 2 serve (a send for a peer's READ) */
    uint64_t key;
    uint64_t *addr, *len, *ends;   /* receive: the destination spans and their running ends */
    size_t n;
    /* send, serve: the source, a grid (bases[t] + offs[r], lens[r] bytes for each tensor t then each run r; a list
     * of spans is a grid of one tensor at 0) walked by the sender of each frame; frame f is bytes
     * [f * frame_bytes, (f + 1) * frame_bytes) of its stream.  gmem: the memory the grid lives in (the job's). */
    const uint64_t *bases, *offs, *lens;
    size_t nt, nr;
    uint64_t *prefix, *gmem;         /* prefix: the nr + 1 running sums of lens */
    uint64_t frame_bytes;
    size_t nframes, next_frame;
    uint64_t total, moved;
    int ready;               /* receive: spans known */
    int staged;              /* its memory is device memory, moved through the staging ring (send or receive) */
    volatile int32_t stop;
    int inflight, done, error, status;
    int64_t row; uint64_t stamp;  /* serve: the directory entry it reads */
    int fence;               /* send: 1 fence requested, 2 FENCE frames queued; fence_left: acks still awaited */
    int fence_left;
    uint8_t **wframe;        /* one-sided write: per frame, its header, the model id, span count and owner spans */
    size_t *wframe_len;
    uint64_t acked;          /* one-sided write: bytes the owner confirmed (WRITE_ACK) */
    struct net_job *next_tx, *next_all;
} net_job;

typedef struct ctrl_frame { adt_hdr h; uint8_t *payload; size_t plen; int conn; struct ctrl_frame *next; } ctrl_frame;

typedef struct adt_net {
    pthread_mutex_t lock;
    pthread_cond_t work;     /* senders: frames or control frames to send */
    pthread_cond_t ready;    /* receivers: a receive job got its spans */
    int notify_fd;
    int64_t *dir; size_t dir_rows;    /* this process's cache directory (serving READs); NULL: none */
    uint64_t frame;
    int nconns, closed, next_conn;
    int fds[MAX_CONNS];
    pthread_mutex_t send_lock[MAX_CONNS];   /* one writer per connection: its sender thread, or an inline READ */
    pthread_t threads[2 * MAX_CONNS];
    int nthreads;
    net_job *tx_head, *tx_tail;      /* send and serve jobs with frames left, round-robin */
    net_job *all;                    /* every live job */
    ctrl_frame *ctrl_head, *ctrl_tail;
    int live_rx;                     /* receive jobs not ended yet (an inline READ only when it is the only one) */
    int ctrl_any, ctrl_for[MAX_CONNS];   /* queued control frames for any connection, for connection i */
    uint64_t served[6];              /* one-sided READs of our caches: accepted, their bytes, refused; WRITEs: same */
    adt_stage *stage[2];             /* the staging rings for sending and receiving device memory (NULL: none) */
} adt_net;

static void net_announce(int fd, net_job *j)
{
    uint64_t id = (uint64_t)(uintptr_t)j;
    ssize_t r;
    do { r = write(fd, &id, sizeof id); } while (r < 0 && errno == EINTR);
}

/* ---- jobs (under n->lock) ---- */

static net_job *find(adt_net *n, uint64_t key, int kind)
{
    for (net_job *j = n->all; j; j = j->next_all)
        if (j->key == key && j->kind == kind && !j->done) return j;
    return NULL;
}

static void unlink_all(adt_net *n, net_job *j)
{
    for (net_job **p = &n->all; *p; p = &(*p)->next_all)
        if (*p == j) { *p = j->next_all; return; }
}

static void unqueue(adt_net *n, net_job *j)
{
    net_job *prev = NULL;
    for (net_job *p = n->tx_head; p; prev = p, p = p->next_tx)
        if (p == j) {
            if (prev) prev->next_tx = p->next_tx; else n->tx_head = p->next_tx;
            if (n->tx_tail == p) n->tx_tail = prev;
            p->next_tx = NULL;
            return;
        }
}

static void enqueue(adt_net *n, net_job *j)   /* one sender is woken: any of them sends any job's frame */
{
    j->next_tx = NULL;
    if (n->tx_tail) n->tx_tail->next_tx = j; else n->tx_head = j;
    n->tx_tail = j;
    pthread_cond_signal(&n->work);
}

static void queue_ctrl_to(adt_net *n, int conn, uint32_t type, uint64_t key, uint64_t offset, uint8_t *payload,
                          size_t plen, uint64_t a, uint64_t b);

/* Ends the job once nothing runs on it: all bytes moved, or stopped. Returns 1 if it must be announced. */
static int finish_if_idle(adt_net *n, net_job *j)
{
    if (j->done || j->inflight) return 0;
    int finished;
    if (j->kind == 0) finished = j->stop || (j->ready && j->moved >= j->total);
    else finished = j->stop || (j->next_frame >= j->nframes && (!j->wframe || j->acked >= j->total));
    if (!finished) return 0;
    if (j->fence == 1 && !n->closed) {
        /* A stopped send: each connection carries a FENCE after the last frame of it that was sent there (none is
         * in flight now); the job ends once the peer acknowledged every one, i.e. nothing of it lands any more. */
        j->fence = 2;
        j->fence_left = n->nconns;
        for (int c = 0; c < n->nconns; c++) queue_ctrl_to(n, c, T_FENCE, j->key, 0, NULL, 0, 0, 0);
    }
    if (j->fence == 2 && j->fence_left > 0 && !n->closed) return 0;
    __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);   /* adt_net_job_done reads it without the lock */
    if (j->kind == 0) n->live_rx--;
    unqueue(n, j);
    unlink_all(n, j);
    return j->kind != 2;     /* serve jobs belong to the helper, nobody waits for them */
}

/* After finish_if_idle returned 1, outside the lock.  The job may be freed already (its waiter saw it done:
 * adt_net_job_done), so only its address is used here. */
static void end_job(adt_net *n, net_job *j)
{
    net_announce(n->notify_fd, j);
}

static void free_job(net_job *j)
{
    if (!j) return;
    free(j->addr); free(j->len); free(j->ends); free(j->prefix); free(j->gmem);
    if (j->wframe) for (size_t f = 0; f < j->nframes; f++) free(j->wframe[f]);
    free(j->wframe); free(j->wframe_len);
    free(j);
}

/* Frames of at most `frame` bytes.  A transfer smaller than one frame per connection is cut into one frame per
 * connection of at least MIN_FRAME, so that every connection (and so every core) carries a share of a big one;
 * up to 1 MiB it is one frame: a second frame's sender and receiver threads cost more hand-offs than they save. */
#define MIN_FRAME (1024u << 10)
static uint64_t frame_for(uint64_t total, uint64_t frame, int nconns)
{
    if (nconns > 1 && total < frame * (uint64_t)nconns) {
        uint64_t share = (total + (uint64_t)nconns - 1) / (uint64_t)nconns;
        frame = share > MIN_FRAME ? share : MIN_FRAME;
    }
    return frame;
}

/* Make j a send of a grid that lives in `gmem` (the job owns it from now on, even on failure): its running sums,
 * total and frames.  -1 when out of memory.  The caller checked that the total does not overflow. */
static int grid_job(net_job *j, uint64_t *gmem, const uint64_t *bases, size_t nt, const uint64_t *offs,
                    const uint64_t *lens, size_t nr, uint64_t frame, int nconns)
{
    j->gmem = gmem;
    j->prefix = malloc((nr + 1) * sizeof *j->prefix);
    if (!j->prefix) return -1;
    j->prefix[0] = 0;
    for (size_t r = 0; r < nr; r++) j->prefix[r + 1] = j->prefix[r] + lens[r];
    j->bases = bases; j->nt = nt; j->offs = offs; j->lens = lens; j->nr = nr;
    j->total = j->prefix[nr] * (uint64_t)nt;
    j->frame_bytes = frame_for(j->total, frame, nconns);
    j->nframes = (size_t)((j->total + j->frame_bytes - 1) / j->frame_bytes);
    return 0;
}

/* A send job's source from a caller's grid (copied: nothing of the caller's arrays is kept). */
static int copied_grid_job(net_job *j, const uint64_t *bases, size_t nt, const uint64_t *offs, const uint64_t *lens,
                           size_t nr, uint64_t frame, int nconns)
{
    uint64_t *gmem = malloc((nt + 2 * nr + 1) * sizeof *gmem);
    if (!gmem) return -1;
    memcpy(gmem, bases, nt * 8);
    memcpy(gmem + nt, offs, nr * 8);
    memcpy(gmem + nt + nr, lens, nr * 8);
    return grid_job(j, gmem, gmem, nt, gmem + nt, gmem + nt + nr, nr, frame, nconns);
}

static uint64_t frame_start(const net_job *j, size_t f) { return (uint64_t)f * j->frame_bytes; }
static uint64_t frame_end(const net_job *j, size_t f)
{
    uint64_t end = ((uint64_t)f + 1) * j->frame_bytes;
    return end < j->total ? end : j->total;
}

static void queue_ctrl_full(adt_net *n, int conn, uint32_t type, uint64_t key, uint64_t offset, uint8_t *payload,
                            size_t plen, uint64_t a, uint64_t b, int wake)
{
    ctrl_frame *f = calloc(1, sizeof *f);
    if (!f) { free(payload); return; }   /* (a lost FENCE: the waiter's bound drops the link) */
    f->h.magic = NET_MAGIC; f->h.type = type; f->h.key = key; f->h.offset = offset; f->h.length = plen;
    f->h.a = a; f->h.b = b;
    f->payload = payload; f->plen = plen; f->conn = conn;
    if (conn < 0) n->ctrl_any++; else n->ctrl_for[conn]++;
    if (n->ctrl_tail) n->ctrl_tail->next = f; else n->ctrl_head = f;
    n->ctrl_tail = f;
    if (wake) pthread_cond_broadcast(&n->work);
}

static void queue_ctrl_quiet(adt_net *n, uint32_t type, uint64_t key, uint64_t offset, uint8_t *payload,
                             size_t plen, uint64_t a, uint64_t b, int wake)
{
    queue_ctrl_full(n, -1, type, key, offset, payload, plen, a, b, wake);
}

static void queue_ctrl_to(adt_net *n, int conn, uint32_t type, uint64_t key, uint64_t offset, uint8_t *payload,
                          size_t plen, uint64_t a, uint64_t b)
{
    queue_ctrl_full(n, conn, type, key, offset, payload, plen, a, b, 1);
}

static void queue_ctrl(adt_net *n, uint32_t type, uint64_t key, uint64_t offset, uint8_t *payload, size_t plen,
                       uint64_t a, uint64_t b)
{
    queue_ctrl_quiet(n, type, key, offset, payload, plen, a, b, 1);
}

/* ---- directory (owner side) ---- */

/* Take a reference on a live directory row for reading its memory; 0 if the stamp no longer matches. */
static int dir_enter(adt_net *n, int64_t row, uint64_t stamp)
{
    if (!n->dir || row < 0 || (size_t)row >= n->dir_rows) return 0;
    int64_t *w = n->dir + row * DIR_WORDS;
    __atomic_add_fetch(&w[6], 1, __ATOMIC_SEQ_CST);
    if ((uint64_t)__atomic_load_n(&w[0], __ATOMIC_SEQ_CST) != stamp) {
        __atomic_sub_fetch(&w[6], 1, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

static void dir_leave(adt_net *n, int64_t row) { __atomic_sub_fetch(&n->dir[row * DIR_WORDS + 6], 1, __ATOMIC_SEQ_CST); }

/* What a live row's memory is.  Range rows (w[3] == 0): [base, base + size), one segment (w[4], w[5]).  Table rows
 * (memory the caller allocated: the span of its tensors may hold anything else of the process): w[7] tensors of
 * w[5] bytes each, at the ascending, non-overlapping start addresses the table at w[3] holds (the owner keeps it
 * until the row is withdrawn, so it is read only under a reference on the row). */
static const uint64_t *dir_table(const int64_t *w, uint64_t *count)
{
    *count = (uint64_t)w[7];
    return (const uint64_t *)(uintptr_t)w[3];
}

/* Table rows: the index of the last tensor starting at or before `addr`, or -1. */
static int64_t table_floor(const uint64_t *starts, uint64_t count, uint64_t addr)
{
    uint64_t lo = 0, hi = count;   /* first start > addr */
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= addr) lo = mid + 1; else hi = mid;
    }
    return (int64_t)lo - 1;
}

/* Whether [addr, addr + len) lies inside the row's memory (a table row's span may run from one tensor into the next
 * where they touch, as merged spans do).  `hint`: the tensor the last span was found in (-1 at first): a frame's
 * spans come tensor by tensor, so most need no search. */
static int dir_covers(const int64_t *w, uint64_t addr, uint64_t len, int64_t *hint)
{
    uint64_t size = (uint64_t)w[5];
    if (!w[3]) { uint64_t base = (uint64_t)w[4]; return addr >= base && len <= size && addr - base <= size - len; }
    uint64_t count;
    const uint64_t *starts = dir_table(w, &count);
    int64_t i = *hint;
    if (i < 0 || (uint64_t)i >= count || addr < starts[i] || addr - starts[i] >= size)
        i = *hint = table_floor(starts, count, addr);
    if (i < 0 || addr - starts[i] >= size) return len == 0 && i >= 0 && addr - starts[i] == size;
    uint64_t end = starts[i] + size, want;
    if (__builtin_add_overflow(addr, len, &want)) return 0;
    while (want > end) {   /* the span goes on past this tensor: only into one that starts right there */
        if ((uint64_t)++i >= count || starts[i] != end) return 0;
        end += size;
    }
    return 1;
}

/* Whether a READ's grid lies inside the row's memory: each tensor base inside it with the runs' furthest end
 * (`furthest` bytes past the base); a table row wants each base to be one of its tensors' starts. */
static int dir_holds_grid(const int64_t *w, const uint64_t *bases, uint64_t nt, uint64_t furthest)
{
    uint64_t size = (uint64_t)w[5];
    if (furthest > size) return 0;
    if (!w[3]) {
        uint64_t base = (uint64_t)w[4];
        for (uint64_t t = 0; t < nt; t++)
            if (bases[t] < base || bases[t] - base > size - furthest) return 0;
        return 1;
    }
    uint64_t count;
    const uint64_t *starts = dir_table(w, &count);
    for (uint64_t t = 0; t < nt; t++) {
        int64_t i = table_floor(starts, count, bases[t]);
        if (i < 0 || starts[i] != bases[t]) return 0;
    }
    return 1;
}

/* Owner side: a row's cache is released; returns 0 once no serving thread touches its memory any more, or 1 if one
 * still does after `bound_ms` (a frame held up by a peer that stopped sending or reading mid-frame). */
int adt_dir_withdraw(int64_t *words, int64_t row, int bound_ms)
{
    int64_t *w = words + row * DIR_WORDS;
    __atomic_store_n(&w[0], 0, __ATOMIC_SEQ_CST);
    for (long waited_us = 0; __atomic_load_n(&w[6], __ATOMIC_SEQ_CST) > 0; waited_us += 50) {
        if (waited_us >= 1000L * bound_ms) return 1;
        usleep(50);
    }
    return 0;
}

/* ---- I/O threads ---- */

static int read_exact(int fd, void *buf, size_t len)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = recv(fd, (char *)buf + got, len - got, MSG_WAITALL);
        if (r == 0) return ECONNRESET;
        if (r < 0) { if (errno == EINTR) continue; return errno ? errno : EIO; }
        got += (size_t)r;
    }
    return 0;
}

static void broken(adt_net *n)   /* a connection failed: every job fails (under the lock) */
{
    if (n->closed) return;
    n->closed = 1;
    for (net_job *j = n->all; j; j = j->next_all) {
        j->stop = 1;
        if (!j->error) j->error = ECONNRESET;
        j->ready = 1;
    }
    for (int i = 0; i < n->nconns; i++) shutdown(n->fds[i], SHUT_RDWR);
    pthread_cond_broadcast(&n->work);
    pthread_cond_broadcast(&n->ready);
}

static void finish_all_idle(adt_net *n)   /* under the lock: announce jobs that can end (after broken()) */
{
    net_job *j = n->all;
    while (j) {
        net_job *next = j->next_all;
        if (finish_if_idle(n, j) && j->kind != 2) net_announce(n->notify_fd, j);
        else if (j->done && j->kind == 2) free_job(j);
        j = next;
    }
}

/* A receiver thread's staged frame whose last scatter still runs (j NULL: none).  The frame counts as landed only
 * once that scatter is done; the thread waits for it before it blocks on its socket or takes a frame of another
 * kind, so that the next frame's receive overlaps the scatter (recv_staged, settle). */
typedef struct { net_job *j; adt_stage *st; int slot, fresh; uint64_t length; } rx_carry;

static long recv_staged(adt_net *n, int fd, net_job *j, uint64_t off, uint64_t length, uint8_t *scratch,
                        uint64_t *consumed, int *dev, rx_carry *carry);
static void settle(adt_net *n, rx_carry *carry);
static int send_staged(adt_net *n, int index, int fd, net_job *j, size_t frame);
static void staged_frames(adt_net *n, net_job *j);

/* Under the lock; 0 or a status.  The serve job takes the READ's payload (*payload is then NULL): its frames are
 * walked from the grid it names.  A serve job of one frame of at most `room` bytes, on a link with nothing else to
 * send, is not queued: its frame is claimed and the job handed back in *claimed, for the caller to send inline. */
static int serve_read(adt_net *n, const adt_hdr *h, uint64_t **payload_in, uint64_t room, net_job **claimed)
{
    uint64_t *payload = *payload_in, nt = payload[1], nr = payload[2];
    const uint64_t *bases = payload + READ_HEAD, *offs = bases + nt, *lens = offs + nr;
    int64_t row = (int64_t)h->a, model = (int64_t)payload[0];
    if (!n->dir || row < 0 || (size_t)row >= n->dir_rows) return 1;
    int64_t *w = n->dir + row * DIR_WORDS;
    if ((uint64_t)w[0] != h->offset || (uint64_t)w[1] != h->b || h->offset == 0) return 1;
    if (model != -1 && w[2] != model) return 1;
    /* Every span inside the cache: the runs' furthest end (checked without overflow) past each tensor base. */
    uint64_t size = (uint64_t)w[5], run_bytes = 0, furthest = 0, total;
    for (uint64_t r = 0; r < nr; r++) {
        if (offs[r] > size || lens[r] > size - offs[r] || __builtin_add_overflow(run_bytes, lens[r], &run_bytes))
            return 3;
        if (offs[r] + lens[r] > furthest) furthest = offs[r] + lens[r];
    }
    if (__builtin_mul_overflow(nt, run_bytes, &total)) return 3;
    if (!dir_enter(n, row, h->offset)) return 1;   /* a table is read only under a reference on the row */
    int inside = dir_holds_grid(w, bases, nt, furthest), device = (int)(w[8] & DIR_DEVICE);
    dir_leave(n, row);
    if (!inside) return 3;
    if (device && !n->stage[0]) return 1;   /* no sending ring on this link yet: the requester asks the owner */
    net_job *j = calloc(1, sizeof *j);
    if (!j) return 2;
    *payload_in = NULL;
    if (grid_job(j, payload, bases, (size_t)nt, offs, lens, (size_t)nr, n->frame, n->nconns)) { free_job(j); return 2; }
    j->kind = 2; j->key = h->key; j->row = row; j->stamp = h->offset;
    if (device) staged_frames(n, j);
    n->served[0]++;
    n->served[1] += j->total;
    j->next_all = n->all; n->all = j;
    if (!j->nframes) { j->done = 1; unlink_all(n, j); free_job(j); }
    else if (j->nframes == 1 && j->total <= room && !n->tx_head && !n->ctrl_head && !j->staged) {
        j->next_frame = 1;
        j->inflight = 1;
        *claimed = j;
    } else enqueue(n, j);
    return 0;
}

/* A WRITE's payload: the model id the cache must still answer to (-1: any), the number of spans, the owner-side
 * spans, then their bytes.  Validated like a READ (live stamp, cache id, model id, every span inside the cache's
 * segment); the bytes land under a reference on the row (dir_enter), so a release waits for at most this frame
 * and nothing is written once it returned.  Returns 0 (written; *written), or a status (the bytes are dropped).
 * A negative value: the connection failed. */
static long serve_write(adt_net *n, int fd, const adt_hdr *h, uint8_t *scratch, uint64_t *written)
{
    static const volatile int32_t always = 1, never = 0;
    uint64_t prefix[2];
    *written = 0;
    if (h->length < sizeof prefix) return -EPROTO;
    int err = read_exact(fd, prefix, sizeof prefix);
    if (err) return -err;
    uint64_t count = prefix[1], rest = h->length - sizeof prefix;
    if (count > MAX_READ_SPANS || count * 16 > rest) return -EPROTO;
    uint64_t *spans = malloc(count ? count * 16 : 1);
    if (!spans) return -ENOMEM;
    if ((err = read_exact(fd, spans, (size_t)(count * 16)))) { free(spans); return -err; }
    uint64_t data = rest - count * 16;
    int64_t row = (int64_t)h->a, model = (int64_t)prefix[0];
    int status = 0, entered = 0, device = 0;
    uint64_t *addr = NULL, *len = NULL, *ends = NULL;
    if (h->offset == 0 || !dir_enter(n, row, h->offset)) status = 1;
    else {
        entered = 1;
        int64_t *w = n->dir + row * DIR_WORDS;
        if ((uint64_t)w[1] != h->b || (model != -1 && w[2] != model)) status = 1;
        device = (int)(w[8] & DIR_DEVICE);
        if (device && !n->stage[1]) status = 1;   /* no receiving ring on this link yet: the requester asks the owner */
    }
    if (!status) {
        const int64_t *w = n->dir + row * DIR_WORDS;
        uint64_t total = 0;
        int64_t hint = -1;
        addr = malloc((count ? count : 1) * 8); len = malloc((count ? count : 1) * 8); ends = malloc((count ? count : 1) * 8);
        if (!addr || !len || !ends) status = 2;
        for (uint64_t i = 0; !status && i < count; i++) {
            uint64_t a = spans[2 * i], l = spans[2 * i + 1];
            if (!dir_covers(w, a, l, &hint) || __builtin_add_overflow(total, l, &total)) status = 3;   /* outside it */
            addr[i] = a; len[i] = l; ends[i] = total;
        }
        if (!status && total != data) status = 3;
    }
    long got;
    if (!status && device) {   /* through the receiving ring, every scatter waited for before the row is left */
        net_job into = {.addr = addr, .len = len, .ends = ends, .n = (size_t)count, .row = -1};
        uint64_t consumed = 0;
        int dev = 0;
        got = recv_staged(n, fd, &into, 0, data, scratch, &consumed, &dev, NULL);
        if (got >= 0 && dev) status = STATUS_DEVICE | dev << 8;
    } else if (!status) got = adt_recv_frame(fd, addr, len, ends, (size_t)count, 0, data, &never, scratch, SCRATCH, 0,
                                             NULL);
    else got = adt_recv_frame(fd, NULL, NULL, NULL, 0, 0, data, &always, scratch, SCRATCH, 0, NULL);
    if (entered) dir_leave(n, row);
    free(spans); free(addr); free(len); free(ends);
    if (got < 0) return got;
    *written = status ? 0 : (uint64_t)got;
    return status;
}

typedef struct { adt_net *n; int fd, index; } conn_arg;

static int send_small(int fd, const adt_hdr *h, const uint8_t *payload, size_t plen);
static int serve_inline(adt_net *n, int index, int fd, net_job *j);

/* Bytes a receiver thread may send inline on its connection without risking a block: a receiver must never wait
 * in a send (two of them, each waiting for the other to read, would hang the link), so only while the socket's
 * queue and the frame together stay under a quarter of its send buffer (the kernel's accounting counts each byte
 * about twice), and 0 when that cannot be read. */
static uint64_t inline_room(int fd)
{
    int queued = 0, buffer = 0;
    socklen_t size = sizeof buffer;
    if (ioctl(fd, SIOCOUTQ, &queued) != 0 || getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, &size) != 0
        || queued < 0 || queued > buffer / 4)
        return 0;
    return (uint64_t)(buffer / 4 - queued);
}

/* A receiver thread's answer to a frame (a WRITE's acknowledgement) sent on its own connection when that is idle
 * and has room (inline_room): waking a sender thread for a 40-byte frame costs a thread hand-off on the push's
 * path.  0 sent, -1 not sent (queue it), or the errno that ended the connection. */
static int reply_inline(adt_net *n, int index, int fd, uint32_t type, uint64_t key, uint64_t value)
{
    if (inline_room(fd) < sizeof(adt_hdr) || pthread_mutex_trylock(&n->send_lock[index]) != 0) return -1;
    adt_hdr h = {NET_MAGIC, type, key, value, 0, 0, 0};
    int err = send_small(fd, &h, NULL, 0);
    pthread_mutex_unlock(&n->send_lock[index]);
    return err;
}

/* A DATA frame of j (`length` bytes) is over on this thread: `got` bytes landed (negative: -errno, the connection
 * failed), `dev` the runtime's code of a failed device copy.  Returns the errno that broke the connection, or 0. */
static int frame_landed(adt_net *n, net_job *j, uint64_t length, long got, int dev)
{
    pthread_mutex_lock(&n->lock);
    j->inflight--;
    /* The frame broke off with part of it written: its job fails, and does so before another receiver can end it
     * as complete (this frame counts as in flight until now). */
    if (got < 0) {
        if (!j->error) j->error = (int)-got;
        broken(n);
        pthread_mutex_unlock(&n->lock);
        return (int)-got;
    }
    if (dev && !j->stop) { j->status = STATUS_DEVICE | dev << 8; j->stop = 1; }
    if (!j->stop) {
        if ((uint64_t)got != length) { j->error = EPROTO; j->stop = 1; }
        j->moved += (uint64_t)got;
    }
    int ann = finish_if_idle(n, j);
    pthread_mutex_unlock(&n->lock);
    if (ann) end_job(n, j);
    return 0;
}

/* Whether at least `bytes` wait in fd's receive queue (reading them will not block). */
static int readable(int fd, size_t bytes)
{
    int queued = 0;
    return ioctl(fd, FIONREAD, &queued) == 0 && queued >= 0 && (size_t)queued >= bytes;
}

static void *receiver(void *arg)
{
    conn_arg *c = (conn_arg *)arg;
    adt_net *n = c->n;
    int fd = c->fd, index = c->index;
    free(c);
    uint8_t *scratch = malloc(SCRATCH);
    static const volatile int32_t always = 1;
    adt_hdr h;
    rx_carry carry = {0};
    for (;;) {
        if (carry.j && !readable(fd, sizeof h)) settle(n, &carry);   /* before this thread may block */
        int err = scratch ? read_exact(fd, &h, sizeof h) : ENOMEM;
        if (!err && h.magic != NET_MAGIC) err = EPROTO;
        if (err) break;
        if (h.type != T_DATA) settle(n, &carry);
        if (h.type == T_DATA) {
            pthread_mutex_lock(&n->lock);
            net_job *j = find(n, h.key, 0);
            if (j) j->inflight++;
            int overlaps = j && j->staged && j->ready;
            pthread_mutex_unlock(&n->lock);
            if (!overlaps) settle(n, &carry);
            pthread_mutex_lock(&n->lock);
            while (j && !j->ready) pthread_cond_wait(&n->ready, &n->lock);
            pthread_mutex_unlock(&n->lock);
            uint64_t consumed = h.length;
            int dev = 0;
            long got = j && j->staged ? recv_staged(n, fd, j, h.offset, h.length, scratch, &consumed, &dev, &carry)
                     : j ? adt_recv_frame(fd, j->addr, j->len, j->ends, j->n, h.offset, h.length, &j->stop, scratch,
                                          SCRATCH, STOP_POLL_MS, &consumed)
                         : adt_recv_frame(fd, NULL, NULL, NULL, 0, h.offset, h.length, &always, scratch, SCRATCH, 0,
                                          NULL);
            if (!j) { if (got < 0) break; continue; }
            if (carry.fresh) { carry.fresh = 0; continue; }   /* its last scatter runs: settle accounts for it */
            if ((err = frame_landed(n, j, h.length, got, dev))) break;
            if (consumed < h.length) {   /* stopped mid-frame: the rest is dropped without the job (it may be gone) */
                long rest = adt_recv_frame(fd, NULL, NULL, NULL, 0, 0, h.length - consumed, &always, scratch, SCRATCH,
                                           0, NULL);
                if (rest < 0) { err = (int)-rest; break; }
            }
        } else if (h.type == T_READ) {
            if (h.length % 8 || h.length < 8 * READ_HEAD || h.length / 8 > READ_HEAD + 3 * (uint64_t)MAX_READ_SPANS) break;
            uint64_t *spans = malloc(h.length);
            if (!spans || read_exact(fd, spans, (size_t)h.length)) { free(spans); break; }
            uint64_t nt = spans[1], nr = spans[2];
            if (nt > MAX_READ_SPANS || nr > MAX_READ_SPANS || nt * nr > MAX_READ_SPANS
                || 8 * (READ_HEAD + nt + 2 * nr) != h.length) { free(spans); break; }   /* malformed: the link fails */
            uint64_t room = inline_room(fd);
            net_job *claimed = NULL;
            pthread_mutex_lock(&n->lock);
            int status = serve_read(n, &h, &spans, room, &claimed);
            if (status) { n->served[2]++; queue_ctrl(n, T_ERROR, h.key, (uint64_t)status, NULL, 0, 0, 0); }
            pthread_mutex_unlock(&n->lock);
            free(spans);
            if (claimed && (err = serve_inline(n, index, fd, claimed))) break;
        } else if (h.type == T_ERROR || h.type == T_ABORT) {
            pthread_mutex_lock(&n->lock);
            net_job *j = find(n, h.key, h.type == T_ERROR ? 0 : 2);
            if (!j && h.type == T_ERROR) { j = find(n, h.key, 1); if (j && !j->wframe) j = NULL; }   /* a WRITE's */
            int ann = 0;
            if (j) {
                if (h.type == T_ERROR && !j->status) j->status = (int)h.offset;
                j->stop = 1;
                j->ready = 1;
                j->next_frame = j->nframes;
                unqueue(n, j);
                ann = finish_if_idle(n, j);
                if (j->done && j->kind == 2) free_job(j);
            }
            pthread_cond_broadcast(&n->ready);
            pthread_mutex_unlock(&n->lock);
            if (ann) end_job(n, j);
        } else if (h.type == T_WRITE) {
            uint64_t written = 0;
            long status = serve_write(n, fd, &h, scratch, &written);
            if (status < 0) { err = (int)-status; break; }
            uint32_t type = status ? T_ERROR : T_WRITE_ACK;
            uint64_t value = status ? (uint64_t)status : written;
            pthread_mutex_lock(&n->lock);
            n->served[status ? 5 : 3]++;
            if (!status) n->served[4] += written;
            int queued = n->ctrl_head != NULL;
            pthread_mutex_unlock(&n->lock);
            int sent = queued ? -1 : reply_inline(n, index, fd, type, h.key, value);
            if (sent > 0) { err = sent; break; }
            if (sent < 0) {
                pthread_mutex_lock(&n->lock);
                queue_ctrl(n, type, h.key, value, NULL, 0, 0, 0);
                pthread_mutex_unlock(&n->lock);
            }
        } else if (h.type == T_WRITE_ACK) {
            pthread_mutex_lock(&n->lock);
            net_job *j = find(n, h.key, 1);
            int ann = 0;
            if (j && j->wframe) {
                j->acked += h.offset;
                ann = finish_if_idle(n, j);
            }
            pthread_mutex_unlock(&n->lock);
            if (ann) end_job(n, j);
        } else if (h.type == T_FENCE || h.type == T_FENCE_ACK) {
            /* FENCE: this thread handles its connection's frames in order, so every earlier frame of the key on
             * it is written (or dropped) by now: stop the receive job and acknowledge.  FENCE_ACK: one more
             * connection of a fenced send is clean. */
            pthread_mutex_lock(&n->lock);
            net_job *j = find(n, h.key, h.type == T_FENCE ? 0 : 1);
            int ann = 0;
            if (h.type == T_FENCE) {
                if (j) {
                    j->stop = 1;
                    j->ready = 1;
                    ann = finish_if_idle(n, j);
                }
                queue_ctrl(n, T_FENCE_ACK, h.key, 0, NULL, 0, 0, 0);
                pthread_cond_broadcast(&n->ready);
            } else if (j && j->fence == 2 && j->fence_left > 0) {
                j->fence_left--;
                ann = finish_if_idle(n, j);
            }
            pthread_mutex_unlock(&n->lock);
            if (ann) end_job(n, j);
        } else {
            break;
        }
    }
    settle(n, &carry);   /* (a launched scatter is waited for, whatever ended the connection) */
    pthread_mutex_lock(&n->lock);
    broken(n);
    finish_all_idle(n);
    pthread_mutex_unlock(&n->lock);
    free(scratch);
    return NULL;
}

/* Send frame `frame` of job j (claimed: j->inflight counts it) on connection `index`, holding its send lock, then
 * account for it (under the lock).  Returns the errno that broke the connection, or 0. */
static int send_job_frame(adt_net *n, int index, int fd, net_job *j, size_t frame)
{
    int err = 0, gone = 0;
    if (j->kind == 2 && !dir_enter(n, j->row, j->stamp)) gone = 1;   /* released meanwhile */
    if (!gone) {
        uint64_t lo = frame_start(j, frame), hi = frame_end(j, frame);
        adt_hdr h = {NET_MAGIC, T_DATA, j->key, lo, hi - lo, 0, 0};
        const uint8_t *head = (const uint8_t *)&h;
        size_t hlen = sizeof h;
        if (j->wframe) { head = j->wframe[frame]; hlen = j->wframe_len[frame]; }   /* a WRITE */
        err = adt_send_grid(fd, head, hlen, j->bases, j->nt, j->offs, j->lens, j->nr, j->prefix, lo, hi);
        if (j->kind == 2) dir_leave(n, j->row);
    }
    pthread_mutex_unlock(&n->send_lock[index]);
    pthread_mutex_lock(&n->lock);
    j->inflight--;
    if (gone && !j->stop) {
        j->stop = 1;
        j->next_frame = j->nframes;
        unqueue(n, j);
        queue_ctrl(n, T_ERROR, j->key, 1, NULL, 0, 0, 0);
    }
    if (!err && !gone) j->moved += frame_end(j, frame) - frame_start(j, frame);
    if (err) { if (!j->error) j->error = err; broken(n); }
    int ann = finish_if_idle(n, j);
    if (j->done && j->kind == 2) { free_job(j); j = NULL; }
    if (err) finish_all_idle(n);
    pthread_mutex_unlock(&n->lock);
    if (ann && j) end_job(n, j);
    return err;
}

/* A READ served by the receiver thread that took it: its one frame sent on this connection if the connection is
 * idle (a sender thread's wake-up is a thread hand-off on the pull's path), else queued for a sender. */
static int serve_inline(adt_net *n, int index, int fd, net_job *j)
{
    if (pthread_mutex_trylock(&n->send_lock[index]) == 0) return send_job_frame(n, index, fd, j, 0);
    pthread_mutex_lock(&n->lock);   /* the sender thread is busy: it takes the frame next */
    j->inflight--;
    if (!j->stop) {
        j->next_frame = 0;
        enqueue(n, j);
    } else {
        finish_if_idle(n, j);   /* aborted meanwhile: nothing of it was sent */
        if (j->done) free_job(j);
    }
    pthread_mutex_unlock(&n->lock);
    return 0;
}

static void *sender(void *arg)
{
    conn_arg *c = (conn_arg *)arg;
    adt_net *n = c->n;
    int fd = c->fd;
    pthread_mutex_t *send_lock = &n->send_lock[c->index];
    int c_index = c->index;
    free(c);
    for (;;) {
        pthread_mutex_lock(&n->lock);
        int me = c_index;
        while (!n->closed && !n->ctrl_any && !n->ctrl_for[me] && !n->tx_head) pthread_cond_wait(&n->work, &n->lock);
        if (n->closed) { pthread_mutex_unlock(&n->lock); break; }
        if (n->ctrl_any || n->ctrl_for[me]) {   /* control frames first: they are small and others wait for them */
            /* Take every queued one (up to CTRL_BATCH) and send them in one sendmsg: a burst of concurrent
             * one-sided reads costs the peer one wake-up, not one per request. */
            ctrl_frame *batch[CTRL_BATCH];
            uint64_t a[2 * CTRL_BATCH], l[2 * CTRL_BATCH];
            int nb = 0, ns = 0;
            ctrl_frame **p = &n->ctrl_head, *prev = NULL;
            while (*p && nb < CTRL_BATCH) {
                ctrl_frame *f = *p;
                if (f->conn >= 0 && f->conn != me) { prev = f; p = &f->next; continue; }   /* another connection's */
                *p = f->next;
                if (n->ctrl_tail == f) n->ctrl_tail = prev;
                if (f->conn < 0) n->ctrl_any--; else n->ctrl_for[me]--;
                batch[nb++] = f;
                a[ns] = (uint64_t)(uintptr_t)&f->h; l[ns++] = sizeof f->h;
                if (f->plen) { a[ns] = (uint64_t)(uintptr_t)f->payload; l[ns++] = f->plen; }
            }
            pthread_mutex_unlock(&n->lock);
            pthread_mutex_lock(send_lock);
            int err = adt_send_frame(fd, NULL, 0, a, l, 0, ns);
            pthread_mutex_unlock(send_lock);
            for (int i = 0; i < nb; i++) { free(batch[i]->payload); free(batch[i]); }
            if (err) { pthread_mutex_lock(&n->lock); broken(n); finish_all_idle(n); pthread_mutex_unlock(&n->lock); break; }
            continue;
        }
        net_job *j = n->tx_head;
        n->tx_head = j->next_tx;
        if (!n->tx_head) n->tx_tail = NULL;
        j->next_tx = NULL;
        size_t frame = j->next_frame++;
        if (j->next_frame < j->nframes) enqueue(n, j);   /* round-robin: the next frame is another job's */
        j->inflight++;
        pthread_mutex_unlock(&n->lock);

        pthread_mutex_lock(send_lock);
        if (j->staged ? send_staged(n, c_index, fd, j, frame) : send_job_frame(n, c_index, fd, j, frame)) break;
    }
    return NULL;
}

/* Send a small frame without blocking: 0 sent, -1 the socket buffer is full (nothing sent), or an errno.  A
 * partial write (the buffer filled up mid-frame, which needs a nearly full buffer) is completed blocking. */
static int send_small(int fd, const adt_hdr *h, const uint8_t *payload, size_t plen)
{
    struct iovec iov[2] = {{(void *)h, sizeof *h}, {(void *)payload, plen}};
    struct msghdr m;
    memset(&m, 0, sizeof m);
    m.msg_iov = iov;
    m.msg_iovlen = 2;
    ssize_t w;
    do { w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT); } while (w < 0 && errno == EINTR);
    if (w < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? -1 : (errno ? errno : EIO);
    size_t sent = (size_t)w;
    if (sent == sizeof *h + plen) return 0;
    uint64_t a, l;
    if (sent < sizeof *h) {
        a = (uint64_t)(uintptr_t)payload; l = plen;
        return adt_send_frame(fd, (const uint8_t *)h + sent, sizeof *h - sent, &a, &l, 0, plen ? 1 : 0);
    }
    a = (uint64_t)(uintptr_t)(payload + (sent - sizeof *h)); l = plen - (sent - sizeof *h);
    return adt_send_frame(fd, NULL, 0, &a, &l, 0, 1);
}

/* ---- API (adt.h: through ctypes, or the module's methods) ---- */

void *adt_net_new(int notify_fd, int64_t *dir, size_t dir_rows, uint64_t frame)
{
    adt_net *n = calloc(1, sizeof *n);
    if (!n) return NULL;
    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->work, NULL);
    pthread_cond_init(&n->ready, NULL);
    n->notify_fd = notify_fd; n->dir = dir; n->dir_rows = dir_rows; n->frame = frame ? frame : (4u << 20);
    for (int i = 0; i < MAX_CONNS; i++) pthread_mutex_init(&n->send_lock[i], NULL);
    return n;
}

/* Adopt a connected blocking socket: start its receiver and sender threads.  0 or errno. */
int adt_net_attach(void *net, int fd)
{
    adt_net *n = (adt_net *)net;
    pthread_mutex_lock(&n->lock);
    if (n->closed || n->nconns >= MAX_CONNS) { pthread_mutex_unlock(&n->lock); return EINVAL; }
    n->fds[n->nconns++] = fd;
    for (int role = 0; role < 2; role++) {
        conn_arg *c = malloc(sizeof *c);
        if (!c) { pthread_mutex_unlock(&n->lock); return ENOMEM; }
        c->n = n; c->fd = fd; c->index = n->nconns - 1;
        if (pthread_create(&n->threads[n->nthreads], NULL, role ? sender : receiver, c) != 0) {
            free(c);
            pthread_mutex_unlock(&n->lock);
            return EAGAIN;
        }
        n->nthreads++;
    }
    pthread_mutex_unlock(&n->lock);
    return 0;
}

static net_job *new_job(int kind, uint64_t key)
{
    net_job *j = calloc(1, sizeof *j);
    if (j) { j->kind = kind; j->key = key; j->row = -1; }
    return j;
}

/* A send job ready to go: listed, and queued for the senders (or failed at once on a closed link). */
static void *start_send(adt_net *n, net_job *j)
{
    pthread_mutex_lock(&n->lock);
    j->next_all = n->all; n->all = j;
    if (n->closed) { j->stop = 1; j->error = ECONNRESET; }
    else if (j->nframes) enqueue(n, j);
    int ann = finish_if_idle(n, j);
    pthread_mutex_unlock(&n->lock);
    if (ann) end_job(n, j);
    return j;
}

/* A send job of device memory: staged, its frames at most a slot long (frame_for may make them longer). */
static void staged_frames(adt_net *n, net_job *j)
{
    uint64_t slot = n->stage[0] ? adt_stage_slot_bytes(n->stage[0]) : 0;
    if (slot && j->frame_bytes > slot) {
        j->frame_bytes = slot;
        j->nframes = (size_t)((j->total + slot - 1) / slot);
    }
    j->staged = 1;
}

/* Two-sided send: the bytes of a grid (run r of tensor t at bases[t] + offs[r], lens[r] bytes, tensor-major: a
 * plan's order; a list of spans is a grid of one tensor at 0) as transfer `key` (copied arrays). */
void *adt_net_send(void *net, uint64_t key, const uint64_t *bases, size_t nt, const uint64_t *offs,
                   const uint64_t *lens, size_t nr, int staged)
{
    adt_net *n = (adt_net *)net;
    net_job *j = new_job(1, key);
    if (!j || copied_grid_job(j, bases, nt, offs, lens, nr, n->frame, n->nconns)) { free_job(j); return NULL; }
    if (staged) staged_frames(n, j);
    return start_send(n, j);
}

/* Register the receiving end of `key`; DATA frames for it wait for adt_net_set_destination. */
void *adt_net_receive(void *net, uint64_t key)
{
    adt_net *n = (adt_net *)net;
    net_job *j = new_job(0, key);
    if (!j) return NULL;
    pthread_mutex_lock(&n->lock);
    j->next_all = n->all; n->all = j;
    n->live_rx++;
    if (n->closed) { j->stop = 1; j->error = ECONNRESET; j->ready = 1; }
    int ann = finish_if_idle(n, j);
    pthread_mutex_unlock(&n->lock);
    if (ann) end_job(n, j);
    return j;
}

/* Hand a receive job its destination: `count` spans at a[i], l[i] bytes, e[i] their running ends (the job takes
 * the arrays, or they are freed if it had ended); DATA frames that waited for it land now. */
static void install_destination(adt_net *n, net_job *j, uint64_t *a, uint64_t *l, uint64_t *e, size_t count,
                                int staged)
{
    pthread_mutex_lock(&n->lock);
    if (!j->ready) {
        j->staged = staged;
        j->addr = a; j->len = l; j->ends = e; j->n = count; j->total = count ? e[count - 1] : 0; j->ready = 1;
        a = l = e = NULL;
    }
    int ann = finish_if_idle(n, j);
    pthread_cond_broadcast(&n->ready);
    pthread_mutex_unlock(&n->lock);
    free(a); free(l); free(e);
    if (ann) end_job(n, j);
}

/* A destination given as a grid: run r of tensor t at bases[t] + offs[r], lens[r] bytes, tensor-major (a plan's
 * order), as span arrays for install_destination, merged where the memory continues.  Walked in one pass, so that
 * the caller builds no span list (a new plan's 8192-span list took the event loop ~100 us).  0 or ENOMEM. */
typedef struct { uint64_t *a, *l, *e; size_t n; } dest_spans;

static int grid_destination(const uint64_t *bases, size_t nt, const uint64_t *offs, const uint64_t *lens, size_t nr,
                            dest_spans *out)
{
    size_t cap = nt && nr ? nt * nr : 1, k = 0;
    uint64_t *a = malloc(cap * 8), *l = malloc(cap * 8), *e = malloc(cap * 8);
    if (!a || !l || !e) { free(a); free(l); free(e); return ENOMEM; }
    uint64_t total = 0;
    for (size_t t = 0; t < nt; t++) {
        for (size_t r = 0; r < nr; r++) {
            uint64_t at = bases[t] + offs[r], len = lens[r];
            if (!len) continue;
            total += len;
            if (k && a[k - 1] + l[k - 1] == at) { l[k - 1] += len; e[k - 1] = total; continue; }
            a[k] = at; l[k] = len; e[k] = total; k++;
        }
    }
    *out = (dest_spans){a, l, e, k};
    return 0;
}

/* Hand a receive job its destination, a grid as adt_net_send's (the arrays are read, not kept). 0 or ENOMEM. */
int adt_net_set_destination(void *net, void *job, const uint64_t *bases, size_t nt, const uint64_t *offs,
                            const uint64_t *lens, size_t nr, int staged)
{
    dest_spans dest;
    if (grid_destination(bases, nt, offs, lens, nr, &dest)) return ENOMEM;
    install_destination((adt_net *)net, (net_job *)job, dest.a, dest.l, dest.e, dest.n, staged);
    return 0;
}

/* One-sided pull: receive into the local grid (local_bases[t] + local_offsets[r], lengths[r]: the owner's runs, laid
 * out in this side's tensors) what the owner's directory row (row, stamp, cache id) holds at the remote grid (and
 * still answers to `model_id`, unless -1).  The owner answers with DATA frames, or an
 * ERROR frame (status 1: released, unknown or re-keyed, 3: outside the cache).  The READ frame goes out from
 * this thread when the link has no other receive job and the connection is idle; otherwise a sender thread sends
 * it, woken at once, or (`defer`) only by adt_net_flush, so that a burst of reads costs one wake-up. */
void *adt_net_read(void *net, uint64_t key, int64_t row, uint64_t stamp, uint64_t cache_id, int64_t model_id,
                   const uint64_t *bases, size_t ntensors, const uint64_t *offsets, const uint64_t *lengths,
                   size_t nruns, const uint64_t *local_bases, const uint64_t *local_offsets, int defer, int staged)
{
    adt_net *n = (adt_net *)net;
    size_t plen = 8 * (READ_HEAD + ntensors + 2 * nruns);
    uint64_t *list = malloc(plen);
    if (!list) return NULL;
    list[0] = (uint64_t)model_id; list[1] = ntensors; list[2] = nruns;
    memcpy(list + READ_HEAD, bases, 8 * ntensors);
    memcpy(list + READ_HEAD + ntensors, offsets, 8 * nruns);
    memcpy(list + READ_HEAD + ntensors + nruns, lengths, 8 * nruns);
    dest_spans dest;
    if (grid_destination(local_bases, ntensors, local_offsets, lengths, nruns, &dest)) { free(list); return NULL; }
    net_job *j = (net_job *)adt_net_receive(net, key);
    if (!j) { free(list); free(dest.a); free(dest.l); free(dest.e); return NULL; }
    install_destination(n, j, dest.a, dest.l, dest.e, dest.n, staged);
    pthread_mutex_lock(&n->lock);
    int conn = n->nconns ? n->next_conn++ % n->nconns : -1, fd = conn >= 0 ? n->fds[conn] : -1;
    int live = !j->done && !n->closed && conn >= 0;
    /* Inline only when this is the link's only receive job and nothing is queued: under concurrency the
     * loopback sendmsg (the kernel delivers the segment and wakes the peer on this thread) would stall the event
     * loop once per request; a sender thread sends the queued READs together instead. */
    int inline_ok = live && n->live_rx == 1 && !n->ctrl_head;
    pthread_mutex_unlock(&n->lock);
    if (inline_ok && pthread_mutex_trylock(&n->send_lock[conn]) == 0) {
        /* The connection is idle: send the small request from this (event loop) thread rather than waking a
         * sender, without ever blocking: if the socket buffer is full, a sender thread sends it instead. */
        adt_hdr h = {NET_MAGIC, T_READ, key, stamp, plen, (uint64_t)row, cache_id};
        int err = send_small(fd, &h, (const uint8_t *)list, plen);
        pthread_mutex_unlock(&n->send_lock[conn]);
        if (err == 0) { free(list); return j; }
        if (err > 0) { free(list); shutdown(fd, SHUT_RDWR); return j; }   /* its receiver fails the jobs */
    }
    pthread_mutex_lock(&n->lock);
    if (!j->done) queue_ctrl_quiet(n, T_READ, key, stamp, (uint8_t *)list, plen, (uint64_t)row, cache_id, !defer);
    else free(list);
    pthread_mutex_unlock(&n->lock);
    return j;
}

/* Wake a sender thread for the control frames queued with `defer` (adt_net_read). */
void adt_net_flush(void *net)
{
    adt_net *n = (adt_net *)net;
    pthread_mutex_lock(&n->lock);
    if (n->ctrl_head) pthread_cond_broadcast(&n->work);
    pthread_mutex_unlock(&n->lock);
}

/* A walk through a grid's byte stream (run r of tensor t at bases[t] + offs[r], lens[r] bytes, tensor-major). */
typedef struct {
    const uint64_t *bases, *offs, *lens;
    size_t nt, nr, t, r;
    uint64_t inner;   /* bytes of run r already walked */
} grid_walk;

/* The walk's next `want` bytes as spans, merged where they continue: (address, length) pairs written to `out` and
 * the walk advanced when `out` is given, else only counted.  Returns the number of spans. */
static size_t walk_spans(grid_walk *w, uint64_t want, uint64_t *out)
{
    grid_walk at = *w;
    size_t count = 0;
    uint64_t end = 0;   /* where the last span ends */
    while (want > 0 && at.t < at.nt) {
        uint64_t take = at.lens[at.r] - at.inner, addr = at.bases[at.t] + at.offs[at.r] + at.inner;
        if (take > want) take = want;
        if (take) {
            if (count && addr == end) { if (out) out[2 * count - 1] += take; }
            else { if (out) { out[2 * count] = addr; out[2 * count + 1] = take; } count++; }
            end = addr + take;
            want -= take;
            at.inner += take;
        }
        if (at.inner == at.lens[at.r]) { at.inner = 0; if (++at.r == at.nr) { at.r = 0; at.t++; } }
    }
    if (out) *w = at;
    return count;
}

/* One-sided push: the local grid's bytes land at the remote grid of the owner's directory row (row, stamp,
 * cache id; still answering to `model_id`, unless -1) with no event loop on the owner: each frame is a WRITE
 * naming its own slice of the owner's spans, validated and written by the owner's receiver thread, which answers
 * WRITE_ACK once the bytes landed, or ERROR (status 1: released, unknown or re-keyed, 3: outside the cache).  The
 * job completes once every byte was acknowledged.  Both grids have `nt` tensors and the same `nr` runs' lengths:
 * run r of tensor t is at remote_bases[t] + remote_offs[r] there and local_bases[t] + local_offs[r] here. */
void *adt_net_write(void *net, uint64_t key, int64_t row, uint64_t stamp, uint64_t cache_id, int64_t model_id,
                    const uint64_t *remote_bases, size_t nt, const uint64_t *remote_offs, const uint64_t *lens,
                    size_t nr, const uint64_t *local_bases, const uint64_t *local_offs, int staged)
{
    adt_net *n = (adt_net *)net;
    net_job *j = new_job(1, key);
    if (!j || copied_grid_job(j, local_bases, nt, local_offs, lens, nr, n->frame, n->nconns)) {
        free_job(j);
        return NULL;
    }
    if (staged) staged_frames(n, j);
    j->wframe = calloc(j->nframes ? j->nframes : 1, sizeof *j->wframe);
    j->wframe_len = calloc(j->nframes ? j->nframes : 1, sizeof *j->wframe_len);
    int bad = !j->wframe || !j->wframe_len;
    /* Each frame names the owner's spans of the same stream bytes (frame_start, frame_end). */
    grid_walk remote = {remote_bases, remote_offs, lens, nt, nr, 0, 0, 0};
    for (size_t f = 0; !bad && f < j->nframes; f++) {
        uint64_t want = frame_end(j, f) - frame_start(j, f);
        size_t count = walk_spans(&remote, want, NULL);
        size_t blen = sizeof(adt_hdr) + 16 + 16 * count;
        uint8_t *b = malloc(blen);
        if (!b) { bad = 1; break; }
        adt_hdr h = {NET_MAGIC, T_WRITE, key, stamp, 16 + 16 * count + want, (uint64_t)row, cache_id};
        memcpy(b, &h, sizeof h);
        uint64_t *w = (uint64_t *)(b + sizeof h);
        w[0] = (uint64_t)model_id; w[1] = count;
        walk_spans(&remote, want, w + 2);
        j->wframe[f] = b; j->wframe_len[f] = blen;
    }
    if (bad) { free_job(j); return NULL; }
    return start_send(n, j);
}

/* Stop a job: no new frame is sent or written (a receiver finishes at most one piece).  `how`: 0 just that;
 * CANCEL_TELL_PEER a stopped one-sided read also tells the owner to stop serving it; CANCEL_FENCE a stopped send
 * (a cut-short push) ends only once the peer acknowledged a FENCE on every connection, sent by the I/O threads as
 * soon as none of its frames is in flight (as adt_net_fence, without a second request).  Returns 1 if that fence
 * is armed, 0 if not (the job had ended already, or the link is closed). */
#define CANCEL_TELL_PEER 1
#define CANCEL_FENCE 2
int adt_net_cancel(void *net, void *job, int how)
{
    adt_net *n = (adt_net *)net;
    net_job *j = (net_job *)job;
    int fenced = 0;
    pthread_mutex_lock(&n->lock);
    if (!j->done) {
        j->stop = 1;
        j->ready = 1;
        j->next_frame = j->nframes;
        unqueue(n, j);
        if (how == CANCEL_TELL_PEER && !n->closed && j->kind == 0) queue_ctrl(n, T_ABORT, j->key, 0, NULL, 0, 0, 0);
        if (how == CANCEL_FENCE && !n->closed && j->kind == 1 && !j->fence) { j->fence = 1; fenced = 1; }
    }
    int ann = finish_if_idle(n, j);
    pthread_cond_broadcast(&n->ready);
    pthread_mutex_unlock(&n->lock);
    if (ann) end_job(n, j);
    return fenced;
}

/* Fence transfer `key` that this end sent (a cut-short push, once its send job ended): a FENCE frame on every
 * connection, after whatever of it was sent there; the returned job ends once the peer's receiver threads
 * acknowledged every one, i.e. no byte of the transfer is written on the peer any more, or the link broke
 * (*error then).  The peer stops its receive job of the key, if any.  No event loop takes part. */
void *adt_net_fence(void *net, uint64_t key)
{
    adt_net *n = (adt_net *)net;
    net_job *j = new_job(1, key);
    if (!j) return NULL;
    j->stop = 1;
    j->fence = 1;
    pthread_mutex_lock(&n->lock);
    j->next_all = n->all; n->all = j;
    if (n->closed) j->error = ECONNRESET;
    int ann = finish_if_idle(n, j);
    pthread_mutex_unlock(&n->lock);
    if (ann) end_job(n, j);
    return j;
}

/* 0 running; 1 complete; 2 stopped; 3 stopped and fenced (the peer acknowledged its FENCE on every connection).
 * *error: errno of a failed connection; *status: the owner's ERROR code. */
int adt_net_job_state(void *net, void *job, int *error, int *status)
{
    adt_net *n = (adt_net *)net;
    net_job *j = (net_job *)job;
    pthread_mutex_lock(&n->lock);
    int done = j->done, stop = j->stop, fenced = j->fence == 2 && j->fence_left == 0 && !j->error;
    *error = j->error;
    *status = j->status;
    pthread_mutex_unlock(&n->lock);
    if (!done) return 0;
    return fenced ? 3 : stop ? 2 : 1;
}

/* Whether a requester's job ended (then adt_net_job_state has its outcome): without the lock, so that a waiter
 * can ask at every turn of its event loop. */
int adt_net_job_done(void *job) { return __atomic_load_n(&((net_job *)job)->done, __ATOMIC_ACQUIRE); }

void adt_net_job_free(void *job) { free_job((net_job *)job); }

/* adt_net_job_state of a job that ended, and the job freed (the module's net_reap). */
int adt_net_job_reap(void *net, void *job, int *error, int *status)
{
    int state = adt_net_job_state(net, job, error, status);
    free_job((net_job *)job);
    return state;
}

int adt_net_connections(void *net) { return ((adt_net *)net)->nconns; }

/* The staging ring through which this link sends (receiving 0) or receives (1) device memory: set before the
 * first staged job of that direction, and kept until adt_net_free (the caller frees the ring after it). */
void adt_net_set_stage(void *net, int receiving, void *stage)
{
    adt_net *n = (adt_net *)net;
    pthread_mutex_lock(&n->lock);
    n->stage[receiving ? 1 : 0] = (adt_stage *)stage;
    pthread_mutex_unlock(&n->lock);
}

/* The one-sided READs this link served: accepted, their bytes, refused (stale or outside the cache); then the
 * same for WRITE frames (out: 6 words). */
void adt_net_served(void *net, uint64_t *out)
{
    adt_net *n = (adt_net *)net;
    pthread_mutex_lock(&n->lock);
    for (int i = 0; i < 6; i++) out[i] = n->served[i];
    pthread_mutex_unlock(&n->lock);
}

/* Shut every connection down and fail the jobs; the threads end on their own (adt_net_join waits). */
void adt_net_close(void *net)
{
    adt_net *n = (adt_net *)net;
    pthread_mutex_lock(&n->lock);
    broken(n);
    finish_all_idle(n);
    pthread_mutex_unlock(&n->lock);
}

/* Join the threads (after adt_net_close), close the sockets and free the link (jobs must be freed already). */
void adt_net_free(void *net)
{
    adt_net *n = (adt_net *)net;
    for (int i = 0; i < n->nthreads; i++) pthread_join(n->threads[i], NULL);
    for (int i = 0; i < n->nconns; i++) close(n->fds[i]);
    while (n->ctrl_head) { ctrl_frame *f = n->ctrl_head; n->ctrl_head = f->next; free(f->payload); free(f); }
    for (int i = 0; i < MAX_CONNS; i++) pthread_mutex_destroy(&n->send_lock[i]);
    pthread_cond_destroy(&n->work);
    pthread_cond_destroy(&n->ready);
    pthread_mutex_destroy(&n->lock);
    free(n);
}

/* ---- staged jobs: device memory through the staging rings (stage.c) ---- */

/* Growable span arrays of one thread. */
typedef struct { uint64_t *addr, *len; size_t cap; } span_buf;

static int span_room(span_buf *b, size_t n)
{
    if (n <= b->cap) return 0;
    size_t cap = n > 2 * b->cap ? n : 2 * b->cap;
    uint64_t *a = realloc(b->addr, cap * 8);
    if (!a) return ENOMEM;
    b->addr = a;
    uint64_t *l = realloc(b->len, cap * 8);
    if (!l) return ENOMEM;
    b->len = l;
    b->cap = cap;
    return 0;
}

/* The device spans of bytes [lo, hi) of a send job's stream, merged where they continue; -1 when out of memory. */
static long send_spans(const net_job *j, uint64_t lo, uint64_t hi, span_buf *b)
{
    uint64_t per = j->prefix[j->nr];   /* bytes of one tensor's runs */
    if (!per || hi <= lo) return 0;
    uint64_t rem = lo % per;
    size_t r = run_at(j->prefix, j->nr, rem);
    grid_walk w = {j->bases, j->offs, j->lens, j->nt, j->nr, (size_t)(lo / per), r, rem - j->prefix[r]};
    grid_walk probe = w;
    size_t count = walk_spans(&probe, hi - lo, NULL);
    uint64_t *pairs = malloc((count ? count : 1) * 16);
    if (!pairs || span_room(b, count)) { free(pairs); return -1; }
    walk_spans(&w, hi - lo, pairs);
    for (size_t i = 0; i < count; i++) { b->addr[i] = pairs[2 * i]; b->len[i] = pairs[2 * i + 1]; }
    free(pairs);
    return (long)count;
}

/* The destination spans of bytes [lo, hi) of a receive job's stream (its spans and their running ends). */
static long recv_spans(const net_job *j, uint64_t lo, uint64_t hi, span_buf *b)
{
    size_t first = 0, top = j->n;   /* the first span ending past lo */
    while (first < top) { size_t mid = first + (top - first) / 2; if (j->ends[mid] <= lo) first = mid + 1; else top = mid; }
    size_t count = 0;
    for (size_t i = first; i < j->n && j->ends[i] - j->len[i] < hi; i++) count++;
    if (span_room(b, count)) return -1;
    for (size_t k = 0; k < count; k++) {
        size_t i = first + k;
        uint64_t start = j->ends[i] - j->len[i], a = start > lo ? start : lo, e = j->ends[i] < hi ? j->ends[i] : hi;
        b->addr[k] = j->addr[i] + (a - start);
        b->len[k] = e - a;
    }
    return (long)count;
}

/* Gather frame f of a staged send into a slot (launched, not waited for).  A serve job's gather reads the owner's
 * cache under a reference on its row (*held), which the caller leaves once the gather's event is done: a release
 * waits for the copy, never for the frame's send.  *gone: the row was released meanwhile (nothing launched).
 * 0 or the runtime's code. */
static int gather_frame(adt_net *n, adt_stage *st, int slot, const net_job *j, size_t f, span_buf *b, int *held,
                        int *gone)
{
    *held = *gone = 0;
    if (j->kind == 2) {
        if (!dir_enter(n, j->row, j->stamp)) { *gone = 1; return 0; }
        *held = 1;
    }
    long count = send_spans(j, frame_start(j, f), frame_end(j, f), b);
    if (count < 0) return ENOMEM;
    return adt_stage_copy(st, slot, b->addr, b->len, (size_t)count, 1);
}

/* A staged frame's end on the sending side (under the lock as send_job_frame's): `sent` whether it went out, `dev`
 * the runtime's code of a failed gather, `gone` a served row released meanwhile (either way the job fails, and
 * the peer is told with an ERROR frame). */
static void staged_frame_done(adt_net *n, net_job *j, size_t frame, int err, int sent, int dev, int gone)
{
    pthread_mutex_lock(&n->lock);
    j->inflight--;
    if ((dev || gone) && !j->stop) {
        j->stop = 1;
        if (dev) j->status = STATUS_DEVICE | dev << 8;
        j->next_frame = j->nframes;
        unqueue(n, j);
        if (!n->closed) queue_ctrl(n, T_ERROR, j->key, dev ? STATUS_DEVICE : 1, NULL, 0, 0, 0);
    }
    if (sent) j->moved += frame_end(j, frame) - frame_start(j, frame);
    if (err) { if (!j->error) j->error = err; broken(n); }
    int ann = finish_if_idle(n, j);
    if (j->done && j->kind == 2) { free_job(j); j = NULL; }
    if (err) finish_all_idle(n);
    pthread_mutex_unlock(&n->lock);
    if (ann && j) end_job(n, j);
}

/* Claim the next frame of j for this thread, if it has one left (under the lock); SIZE_MAX if not. */
static size_t claim_next(adt_net *n, net_job *j)
{
    size_t f = SIZE_MAX;
    pthread_mutex_lock(&n->lock);
    if (!j->stop && !n->closed && j->next_frame < j->nframes) {
        f = j->next_frame++;
        j->inflight++;
        if (j->next_frame >= j->nframes) unqueue(n, j);
    }
    pthread_mutex_unlock(&n->lock);
    return f;
}

/* Send frame `frame` of a staged job (claimed, the connection's send lock held, released here): gathered into a
 * slot, its event polled, the slot sent; with a second slot the job's next frames follow on this connection, each
 * gathered while the one before is on the wire.  Returns the errno that broke the connection, or 0. */
static int send_staged(adt_net *n, int index, int fd, net_job *j, size_t frame)
{
    adt_stage *st = n->stage[0];
    span_buf b = {0};
    int slots[2], have = st ? adt_stage_take(st, 2, slots, &j->stop) : 0, err = 0;
    uint64_t chunks = 0, bytes = 0, failed = 0;
    if (!have) {   /* no ring (fails the job), or stopped while waiting for a slot */
        pthread_mutex_unlock(&n->send_lock[index]);
        staged_frame_done(n, j, frame, 0, 0, st ? 0 : ENODEV, 0);
        return 0;
    }
    int held[2] = {0, 0}, gone = 0;
    int dev = adt_stage_bind(st);
    if (!dev) dev = gather_frame(n, st, slots[0], j, frame, &b, &held[0], &gone);
    size_t f = frame;
    while (f != SIZE_MAX) {
        int done = adt_stage_wait(st, slots[0]);   /* (also after a failed launch: what it queued is waited for) */
        if (held[0]) { dir_leave(n, j->row); held[0] = 0; }
        if (!dev) dev = done;
        size_t next = SIZE_MAX;
        int next_dev = 0, next_gone = 0;
        if (have == 2 && !dev && !gone && !err) {
            next = claim_next(n, j);
            if (next != SIZE_MAX) {
                next_dev = gather_frame(n, st, slots[1], j, next, &b, &held[1], &next_gone);
                adt_stage_overlapped(st);
            }
        }
        int sent = 0;
        if (!dev && !gone && !err && !j->stop) {
            uint64_t lo = frame_start(j, f), hi = frame_end(j, f), host = adt_stage_host(st, slots[0]), len = hi - lo;
            adt_hdr h = {NET_MAGIC, T_DATA, j->key, lo, len, 0, 0};
            const uint8_t *head = (const uint8_t *)&h;
            size_t hlen = sizeof h;
            if (j->wframe) { head = j->wframe[f]; hlen = j->wframe_len[f]; }   /* a one-sided WRITE */
            err = adt_send_frame(fd, head, hlen, &host, &len, 0, 1);
            sent = !err;
            chunks++; bytes += len;
        }
        if (dev) failed++;
        if (next == SIZE_MAX) pthread_mutex_unlock(&n->send_lock[index]);   /* before the job may end */
        staged_frame_done(n, j, f, err, sent, dev, gone);
        if (next != SIZE_MAX) {
            int t = slots[0]; slots[0] = slots[1]; slots[1] = t;
            held[0] = held[1]; held[1] = 0;
        }
        f = next;
        dev = next_dev;
        gone = next_gone;
    }
    if (have) adt_stage_give(st, slots, have, chunks, bytes, failed);
    free(b.addr); free(b.len);
    return err;
}

/* The carried frame's scatter on `carry->slot` is done (`dev`: the runtime's code of a failure): the frame is
 * accounted for; the slot stays the caller's. */
static void carried_done(adt_net *n, rx_carry *carry, int dev)
{
    net_job *j = carry->j;
    carry->j = NULL;
    carry->fresh = 0;
    frame_landed(n, j, carry->length, dev ? 0 : (long)carry->length, dev);
}

/* Wait for the carried frame's scatter, account for the frame and give its slot back (nothing carried: no-op). */
static void settle(adt_net *n, rx_carry *carry)
{
    if (!carry || !carry->j) return;
    adt_stage *st = carry->st;
    int slot = carry->slot, dev = adt_stage_wait(st, slot);
    carried_done(n, carry, dev);
    adt_stage_give(st, &slot, 1, 0, 0, dev ? 1 : 0);
}

/* Receive a staged DATA frame (bytes [off, off + length) of j's stream): piece by piece into slots, each scattered
 * into the destination while the next is received.  Returns the bytes landed, or a negative errno when the
 * connection failed; *consumed: the frame's bytes taken from the socket (fewer when j was stopped mid-frame); *dev:
 * the runtime's code of a failed copy (the rest of the frame is then dropped).  Every scatter is waited for before
 * this returns, except, with `carry`, the last one of a whole frame when the next frame's header is already here:
 * that frame is then carried (carry->fresh), and counts as landed once settle (or the next call, reusing its slot)
 * saw its scatter done.  A frame carried from before on the same ring lends its slot: its scatter is waited for
 * before the slot takes a piece of this frame. */
static long recv_staged(adt_net *n, int fd, net_job *j, uint64_t off, uint64_t length, uint8_t *scratch,
                        uint64_t *consumed, int *dev, rx_carry *carry)
{
    static const volatile int32_t always = 1;
    adt_stage *st = n->stage[1];
    if (carry && carry->j && carry->st != st) settle(n, carry);
    int slots[2], pending[2] = {0, 0}, have = 0, k = 0, lent = -1;
    /* The carried slot is the second, with one more if one is free now (never waited for while holding a slot:
     * threads holding one each and waiting for another would wait for each other). */
    if (st && carry && carry->j) {
        have = adt_stage_take(st, 1, slots, &always);
        if (have) { slots[1] = carry->slot; pending[1] = 1; lent = 1; have = 2; }
        else settle(n, carry);
    }
    if (st && !have) have = adt_stage_take(st, 2, slots, &j->stop);
    span_buf b = {0};
    uint64_t done = 0, landed = 0, chunks = 0, failed = 0;
    long failure = 0;
    *dev = !st ? ENODEV : have ? adt_stage_bind(st) : 0;
    while (done < length && have && !*dev && !j->stop) {
        uint64_t piece = length - done < adt_stage_slot_bytes(st) ? length - done : adt_stage_slot_bytes(st);
        if (pending[k]) {
            pending[k] = 0;
            int r = adt_stage_wait(st, slots[k]);
            if (k == lent) { lent = -1; carried_done(n, carry, r); failed += r != 0; r = 0; }   /* (its frame's) */
            if ((*dev = r)) break;
        }
        uint64_t host = adt_stage_host(st, slots[k]), taken = 0;
        long got = adt_recv_frame(fd, &host, &piece, &piece, 1, 0, piece, &j->stop, scratch, SCRATCH, STOP_POLL_MS,
                                  &taken);
        if (got < 0) { failure = got; break; }
        done += taken;
        if ((uint64_t)got < piece) break;   /* stopped mid-piece */
        long count = recv_spans(j, off + done - piece, off + done, &b);
        int r = count < 0 ? ENOMEM : adt_stage_copy(st, slots[k], b.addr, b.len, (size_t)count, 0);
        pending[k] = 1;   /* (a failed launch too: what it queued is waited for) */
        if (r) { *dev = r; break; }
        landed += piece;
        chunks++;
        if (have == 2) k ^= 1;
    }
    /* The last scatter of a whole frame is carried when the next frame's header is already here. */
    int last = have == 2 ? k ^ 1 : 0, keep = -1;
    if (carry && have == 2 && !failure && !*dev && !j->stop && done == length && length && pending[last]
        && lent != last && readable(fd, sizeof(adt_hdr)))
        keep = last;
    for (int i = 0; i < have; i++) {
        if (!pending[i] || i == keep) continue;
        int r = adt_stage_wait(st, slots[i]);
        if (i == lent) { lent = -1; carried_done(n, carry, r); failed += r != 0; continue; }
        if (r && !*dev) *dev = r;
    }
    if (have) {
        int back[2], nback = 0;
        for (int i = 0; i < have; i++) if (i != keep) back[nback++] = slots[i];
        adt_stage_give(st, back, nback, chunks, landed, failed + (*dev ? 1 : 0));
    }
    free(b.addr); free(b.len);
    if (failure) return failure;
    if (*dev || (!have && !j->stop)) {   /* the rest of the frame is dropped; nothing of it counts */
        if (!*dev) *dev = ENODEV;
        long rest = adt_recv_frame(fd, NULL, NULL, NULL, 0, 0, length - done, &always, scratch, SCRATCH, 0, NULL);
        if (rest < 0) return rest;
        *consumed = length;
        return 0;
    }
    if (keep >= 0) {
        carry->j = j; carry->st = st; carry->slot = slots[keep]; carry->length = length; carry->fresh = 1;
        adt_stage_overlapped(st);
    }
    *consumed = done;
    return (long)landed;
}
