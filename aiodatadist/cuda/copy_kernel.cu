// Pointer-list copy kernel of aiodatadist (source of copy_kernel.ptx; regenerate with scripts/gen_ptx.sh).
//
// adt_copy_spans copies n spans: len[i] bytes from address src[i] to address dst[i].  The three descriptor
// arrays live in device memory; the addresses may be device memory, IPC-opened device memory of another
// process, or device pointers of page-locked host memory (zero-copy, read or written over PCIe/NVLink-C2C).
//
// Work split: CTA b copies spans b, b + gridDim.x, ... (grid-stride), each one with all its threads.  The host
// cuts long spans into pieces so that CTAs get similar amounts of work.
//
// Widths: when src and dst have the same address modulo 16 (so any 16-aligned pair, whatever the length), the
// bytes up to the first 16-aligned address and after the last one are copied one by one and the rest with
// 16-byte loads/stores; otherwise the widest of 8, 4 or 1 bytes that src and dst share an alignment for.
// Each thread issues UNROLL independent loads before the matching stores, so that many requests are in
// flight at once: what reads of host memory over PCIe (latency ~1 us) need to reach full bandwidth.
// Loads and stores use the streaming cache hint (.cs): copied bytes are not read again soon.
//
// Spans must not overlap each other's destinations, nor a source overlap a destination (no memmove).

typedef unsigned long long u64;

#define ADT_UNROLL 4

template <typename T>
__device__ __forceinline__ void copy_words(const T* __restrict__ s, T* __restrict__ d, u64 count) {
    const u64 step = blockDim.x;
    u64 i = threadIdx.x;
    for (; i + (ADT_UNROLL - 1) * step < count; i += ADT_UNROLL * step) {
        T v[ADT_UNROLL];
#pragma unroll
        for (int k = 0; k < ADT_UNROLL; ++k) v[k] = __ldcs(s + i + k * step);
#pragma unroll
        for (int k = 0; k < ADT_UNROLL; ++k) __stcs(d + i + k * step, v[k]);
    }
    for (; i < count; i += step) __stcs(d + i, __ldcs(s + i));
}

// s and d are congruent modulo sizeof(T): bytes up to the first T-aligned address, T words, then the tail.
// Requires blockDim.x >= sizeof(T) (head and tail are copied by one thread per byte).
template <typename T>
__device__ __forceinline__ void copy_span(const unsigned char* s, unsigned char* d, u64 n) {
    const u64 mask = sizeof(T) - 1;
    u64 head = (sizeof(T) - (reinterpret_cast<u64>(s) & mask)) & mask;
    if (head > n) head = n;
    const u64 body = (n - head) & ~mask;
    const u64 tail = n - head - body;
    if (threadIdx.x < head) __stcs(d + threadIdx.x, __ldcs(s + threadIdx.x));
    copy_words<T>(reinterpret_cast<const T*>(s + head), reinterpret_cast<T*>(d + head), body / sizeof(T));
    if (threadIdx.x < tail) {
        const u64 at = head + body + threadIdx.x;
        __stcs(d + at, __ldcs(s + at));
    }
}

extern "C" __global__ void __launch_bounds__(256)
adt_copy_spans(const u64* __restrict__ src, const u64* __restrict__ dst, const u64* __restrict__ len,
               unsigned int n) {
    for (u64 i = blockIdx.x; i < n; i += gridDim.x) {
        const u64 s = src[i];
        const u64 d = dst[i];
        const u64 l = len[i];
        const u64 skew = s ^ d;
        const unsigned char* sp = reinterpret_cast<const unsigned char*>(s);
        unsigned char* dp = reinterpret_cast<unsigned char*>(d);
        if ((skew & 15) == 0) {
            copy_span<uint4>(sp, dp, l);
        } else if ((skew & 7) == 0) {
            copy_span<uint2>(sp, dp, l);
        } else if ((skew & 3) == 0) {
            copy_span<unsigned int>(sp, dp, l);
        } else {
            copy_words<unsigned char>(sp, dp, l);
        }
    }
}
