/* The native helper as a CPython module (aiodatadist.native._native): the functions Python calls without ctypes,
 * because ctypes' argument conversion alone costs more than a small copy or a poll.  Each parses its arguments
 * (buffers taken as they are, METH_FASTCALL) and calls the C file that does the work; the rest of the library is
 * bound through ctypes (adt.h says which is which).  The CUDA methods go through the device-runtime table
 * (adt_device_ops), whose capsule cuda_bind returns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "adt.h"

#include <errno.h>

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
static adt_grid *plan_grid(PyObject *const *args, uint64_t src_delta, uint64_t dst_delta, uint64_t piece)
{
    Py_buffer b[PLAN_ARRAYS];
    if (plan_buffers(args, b) < 0) return NULL;
    size_t nt = (size_t)(b[2].len / 8), nr = (size_t)(b[4].len / 8);
    int err = 0;
    adt_grid *g = NULL;
    if ((size_t)(b[3].len / 8) != nt || (size_t)(b[5].len / 8) != nr || (size_t)(b[6].len / 8) != nr) err = EINVAL;
    else g = adt_grid_new(b[0].buf, (size_t)(b[0].len / 8), b[1].buf, (size_t)(b[1].len / 8), b[2].buf, b[3].buf,
                          nt, b[4].buf, b[5].buf, b[6].buf, nr, src_delta, dst_delta, piece, &err);
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
    adt_grid *g = plan_grid(args, src_delta, dst_delta, 0);
    if (g == NULL) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = adt_grid_copy(g, 0, adt_grid_bytes(g), (int)mode, (int)pid, 0, NULL);
    Py_END_ALLOW_THREADS
    adt_grid_free(g);
    return PyLong_FromLong(err);
}

/* submit_grid(pool, *plan arrays, src_delta, dst_delta, chunk, piece, mode, pid, streaming, notify_fd) -> job
 * handle: a plan queued in the pool; the caller keeps the run arrays alive until the job is reaped. */
static PyObject *py_submit_grid(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != PLAN_ARRAYS + 9) { PyErr_SetString(PyExc_TypeError, "submit_grid takes 16 arguments"); return NULL; }
    void *pool = PyLong_AsVoidPtr(args[0]);
    uint64_t src_delta = PyLong_AsUnsignedLongLongMask(args[8]), dst_delta = PyLong_AsUnsignedLongLongMask(args[9]);
    uint64_t chunk = PyLong_AsUnsignedLongLongMask(args[10]), piece = PyLong_AsUnsignedLongLongMask(args[11]);
    long mode = PyLong_AsLong(args[12]), pid = PyLong_AsLong(args[13]), streaming = PyLong_AsLong(args[14]);
    long fd = PyLong_AsLong(args[15]);
    if (PyErr_Occurred()) return NULL;
    if (pool == NULL || chunk == 0 || piece == 0) {
        PyErr_SetString(PyExc_ValueError, "submit_grid: no pool, or a zero chunk or piece");
        return NULL;
    }
    adt_grid *g = plan_grid(args + 1, src_delta, dst_delta, piece);
    if (g == NULL) return NULL;
    void *j = adt_pool_submit_grid(pool, g, chunk, (int)mode, (int)pid, (int)streaming, (int)fd);
    if (j == NULL) return PyErr_NoMemory();
    return PyLong_FromVoidPtr(j);
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
    adt_grid *g = plan_grid(args, 0, 0, piece);
    if (g == NULL) { PyBuffer_Release(&out); return NULL; }
    size_t merged = 0;
    uint64_t longest = 0;
    size_t n = adt_grid_table(g, out.buf, (size_t)(out.len / 8), &merged, &longest);
    adt_grid_free(g);
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
    void *j = job_arg(arg, "reap");
    if (j == NULL) return NULL;
    int err = 0, state = adt_job_reap(j, &err);
    if (state == 0) Py_RETURN_NONE;
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

/* The TCP plane's one-sided calls (net.c), called as Python functions for the same reason as the plan functions:
 * net_read and net_write(net, key, row, stamp, cache_id, model_id, remote_bases, remote_offsets, lengths,
 * local_bases, local_offsets) -> job handle (0: out of memory).  Both name both sides as grids of the same runs: the
 * owner's tensors' bases and the runs' offsets there, the runs' lengths, this side's tensors' bases and the runs'
 * offsets here (tensor t's run r pairs with tensor t's run r); the arrays (8-byte items) are copied by the callee. */
static PyObject *net_one_sided(PyObject *const *args, Py_ssize_t nargs, int write)
{
    if (nargs != 11 && nargs != 12) {
        PyErr_SetString(PyExc_TypeError, write ? "net_write takes 11 or 12 arguments"
                                               : "net_read takes 11 or 12 arguments");
        return NULL;
    }
    int staged = nargs == 12 ? PyObject_IsTrue(args[11]) : 0;
    if (staged < 0) return NULL;
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
                            b[2].buf, nr, b[3].buf, b[4].buf, staged);
    else
        job = adt_net_read(net, key, (int64_t)row, stamp, cache_id, (int64_t)model, b[0].buf, nt, b[1].buf,
                           b[2].buf, nr, b[3].buf, b[4].buf, 1, staged);
    release_buffers(b, 5);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromVoidPtr(job);
}

/* The two-sided calls, with one side as a grid (bases, offsets, lengths; see net_read):
 * net_send(net, key, bases, offsets, lengths[, staged]) -> job handle (0: out of memory), and
 * net_set_destination(net, job, bases, offsets, lengths[, staged]) -> 0 or ENOMEM; `staged`: the grid is device
 * memory, moved through the link's staging ring of that direction. */
static PyObject *net_two_sided(PyObject *const *args, Py_ssize_t nargs, int send)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, send ? "net_send takes 5 or 6 arguments"
                                              : "net_set_destination takes 5 or 6 arguments");
        return NULL;
    }
    int staged = nargs == 6 ? PyObject_IsTrue(args[5]) : 0;
    if (staged < 0) return NULL;
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
    else if (send) out = PyLong_FromVoidPtr(adt_net_send(net, key, b[0].buf, nt, b[1].buf, b[2].buf, nr, staged));
    else out = PyLong_FromLong(adt_net_set_destination(net, job, b[0].buf, nt, b[1].buf, b[2].buf, nr, staged));
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
    int err = 0, status = 0, state = adt_net_job_reap(net, job, &err, &status);
    return Py_BuildValue("(iii)", state, err, status);
}

/* net_done(job) -> whether a TCP job ended (then net_reap gives its outcome); for a job not reaped yet. */
static PyObject *py_net_done(PyObject *self, PyObject *arg)
{
    (void)self;
    void *job = job_arg(arg, "net_done");
    return job == NULL ? NULL : PyBool_FromLong(adt_net_job_done(job));
}

/* The CUDA methods: the device-runtime table of CUDA's driver (cuda.c) as a capsule, and the launch, record and
 * query of a GPU copy through it, each making the device's context current first when it is not (what
 * Device.make_current does).  Each returns the CUresult, plus ADT_DEVICE_BIND_FAILED when making the context
 * current failed (then nothing else was called). */
static void device_ops_free(PyObject *capsule)
{
    adt_cuda_ops_free(PyCapsule_GetPointer(capsule, ADT_DEVICE_OPS_CAPSULE));
}

/* cuda_bind(cuCtxGetCurrent, cuCtxSetCurrent, cuLaunchKernel, cuEventRecord, cuEventQuery, cuMemcpyHtoDAsync_v2)
 * -> a capsule of the device-runtime table (ADT_DEVICE_OPS_CAPSULE), for these methods and native I/O threads. */
static PyObject *py_cuda_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != ADT_CUDA_FNS) {
        PyErr_SetString(PyExc_TypeError, "cuda_bind takes 6 function addresses");
        return NULL;
    }
    void *f[ADT_CUDA_FNS];
    for (int i = 0; i < ADT_CUDA_FNS; i++) {
        f[i] = PyLong_AsVoidPtr(args[i]);
        if (!f[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a CUDA function address is NULL");
            return NULL;
        }
    }
    adt_device_ops *ops = adt_cuda_ops_new(f);
    if (!ops) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(ops, ADT_DEVICE_OPS_CAPSULE, device_ops_free);
    if (!capsule) adt_cuda_ops_free(ops);
    return capsule;
}

/* The table of a capsule (args[0]), after binding this thread to the device's context (args[1]); NULL with an
 * exception, else *failed is 0 or ADT_DEVICE_BIND_FAILED plus the driver's code. */
static adt_device_ops *device_enter(PyObject *const *args, long *failed)
{
    adt_device_ops *ops = PyCapsule_GetPointer(args[0], ADT_DEVICE_OPS_CAPSULE);
    if (!ops) return NULL;
    void *ctx = PyLong_AsVoidPtr(args[1]);
    if (!ctx && PyErr_Occurred()) return NULL;
    int r = ops->bind(ops->ctx, ctx);
    *failed = r ? ADT_DEVICE_BIND_FAILED | r : 0;
    return ops;
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
 * stream (cuMemcpyHtoDAsync_v2; ADT_DEVICE_STAGE_FAILED plus its CUresult when that failed, and nothing was
 * launched). */
static PyObject *py_cuda_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7 && nargs != 11) { PyErr_SetString(PyExc_TypeError, "cuda_launch takes 7 or 11 arguments"); return NULL; }
    adt_device_launch launch = {0};
    launch.kernel = PyLong_AsVoidPtr(args[2]);
    launch.stream = PyLong_AsVoidPtr(args[5]);
    launch.params = (void **)PyLong_AsVoidPtr(args[6]);
    if (nargs == 11) {
        launch.table_bytes = PyLong_AsSize_t(args[8]);
        launch.staging = PyLong_AsVoidPtr(args[9]);
        launch.device_table = (uint64_t)PyLong_AsUnsignedLongLong(args[10]);
    }
    if (PyErr_Occurred() || as_uint(args[3], &launch.grid) || as_uint(args[4], &launch.block)) return NULL;
    Py_buffer table = {0};
    if (launch.table_bytes) {
        if (!launch.staging) {
            PyErr_SetString(PyExc_ValueError, "a table to stage needs a staging buffer");
            return NULL;
        }
        if (PyObject_GetBuffer(args[7], &table, PyBUF_SIMPLE) < 0) return NULL;
        if ((size_t)table.len < launch.table_bytes) {
            PyBuffer_Release(&table);
            PyErr_SetString(PyExc_ValueError, "the table is shorter than the bytes to stage");
            return NULL;
        }
        launch.table = table.buf;
    }
    long failed, result;
    adt_device_ops *ops = device_enter(args, &failed);
    if (!ops) result = -1;
    else result = failed ? failed : ops->launch(ops->ctx, &launch);
    if (launch.table_bytes) PyBuffer_Release(&table);
    return result == -1 ? NULL : PyLong_FromLong(result);
}

/* cuda_record(fns, ctx, event, stream), also device_record -> the runtime's result of recording the event on the
 * stream (cuEventRecord, aclrtRecordEvent). */
static PyObject *py_device_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "device_record takes 4 arguments"); return NULL; }
    void *event = PyLong_AsVoidPtr(args[2]), *stream = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    long failed;
    adt_device_ops *ops = device_enter(args, &failed);
    if (!ops) return NULL;
    return PyLong_FromLong(failed ? failed : ops->record(ops->ctx, event, stream));
}

/* cuda_query(fns, ctx, event) -> CUresult of cuEventQuery (CUDA_ERROR_NOT_READY while the work before it runs). */
static PyObject *py_cuda_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "cuda_query takes 3 arguments"); return NULL; }
    void *event = PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) return NULL;
    long failed;
    adt_device_ops *ops = device_enter(args, &failed);
    if (!ops) return NULL;
    if (failed) return PyLong_FromLong(failed);
    int code = 0;
    ops->query(ops->ctx, event, NULL, &code);
    return PyLong_FromLong(code);
}

/* The ACL methods: the device-runtime table of ACL (acl.c) as a capsule, the span copies of a job and the query of
 * its event through it, each binding the calling thread to the device's context first (as cuda_* do). */
static void acl_ops_free(PyObject *capsule)
{
    adt_acl_ops_free(PyCapsule_GetPointer(capsule, ADT_DEVICE_OPS_CAPSULE));
}

/* acl_bind(aclrtGetCurrentContext, aclrtSetCurrentContext, aclrtMemcpyAsync, aclrtMemcpyBatchAsync or 0,
 * aclrtRecordEvent, aclrtQueryEventStatus, aclrtStreamQuery, aclrtStreamAbort, device) -> a capsule of the
 * device-runtime table (ADT_DEVICE_OPS_CAPSULE). */
static PyObject *py_acl_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != ADT_ACL_FNS + 1) {
        PyErr_SetString(PyExc_TypeError, "acl_bind takes 8 function addresses and a device");
        return NULL;
    }
    void *f[ADT_ACL_FNS];
    for (int i = 0; i < ADT_ACL_FNS; i++) {
        f[i] = PyLong_AsVoidPtr(args[i]);
        if (!f[i] && PyErr_Occurred()) return NULL;
        if (!f[i] && i != 3) {   /* only the batch copy is optional */
            PyErr_SetString(PyExc_ValueError, "an ACL function address is NULL");
            return NULL;
        }
    }
    long device = PyLong_AsLong(args[ADT_ACL_FNS]);
    if (device == -1 && PyErr_Occurred()) return NULL;
    adt_device_ops *ops = adt_acl_ops_new(f, (int)device);
    if (!ops) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(ops, ADT_DEVICE_OPS_CAPSULE, acl_ops_free);
    if (!capsule) adt_acl_ops_free(ops);
    return capsule;
}

/* acl_copy(fns, ctx, stream, kind, table, n) -> (aclError, spans queued): the n spans of a C-contiguous uint64
 * table (sources, destinations, lengths) queued on the stream (adt_acl_copy). */
static PyObject *py_acl_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6) { PyErr_SetString(PyExc_TypeError, "acl_copy takes 6 arguments"); return NULL; }
    void *stream = PyLong_AsVoidPtr(args[2]);
    long kind = PyLong_AsLong(args[3]);
    size_t n = PyLong_AsSize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer table;
    if (PyObject_GetBuffer(args[4], &table, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if ((size_t)table.len < 24 * n) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "the table is shorter than its spans");
        return NULL;
    }
    long failed;
    size_t queued = 0;
    adt_device_ops *ops = device_enter(args, &failed);
    long result = -1;
    if (ops) {
        if (failed) result = failed;
        else {
            Py_BEGIN_ALLOW_THREADS   /* a copy from pageable host memory returns only once it is done */
            result = adt_acl_copy(ops, stream, (int)kind, table.buf, n, &queued);
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&table);
    if (!ops) return NULL;
    return Py_BuildValue("(ln)", result, (Py_ssize_t)queued);
}

/* device_query(fns, ctx, event, stream) -> -1 while the work before the event runs, 0 once it is done, else the
 * runtime's code (of the query, or of the stream's failed copy). */
static PyObject *py_device_query(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) { PyErr_SetString(PyExc_TypeError, "device_query takes 4 arguments"); return NULL; }
    void *event = PyLong_AsVoidPtr(args[2]), *stream = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    long failed;
    adt_device_ops *ops = device_enter(args, &failed);
    if (!ops) return NULL;
    if (failed) return PyLong_FromLong(failed);
    int code = 0, state = ops->query(ops->ctx, event, stream, &code);
    return PyLong_FromLong(state == ADT_EVENT_READY ? 0 : state == ADT_EVENT_PENDING ? -1 : (code ? code : 1));
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
    {"cuda_bind", (PyCFunction)(void (*)(void))py_cuda_bind, METH_FASTCALL, "CUDA's device-runtime table."},
    {"cuda_launch", (PyCFunction)(void (*)(void))py_cuda_launch, METH_FASTCALL, "cuLaunchKernel of a 1-D grid."},
    {"cuda_record", (PyCFunction)(void (*)(void))py_device_record, METH_FASTCALL, "cuEventRecord."},
    {"device_record", (PyCFunction)(void (*)(void))py_device_record, METH_FASTCALL, "An event recorded."},
    {"device_query", (PyCFunction)(void (*)(void))py_device_query, METH_FASTCALL, "An event queried, and its stream."},
    {"acl_bind", (PyCFunction)(void (*)(void))py_acl_bind, METH_FASTCALL, "ACL's device-runtime table."},
    {"acl_copy", (PyCFunction)(void (*)(void))py_acl_copy, METH_FASTCALL, "Spans queued as ACL copies."},
    {"cuda_query", (PyCFunction)(void (*)(void))py_cuda_query, METH_FASTCALL, "cuEventQuery."},
    {NULL, NULL, 0, NULL},
};

/* The rest of the library is bound through ctypes (adt.h: ADT_API). */
static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "_native", "aiodatadist span copier", -1,
                                           native_methods};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
