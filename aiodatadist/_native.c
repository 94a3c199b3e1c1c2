/* Batched span copies for aiodatadist, called through ctypes (which releases the GIL).
 *
 * adt_copy_spans copies n spans dst[i] <- src[i] of len[i] bytes, checking a stop flag between spans, so that
 * one call can cover many spans (few GIL round trips) and still stop promptly.  With `streaming` set, spans of 4 KiB and
 * more use non-temporal stores: bulk KV-cache transfers are far bigger than the caches, and skipping the
 * read-for-ownership of the destination is what makes scattered 32 KiB blocks copy as fast as one big memcpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
static void stream_copy(char *d, const char *s, size_t n)
{
    while (n && ((uintptr_t)d & 15u)) { *d++ = *s++; n--; }
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        s += 64; d += 64;
    }
    memcpy(d, s, n - blocks * 64);
}
#define STREAM_FENCE() _mm_sfence()
#else
static void stream_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }
#define STREAM_FENCE() ((void)0)
#endif

/* Returns the number of spans copied: n, or fewer when *stop became non-zero (checked before every span, so a
 * stop takes effect within one span; callers keep spans small).  stop may be NULL. */
long adt_copy_spans(const uint64_t *dst, const uint64_t *src, const uint64_t *len, size_t n, int streaming,
                    const volatile int32_t *stop)
{
    size_t i;
    for (i = 0; i < n; i++) {
        if (stop && *stop) break;
        if (streaming && len[i] >= 4096)
            stream_copy((char *)(uintptr_t)dst[i], (const char *)(uintptr_t)src[i], (size_t)len[i]);
        else
            memmove((void *)(uintptr_t)dst[i], (const void *)(uintptr_t)src[i], (size_t)len[i]);
    }
    if (streaming) STREAM_FENCE();
    return (long)i;
}

/* Importable as a module so that the build and the loader can find it; the work is done through ctypes. */
static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "_native", "aiodatadist span copier", -1, NULL};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
