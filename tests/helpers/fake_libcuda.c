/* A fake libcuda for CPU tests: "device" memory is shared host memory (memfd, so that IPC handles work across
   processes), each stream a thread. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef void (*CUstreamCallback)(void *, CUresult, void *);
typedef void (*CUhostFn)(void *);

static int env_int(const char *name, int def) { const char *v = getenv(name); return v && *v ? atoi(v) : def; }

/* -- allocations: kind 2 device, kind 1 page-locked host (allocated or registered), kind 3 IPC-opened --
   owned: 0 not ours, 1 malloc'ed, 2 memfd mapping (fd kept for IPC), 3 mapping of another process's memfd */
#define MAXA 65536
static struct { uintptr_t base; size_t size; int kind; int owned; int fd; } al[MAXA];
static int nal;
static size_t dev_bytes;
static pthread_mutex_t amu = PTHREAD_MUTEX_INITIALIZER;
static int find(uintptr_t p, int kind) {
    for (int i = 0; i < nal; i++)
        if ((kind == 0 || al[i].kind == kind) && p >= al[i].base && p < al[i].base + al[i].size) return i;
    return -1;
}
static void add(uintptr_t b, size_t n, int kind, int owned, int fd) {
    pthread_mutex_lock(&amu);
    al[nal].base = b; al[nal].size = n; al[nal].kind = kind; al[nal].owned = owned; al[nal].fd = fd; nal++;
    if (kind == 2) dev_bytes += n;
    pthread_mutex_unlock(&amu);
}
static int drop(uintptr_t b, int kind) { /* 0 or -1 */
    pthread_mutex_lock(&amu);
    int i = find(b, kind);
    if (i < 0 || al[i].base != b) { pthread_mutex_unlock(&amu); return -1; }
    if (al[i].kind == 2) dev_bytes -= al[i].size;
    if (al[i].owned == 1) free((void *)al[i].base);
    if (al[i].owned >= 2) munmap((void *)al[i].base, al[i].size);
    if (al[i].owned == 2) close(al[i].fd);
    al[i] = al[--nal];
    pthread_mutex_unlock(&amu);
    return 0;
}
static int valid(uintptr_t p, size_t n) { /* [p, p+n) inside one known region */
    pthread_mutex_lock(&amu);
    int i = find(p, 0);
    int ok = i >= 0 && p + n <= al[i].base + al[i].size;
    pthread_mutex_unlock(&amu);
    return ok;
}

static int initialized;
static volatile int sticky; /* a sticky device error, e.g. 700 */
static __thread void *cur;
int fake_set_current_calls;
#define NEED_CTX if (!cur) return 201

/* -- streams -- */
enum { OP_COPY, OP_KERNEL, OP_CALLBACK, OP_HOSTFN, OP_EVENT };
typedef struct op { int kind; uintptr_t a, b, c; unsigned n; void *fn, *user; struct op *next; } op;
typedef struct stream { pthread_mutex_t mu; pthread_cond_t cv; op *head, *tail; int busy, stop; pthread_t th; } stream;
/* As the driver's, an event stands for its latest record only: an earlier record still queued completes
   nothing.  state is (records << 1 | done), changed by compare-and-swap: a record op completes the event only
   while no later record was made (the op carries its record's number); t and status are written first. */
typedef struct event { unsigned long state; int status, recorded, timing; double t; } event;
static stream *streams[256];
static int nstreams;
static pthread_mutex_t smu = PTHREAD_MUTEX_INITIALIZER;

static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
/* While set (a test's gate, written through ctypes), every copy and kernel waits before it runs, at most
   60 s: a copy stays "on the GPU" for exactly as long as a test needs, however slow the machine. */
volatile int fake_hold;
static void delay(void) {
    int us = env_int("FAKE_CUDA_DELAY_US", 0);
    if (us > 0) usleep(us);
    for (double until = now() + 60; fake_hold && now() < until;) usleep(100);
}

static void run(stream *s, op *o) {
    if (o->kind == OP_COPY) {
        delay();
        if (sticky) return;
        if (!valid(o->a, o->c) || !valid(o->b, o->c)) { sticky = 700; return; }
        memcpy((void *)o->a, (void *)o->b, o->c);
    } else if (o->kind == OP_KERNEL) {
        delay();
        if (sticky) return;
        const uint64_t *src = (const uint64_t *)o->a, *dst = (const uint64_t *)o->b, *len = (const uint64_t *)o->c;
        if (!valid(o->a, 8ull * o->n) || !valid(o->b, 8ull * o->n) || !valid(o->c, 8ull * o->n)) { sticky = 700; return; }
        for (unsigned i = 0; i < o->n; i++) {
            if (!valid(src[i], len[i]) || !valid(dst[i], len[i])) { sticky = 700; return; }
            memcpy((void *)dst[i], (void *)src[i], len[i]);
        }
    } else if (o->kind == OP_CALLBACK) {
        ((CUstreamCallback)o->fn)(s, sticky, o->user);
    } else if (o->kind == OP_HOSTFN) {
        if (!sticky) ((CUhostFn)o->fn)(o->user);
    } else if (o->kind == OP_EVENT) {
        event *e = (event *)o->user;
        unsigned long mine = (unsigned long)o->c << 1;
        if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) == mine) {
            e->t = now(); e->status = sticky;
            __atomic_compare_exchange_n(&e->state, &mine, mine | 1, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
        }
    }
}
static void *worker(void *arg) {
    stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head) break;
        op *o = s->head; s->head = o->next; if (!s->head) s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->mu);
        run(s, o); free(o);
        pthread_mutex_lock(&s->mu);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}
static CUresult enqueue(stream *s, int kind, uintptr_t a, uintptr_t b, uintptr_t c, unsigned n, void *fn, void *user) {
    if (!s) return 400; /* the tests never use the NULL stream */
    op *o = calloc(1, sizeof *o);
    o->kind = kind; o->a = a; o->b = b; o->c = c; o->n = n; o->fn = fn; o->user = user;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = o; else s->head = o;
    s->tail = o;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 0;
}
static void drain(stream *s) {
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

/* -- API -- */
CUresult cuInit(unsigned flags) { int r = env_int("FAKE_CUDA_INIT", 0); if (!r && !flags) initialized = 1; return flags ? 1 : r; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
static const struct { int code; const char *name, *text; } errs[] = {
    {0, "CUDA_SUCCESS", "no error"}, {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"}, {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"}, {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
};
static int err_index(int code) { for (unsigned i = 0; i < sizeof errs / sizeof errs[0]; i++) if (errs[i].code == code) return i; return -1; }
CUresult cuGetErrorName(CUresult e, const char **s) { int i = err_index(e); *s = i < 0 ? NULL : errs[i].name; return i < 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { int i = err_index(e); *s = i < 0 ? NULL : errs[i].text; return i < 0; }
CUresult cuDeviceGetCount(int *n) { if (!initialized) return 3; *n = env_int("FAKE_CUDA_DEVICES", 1); return 0; }
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal < 0 || ordinal >= env_int("FAKE_CUDA_DEVICES", 1)) return 101; *d = ordinal; return 0; }
CUresult cuDeviceGetName(char *name, int len, int dev) { snprintf(name, len, "Fake GPU %d", dev); return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) { *v = attr == 16 ? 4 : attr == 75 ? 9 : attr == 76 ? 0 : 1; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(uintptr_t)(0x1000 + dev); return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { return 0; }
CUresult cuCtxSetCurrent(void *ctx) {
    if (env_int("FAKE_CUDA_FAIL_SET_CURRENT", 0)) return 201;
    cur = ctx; fake_set_current_calls++; return 0;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = cur; return 0; }
CUresult cuCtxSynchronize(void) {
    NEED_CTX;
    pthread_mutex_lock(&smu);
    for (int i = 0; i < nstreams; i++) drain(streams[i]);
    pthread_mutex_unlock(&smu);
    return sticky;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    NEED_CTX;
    if (!n) return 1;
    size_t limit = (size_t)env_int("FAKE_CUDA_MEM_LIMIT", 0);
    if (limit && dev_bytes + n > limit) return 2;
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0) return 2;
    void *m = ftruncate(fd, (off_t)n) ? MAP_FAILED : mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) { close(fd); return 2; }
    memset(m, 0xCD, n);
    add((uintptr_t)m, n, 2, 2, fd); *p = (uintptr_t)m; return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) { NEED_CTX; return drop(p, 2) ? 1 : 0; }
static CUresult sync_copy(uintptr_t d, uintptr_t s, size_t n, int dkind, int skind) {
    NEED_CTX;
    if (sticky) return sticky;
    pthread_mutex_lock(&amu);
    int okd = dkind ? find(d, dkind) >= 0 : 1, oks = skind ? find(s, skind) >= 0 : 1;
    pthread_mutex_unlock(&amu);
    if (!okd || !oks) return 1;
    memcpy((void *)d, (void *)s, n); return 0;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { return sync_copy(d, (uintptr_t)s, n, 2, 0); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { return sync_copy((uintptr_t)d, s, n, 0, 2); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return sync_copy(d, s, n, 2, 2); }
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { NEED_CTX; if (!valid(d, n)) return 1; memset((void *)d, v, n); return 0; }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, void *st) { NEED_CTX; return enqueue(st, OP_COPY, d, s, n, 0, 0, 0); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, void *st) {
    NEED_CTX;
    if (env_int("FAKE_CUDA_FAIL_HTOD", 0)) return 1;
    pthread_mutex_lock(&amu);
    int ok = find(d, 2) >= 0 && find((uintptr_t)s, 1) >= 0; /* the executor stages descriptors in pinned memory */
    pthread_mutex_unlock(&amu);
    return ok ? enqueue(st, OP_COPY, d, (uintptr_t)s, n, 0, 0, 0) : 1;
}
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    NEED_CTX;
    pthread_mutex_lock(&amu);
    int dup = find((uintptr_t)p, 1) >= 0;
    pthread_mutex_unlock(&amu);
    if (dup) return 712;
    if (flags != 3) return 1;
    add((uintptr_t)p, n, 1, 0, -1); return 0;
}
CUresult cuMemHostUnregister(void *p) { NEED_CTX; return drop((uintptr_t)p, 1) ? 713 : 0; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) {
    NEED_CTX; pthread_mutex_lock(&amu); int i = find((uintptr_t)p, 1); pthread_mutex_unlock(&amu);
    if (i < 0 || flags) return 1;
    *d = (uintptr_t)p; return 0;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    NEED_CTX;
    if (!n) return 1;
    *p = aligned_alloc(4096, (n + 4095) & ~(size_t)4095);
    if (!*p) return 2;
    add((uintptr_t)*p, n, 1, 1, -1); return 0;
}
CUresult cuMemFreeHost(void *p) { NEED_CTX; return drop((uintptr_t)p, 1) ? 1 : 0; }
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    NEED_CTX; pthread_mutex_lock(&amu); int i = find(p, 2); if (i < 0) i = find(p, 3);
    if (i >= 0) { *base = al[i].base; *size = al[i].size; }
    pthread_mutex_unlock(&amu); return i < 0;
}
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    pthread_mutex_lock(&amu); int i = find(p, 0); int kind = i < 0 ? 0 : al[i].kind; pthread_mutex_unlock(&amu);
    if (attr != 2 || !kind) return 1;
    *(unsigned *)data = kind == 1 ? 1 : 2; return 0;
}
CUresult cuStreamCreate(void **out, unsigned flags) {
    NEED_CTX;
    if (flags != 1) return 1;
    stream *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL); pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->th, NULL, worker, s);
    pthread_mutex_lock(&smu); streams[nstreams++] = s; pthread_mutex_unlock(&smu);
    *out = s; return 0;
}
CUresult cuStreamSynchronize(void *st) { NEED_CTX; drain(st); return sticky; }
CUresult cuStreamQuery(void *st) {
    stream *s = st;
    pthread_mutex_lock(&s->mu); int idle = !s->head && !s->busy; pthread_mutex_unlock(&s->mu);
    return sticky ? sticky : idle ? 0 : 600;
}
CUresult cuStreamDestroy_v2(void *st) {
    NEED_CTX;
    stream *s = st;
    pthread_mutex_lock(&smu);
    for (int i = 0; i < nstreams; i++) if (streams[i] == s) { streams[i] = streams[--nstreams]; break; }
    pthread_mutex_unlock(&smu);
    pthread_mutex_lock(&s->mu); s->stop = 1; pthread_cond_broadcast(&s->cv); pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL); free(s); return 0;
}
CUresult cuStreamAddCallback(void *st, CUstreamCallback fn, void *user, unsigned flags) {
    NEED_CTX;
    if (flags || env_int("FAKE_CUDA_FAIL_CALLBACK", 0)) return 1;
    return enqueue(st, OP_CALLBACK, 0, 0, 0, 0, (void *)fn, user);
}
CUresult cuLaunchHostFunc(void *st, CUhostFn fn, void *user) { NEED_CTX; return enqueue(st, OP_HOSTFN, 0, 0, 0, 0, (void *)fn, user); }
CUresult cuEventCreate(void **e, unsigned flags) {
    NEED_CTX;
    event *made = calloc(1, sizeof(event));
    made->timing = !(flags & 2); /* CU_EVENT_DISABLE_TIMING */
    *e = made; return 0;
}
CUresult cuEventDestroy_v2(void *e) { free(e); return 0; }
CUresult cuEventRecord(void *e, void *st) {
    NEED_CTX;
    if (env_int("FAKE_CUDA_FAIL_EVENT", 0)) return 1;
    event *ev = e;
    unsigned long was = __atomic_load_n(&ev->state, __ATOMIC_RELAXED), next;
    do next = ((was >> 1) + 1) << 1; while (!__atomic_compare_exchange_n(&ev->state, &was, next, 0, __ATOMIC_ACQ_REL,
                                                                        __ATOMIC_RELAXED));
    ev->recorded = 1;
    return enqueue(st, OP_EVENT, 0, 0, next >> 1, 0, 0, e);
}
static int event_done(event *e) { return __atomic_load_n(&e->state, __ATOMIC_ACQUIRE) & 1; }
/* An event never recorded counts as complete, as the driver's does. */
CUresult cuEventQuery(void *e) { return !((event *)e)->recorded || event_done(e) ? ((event *)e)->status : 600; }
CUresult cuEventSynchronize(void *e) {
    while (((event *)e)->recorded && !event_done(e)) usleep(100);
    return ((event *)e)->status;
}
/* As the driver: both events made with timing and recorded (else CUDA_ERROR_INVALID_HANDLE), both complete
   (else CUDA_ERROR_NOT_READY). */
CUresult cuEventElapsedTime(float *ms, void *a, void *b) {
    event *start = a, *end = b;
    if (!start->timing || !end->timing || !start->recorded || !end->recorded) return 400;
    if (!event_done(start) || !event_done(end)) return 600;
    *ms = (float)((end->t - start->t) * 1e3); return 0;
}
CUresult cuModuleLoadData(void **m, const void *image) {
    NEED_CTX;
    const char *text = image;
    if (!strstr(text, ".entry adt_copy_spans(") || !strstr(text, "\n.version ")) return 218;
    *m = (void *)0x2000; return 0;
}
CUresult cuModuleUnload(void *m) { return m == (void *)0x2000 ? 0 : 400; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
    if (m != (void *)0x2000) return 400;
    if (strcmp(name, "adt_copy_spans")) return 500;
    *f = (void *)0x3000; return 0;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *st, void **params, void **extra) {
    NEED_CTX;
    if (env_int("FAKE_CUDA_FAIL_LAUNCH", 0)) return 1;
    if (f != (void *)0x3000 || !gx || gy != 1 || gz != 1 || bx < 16 || bx > 256 || by != 1 || bz != 1 || shmem || extra) return 1;
    uint64_t src = *(uint64_t *)params[0], dst = *(uint64_t *)params[1], len = *(uint64_t *)params[2];
    unsigned n = *(unsigned *)params[3];
    pthread_mutex_lock(&amu); /* descriptors must be device memory */
    int ok = find(src, 2) >= 0 && find(dst, 2) >= 0 && find(len, 2) >= 0;
    pthread_mutex_unlock(&amu);
    if (!ok || gx > n) return 1;
    return enqueue(st, OP_KERNEL, src, dst, len, n, 0, 0);
}
static const char magic[8] = "FAKEIPC", tail[8] = "IPCTAIL";
CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    NEED_CTX; pthread_mutex_lock(&amu); int i = find(p, 2); uintptr_t b = i < 0 ? 0 : al[i].base; size_t n = i < 0 ? 0 : al[i].size;
    int fd = i < 0 ? -1 : al[i].fd, pid = getpid();
    pthread_mutex_unlock(&amu);
    if (i < 0) return 1;
    memset(h, 0, sizeof *h); memcpy(h->reserved, magic, 8); memcpy(h->reserved + 8, &b, 8);
    memcpy(h->reserved + 16, &n, 8); memcpy(h->reserved + 24, &pid, 4); memcpy(h->reserved + 28, &fd, 4);
    memcpy(h->reserved + 56, tail, 8); return 0;
}
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    NEED_CTX;
    if (memcmp(h.reserved, magic, 8) || memcmp(h.reserved + 56, tail, 8) || flags != 1) return 1;
    uintptr_t b; size_t n; int pid, fd;
    memcpy(&b, h.reserved + 8, 8); memcpy(&n, h.reserved + 16, 8);
    memcpy(&pid, h.reserved + 24, 4); memcpy(&fd, h.reserved + 28, 4);
    if (pid != getpid()) { /* another process: map its memfd (at another address) */
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
        int mine = open(path, O_RDWR | O_CLOEXEC);
        if (mine < 0) return 400;
        void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0);
        close(mine);
        if (m == MAP_FAILED) return 2;
        add((uintptr_t)m, n, 3, 3, -1); *p = (uintptr_t)m; return 0;
    }
    /* this process (not allowed by CUDA, convenient here): the same bytes, registered as IPC-opened */
    pthread_mutex_lock(&amu); int already = find(b, 3) >= 0; pthread_mutex_unlock(&amu);
    if (already) return 208;
    add(b, n, 3, 0, -1); *p = b; return 0;
}
CUresult cuIpcCloseMemHandle(CUdeviceptr p) { NEED_CTX; return drop(p, 3) ? 1 : 0; }
void fake_reset(void) { sticky = 0; }
/* A device fault from now on (a sticky error, e.g. 700 CUDA_ERROR_ILLEGAL_ADDRESS), until fake_reset. */
void fake_fault(int code) { sticky = code; }
