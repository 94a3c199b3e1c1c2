/* CUDA's driver behind the device-runtime table (adt_device_ops, adt.h): the driver's functions, found by ctypes
 * in the loaded libcuda, called with the arguments as plain ints and pointers.  The table binds the calling thread
 * to a device's context, launches the pointer-list copy kernel (aiodatadist/cuda/copy_kernel.cu) with its
 * descriptor table staged through page-locked memory, gathers spans into host memory or scatters them from it in
 * one such launch, and records and queries events.  CUDA's types and codes stay in this file.
 */
#include "adt.h"

#include <stdlib.h>

typedef int CUresult;
#define CUDA_ERROR_NOT_READY 600

typedef CUresult (*cu_ctx_get_fn)(void **);
typedef CUresult (*cu_ctx_set_fn)(void *);
typedef CUresult (*cu_launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 void *, void **, void **);
typedef CUresult (*cu_record_fn)(void *, void *);
typedef CUresult (*cu_query_fn)(void *);
typedef CUresult (*cu_htod_fn)(uint64_t, const void *, size_t, void *);

/* The table and the driver functions behind it, in one allocation (the table first: its address is the whole's). */
typedef struct {
    adt_device_ops ops;
    cu_ctx_get_fn get_current;
    cu_ctx_set_fn set_current;
    cu_launch_fn launch;
    cu_record_fn record;
    cu_query_fn query;
    cu_htod_fn htod;
} cuda_table;

static int cuda_bind(void *ctx, void *device)
{
    const cuda_table *cu = ctx;
    void *current = NULL;
    if (cu->get_current(&current) == 0 && current == device) return 0;
    return cu->set_current(device);
}

static int cuda_launch(void *ctx, const adt_device_launch *l)
{
    const cuda_table *cu = ctx;
    if (l->table_bytes) {
        if (l->table != l->staging) memcpy(l->staging, l->table, l->table_bytes);
        int r = cu->htod(l->device_table, l->staging, l->table_bytes, l->stream);
        if (r) return ADT_DEVICE_STAGE_FAILED | r;
    }
    return cu->launch(l->kernel, l->grid, 1, 1, l->block, 1, 1, 0, l->stream, l->params, NULL);
}

/* Gather (to_host) or scatter: the descriptors written straight into the lane's staging memory, then one launch. */
static int lane_copy(void *ctx, const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                     uint64_t host, int to_host)
{
    size_t count = adt_lane_table(lane, addr, len, n, host, to_host, NULL, 0);
    if (count == 0) return 0;
    if (count > lane->capacity || count > 0xffffffffu) return ADT_DEVICE_NO_ROOM;
    adt_lane_table(lane, addr, len, n, host, to_host, (uint64_t *)lane->staging, count);
    uint64_t src = lane->device_table, dst = src + 8 * count, lengths = src + 16 * count;
    unsigned spans = (unsigned)count;
    void *params[4] = {&src, &dst, &lengths, &spans};   /* the driver copies them at the launch */
    adt_device_launch l = {0};
    l.kernel = lane->kernel;
    l.grid = lane->max_grid && count > lane->max_grid ? lane->max_grid : spans;
    l.block = lane->block;
    l.stream = lane->stream;
    l.params = params;
    l.table = lane->staging;
    l.table_bytes = 24 * count;
    l.staging = lane->staging;
    l.device_table = lane->device_table;
    return cuda_launch(ctx, &l);
}

static int cuda_gather(void *ctx, const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                       uint64_t host)
{
    return lane_copy(ctx, lane, addr, len, n, host, 1);
}

static int cuda_scatter(void *ctx, const adt_device_lane *lane, uint64_t host, const uint64_t *addr,
                        const uint64_t *len, size_t n)
{
    return lane_copy(ctx, lane, addr, len, n, host, 0);
}

static int cuda_record(void *ctx, void *event, void *stream)
{
    return ((const cuda_table *)ctx)->record(event, stream);
}

static int cuda_query(void *ctx, void *event, void *stream, int *code)
{
    (void)stream;   /* a CUDA event carries the stream's error */
    *code = ((const cuda_table *)ctx)->query(event);
    return *code == 0 ? ADT_EVENT_READY : *code == CUDA_ERROR_NOT_READY ? ADT_EVENT_PENDING : ADT_EVENT_FAILED;
}

/* CUDA's table from the driver functions' addresses (adt.h: ADT_CUDA_FNS says which, in order); NULL when out of
 * memory.  Freed with adt_cuda_ops_free. */
adt_device_ops *adt_cuda_ops_new(void *const fns[ADT_CUDA_FNS])
{
    cuda_table *cu = calloc(1, sizeof *cu);
    if (!cu) return NULL;
    cu->get_current = (cu_ctx_get_fn)fns[0];
    cu->set_current = (cu_ctx_set_fn)fns[1];
    cu->launch = (cu_launch_fn)fns[2];
    cu->record = (cu_record_fn)fns[3];
    cu->query = (cu_query_fn)fns[4];
    cu->htod = (cu_htod_fn)fns[5];
    cu->ops = (adt_device_ops){cu, cuda_bind, cuda_launch, cuda_gather, cuda_scatter, cuda_record, cuda_query};
    return &cu->ops;
}

void adt_cuda_ops_free(adt_device_ops *ops) { free(ops); }
