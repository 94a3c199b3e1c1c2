/* An emulated Ascend ACL runtime (a fake libascendcl.so) for CPU tests: "device" memory is shared host memory
   (memfd, so that IPC export keys import in other processes through /proc/<pid>/fd/<fd>), each stream a thread.
   It refuses what CANN's documentation says the real runtime refuses, with the real codes
   (tests/helpers/fake_acl.py lists the rules, knobs and hooks). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int aclError;
enum {
    OK = 0, INVALID_PARAM = 100000, UNINITIALIZE = 100001, REPEAT_INITIALIZE = 100002, REPEAT_FINALIZE = 100037,
    API_NOT_SUPPORT = 200001, RT_PARAM_INVALID = 107000, RT_INVALID_DEVICEID = 107001, RT_CONTEXT_NULL = 107002,
    RT_STREAM_CONTEXT = 107003, RT_FEATURE_NOT_SUPPORT = 207000, RT_MEMORY_ALLOCATION = 207001,
    RT_INTERNAL_ERROR = 507000, RT_IPC_ERROR = 507022, RT_STREAM_SYNC_TIMEOUT = 507046,
    RT_EVENT_SYNC_TIMEOUT = 507047, RT_DEVICE_MEM_ERROR = 507053,
};
enum { H2H = 0, H2D = 1, D2H = 2, D2D = 3, KIND_DEFAULT = 4 };
enum { LOC_HOST = 0, LOC_DEVICE = 1, LOC_UNREGISTERED = 2 };
#define HUGE_PAGE ((size_t)2 << 20)
#define SMALL_PAGE ((size_t)4096)
#define KEY_LEN 65
#define MAXDEV 64
#define WHITELIST 64

typedef struct { uint32_t id; int type; } aclrtMemLocation;
typedef struct { aclrtMemLocation dstLoc, srcLoc; uint8_t rsv[16]; } aclrtMemcpyBatchAttr;
typedef struct { aclrtMemLocation location; uint32_t pageSize; uint32_t rsv[4]; } aclrtPtrAttributes;

static long long env_ll(const char *name, long long def) { const char *v = getenv(name); return v && *v ? strtoll(v, NULL, 0) : def; }
static int env_int(const char *name, int def) { return (int)env_ll(name, def); }
static double now(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + ts.tv_nsec * 1e-9; }
static int version(void) { return env_int("FAKE_ACL_VERSION", 9) >= 9 ? 9 : 8; }
static int bare_tgid(void) { return getpid() + env_int("FAKE_ACL_TGID_OFFSET", 0); }
static void bump(int *counter) { __atomic_add_fetch(counter, 1, __ATOMIC_RELAXED); }

/* -- hooks and counters (ctypes reads and writes them) -- */
volatile int fake_hold;     /* while set, every stream task waits before it runs (at most 60 s) */
static volatile int fault;  /* every copy task fails with this code until fake_reset */
int fake_sync_copies;       /* aclrtMemcpy, and asynchronous copies run in the caller (pageable host memory) */
int fake_async_copies;      /* copy tasks queued on a stream */
int fake_batches;           /* successful aclrtMemcpyBatchAsync calls */
int fake_set_device_calls;
void fake_fault(int code) { fault = code; }
void fake_reset(void) { fault = 0; }

/* -- the per-thread message of aclGetRecentErrMsg -- */
static __thread char message[512];
static aclError failv(aclError code, const char *fn, const char *fmt, va_list ap) {
    int n = snprintf(message, sizeof message, "fake ACL: %s: ", fn);
    if (n > 0 && (size_t)n < sizeof message) vsnprintf(message + n, sizeof message - (size_t)n, fmt, ap);
    size_t len = strlen(message);
    snprintf(message + len, sizeof message - len, " (error %d)", code);
    return code;
}
static aclError fail_in(aclError code, const char *fn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static aclError fail_in(aclError code, const char *fn, const char *fmt, ...) {
    va_list ap; va_start(ap, fmt); failv(code, fn, fmt, ap); va_end(ap); return code;
}
#define FAIL(code, ...) fail_in(code, __func__, __VA_ARGS__)
const char *aclGetRecentErrMsg(void) { return message[0] ? message : NULL; }

/* -- init, devices, contexts --
   A device's default context (aclrtSetDevice) is one per process, shared by every thread that sets the device,
   and current on the calling thread only.  It lives while the process-wide SetDevice count is above 0. */
#define CTX_MAGIC 0xAC1C0E7Eu
struct stream;
typedef struct context { uint32_t magic; int dev, is_default; volatile int alive; struct stream *null_stream; } context;
static int inits, ndev;
static context defaults[MAXDEV];
static int default_refs[MAXDEV];
static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static __thread context *cur;

#define NEED_INIT do { if (!inits) return FAIL(UNINITIALIZE, "aclInit was not called (or aclFinalize was)"); } while (0)
#define NEED_CTX do { NEED_INIT; if (!cur || !cur->alive) \
    return FAIL(RT_CONTEXT_NULL, "no current context on this thread (call aclrtSetDevice or aclrtSetCurrentContext on it first)"); } while (0)
#define NEED(cond, what) do { if (!(cond)) return FAIL(INVALID_PARAM, "%s", what); } while (0)

aclError aclInit(const char *config) {
    (void)config;
    int forced = env_int("FAKE_ACL_INIT", 0);
    if (forced) return FAIL(forced, "FAKE_ACL_INIT=%d", forced);
    if (inits) { inits++; return FAIL(REPEAT_INITIALIZE, "aclInit was called already (harmless)"); }
    ndev = env_int("FAKE_ACL_DEVICES", 2);
    if (ndev < 0) ndev = 0;
    if (ndev > MAXDEV) ndev = MAXDEV;
    for (int i = 0; i < MAXDEV; i++) { defaults[i].magic = CTX_MAGIC; defaults[i].dev = i; defaults[i].is_default = 1; }
    inits = 1;
    return OK;
}
aclError aclFinalize(void) {
    if (!inits) return FAIL(REPEAT_FINALIZE, "not initialised");
    inits = 0; return OK;
}
aclError aclFinalizeReference(uint64_t *count) {
    NEED(count, "refCount is NULL");
    if (!inits) return FAIL(REPEAT_FINALIZE, "not initialised");
    *count = (uint64_t)--inits; return OK;
}
aclError aclrtGetVersion(int32_t *major, int32_t *minor, int32_t *patch) {
    NEED(major && minor && patch, "NULL argument");
    *major = 1; *minor = version() >= 9 ? 17 : 16; *patch = 0; return OK;
}
aclError aclsysGetVersionStr(char *pkg, char *text) {
    (void)pkg;
    NEED(text, "versionStr is NULL");
    snprintf(text, 128, "%s", version() >= 9 ? "9.0.0" : "8.5.0"); return OK;
}
aclError aclrtGetDeviceCount(uint32_t *n) { NEED_INIT; NEED(n, "count is NULL"); *n = (uint32_t)ndev; return OK; }
aclError aclrtSetDevice(int32_t dev) {
    NEED_INIT;
    if (dev < 0 || dev >= ndev) return FAIL(RT_INVALID_DEVICEID, "device %d does not exist (%d devices)", dev, ndev);
    pthread_mutex_lock(&cmu);
    default_refs[dev]++; defaults[dev].alive = 1;
    pthread_mutex_unlock(&cmu);
    cur = &defaults[dev]; bump(&fake_set_device_calls);
    return OK;
}
static aclError reset_device(int32_t dev, int force, const char *fn) {
    NEED_INIT;
    if (dev < 0 || dev >= ndev) return fail_in(RT_INVALID_DEVICEID, fn, "device %d does not exist", dev);
    pthread_mutex_lock(&cmu);
    if (default_refs[dev] > 0) default_refs[dev] = force ? 0 : default_refs[dev] - 1;
    if (!default_refs[dev]) defaults[dev].alive = 0; /* the default context is gone for every thread */
    pthread_mutex_unlock(&cmu);
    if (cur == &defaults[dev] && !defaults[dev].alive) cur = NULL;
    return OK;
}
aclError aclrtResetDevice(int32_t dev) { return reset_device(dev, 0, __func__); }
aclError aclrtResetDeviceForce(int32_t dev) { return reset_device(dev, 1, __func__); }
aclError aclrtGetDevice(int32_t *dev) { NEED_CTX; NEED(dev, "deviceId is NULL"); *dev = cur->dev; return OK; }
static int is_context(const void *p) { const context *c = p; return c && c->magic == CTX_MAGIC; }
aclError aclrtCreateContext(void **out, int32_t dev) {
    NEED_INIT;
    NEED(out, "context is NULL");
    if (dev < 0 || dev >= ndev) return FAIL(RT_INVALID_DEVICEID, "device %d does not exist (%d devices)", dev, ndev);
    context *c = calloc(1, sizeof *c);
    c->magic = CTX_MAGIC; c->dev = dev; c->alive = 1;
    cur = c; *out = c; return OK;
}
aclError aclrtDestroyContext(void *ctx) {
    NEED_INIT;
    context *c = ctx;
    if (!is_context(c) || c->is_default || !c->alive) return FAIL(RT_PARAM_INVALID, "%p is not a context made by aclrtCreateContext", ctx);
    c->alive = 0; /* kept (never freed): other threads may still name it, and fail with 107002 */
    if (cur == c) cur = NULL;
    return OK;
}
aclError aclrtSetCurrentContext(void *ctx) {
    NEED_INIT;
    NEED(ctx, "context is NULL");
    context *c = ctx;
    if (!is_context(c) || !c->alive) return FAIL(RT_PARAM_INVALID, "%p is not a live context", ctx);
    cur = c; return OK;
}
aclError aclrtGetCurrentContext(void **ctx) { NEED_CTX; NEED(ctx, "context is NULL"); *ctx = cur; return OK; }

/* -- memory regions: R_DEV (aclrtMalloc), R_IMP (imported by key), R_HOST (aclrtMallocHost), R_REG (a range
   registered with aclrtHostRegisterV2).  R_HOST and R_REG are page-locked host memory. -- */
enum { R_DEV = 1, R_IMP, R_HOST, R_REG };
typedef struct ctl ctl;
typedef struct {
    uintptr_t base; size_t size;   /* as ACL reports it (aclrtMalloc: rounded to 32 bytes, plus 32) */
    uintptr_t map; size_t maplen;  /* what to munmap (0: nothing) */
    int type, dev, page, fd;       /* fd: the memfd of an R_DEV */
    int exporter_dev, exports;     /* R_IMP: the exporter's device; R_DEV: live exports */
    ctl *control; int slot;        /* R_IMP: the export's control page, the importer slot taken */
    char key[KEY_LEN];             /* R_IMP: the key it was imported by */
} region;
#define MAXR 65536
static region rg[MAXR];
static int nrg;
static size_t dev_bytes[MAXDEV];
/* Readers: lookups and every copy (a copy's spans are checked and copied under the read lock, so that memory
   cannot be unmapped under it); writers: allocation, free, import, close. */
static pthread_rwlock_t rw = PTHREAD_RWLOCK_INITIALIZER;
static int find(uintptr_t p) { for (int i = 0; i < nrg; i++) if (p >= rg[i].base && p < rg[i].base + rg[i].size) return i; return -1; }
static int is_dev(int i) { return i >= 0 && (rg[i].type == R_DEV || rg[i].type == R_IMP); }
static int is_locked_host(int i) { return i >= 0 && (rg[i].type == R_HOST || rg[i].type == R_REG); }
static int foreign(int i) { return i >= 0 && rg[i].type == R_IMP && rg[i].exporter_dev != rg[i].dev; }
static int inside(int i, uintptr_t p, size_t n) { return i >= 0 && p >= rg[i].base && p + n <= rg[i].base + rg[i].size && p + n >= p; }
static int add_region(region r) {
    if (nrg >= MAXR) return -1;
    rg[nrg] = r; return nrg++;
}
static void drop_region(int i) {
    if (rg[i].maplen) munmap((void *)rg[i].map, rg[i].maplen);
    if (rg[i].fd >= 0) close(rg[i].fd);
    rg[i] = rg[--nrg];
}

/* Map len bytes of fd (from off) at an address aligned to align: reserve len + align, map over the aligned part,
   trim the rest. */
static void *map_aligned(int fd, off_t off, size_t len, size_t align) {
    size_t total = len + align;
    uint8_t *area = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (area == MAP_FAILED) return MAP_FAILED;
    uintptr_t at = ((uintptr_t)area + align - 1) / align * align;
    void *m = mmap((void *)at, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, off);
    if (m == MAP_FAILED) { munmap(area, total); return MAP_FAILED; }
    if (at > (uintptr_t)area) munmap(area, at - (uintptr_t)area);
    uintptr_t end = at + len, area_end = (uintptr_t)area + total;
    if (end < area_end) munmap((void *)end, area_end - end);
    return m;
}
static size_t mem_limit(void) { long long v = env_ll("FAKE_ACL_MEM_LIMIT", 0); return v > 0 ? (size_t)v : (size_t)16 << 30; }

aclError aclrtMalloc(void **p, size_t n, int policy) {
    NEED_CTX;
    NEED(p, "devPtr is NULL");
    if (!n) return FAIL(INVALID_PARAM, "size 0");
    if (policy < 0 || policy > 5) return FAIL(INVALID_PARAM, "policy %d is not one of HUGE_FIRST(_P2P), HUGE_ONLY(_P2P), NORMAL_ONLY(_P2P)", policy);
    int base_policy = policy % 3;
    size_t size = (n + 31) / 32 * 32 + 32;
    size_t page = base_policy == 1 || (base_policy == 0 && n > ((size_t)1 << 20)) ? HUGE_PAGE : SMALL_PAGE;
    size_t mapped = (size + page - 1) / page * page;
    int dev = cur->dev;
    pthread_rwlock_wrlock(&rw);
    size_t limit = mem_limit();
    if (dev_bytes[dev] + size > limit) {
        size_t used = dev_bytes[dev];
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_MEMORY_ALLOCATION, "out of device memory: %zu bytes asked, %zu of %zu in use on device %d", n, used, limit, dev);
    }
    int fd = memfd_create("fake-acl-device", MFD_CLOEXEC);
    void *m = fd < 0 || ftruncate(fd, (off_t)mapped) ? MAP_FAILED : map_aligned(fd, 0, mapped, page);
    if (m == MAP_FAILED) {
        if (fd >= 0) close(fd);
        pthread_rwlock_unlock(&rw); return FAIL(RT_MEMORY_ALLOCATION, "memfd/mmap of %zu bytes failed", mapped);
    }
    memset(m, 0xA5, size); /* not zeroed, as on the device */
    if (add_region((region){.base = (uintptr_t)m, .size = size, .map = (uintptr_t)m, .maplen = mapped, .type = R_DEV,
                            .dev = dev, .page = (int)page, .fd = fd, .exporter_dev = dev, .slot = -1}) < 0) {
        munmap(m, mapped); close(fd);
        pthread_rwlock_unlock(&rw); return FAIL(RT_MEMORY_ALLOCATION, "too many allocations");
    }
    dev_bytes[dev] += size;
    pthread_rwlock_unlock(&rw);
    *p = m; return OK;
}
aclError aclrtFree(void *p) {
    NEED_CTX;
    pthread_rwlock_wrlock(&rw);
    int i = find((uintptr_t)p);
    if (i < 0 || rg[i].type != R_DEV || rg[i].base != (uintptr_t)p) {
        int imported = i >= 0 && rg[i].type == R_IMP;
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_PARAM_INVALID, "%p is not the start of an aclrtMalloc allocation%s", p,
                    imported ? " (it is imported memory: aclrtIpcMemClose its key)" : "");
    }
    if (rg[i].exports) {
        int k = rg[i].exports;
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_IPC_ERROR, "%p still has %d open IPC export key(s): aclrtIpcMemClose them first", p, k);
    }
    dev_bytes[rg[i].dev] -= rg[i].size;
    drop_region(i);
    pthread_rwlock_unlock(&rw);
    return OK;
}
aclError aclrtMallocHost(void **p, size_t n) {
    NEED_CTX;
    NEED(p, "hostPtr is NULL");
    if (!n) return FAIL(INVALID_PARAM, "size 0");
    size_t mapped = (n + SMALL_PAGE - 1) / SMALL_PAGE * SMALL_PAGE;
    void *m = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return FAIL(RT_MEMORY_ALLOCATION, "mmap of %zu bytes failed", n);
    pthread_rwlock_wrlock(&rw);
    int i = add_region((region){.base = (uintptr_t)m, .size = n, .map = (uintptr_t)m, .maplen = mapped, .type = R_HOST,
                                .dev = cur->dev, .page = (int)SMALL_PAGE, .fd = -1, .slot = -1});
    pthread_rwlock_unlock(&rw);
    if (i < 0) { munmap(m, mapped); return FAIL(RT_MEMORY_ALLOCATION, "too many allocations"); }
    *p = m; return OK;
}
aclError aclrtFreeHost(void *p) {
    NEED_CTX;
    pthread_rwlock_wrlock(&rw);
    int i = find((uintptr_t)p);
    if (i < 0 || rg[i].type != R_HOST || rg[i].base != (uintptr_t)p) {
        pthread_rwlock_unlock(&rw); return FAIL(RT_PARAM_INVALID, "%p is not the start of aclrtMallocHost memory", p);
    }
    drop_region(i);
    pthread_rwlock_unlock(&rw);
    return OK;
}
aclError aclrtHostRegisterV2(void *p, uint64_t n, uint32_t flag) {
    NEED_CTX;
    if (env_int("FAKE_ACL_NO_HOST_REGISTER_V2", 0)) return FAIL(RT_FEATURE_NOT_SUPPORT, "not supported on this product (FAKE_ACL_NO_HOST_REGISTER_V2)");
    if (flag != 0x10000000u && flag != 0x2u) return FAIL(INVALID_PARAM, "flag %#x is neither ACL_HOST_REG_PINNED nor ACL_HOST_REG_MAPPED", flag);
    if (!p || !n) return FAIL(INVALID_PARAM, "ptr %p, size %llu", p, (unsigned long long)n);
    if ((uintptr_t)p % SMALL_PAGE) return FAIL(INVALID_PARAM, "ptr %p is not 4 KiB aligned", p);
    uintptr_t a = (uintptr_t)p, b = a + n;
    pthread_rwlock_wrlock(&rw);
    for (int i = 0; i < nrg; i++)
        if (a < rg[i].base + rg[i].size && rg[i].base < b) {
            int type = rg[i].type; uintptr_t base = rg[i].base;
            pthread_rwlock_unlock(&rw);
            return FAIL(RT_PARAM_INVALID, "[%p, +%llu) overlaps %s at %#lx", p, (unsigned long long)n,
                        type == R_REG ? "a registered range" : type == R_HOST ? "aclrtMallocHost memory" : "device memory",
                        (unsigned long)base);
        }
    int i = add_region((region){.base = a, .size = (size_t)n, .type = R_REG, .dev = cur->dev, .page = (int)SMALL_PAGE, .fd = -1, .slot = -1});
    pthread_rwlock_unlock(&rw);
    return i < 0 ? FAIL(RT_MEMORY_ALLOCATION, "too many regions") : OK;
}
aclError aclrtHostUnregister(void *p) {
    NEED_CTX;
    pthread_rwlock_wrlock(&rw);
    int i = find((uintptr_t)p);
    if (i < 0 || rg[i].type != R_REG || rg[i].base != (uintptr_t)p) {
        pthread_rwlock_unlock(&rw); return FAIL(RT_PARAM_INVALID, "%p is not the start of a registered range", p);
    }
    drop_region(i);
    pthread_rwlock_unlock(&rw);
    return OK;
}
aclError aclrtPointerGetAttributes(const void *p, aclrtPtrAttributes *a) {
    NEED_CTX;
    NEED(a, "attributes is NULL");
    memset(a, 0, sizeof *a);
    pthread_rwlock_rdlock(&rw);
    int i = find((uintptr_t)p);
    if (is_dev(i)) { a->location.type = LOC_DEVICE; a->location.id = (uint32_t)rg[i].dev; a->pageSize = (uint32_t)rg[i].page; }
    else if (is_locked_host(i)) { a->location.type = LOC_HOST; a->pageSize = (uint32_t)SMALL_PAGE; }
    else a->location.type = LOC_UNREGISTERED;
    pthread_rwlock_unlock(&rw);
    return OK;
}
aclError aclrtMemGetAddressRange(void *p, void **base, size_t *size) {
    NEED_CTX;
    if (version() < 9) return FAIL(API_NOT_SUPPORT, "aclrtMemGetAddressRange needs CANN 9.0 (FAKE_ACL_VERSION=8)");
    pthread_rwlock_rdlock(&rw);
    int i = find((uintptr_t)p);
    int ok = i >= 0 && rg[i].type != R_REG;
    if (ok) { if (base) *base = (void *)rg[i].base; if (size) *size = rg[i].size; }
    pthread_rwlock_unlock(&rw);
    return ok ? OK : FAIL(RT_PARAM_INVALID, "%p is in no allocation (aclrtMalloc, imported, aclrtMallocHost)", p);
}
aclError aclrtGetMemInfo(int attr, size_t *freeb, size_t *total) {
    NEED_CTX;
    NEED(freeb && total, "free or total is NULL");
    if (attr < 0 || attr > 11) return FAIL(INVALID_PARAM, "attr %d", attr);
    pthread_rwlock_rdlock(&rw);
    size_t limit = mem_limit(), used = dev_bytes[cur->dev];
    pthread_rwlock_unlock(&rw);
    *total = limit; *freeb = used < limit ? limit - used : 0; return OK;
}

/* -- copy checks --
   A side of a copy is SIDE_DEV (device memory: own or imported), SIDE_LOCKED (page-locked host memory) or
   SIDE_PAGEABLE (any other host memory). */
enum { SIDE_PAGEABLE = 0, SIDE_LOCKED = 1, SIDE_DEV = 2 };
static const char *kind_name(int kind) {
    static const char *names[] = {"HOST_TO_HOST", "HOST_TO_DEVICE", "DEVICE_TO_HOST", "DEVICE_TO_DEVICE", "DEFAULT"};
    return kind >= 0 && kind <= 4 ? names[kind] : "?";
}
/* mode: 0 synchronous (aclrtMemcpy), 1 asynchronous.  On success *kind_out is the explicit kind, *dside and *sside the
   sides.  The caller holds the read lock. */
static aclError check_copy_locked(const char *fn, uintptr_t dst, size_t dmax, uintptr_t src, size_t n, int kind, int mode,
                                  int *kind_out, int *dside, int *sside) {
    if (!dst || !src) return fail_in(INVALID_PARAM, fn, "dst %#lx or src %#lx is NULL", (unsigned long)dst, (unsigned long)src);
    if (n > dmax) return fail_in(INVALID_PARAM, fn, "count %zu > destMax %zu", n, dmax);
    if (kind < H2H || kind > KIND_DEFAULT) return fail_in(INVALID_PARAM, fn, "kind %d is not supported", kind);
    int di = find(dst), si = find(src);
    int ddev = is_dev(di), sdev = is_dev(si);
    if (kind == KIND_DEFAULT) {
        if (foreign(di) || foreign(si))
            return fail_in(RT_PARAM_INVALID, fn, "ACL_MEMCPY_DEFAULT on memory imported from another device (dst %#lx, src %#lx): name the kind",
                           (unsigned long)dst, (unsigned long)src);
        kind = ddev && sdev ? D2D : ddev ? H2D : sdev ? D2H : H2H;
    }
    int want_d = kind == H2D || kind == D2D, want_s = kind == D2H || kind == D2D;
    if (want_d != ddev)
        return fail_in(RT_PARAM_INVALID, fn, "%s: dst %#lx %s device memory", kind_name(kind), (unsigned long)dst, ddev ? "is" : "is not");
    if (want_s != sdev)
        return fail_in(RT_PARAM_INVALID, fn, "%s: src %#lx %s device memory", kind_name(kind), (unsigned long)src, sdev ? "is" : "is not");
    if (ddev && !inside(di, dst, n))
        return fail_in(RT_PARAM_INVALID, fn, "dst [%#lx, +%zu) runs past the end of its allocation", (unsigned long)dst, n);
    if (sdev && !inside(si, src, n))
        return fail_in(RT_PARAM_INVALID, fn, "src [%#lx, +%zu) runs past the end of its allocation", (unsigned long)src, n);
    if (kind == H2H && mode) return fail_in(RT_FEATURE_NOT_SUPPORT, fn, "asynchronous HOST_TO_HOST copies are refused");
    if ((kind == H2D && foreign(di)) || (kind == D2H && foreign(si)))
        return fail_in(RT_PARAM_INVALID, fn, "%s on memory imported from another device (only asynchronous DEVICE_TO_DEVICE is allowed there)", kind_name(kind));
    if (kind == D2D && !mode && (foreign(di) || foreign(si)))
        return fail_in(RT_PARAM_INVALID, fn, "synchronous DEVICE_TO_DEVICE on memory imported from another device (use aclrtMemcpyAsync)");
    *kind_out = kind;
    *dside = ddev ? SIDE_DEV : inside(di, dst, n) && is_locked_host(di) ? SIDE_LOCKED : SIDE_PAGEABLE;
    *sside = sdev ? SIDE_DEV : inside(si, src, n) && is_locked_host(si) ? SIDE_LOCKED : SIDE_PAGEABLE;
    return OK;
}
static aclError check_copy(const char *fn, uintptr_t dst, size_t dmax, uintptr_t src, size_t n, int kind, int mode,
                           int *kind_out, int *dside, int *sside) {
    pthread_rwlock_rdlock(&rw);
    aclError r = check_copy_locked(fn, dst, dmax, src, n, kind, mode, kind_out, dside, sside);
    pthread_rwlock_unlock(&rw);
    return r;
}
/* A side still what it was when the copy was issued (checked again when the task runs). */
static int side_ok(uintptr_t p, size_t n, int side) {
    if (side == SIDE_PAGEABLE) return 1;
    int i = find(p);
    return inside(i, p, n) && (side == SIDE_DEV ? is_dev(i) : is_locked_host(i));
}

/* -- streams: one thread each; a task is a list of copies or an event record -- */
#define ST_MAGIC 0x57AE4A11u
#define EV_MAGIC 0xE7E47000u
/* As in fake_libcuda.c, an event stands for its latest record only: state is (records << 1 | done), changed by
   compare-and-swap; a record task completes the event only while no later record was made.  A record discarded
   (stop-on-failure, abort) leaves it NOT_READY: disc_rec names that record. */
typedef struct event {
    uint32_t magic; int dev; uint32_t flags; unsigned long state; int recorded;
    volatile unsigned long disc_rec; volatile int disc_err;
} event;
typedef struct span { uintptr_t dst, src; size_t n; } span;
enum { T_COPY, T_EVENT };
typedef struct task {
    int type, dside, sside, reverse;
    size_t n; span *sp;
    event *ev; unsigned long rec;
    struct task *next;
} task;
typedef struct stream {
    uint32_t magic; int dev; uint32_t priority, flags;
    pthread_mutex_t mu; pthread_cond_t cv; pthread_t th;
    task *head, *tail; int busy, quit, stop_on_failure;
    volatile unsigned gen;  /* bumped by aclrtStreamAbort: a task waiting at the gate gives up */
    int err; char errmsg[256];
} stream;

static void free_task(task *t) { free(t->sp); free(t); }
static void discard(task *t, int err) {
    if (t->type == T_EVENT) {
        t->ev->disc_err = err ? err : RT_INTERNAL_ERROR;
        __atomic_store_n(&t->ev->disc_rec, t->rec, __ATOMIC_RELEASE);
    }
    free_task(t);
}
static void gate(stream *s, unsigned gen) {
    int us = env_int("FAKE_ACL_DELAY_US", 0);
    for (double until = now() + us / 1e6; us > 0 && now() < until && s->gen == gen;) usleep(us < 1000 ? (useconds_t)us : 1000);
    for (double until = now() + 60; fake_hold && now() < until && s->gen == gen;) usleep(100);
}
/* The copies of a task: 0, or the failure's code with why. */
static int run_copies(const task *t, char *why, size_t whylen) {
    if (fault) { snprintf(why, whylen, "device fault injected by fake_fault(%d)", fault); return fault; }
    pthread_rwlock_rdlock(&rw);
    for (size_t i = 0; i < t->n; i++) {
        const span *c = &t->sp[i];
        if (!side_ok(c->dst, c->n, t->dside) || !side_ok(c->src, c->n, t->sside)) {
            pthread_rwlock_unlock(&rw);
            snprintf(why, whylen, "copy %#lx <- %#lx (%zu bytes) is no longer inside known memory (freed?)",
                     (unsigned long)c->dst, (unsigned long)c->src, c->n);
            return RT_DEVICE_MEM_ERROR;
        }
    }
    for (size_t k = 0; k < t->n; k++) {
        const span *c = &t->sp[t->reverse ? t->n - 1 - k : k];
        memmove((void *)c->dst, (const void *)c->src, c->n);
    }
    pthread_rwlock_unlock(&rw);
    return 0;
}
static void complete(event *e, unsigned long rec) {
    unsigned long mine = rec << 1;
    __atomic_compare_exchange_n(&e->state, &mine, mine | 1, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}
static void record_error(stream *s, int code, const char *why) { /* s->mu held */
    if (s->err) return;
    s->err = code;
    snprintf(s->errmsg, sizeof s->errmsg, "task failed with %d on stream %p: %s", code, (void *)s, why);
}
static void *worker(void *arg) {
    stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->quit) pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head) break;
        task *t = s->head; s->head = t->next; if (!s->head) s->tail = NULL;
        if (s->err && s->stop_on_failure) { discard(t, s->err); pthread_cond_broadcast(&s->cv); continue; }
        s->busy = 1;
        unsigned gen = s->gen;
        pthread_mutex_unlock(&s->mu);
        gate(s, gen);
        char why[200] = "";
        int r = 0, aborted = s->gen != gen;
        if (aborted) discard(t, RT_INTERNAL_ERROR);
        else {
            if (t->type == T_COPY) r = run_copies(t, why, sizeof why);
            else complete(t->ev, t->rec);
            free_task(t);
        }
        pthread_mutex_lock(&s->mu);
        if (r) record_error(s, r, why);
        s->busy = 0;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}
static void push(stream *s, task *t) {
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = t; else s->head = t;
    s->tail = t;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}
/* Wait until the stream is idle: 0, or RT_STREAM_SYNC_TIMEOUT after ms (-1: never).  After a failure in
   stop-on-failure mode the worker discards what is left at once, so this returns then too. */
static int drain(stream *s, int ms) {
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    if (ms > 0) { until.tv_sec += ms / 1000; until.tv_nsec += (long)(ms % 1000) * 1000000; }
    if (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
    int r = 0;
    pthread_mutex_lock(&s->mu);
    while (s->head || s->busy) {
        if (ms < 0) pthread_cond_wait(&s->cv, &s->mu);
        else if (pthread_cond_timedwait(&s->cv, &s->mu, &until) == ETIMEDOUT && (s->head || s->busy)) { r = RT_STREAM_SYNC_TIMEOUT; break; }
    }
    pthread_mutex_unlock(&s->mu);
    return r;
}
static stream *new_stream(int dev, uint32_t priority, uint32_t flags) {
    stream *s = calloc(1, sizeof *s);
    s->magic = ST_MAGIC; s->dev = dev; s->priority = priority; s->flags = flags;
    pthread_mutex_init(&s->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca); pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->cv, &ca); pthread_condattr_destroy(&ca);
    pthread_create(&s->th, NULL, worker, s);
    return s;
}
/* The stream st names in the current context (NULL: the context's default stream).  Call after NEED_CTX. */
static aclError stream_of(const char *fn, void *st, stream **out) {
    stream *s = st;
    if (!s) {
        pthread_mutex_lock(&cmu);
        if (!cur->null_stream) cur->null_stream = new_stream(cur->dev, 0, 0);
        s = cur->null_stream;
        pthread_mutex_unlock(&cmu);
    } else if (s->magic != ST_MAGIC) return fail_in(RT_PARAM_INVALID, fn, "%p is not a stream (destroyed?)", st);
    if (s->dev != cur->dev)
        return fail_in(RT_STREAM_CONTEXT, fn, "stream %p belongs to device %d, the current context is device %d's", st, s->dev, cur->dev);
    *out = s; return OK;
}
#define STREAM(st, s) stream *s; do { NEED_CTX; aclError r_ = stream_of(__func__, st, &s); if (r_) return r_; } while (0)

aclError aclrtCreateStreamWithConfig(void **out, uint32_t priority, uint32_t flag) {
    NEED_CTX;
    NEED(out, "stream is NULL");
    if (priority > 7) return FAIL(INVALID_PARAM, "priority %u is not 0..7", priority);
    if (flag & ~3u) return FAIL(INVALID_PARAM, "flag %#x: the fake knows ACL_STREAM_FAST_LAUNCH (0x1) and ACL_STREAM_FAST_SYNC (0x2)", flag);
    *out = new_stream(cur->dev, priority, flag); return OK;
}
aclError aclrtCreateStream(void **out) { return aclrtCreateStreamWithConfig(out, 0, 0); }
aclError aclrtSetStreamFailureMode(void *st, uint64_t mode) {
    STREAM(st, s);
    if (mode > 1) return FAIL(INVALID_PARAM, "mode %llu is neither ACL_CONTINUE_ON_FAILURE (0) nor ACL_STOP_ON_FAILURE (1)", (unsigned long long)mode);
    pthread_mutex_lock(&s->mu); s->stop_on_failure = (int)mode; pthread_mutex_unlock(&s->mu);
    return OK;
}
static aclError stream_error(stream *s, const char *fn) {
    pthread_mutex_lock(&s->mu);
    int err = s->err; char text[256];
    memcpy(text, s->errmsg, sizeof text);
    pthread_mutex_unlock(&s->mu);
    return err ? fail_in(err, fn, "%s", text) : OK;
}
aclError aclrtStreamQuery(void *st, int *status) {
    STREAM(st, s);
    NEED(status, "status is NULL");
    pthread_mutex_lock(&s->mu);
    int busy = s->head || s->busy;
    pthread_mutex_unlock(&s->mu);
    aclError r = stream_error(s, __func__);
    if (r) return r; /* status untouched */
    *status = busy ? 1 : 0; /* ACL_STREAM_STATUS_NOT_READY 1, _COMPLETE 0 */
    return OK;
}
aclError aclrtSynchronizeStreamWithTimeout(void *st, int32_t ms) {
    STREAM(st, s);
    if (ms < -1) return FAIL(INVALID_PARAM, "timeout %d ms (-1: forever)", ms);
    if (drain(s, ms)) return FAIL(RT_STREAM_SYNC_TIMEOUT, "stream %p still busy after %d ms", (void *)s, ms);
    return stream_error(s, __func__);
}
aclError aclrtSynchronizeStream(void *st) {
    STREAM(st, s);
    drain(s, -1);
    return stream_error(s, __func__);
}
static void abort_stream(stream *s) {
    pthread_mutex_lock(&s->mu);
    int err = s->err;
    while (s->head) { task *t = s->head; s->head = t->next; discard(t, err); }
    s->tail = NULL;
    __atomic_add_fetch(&s->gen, 1, __ATOMIC_RELEASE);
    while (s->busy) pthread_cond_wait(&s->cv, &s->mu);
    s->err = 0; s->errmsg[0] = 0;
    pthread_mutex_unlock(&s->mu);
}
aclError aclrtStreamAbort(void *st) { STREAM(st, s); abort_stream(s); return OK; }
static aclError destroy_stream(void *st, int force, const char *fn) {
    NEED_CTX;
    if (!st) return fail_in(INVALID_PARAM, fn, "the default stream cannot be destroyed");
    stream *s;
    aclError r = stream_of(fn, st, &s);
    if (r) return r;
    if (force) abort_stream(s); else drain(s, -1);
    pthread_mutex_lock(&s->mu); s->quit = 1; s->magic = 0; pthread_cond_broadcast(&s->cv); pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    abort_stream(s); /* anything queued meanwhile */
    return OK; /* the struct is kept: a late call with the handle fails with 107000 instead of crashing */
}
aclError aclrtDestroyStream(void *st) { return destroy_stream(st, 0, __func__); }
aclError aclrtDestroyStreamForce(void *st) { return destroy_stream(st, 1, __func__); }

/* Queue the copies as one task, or -- when a host side is pageable -- run them here once the stream is idle, as
   ACL does (the call returns after the copy).  Takes sp. */
static aclError submit(const char *fn, stream *s, span *sp, size_t n, int dside, int sside, int reverse) {
    task *t = calloc(1, sizeof *t);
    t->type = T_COPY; t->sp = sp; t->n = n; t->dside = dside; t->sside = sside; t->reverse = reverse;
    if (dside != SIDE_PAGEABLE && sside != SIDE_PAGEABLE) { bump(&fake_async_copies); push(s, t); return OK; }
    drain(s, -1);
    pthread_mutex_lock(&s->mu);
    int stopped = s->err && s->stop_on_failure;
    pthread_mutex_unlock(&s->mu);
    if (stopped) { free_task(t); return stream_error(s, fn); }
    bump(&fake_sync_copies);
    char why[200] = "";
    int r = run_copies(t, why, sizeof why);
    free_task(t);
    if (!r) return OK;
    pthread_mutex_lock(&s->mu); record_error(s, r, why); pthread_mutex_unlock(&s->mu);
    return fail_in(r, fn, "task failed with %d on stream %p: %s", r, (void *)s, why);
}
aclError aclrtMemcpy(void *dst, size_t dmax, const void *src, size_t n, int kind) {
    NEED_CTX;
    int k, ds, ss;
    pthread_rwlock_rdlock(&rw);
    aclError r = check_copy_locked(__func__, (uintptr_t)dst, dmax, (uintptr_t)src, n, kind, 0, &k, &ds, &ss);
    if (!r) memmove(dst, src, n);
    pthread_rwlock_unlock(&rw);
    if (!r) bump(&fake_sync_copies);
    return r;
}
aclError aclrtMemcpyAsync(void *dst, size_t dmax, const void *src, size_t n, int kind, void *st) {
    STREAM(st, s);
    int k, ds, ss;
    aclError r = check_copy(__func__, (uintptr_t)dst, dmax, (uintptr_t)src, n, kind, 1, &k, &ds, &ss);
    if (r) return r;
    span *sp = malloc(sizeof *sp);
    *sp = (span){(uintptr_t)dst, (uintptr_t)src, n};
    return submit(__func__, s, sp, 1, ds, ss, 0);
}
aclError aclrtMemcpy2dAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                            int kind, void *st) {
    STREAM(st, s);
    if (kind != H2D && kind != D2H && kind != D2D) return FAIL(INVALID_PARAM, "kind %d: only HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE", kind);
    if (!width || !height || width > dpitch || width > spitch || width > 5000000 || height > 5242880)
        return FAIL(INVALID_PARAM, "width %zu, dpitch %zu, spitch %zu, height %zu (width <= both pitches and 5000000, height <= 5242880)",
                    width, dpitch, spitch, height);
    span *sp = malloc(height * sizeof *sp);
    int dside = SIDE_DEV, sside = SIDE_DEV;
    pthread_rwlock_rdlock(&rw);
    for (size_t i = 0; i < height; i++) {
        int k, ds, ss;
        uintptr_t d = (uintptr_t)dst + i * dpitch, sr = (uintptr_t)src + i * spitch;
        aclError r = check_copy_locked(__func__, d, width, sr, width, kind, 1, &k, &ds, &ss);
        if (r) { pthread_rwlock_unlock(&rw); free(sp); return r; }
        if (ds < dside) dside = ds;
        if (ss < sside) sside = ss;
        sp[i] = (span){d, sr, width};
    }
    pthread_rwlock_unlock(&rw);
    return submit(__func__, s, sp, height, dside, sside, 0);
}
aclError aclrtMemcpyBatchAsync(void **dsts, size_t *dmaxs, void **srcs, size_t *sizes, size_t n, aclrtMemcpyBatchAttr *attrs,
                               size_t *attr_index, size_t nattrs, size_t *fail_index, void *st) {
    STREAM(st, s);
    if (env_int("FAKE_ACL_NO_BATCH", 0)) return FAIL(RT_FEATURE_NOT_SUPPORT, "no batch copies on this product (FAKE_ACL_NO_BATCH)");
    NEED(dsts && dmaxs && srcs && sizes && attrs && attr_index && fail_index, "a NULL array");
    *fail_index = SIZE_MAX;
    if (!n) return FAIL(INVALID_PARAM, "numBatches 0");
    if (!nattrs || nattrs > n) return FAIL(INVALID_PARAM, "numAttrs %zu with numBatches %zu (1 <= numAttrs <= numBatches)", nattrs, n);
    if (attr_index[0] != 0) return FAIL(INVALID_PARAM, "attrsIndexes[0] is %zu, not 0", attr_index[0]);
    for (size_t j = 1; j < nattrs; j++)
        if (attr_index[j] <= attr_index[j - 1] || attr_index[j] >= n)
            return FAIL(INVALID_PARAM, "attrsIndexes[%zu] = %zu: not increasing below numBatches", j, attr_index[j]);
    span *sp = malloc(n * sizeof *sp);
    int direction = -1, dside = SIDE_DEV, sside = SIDE_DEV;
    size_t j = 0;
    pthread_rwlock_rdlock(&rw);
    for (size_t i = 0; i < n; i++) {
        while (j + 1 < nattrs && attr_index[j + 1] <= i) j++;
        uintptr_t d = (uintptr_t)dsts[i], sr = (uintptr_t)srcs[i];
        int di = find(d), si = find(sr), ddev = is_dev(di), sdev = is_dev(si);
        int kind = ddev && !sdev ? H2D : sdev && !ddev ? D2H : -1;
        const char *why = NULL;
        if (kind < 0) why = ddev ? "device to device: a batch copies host to device or device to host" : "host to host: a batch copies host to device or device to host";
        else if (direction >= 0 && kind != direction) why = "a batch has one direction, host to device or device to host";
        else if (attrs[j].dstLoc.type != (kind == H2D ? LOC_DEVICE : LOC_HOST) || attrs[j].srcLoc.type != (kind == H2D ? LOC_HOST : LOC_DEVICE))
            why = "attrs' dstLoc/srcLoc types do not match the pointers";
        else if ((kind == H2D ? attrs[j].dstLoc.id : attrs[j].srcLoc.id) != (uint32_t)rg[kind == H2D ? di : si].dev)
            why = "attrs' device id is not the device of the memory";
        if (why) {
            pthread_rwlock_unlock(&rw); free(sp);
            *fail_index = i;
            return FAIL(INVALID_PARAM, "entry %zu (dst %#lx, src %#lx, attrs[%zu]): %s", i, (unsigned long)d, (unsigned long)sr, j, why);
        }
        direction = kind;
        int k, ds, ss;
        aclError r = check_copy_locked(__func__, d, dmaxs[i], sr, sizes[i], kind, 1, &k, &ds, &ss);
        if (r) {
            pthread_rwlock_unlock(&rw); free(sp);
            *fail_index = i;
            size_t len = strlen(message);
            snprintf(message + len, sizeof message - len, " [batch entry %zu]", i);
            return r;
        }
        if (ds < dside) dside = ds;
        if (ss < sside) sside = ss;
        sp[i] = (span){d, sr, sizes[i]};
    }
    pthread_rwlock_unlock(&rw);
    /* the copies within a batch are unordered: run them in reverse, so nothing can rely on an order */
    aclError r = submit(__func__, s, sp, n, dside, sside, 1);
    if (!r) bump(&fake_batches);
    return r;
}

/* -- events -- */
static aclError event_of(const char *fn, void *e, event **out) {
    if (!e) return fail_in(INVALID_PARAM, fn, "event is NULL");
    event *ev = e;
    if (ev->magic != EV_MAGIC) return fail_in(RT_PARAM_INVALID, fn, "%p is not an event (destroyed?)", e);
    *out = ev; return OK;
}
#define EVENT(e, ev) event *ev; do { NEED_CTX; aclError r_ = event_of(__func__, e, &ev); if (r_) return r_; } while (0)
aclError aclrtCreateEventExWithFlag(void **e, uint32_t flag) {
    NEED_CTX;
    NEED(e, "event is NULL");
    if (flag & ~0x7Bu) return FAIL(INVALID_PARAM, "flag %#x", flag);
    event *m = calloc(1, sizeof *m);
    m->magic = EV_MAGIC; m->dev = cur->dev; m->flags = flag; m->disc_rec = 0;
    *e = m; return OK;
}
aclError aclrtCreateEventWithFlag(void **e, uint32_t flag) { return aclrtCreateEventExWithFlag(e, flag); }
aclError aclrtCreateEvent(void **e) { return aclrtCreateEventExWithFlag(e, 0); }
/* The struct is kept (a queued record may still name it); the handle is dead. */
aclError aclrtDestroyEvent(void *e) { EVENT(e, ev); ev->magic = 0; return OK; }
aclError aclrtRecordEvent(void *e, void *st) {
    EVENT(e, ev);
    stream *s;
    aclError r = stream_of(__func__, st, &s);
    if (r) return r;
    if (ev->dev != s->dev) return FAIL(RT_STREAM_CONTEXT, "event of device %d recorded on a stream of device %d", ev->dev, s->dev);
    unsigned long was = __atomic_load_n(&ev->state, __ATOMIC_RELAXED), next;
    do next = ((was >> 1) + 1) << 1;
    while (!__atomic_compare_exchange_n(&ev->state, &was, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
    ev->recorded = 1;
    task *t = calloc(1, sizeof *t);
    t->type = T_EVENT; t->ev = ev; t->rec = next >> 1;
    push(s, t);
    return OK;
}
/* An event never recorded is complete. */
static int event_done(event *e) { return !e->recorded || (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) & 1); }
aclError aclrtQueryEventStatus(void *e, int *status) {
    EVENT(e, ev);
    NEED(status, "status is NULL");
    *status = event_done(ev) ? 1 : 0; /* ACL_EVENT_RECORDED_STATUS_COMPLETE 1, _NOT_READY 0 */
    return OK;
}
aclError aclrtQueryEvent(void *e, int *status) {
    EVENT(e, ev);
    NEED(status, "status is NULL");
    *status = event_done(ev) ? 0 : 1; /* deprecated: ACL_EVENT_STATUS_COMPLETE 0, _NOT_READY 1 */
    return OK;
}
static aclError wait_event(event *ev, int32_t ms, const char *fn) {
    if (ms < -1) return fail_in(INVALID_PARAM, fn, "timeout %d ms (-1: forever)", ms);
    double until = now() + (ms > 0 ? ms : 0) / 1e3;
    while (!event_done(ev)) {
        unsigned long rec = __atomic_load_n(&ev->state, __ATOMIC_ACQUIRE) >> 1;
        if (ms < 0 && __atomic_load_n(&ev->disc_rec, __ATOMIC_ACQUIRE) == rec)
            /* a real runtime would wait forever; the fake says why instead */
            return fail_in(ev->disc_err, fn, "event %p can never complete: its record was discarded (its stream failed with %d or was aborted)",
                           (void *)ev, ev->disc_err);
        if (ms >= 0 && now() >= until) return fail_in(RT_EVENT_SYNC_TIMEOUT, fn, "event %p not complete after %d ms", (void *)ev, ms);
        usleep(100);
    }
    return OK;
}
aclError aclrtSynchronizeEventWithTimeout(void *e, int32_t ms) { EVENT(e, ev); return wait_event(ev, ms, __func__); }
aclError aclrtSynchronizeEvent(void *e) { EVENT(e, ev); return wait_event(ev, -1, __func__); }

/* -- IPC --
   A key is the text "acl-<pid>-<fd>-<cfd>-<offset hex>-<size hex>-<device>-<id>" (NUL-padded to 65 bytes): the
   exporter's pid, its memfd of the allocation, the memfd of the export's control page (below), the exported range
   within the allocation, the exporter's device, and the export's number in that process.  Another process maps
   both through /proc/<pid>/fd/. */
#define CTL_MAGIC 0xAC1C7A10u
struct ctl {
    uint32_t magic, flags;         /* flags: 1 ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION */
    int32_t owner_pid, owner_dev;
    uint32_t page; int32_t npids;
    int32_t pids[WHITELIST];       /* bare TGIDs allowed to import */
    int32_t state;                 /* live importers; -1 once the exporter closed the key */
    int32_t importers[WHITELIST];  /* their pids (a dead importer's slot is reclaimed by the exporter's close) */
};
typedef struct { int live; uintptr_t alloc; uintptr_t start; size_t size; int cfd; ctl *c; char key[KEY_LEN]; } export_t;
#define MAXE 4096
static export_t exps[MAXE];
static int nexps, export_ids;

static int parse_key(const char *key, int *pid, int *fd, int *cfd, size_t *off, size_t *n, int *dev) {
    unsigned id; int used = -1;
    if (!key || strnlen(key, KEY_LEN) >= KEY_LEN) return 0;
    if (sscanf(key, "acl-%d-%d-%d-%zx-%zx-%d-%u%n", pid, fd, cfd, off, n, dev, &id, &used) != 7) return 0;
    return used == (int)strlen(key);
}
static int find_export(const char *key) {
    for (int i = 0; i < nexps; i++) if (exps[i].live && !strcmp(exps[i].key, key)) return i;
    return -1;
}
aclError aclrtDeviceGetBareTgid(int32_t *pid) { NEED_INIT; NEED(pid, "pid is NULL"); *pid = bare_tgid(); return OK; }
aclError aclrtIpcMemGetExportKey(void *p, size_t n, char *key, size_t len, uint64_t flags) {
    NEED_CTX;
    if (!key || len != KEY_LEN) return FAIL(INVALID_PARAM, "key buffer of %zu bytes: it must be exactly %d", len, KEY_LEN);
    if (flags > 1) return FAIL(INVALID_PARAM, "flags %llu (0 DEFAULT, 1 DISABLE_PID_VALIDATION)", (unsigned long long)flags);
    if (!n) return FAIL(INVALID_PARAM, "size 0");
    uintptr_t at = (uintptr_t)p;
    pthread_rwlock_wrlock(&rw);
    int i = find(at);
    if (i < 0 || rg[i].type != R_DEV) {
        int imported = i >= 0 && rg[i].type == R_IMP;
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_PARAM_INVALID, "%p is not inside an aclrtMalloc allocation of this process%s", p, imported ? " (imported memory cannot be exported)" : "");
    }
    region *r = &rg[i];
    size_t page = (size_t)r->page, off = at - r->base, end = r->base + r->size;
    if (at + n > end || at + n < at) {
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_PARAM_INVALID, "[%p, +%zu) runs past its allocation [%#lx, +%zu)", p, n, (unsigned long)r->base, r->size);
    }
    if (off % page || (n % page && at + n != end)) {
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_PARAM_INVALID, "unaligned: [%p, +%zu) must start on a %zu-byte page of its allocation [%#lx, +%zu) and be whole pages or reach its end",
                    p, n, page, (unsigned long)r->base, r->size);
    }
    for (int k = 0; k < nexps; k++)
        if (exps[k].live && exps[k].alloc == r->base && at < exps[k].start + exps[k].size && exps[k].start < at + n) {
            pthread_rwlock_unlock(&rw);
            return FAIL(RT_IPC_ERROR, "[%p, +%zu) overlaps a range exported already (%s)", p, n, exps[k].key);
        }
    int slot = -1;
    for (int k = 0; k < nexps && slot < 0; k++) if (!exps[k].live) slot = k;
    if (slot < 0 && nexps < MAXE) slot = nexps++;
    int cfd = slot < 0 ? -1 : memfd_create("fake-acl-ipc", MFD_CLOEXEC);
    ctl *c = cfd < 0 || ftruncate(cfd, (off_t)SMALL_PAGE) ? MAP_FAILED : mmap(NULL, SMALL_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, cfd, 0);
    if (c == MAP_FAILED) {
        if (cfd >= 0) close(cfd);
        pthread_rwlock_unlock(&rw); return FAIL(RT_IPC_ERROR, "no control page (too many exports?)");
    }
    memset(c, 0, sizeof *c);
    c->magic = CTL_MAGIC; c->flags = (uint32_t)flags; c->owner_pid = getpid(); c->owner_dev = r->dev; c->page = (uint32_t)page;
    export_t *x = &exps[slot];
    memset(x, 0, sizeof *x);
    int w = snprintf(x->key, KEY_LEN, "acl-%d-%d-%d-%zx-%zx-%d-%u", getpid(), r->fd, cfd, off, n, r->dev, (unsigned)++export_ids);
    if (w < 0 || w >= KEY_LEN) {
        munmap(c, SMALL_PAGE); close(cfd);
        pthread_rwlock_unlock(&rw); return FAIL(RT_IPC_ERROR, "key longer than 64 characters");
    }
    x->live = 1; x->alloc = r->base; x->start = at; x->size = n; x->cfd = cfd; x->c = c;
    r->exports++;
    memset(key, 0, KEY_LEN);
    memcpy(key, x->key, (size_t)w);
    pthread_rwlock_unlock(&rw);
    return OK;
}
aclError aclrtIpcMemSetImportPid(const char *key, int32_t *pids, size_t num) {
    NEED_CTX;
    int pid, fd, cfd, dev; size_t off, n;
    if (!pids || !num) return FAIL(INVALID_PARAM, "no pids");
    if (!parse_key(key, &pid, &fd, &cfd, &off, &n, &dev)) return FAIL(RT_PARAM_INVALID, "not an export key");
    if (pid != getpid()) return FAIL(RT_IPC_ERROR, "only the exporting process (pid %d) may whitelist importers of %s", pid, key);
    pthread_rwlock_wrlock(&rw);
    int i = find_export(key);
    if (i < 0) { pthread_rwlock_unlock(&rw); return FAIL(RT_IPC_ERROR, "%s is not an open export of this process", key); }
    ctl *c = exps[i].c;
    if ((size_t)c->npids + num > WHITELIST) {
        pthread_rwlock_unlock(&rw); return FAIL(RT_IPC_ERROR, "more than %d pids whitelisted for %s", WHITELIST, key);
    }
    for (size_t k = 0; k < num; k++) c->pids[c->npids + (int)k] = pids[k];
    __atomic_add_fetch(&c->npids, (int)num, __ATOMIC_RELEASE);
    pthread_rwlock_unlock(&rw);
    return OK;
}
static ctl *open_control(int pid, int cfd) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, cfd);
    int f = open(path, O_RDWR | O_CLOEXEC);
    if (f < 0) return NULL;
    ctl *c = mmap(NULL, SMALL_PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    close(f);
    if (c == MAP_FAILED) return NULL;
    if (c->magic != CTL_MAGIC) { munmap(c, SMALL_PAGE); return NULL; }
    return c;
}
aclError aclrtIpcMemImportByKey(void **p, const char *key, uint64_t flags) {
    NEED_CTX;
    NEED(p, "devPtr is NULL");
    if (flags > 1) return FAIL(INVALID_PARAM, "flags %llu (0 DEFAULT, 1 ENABLE_PEER_ACCESS)", (unsigned long long)flags);
    int pid, fd, cfd, dev; size_t off, n;
    if (!parse_key(key, &pid, &fd, &cfd, &off, &n, &dev)) return FAIL(RT_PARAM_INVALID, "not an export key");
    if (pid == getpid()) return FAIL(RT_IPC_ERROR, "%s was exported by this process: a process cannot import its own memory", key);
    pthread_rwlock_rdlock(&rw);
    int dup = 0;
    for (int i = 0; i < nrg && !dup; i++) dup = rg[i].type == R_IMP && !strcmp(rg[i].key, key);
    pthread_rwlock_unlock(&rw);
    if (dup) return FAIL(RT_IPC_ERROR, "%s is imported already by this process (once per process)", key);
    ctl *c = open_control(pid, cfd);
    if (!c) return FAIL(RT_IPC_ERROR, "the export %s is gone (its process exited or closed it)", key);
    if (!(c->flags & 1)) {
        int me = bare_tgid(), allowed = 0, np = __atomic_load_n(&c->npids, __ATOMIC_ACQUIRE);
        for (int k = 0; k < np && !allowed; k++) allowed = c->pids[k] == me;
        if (!allowed) {
            munmap(c, SMALL_PAGE);
            return FAIL(RT_IPC_ERROR, "pid not in whitelist: this process's bare TGID %d (aclrtDeviceGetBareTgid; os.getpid() is %d) was not given to aclrtIpcMemSetImportPid for %s",
                        me, getpid(), key);
        }
    }
    int32_t state = __atomic_load_n(&c->state, __ATOMIC_ACQUIRE);
    do if (state < 0) { munmap(c, SMALL_PAGE); return FAIL(RT_IPC_ERROR, "the export %s was closed", key); }
    while (!__atomic_compare_exchange_n(&c->state, &state, state + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    int slot = -1;
    for (int k = 0; k < WHITELIST && slot < 0; k++) {
        int32_t zero = 0;
        if (__atomic_compare_exchange_n(&c->importers[k], &zero, getpid(), 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) slot = k;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", pid, fd);
    int mine = open(path, O_RDWR | O_CLOEXEC);
    size_t page = c->page ? c->page : SMALL_PAGE, maplen = (n + SMALL_PAGE - 1) / SMALL_PAGE * SMALL_PAGE;
    void *m = mine < 0 ? MAP_FAILED : map_aligned(mine, (off_t)off, maplen, page);
    if (mine >= 0) close(mine);
    if (m == MAP_FAILED) {
        if (slot >= 0) __atomic_store_n(&c->importers[slot], 0, __ATOMIC_RELEASE);
        __atomic_sub_fetch(&c->state, 1, __ATOMIC_ACQ_REL);
        munmap(c, SMALL_PAGE);
        return FAIL(RT_IPC_ERROR, "cannot map the memory of %s", key);
    }
    pthread_rwlock_wrlock(&rw);
    region r = {.base = (uintptr_t)m, .size = n, .map = (uintptr_t)m, .maplen = maplen, .type = R_IMP, .dev = cur->dev,
                .page = (int)page, .fd = -1, .exporter_dev = c->owner_dev, .control = c, .slot = slot};
    memcpy(r.key, key, strlen(key) + 1);
    int i = add_region(r);
    pthread_rwlock_unlock(&rw);
    if (i < 0) {
        munmap(m, maplen);
        if (slot >= 0) __atomic_store_n(&c->importers[slot], 0, __ATOMIC_RELEASE);
        __atomic_sub_fetch(&c->state, 1, __ATOMIC_ACQ_REL);
        munmap(c, SMALL_PAGE);
        return FAIL(RT_MEMORY_ALLOCATION, "too many regions");
    }
    *p = m; return OK;
}
aclError aclrtIpcMemClose(const char *key) {
    NEED_CTX;
    int pid, fd, cfd, dev; size_t off, n;
    if (!parse_key(key, &pid, &fd, &cfd, &off, &n, &dev)) return FAIL(RT_PARAM_INVALID, "not an export key");
    pthread_rwlock_wrlock(&rw);
    if (pid != getpid()) { /* an importer: unmap */
        for (int i = 0; i < nrg; i++)
            if (rg[i].type == R_IMP && !strcmp(rg[i].key, key)) {
                ctl *c = rg[i].control;
                int slot = rg[i].slot;
                drop_region(i);
                if (slot >= 0) __atomic_store_n(&c->importers[slot], 0, __ATOMIC_RELEASE);
                __atomic_sub_fetch(&c->state, 1, __ATOMIC_ACQ_REL);
                munmap(c, SMALL_PAGE);
                pthread_rwlock_unlock(&rw);
                return OK;
            }
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_IPC_ERROR, "%s is not imported by this process", key);
    }
    int x = find_export(key);
    if (x < 0) { pthread_rwlock_unlock(&rw); return FAIL(RT_IPC_ERROR, "%s is not an open export of this process", key); }
    ctl *c = exps[x].c;
    for (int k = 0; k < WHITELIST; k++) { /* importers that died without closing */
        int32_t who = __atomic_load_n(&c->importers[k], __ATOMIC_ACQUIRE);
        if (who > 0 && kill(who, 0) < 0 && errno == ESRCH &&
            __atomic_compare_exchange_n(&c->importers[k], &who, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED))
            __atomic_sub_fetch(&c->state, 1, __ATOMIC_ACQ_REL);
    }
    int32_t zero = 0;
    if (!__atomic_compare_exchange_n(&c->state, &zero, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        pthread_rwlock_unlock(&rw);
        return FAIL(RT_IPC_ERROR, "importer must close first: %d importer(s) still have %s open", zero, key);
    }
    munmap(c, SMALL_PAGE); close(exps[x].cfd);
    int i = find(exps[x].alloc);
    if (i >= 0 && rg[i].type == R_DEV) rg[i].exports--;
    exps[x].live = 0;
    pthread_rwlock_unlock(&rw);
    return OK;
}
