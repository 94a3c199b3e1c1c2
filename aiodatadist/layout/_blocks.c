/* aiodatadist.layout._blocks: block lists -> byte runs in one pass (layout.b2b_runs).  A serving engine's request names
 * blocks that no earlier call named, so its plan is built on every call; with Python lists of 64-128 random blocks
 * that build took 60-110 us in Python and numpy (4-6 us here).
 *
 * block_runs(src, dst, src_slots, dst_slots, stride) -> bytes | None: src[i] -> dst[i] as runs of `stride`-byte
 * blocks, in source order (stable), merged where both sides continue; the bytes hold m source offsets, then m
 * destination offsets, then m lengths (int64).  None when the input is not two non-empty lists or tuples of
 * equal length of exact ints with 0 <= src[i] < src_slots, 0 <= dst[i] < dst_slots and no destination twice (nor
 * when an offset would overflow): the caller's checked path then raises the precise error. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define STACK_PAIRS 128   /* lists up to this long need no heap memory (8 KiB of stack) */

typedef struct { int64_t s, d; } pair;

/* Sort p[0, n) by source, stably (equal sources keep the input's order), with tmp[0, n) as scratch: a radix sort
 * by bytes, as many passes as `limit` (every source is below it) has bytes.  Comparison sorts mispredict a branch
 * per comparison on random block lists: qsort took ~10 us and a merge sort ~3 us for 128 random pairs. */
static void sort_by_source(pair *p, pair *tmp, Py_ssize_t n, uint64_t limit)
{
    pair *from = p, *to = tmp;
    for (unsigned shift = 0; shift < 64 && (limit - 1) >> shift; shift += 8) {
        Py_ssize_t count[257] = {0};
        for (Py_ssize_t i = 0; i < n; i++) count[((uint64_t)from[i].s >> shift & 255) + 1]++;
        for (int c = 0; c < 256; c++) count[c + 1] += count[c];
        for (Py_ssize_t i = 0; i < n; i++) to[count[(uint64_t)from[i].s >> shift & 255]++] = from[i];
        pair *swap = from; from = to; to = swap;
    }
    if (from != p) memcpy(p, from, (size_t)n * sizeof *p);
}

/* Each item an exact int in [0, limit): its value at out[i].s or .d.  0 otherwise. */
static int read_blocks(PyObject *seq, pair *out, Py_ssize_t n, int64_t limit, int dst)
{
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(items[i])) return 0;
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow || v < 0 || v >= limit) return 0;
        if (dst) out[i].d = v; else out[i].s = v;
    }
    return 1;
}

/* Whether no two pairs share a destination: strictly increasing destinations (the common case) need no table;
 * otherwise an open-addressing set of at least 2n slots (`scratch` when it fits). */
static int unique_destinations(const pair *p, Py_ssize_t n, uint64_t *scratch, size_t scratch_slots)
{
    Py_ssize_t k = 1;
    while (k < n && p[k].d > p[k - 1].d) k++;
    if (k >= n) return 1;
    size_t slots = 16;
    while (slots < 2 * (size_t)n) slots <<= 1;
    uint64_t *set = slots <= scratch_slots ? scratch : malloc(slots * sizeof *set);
    if (!set) return -1;
    memset(set, 0, slots * sizeof *set);
    int unique = 1;
    for (Py_ssize_t i = 0; i < n && unique; i++) {
        uint64_t key = (uint64_t)p[i].d + 1;   /* 0 marks an empty slot */
        size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & (slots - 1);
        while (set[h] && set[h] != key) h = (h + 1) & (slots - 1);
        if (set[h]) unique = 0; else set[h] = key;
    }
    if (set != scratch) free(set);
    return unique;
}

static PyObject *block_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) { PyErr_SetString(PyExc_TypeError, "block_runs takes 5 arguments"); return NULL; }
    PyObject *src = args[0], *dst = args[1];
    long long src_slots = PyLong_AsLongLong(args[2]), dst_slots = PyLong_AsLongLong(args[3]);
    long long stride = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (!(PyList_CheckExact(src) || PyTuple_CheckExact(src)) || !(PyList_CheckExact(dst) || PyTuple_CheckExact(dst)))
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(src);
    if (n == 0 || PySequence_Fast_GET_SIZE(dst) != n || stride <= 0) Py_RETURN_NONE;
    pair stack_pairs[STACK_PAIRS];
    int64_t stack_runs[3 * STACK_PAIRS];
    uint64_t stack_set[2 * STACK_PAIRS];
    pair *p = n <= STACK_PAIRS ? stack_pairs : malloc((size_t)n * sizeof *p);
    int64_t *runs = n <= STACK_PAIRS ? stack_runs : malloc(3 * (size_t)n * sizeof *runs);
    PyObject *result = NULL;
    if (!p || !runs) { PyErr_NoMemory(); goto done; }
    if (!read_blocks(src, p, n, src_slots, 0) || !read_blocks(dst, p, n, dst_slots, 1)) goto none;
    int unique = unique_destinations(p, n, stack_set, 2 * STACK_PAIRS);
    if (unique < 0) { PyErr_NoMemory(); goto done; }
    if (!unique) goto none;
    Py_ssize_t k = 1;
    while (k < n && p[k].s >= p[k - 1].s) k++;
    if (k < n) sort_by_source(p, (pair *)runs, n, (uint64_t)src_slots);   /* scratch: runs' 24n bytes, unused yet */
    /* Runs of consecutive blocks on both sides, counted in blocks: starts at runs[0, m) and runs[n, n + m). */
    Py_ssize_t m = 0;
    int64_t *starts_s = runs, *starts_d = runs + n, *counts = runs + 2 * n;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (m && p[i].s == starts_s[m - 1] + counts[m - 1] && p[i].d == starts_d[m - 1] + counts[m - 1]) {
            counts[m - 1]++;
            continue;
        }
        starts_s[m] = p[i].s; starts_d[m] = p[i].d; counts[m] = 1; m++;
    }
    result = PyBytes_FromStringAndSize(NULL, 3 * m * (Py_ssize_t)sizeof(int64_t));
    if (!result) goto done;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(result);
    for (Py_ssize_t r = 0; r < m; r++) {
        if (__builtin_mul_overflow(starts_s[r], stride, &out[r])
            || __builtin_mul_overflow(starts_d[r], stride, &out[m + r])
            || __builtin_mul_overflow(counts[r], stride, &out[2 * m + r])) {
            Py_CLEAR(result);
            goto none;
        }
    }
    goto done;
none:
    result = Py_None;
    Py_INCREF(result);
done:
    if (p != stack_pairs) free(p);
    if (runs != stack_runs) free(runs);
    return result;
}

static PyMethodDef blocks_methods[] = {
    {"block_runs", (PyCFunction)(void (*)(void))block_runs, METH_FASTCALL, "Block lists as byte runs, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blocks_module = {PyModuleDef_HEAD_INIT, "_blocks", "Block lists as byte runs.", -1,
                                           blocks_methods};
PyMODINIT_FUNC PyInit__blocks(void) { return PyModule_Create(&blocks_module); }
