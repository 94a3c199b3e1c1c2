/* Staging rings: page-locked host memory through which the TCP plane's I/O threads move device memory.
 *
 * A ring is a few slots of page-locked host memory, each with a lane of its own (a stream and the descriptor
 * memory of the pointer-list kernel, adt.h) and an event.  A sender thread gathers a frame's device spans into a
 * slot with one launch and sends the slot; a receiver thread receives into a slot and scatters it into device
 * memory with one launch.  A slot is taken while free and given back once its event says the device is done with
 * it (the thread that launched the copy polls that event itself: no driver callback thread, no Python).
 * Everything here goes through the device-runtime table (adt_device_ops): no runtime's types or calls.
 */
#include "adt.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>

#define SPIN_NS 50000u       /* a copy's event is polled this long yielding the CPU in between, then between
                              * 10 us sleeps (a chunk's copy over the bus takes 40-80 us on a GPU) */
#define TAKE_POLL_NS 2000000 /* a thread waiting for a free slot looks at its job's stop this often */

struct adt_stage {
    const adt_device_ops *ops;
    void *device;
    uint64_t slot_bytes;
    int nslots;
    adt_stage_slot *slots;
    unsigned char *busy;
    pthread_mutex_t lock;
    pthread_cond_t freed;
    uint64_t stats[ADT_STAGE_STATS];
};

void *adt_stage_new(const adt_device_ops *ops, void *device, uint64_t slot_bytes, const adt_stage_slot *slots, int n)
{
    if (!ops || n <= 0 || !slot_bytes) return NULL;
    adt_stage *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->slots = malloc((size_t)n * sizeof *st->slots);
    st->busy = calloc((size_t)n, 1);
    if (!st->slots || !st->busy) { free(st->slots); free(st->busy); free(st); return NULL; }
    memcpy(st->slots, slots, (size_t)n * sizeof *st->slots);
    st->ops = ops; st->device = device; st->slot_bytes = slot_bytes; st->nslots = n;
    pthread_mutex_init(&st->lock, NULL);
    pthread_cond_init(&st->freed, NULL);
    return st;
}

/* Free a ring no thread uses any more (its link's I/O threads have ended); its memory is the caller's. */
void adt_stage_free(void *stage)
{
    adt_stage *st = stage;
    if (!st) return;
    pthread_cond_destroy(&st->freed);
    pthread_mutex_destroy(&st->lock);
    free(st->slots); free(st->busy); free(st);
}

/* chunks moved, their bytes, waits for a free slot, device copies that failed, copies that overlapped another
 * frame's wire time (ADT_STAGE_STATS words). */
void adt_stage_stats(void *stage, uint64_t *out)
{
    adt_stage *st = stage;
    pthread_mutex_lock(&st->lock);
    memcpy(out, st->stats, sizeof st->stats);
    pthread_mutex_unlock(&st->lock);
}

uint64_t adt_stage_slot_bytes(const adt_stage *st) { return st->slot_bytes; }

uint64_t adt_stage_host(const adt_stage *st, int slot) { return st->slots[slot].host; }

/* Take up to `want` free slots into out[]: waits while none is free, unless *stop is set (then 0). */
int adt_stage_take(adt_stage *st, int want, int *out, const volatile int32_t *stop)
{
    int got = 0, waited = 0;
    pthread_mutex_lock(&st->lock);
    for (;;) {
        for (int i = 0; i < st->nslots && got < want; i++)
            if (!st->busy[i]) { st->busy[i] = 1; out[got++] = i; }
        if (got || *stop) break;
        waited = 1;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_nsec += TAKE_POLL_NS;
        if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&st->freed, &st->lock, &until);
    }
    st->stats[2] += (uint64_t)waited;
    pthread_mutex_unlock(&st->lock);
    return got;
}

/* Give slots back (their copies are done); `chunks` and `bytes` they moved are counted, `failed` copies too. */
void adt_stage_give(adt_stage *st, const int *slots, int n, uint64_t chunks, uint64_t bytes, uint64_t failed)
{
    pthread_mutex_lock(&st->lock);
    for (int i = 0; i < n; i++) st->busy[slots[i]] = 0;
    st->stats[0] += chunks; st->stats[1] += bytes; st->stats[3] += failed;
    pthread_cond_broadcast(&st->freed);
    pthread_mutex_unlock(&st->lock);
}

int adt_stage_bind(adt_stage *st) { return st->ops->bind(st->ops->ctx, st->device); }

/* A gather launched while the frame before it is sent, or a frame's last scatter carried into the next frame. */
void adt_stage_overlapped(adt_stage *st)
{
    pthread_mutex_lock(&st->lock);
    st->stats[4]++;
    pthread_mutex_unlock(&st->lock);
}

/* Wait for what was queued on a slot's lane: its event recorded and polled until ready.  Never gives up early: a
 * launched copy is waited for, whatever stopped its job.  0, or the runtime's code. */
static int slot_sync(adt_stage *st, int slot)
{
    const adt_device_ops *ops = st->ops;
    adt_stage_slot *s = &st->slots[slot];
    int r = ops->record(ops->ctx, s->event, s->lane.stream);
    if (r) return r;
    uint64_t start = now_ns();
    for (;;) {
        int code = 0, q = ops->query(ops->ctx, s->event, s->lane.stream, &code);
        if (q == ADT_EVENT_READY) return 0;
        if (q == ADT_EVENT_FAILED) return code ? code : -1;
        if (now_ns() - start < SPIN_NS) { sched_yield(); continue; }   /* (a copy on the CPU may need this core) */
        /* The default timer slack (50 us) would stretch each sleep to five times its length. */
        prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
        struct timespec pause = {0, 10000};
        nanosleep(&pause, NULL);
    }
}

/* One or more launches copying n spans between device memory and the slot's host memory (from `off` on, back to
 * back): more descriptors than the lane holds are halved, each half waited for before the next reuses the lane's
 * descriptor memory.  0, or the runtime's code. */
static int slot_launch(adt_stage *st, int slot, const uint64_t *addr, const uint64_t *len, size_t n, uint64_t off,
                       int to_host)
{
    const adt_device_ops *ops = st->ops;
    adt_stage_slot *s = &st->slots[slot];
    uint64_t host = s->host + off;
    int r = to_host ? ops->gather(ops->ctx, &s->lane, addr, len, n, host)
                    : ops->scatter(ops->ctx, &s->lane, host, addr, len, n);
    if (r != ADT_DEVICE_NO_ROOM) return r;
    if (n == 1) {   /* one span of more pieces than the lane holds: its halves */
        if (len[0] < 2) return r;
        uint64_t a[2] = {addr[0], addr[0] + len[0] / 2}, l[2] = {len[0] / 2, len[0] - len[0] / 2};
        return slot_launch(st, slot, a, l, 2, off, to_host);
    }
    size_t half = n / 2;
    uint64_t first = 0;
    for (size_t i = 0; i < half; i++) first += len[i];
    if ((r = slot_launch(st, slot, addr, len, half, off, to_host))) return r;
    if ((r = slot_sync(st, slot))) return r;
    return slot_launch(st, slot, addr + half, len + half, n - half, off + first, to_host);
}

int adt_stage_copy(adt_stage *st, int slot, const uint64_t *addr, const uint64_t *len, size_t n, int to_host)
{
    return slot_launch(st, slot, addr, len, n, 0, to_host);
}

int adt_stage_wait(adt_stage *st, int slot) { return slot_sync(st, slot); }
