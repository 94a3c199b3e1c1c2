/* The worker pool.  Jobs are span lists cut into chunks, or grids (grid.c) cut into byte ranges; POSIX threads take
 * chunks round-robin across jobs and never touch Python, so copies overlap with the event loop instead of
 * contending for the GIL.  A finished (or stopped) job is announced by writing its address to the job's notify
 * pipe; the event loop then reaps (adt_job_reap) exactly the jobs that ended.  Modes: 0 = memcpy within this
 * process, 1 = process_vm_readv (remote source), 2 = process_vm_writev (remote destination).
 */
#include "adt.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

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
    adt_grid *grid;                    /* a grid job: chunks are byte ranges of the grid's stream (bounds unused) */
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

/* Runs chunk c of a grid job (a worker, without the mutex): 0 or an errno. */
static int run_grid_chunk(adt_job *j, size_t c)
{
    uint64_t total = adt_grid_bytes(j->grid);
    uint64_t b0 = (uint64_t)c * j->chunk, b1 = b0 + j->chunk < total ? b0 + j->chunk : total;
    int err = adt_grid_copy(j->grid, b0, b1, j->mode, j->pid, j->streaming, &j->stop);
    return err < 0 ? 0 : err;
}

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

/* Queue a grid job: its chunks are `chunk`-byte ranges of the grid's stream (the job owns g from now on); NULL when
 * out of memory (g freed). */
void *adt_pool_submit_grid(void *pool, adt_grid *g, uint64_t chunk, int mode, int pid, int streaming, int notify_fd)
{
    adt_job *j = calloc(1, sizeof *j);
    if (!j) { adt_grid_free(g); return NULL; }
    uint64_t total = adt_grid_bytes(g);
    j->grid = g; j->chunk = chunk;
    j->nchunks = total ? (size_t)((total + chunk - 1) / chunk) : 0;
    j->mode = mode; j->pid = pid; j->streaming = streaming; j->notify_fd = notify_fd;
    j->nbytes = total;
    return submit((adt_pool *)pool, j);
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

void adt_job_free(void *job)
{
    adt_job *j = (adt_job *)job;
    if (j->grid) adt_grid_free(j->grid);
    free(j);
}

/* A job's end, for the event loop: 0 while workers may touch it; else 1 (done) or 2 (stopped), with *error its
 * errno (0: none), and the job freed (its handle is then invalid). */
int adt_job_reap(void *job, int *error)
{
    adt_job *j = (adt_job *)job;
    if (!__atomic_load_n(&j->done, __ATOMIC_ACQUIRE)) return 0;
    int state = __atomic_load_n(&j->stop, __ATOMIC_RELAXED) ? 2 : 1;
    *error = j->error;
    adt_job_free(j);
    return state;
}
