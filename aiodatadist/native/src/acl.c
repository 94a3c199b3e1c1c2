/* Ascend's ACL runtime behind the device-runtime table (adt_device_ops, adt.h), and the span copies of the ACL
 * executor: the runtime's functions, found by ctypes in the loaded libascendcl, called with the arguments as
 * plain ints and pointers.  ACL has no pointer-list copy kernel that ctypes could load, so a gather or scatter is
 * the lane's merged spans as copies: one aclrtMemcpyBatchAsync per 4096 spans (host and device, one direction a
 * batch), or one aclrtMemcpyAsync per span where the runtime refuses batches.  An ACL event carries no error: a
 * query that finds its event complete (or still pending) asks the stream too, where a failed copy is kept (the
 * executor's streams stop at a failure), and a failed stream is aborted so that its lane can be used again.
 * ACL's types and codes stay in this file.
 */
#include "adt.h"

#include <stdlib.h>

typedef int aclError;
#define ACL_ERROR_API_NOT_SUPPORT 200001
#define ACL_ERROR_RT_FEATURE_NOT_SUPPORT 207000
#define ACL_MEMCPY_HOST_TO_DEVICE 1
#define ACL_MEMCPY_DEVICE_TO_HOST 2
#define ACL_EVENT_RECORDED_STATUS_COMPLETE 1
#define ACL_STREAM_STATUS_COMPLETE 0
#define ACL_MEM_LOCATION_TYPE_HOST 0
#define ACL_MEM_LOCATION_TYPE_DEVICE 1
#define BATCH_MAX 4096    /* spans per aclrtMemcpyBatchAsync (as Mooncake's copy engine batches) */

typedef struct { uint32_t id; int type; } acl_location;
typedef struct { acl_location dst, src; uint8_t rsv[16]; } acl_batch_attr;

typedef aclError (*acl_ctx_get_fn)(void **);
typedef aclError (*acl_ctx_set_fn)(void *);
typedef aclError (*acl_memcpy_fn)(void *, size_t, const void *, size_t, int, void *);
typedef aclError (*acl_batch_fn)(void **, size_t *, void **, size_t *, size_t, acl_batch_attr *, size_t *, size_t,
                                 size_t *, void *);
typedef aclError (*acl_record_fn)(void *, void *);
typedef aclError (*acl_event_status_fn)(void *, int *);
typedef aclError (*acl_stream_query_fn)(void *, int *);
typedef aclError (*acl_stream_abort_fn)(void *);

/* The table and the runtime functions behind it, in one allocation (the table first: its address is the whole's).
 * `batches` drops to 0 once the runtime refused a batch: from then on every span is a copy of its own. */
typedef struct {
    adt_device_ops ops;
    acl_ctx_get_fn get_current;
    acl_ctx_set_fn set_current;
    acl_memcpy_fn memcpy_async;
    acl_batch_fn batch;
    acl_record_fn record;
    acl_event_status_fn event_status;
    acl_stream_query_fn stream_query;
    acl_stream_abort_fn stream_abort;
    int device;
    volatile int batches;
} acl_table;

static int acl_bind(void *ctx, void *device)
{
    const acl_table *acl = ctx;
    void *current = NULL;
    if (acl->get_current(&current) == 0 && current == device) return 0;
    return acl->set_current(device);
}

static int acl_launch(void *ctx, const adt_device_launch *launch)
{
    (void)ctx; (void)launch;
    return ACL_ERROR_RT_FEATURE_NOT_SUPPORT;   /* no pointer-list kernel: gather and scatter copy span by span */
}

static int per_span(const acl_table *acl, void *stream, int kind, const uint64_t *src, const uint64_t *dst,
                    const uint64_t *len, size_t n, size_t *queued)
{
    for (size_t i = 0; i < n; i++) {
        int r = acl->memcpy_async((void *)(uintptr_t)dst[i], len[i], (const void *)(uintptr_t)src[i], len[i], kind,
                                  stream);
        if (r) return r;
        (*queued)++;
    }
    return 0;
}

/* One batch of n <= BATCH_MAX spans of one direction; the descriptor arrays are the table's own (on a 64-bit
 * machine a uint64_t array is a void * and a size_t array). */
static int batch(const acl_table *acl, void *stream, int kind, const uint64_t *src, const uint64_t *dst,
                 const uint64_t *len, size_t n)
{
    acl_batch_attr attr = {{0, 0}, {0, 0}, {0}};
    acl_location device = {(uint32_t)acl->device, ACL_MEM_LOCATION_TYPE_DEVICE}, host = {0, ACL_MEM_LOCATION_TYPE_HOST};
    attr.dst = kind == ACL_MEMCPY_HOST_TO_DEVICE ? device : host;
    attr.src = kind == ACL_MEMCPY_HOST_TO_DEVICE ? host : device;
    size_t index = 0, failed = 0;
    return acl->batch((void **)(uintptr_t)dst, (size_t *)(uintptr_t)len, (void **)(uintptr_t)src,
                      (size_t *)(uintptr_t)len, n, &attr, &index, 1, &failed, stream);
}

int adt_acl_copy(const adt_device_ops *ops, void *stream, int kind, const uint64_t *table, size_t n, size_t *queued)
{
    acl_table *acl = (acl_table *)ops->ctx;
    const uint64_t *src = table, *dst = table + n, *len = table + 2 * n;
    *queued = 0;
    int batched = (kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_HOST) && acl->batch
                  && acl->batches && n > 1 && sizeof(uint64_t) == sizeof(void *) && sizeof(uint64_t) == sizeof(size_t);
    for (size_t at = 0; batched && at < n;) {
        size_t k = n - at < BATCH_MAX ? n - at : BATCH_MAX;
        int r = batch(acl, stream, kind, src + at, dst + at, len + at, k);
        if (r == ACL_ERROR_RT_FEATURE_NOT_SUPPORT || r == ACL_ERROR_API_NOT_SUPPORT) {
            acl->batches = 0;   /* this runtime or product copies span by span (nothing of the batch was queued) */
            break;
        }
        if (r) return r;
        at += k;
        *queued = at;
    }
    size_t done = *queued;
    if (done == n) return 0;
    return per_span(acl, stream, kind, src + done, dst + done, len + done, n - done, queued);
}

/* Gather (to_host) or scatter: the lane's merged spans written into its staging memory, then queued as copies. */
static int lane_copy(void *ctx, const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                     uint64_t host, int to_host)
{
    size_t count = adt_lane_table(lane, addr, len, n, host, to_host, NULL, 0);
    if (count == 0) return 0;
    if (count > lane->capacity) return ADT_DEVICE_NO_ROOM;
    uint64_t *table = (uint64_t *)lane->staging;
    adt_lane_table(lane, addr, len, n, host, to_host, table, count);
    size_t queued = 0;
    return adt_acl_copy(&((acl_table *)ctx)->ops, lane->stream,
                        to_host ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_DEVICE, table, count, &queued);
}

static int acl_gather(void *ctx, const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                      uint64_t host)
{
    return lane_copy(ctx, lane, addr, len, n, host, 1);
}

static int acl_scatter(void *ctx, const adt_device_lane *lane, uint64_t host, const uint64_t *addr,
                       const uint64_t *len, size_t n)
{
    return lane_copy(ctx, lane, addr, len, n, host, 0);
}

static int acl_record(void *ctx, void *event, void *stream)
{
    return ((const acl_table *)ctx)->record(event, stream);
}

/* The event's status, and the stream's error if it has one (then the stream is aborted: its remaining tasks,
 * never to run after the failure, are dropped, and it takes new work again). */
static int acl_query(void *ctx, void *event, void *stream, int *code)
{
    const acl_table *acl = ctx;
    int status = 0;
    *code = acl->event_status(event, &status);
    if (*code) return ADT_EVENT_FAILED;
    if (stream) {
        int state = 0;
        int r = acl->stream_query(stream, &state);
        if (r) {
            *code = r;
            acl->stream_abort(stream);
            return ADT_EVENT_FAILED;
        }
    }
    return status == ACL_EVENT_RECORDED_STATUS_COMPLETE ? ADT_EVENT_READY : ADT_EVENT_PENDING;
}

adt_device_ops *adt_acl_ops_new(void *const fns[ADT_ACL_FNS], int device)
{
    acl_table *acl = calloc(1, sizeof *acl);
    if (!acl) return NULL;
    acl->get_current = (acl_ctx_get_fn)fns[0];
    acl->set_current = (acl_ctx_set_fn)fns[1];
    acl->memcpy_async = (acl_memcpy_fn)fns[2];
    acl->batch = (acl_batch_fn)fns[3];
    acl->record = (acl_record_fn)fns[4];
    acl->event_status = (acl_event_status_fn)fns[5];
    acl->stream_query = (acl_stream_query_fn)fns[6];
    acl->stream_abort = (acl_stream_abort_fn)fns[7];
    acl->device = device;
    acl->batches = 1;
    acl->ops = (adt_device_ops){acl, acl_bind, acl_launch, acl_gather, acl_scatter, acl_record, acl_query};
    return &acl->ops;
}

void adt_acl_ops_free(adt_device_ops *ops) { free(ops); }
