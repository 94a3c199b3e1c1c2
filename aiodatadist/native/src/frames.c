/* Frames on blocking stream sockets, moved straight between the socket and cache memory: a frame is a header
 * followed by a payload that is a contiguous slice of a transfer's byte stream (its spans in plan order).  Sent
 * from spans or a grid (gathering small spans into a bounce buffer), received into spans (scattering small ones
 * out of one).  Called by the TCP plane's I/O threads (net.c), and through ctypes by the Python TCP plane (the
 * GIL released).
 */
#include "adt.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>

#define IOV_CAP 512
#define RECV_PIECE (1u << 20)

/* Spans shorter than SMALL_SPAN go through a bounce buffer, copied in user space: the kernel's cost per iovec
 * (~70 ns on loopback) is many times a small memcpy, so 8192 scattered 64-byte spans cost ~0.6 ms as iovecs and
 * ~0.05 ms gathered.  Larger spans are still sent and received in place.  The buffer (on the stack: the I/O
 * threads' stacks are the default 8 MiB) takes a whole frame share of tiny spans: every sendmsg wakes the
 * receiving thread, and 64 KiB writes made an 8192-span pull ~50 us slower on 2 vCPUs than 256 KiB ones. */
#define SMALL_SPAN 2048u
#define GATHER_BYTES (256u << 10)

static int send_all(int fd, struct iovec *iov, int n)   /* every byte of iov[0..n), or the errno */
{
    int i = 0;
    while (i < n) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov + i;
        m.msg_iovlen = (size_t)(n - i);
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        size_t left = (size_t)w;
        while (i < n && left >= iov[i].iov_len) { left -= iov[i].iov_len; i++; }
        if (i < n) { iov[i].iov_base = (uint8_t *)iov[i].iov_base + left; iov[i].iov_len -= left; }
    }
    return 0;
}

/* A frame being sent: iovecs (up to IOV_CAP), spans shorter than SMALL_SPAN gathered into a bounce buffer, a span
 * that continues the previous iovec extending it; sent (send_all) whenever either is full, and at the end. */
typedef struct {
    struct iovec iov[IOV_CAP];
    int n, gathering;
    size_t used;
    uint8_t gather[GATHER_BYTES];
} sendbuf;

static int sb_flush(sendbuf *b, int fd)
{
    int err = b->n ? send_all(fd, b->iov, b->n) : 0;
    b->n = 0; b->used = 0; b->gathering = 0;
    return err;
}

static void sb_open(sendbuf *b, const uint8_t *header, size_t hlen)
{
    b->n = 0; b->used = 0; b->gathering = 0;
    if (hlen) { b->iov[0].iov_base = (void *)header; b->iov[0].iov_len = hlen; b->n = 1; }
}

/* 0, or the errno that ended the connection.  Inlined: it runs once per span, and most spans are tiny. */
static inline __attribute__((always_inline)) int sb_add(sendbuf *b, int fd, const uint8_t *src, size_t l)
{
    int err;
    if (l == 0) return 0;
    if (l <= TINY_SPAN && b->gathering && b->used + l <= GATHER_BYTES) {   /* the common case, first */
        if (!copy_small((char *)(b->gather + b->used), (const char *)src, l)) memcpy(b->gather + b->used, src, l);
        b->iov[b->n - 1].iov_len += l;
        b->used += l;
        return 0;
    }
    if (l < SMALL_SPAN) {
        if ((b->used + l > GATHER_BYTES || (!b->gathering && b->n == IOV_CAP)) && (err = sb_flush(b, fd))) return err;
        uint8_t *to = b->gather + b->used;
        if (!copy_small((char *)to, (const char *)src, l)) memcpy(to, src, l);
        if (b->gathering) b->iov[b->n - 1].iov_len += l;
        else { b->iov[b->n].iov_base = to; b->iov[b->n].iov_len = l; b->n++; b->gathering = 1; }
        b->used += l;
        return 0;
    }
    if (b->n && !b->gathering && (const uint8_t *)b->iov[b->n - 1].iov_base + b->iov[b->n - 1].iov_len == src) {
        b->iov[b->n - 1].iov_len += l;
        return 0;
    }
    if (b->n == IOV_CAP && (err = sb_flush(b, fd))) return err;
    b->iov[b->n].iov_base = (void *)src; b->iov[b->n].iov_len = l; b->n++;
    b->gathering = 0;
    return 0;
}

/* Send `hlen` header bytes, then spans [lo, hi).  Returns 0, or the errno that ended the connection. */
int adt_send_frame(int fd, const uint8_t *header, size_t hlen, const uint64_t *addr, const uint64_t *len,
                   int64_t lo, int64_t hi)
{
    sendbuf b;
    sb_open(&b, header, hlen);
    for (int64_t i = lo; i < hi; i++) {
        int err = sb_add(&b, fd, (const uint8_t *)(uintptr_t)addr[i], (size_t)len[i]);
        if (err) return err;
    }
    return sb_flush(&b, fd);
}

/* Send `hlen` header bytes, then bytes [b0, b1) of a grid's stream: bases[t] + offs[r], lens[r] bytes, for each of
 * the nt tensors then each of the nr runs (`prefix`: the nr + 1 running sums of lens), walked straight into the
 * frame (no span list is built).  Returns 0, or the errno that ended the connection. */
int adt_send_grid(int fd, const uint8_t *header, size_t hlen, const uint64_t *bases, size_t nt, const uint64_t *offs,
                  const uint64_t *lens, size_t nr, const uint64_t *prefix, uint64_t b0, uint64_t b1)
{
    sendbuf b;
    sb_open(&b, header, hlen);
    uint64_t per = nr ? prefix[nr] : 0;
    if (b0 < b1 && per) {
        size_t t = (size_t)(b0 / per), r = run_at(prefix, nr, b0 - (uint64_t)t * per);
        uint64_t off = b0 - (uint64_t)t * per - prefix[r], pos = b0;
        while (pos < b1 && t < nt) {
            uint64_t l = lens[r] - off;
            if (l > b1 - pos) l = b1 - pos;
            int err = sb_add(&b, fd, (const uint8_t *)(uintptr_t)(bases[t] + offs[r] + off), (size_t)l);
            if (err) return err;
            pos += l; off = 0;
            if (++r == nr) { r = 0; t++; }
        }
    }
    return sb_flush(&b, fd);
}

/* The first span index in [k, hi) whose running end (`ends`) reaches `at`, or hi: a binary search, so that each
 * receive of a frame costs O(log n) in bookkeeping however many spans remain. */
static size_t first_end_at(const uint64_t *ends, size_t k, size_t hi, uint64_t at)
{
    while (k < hi) {
        size_t mid = k + (hi - k) / 2;
        if (ends[mid] >= at) hi = mid; else k = mid + 1;
    }
    return k;
}

/* Whether the next spans (from span k, `inner` bytes in) are small on average: the next IOV_CAP spans, or as
 * many as `left` bytes reach, hold fewer than SMALL_SPAN bytes each.  `ends`: running sums of the lengths. */
static int scatter_small(const uint64_t *ends, const uint64_t *len, size_t n, size_t k, uint64_t inner,
                         uint64_t left, size_t scratch_len)
{
    if (scratch_len < GATHER_BYTES || k >= n) return 0;
    uint64_t start = ends[k] - len[k] + inner;   /* stream offset of the next byte */
    size_t cap = n - k < IOV_CAP ? n : k + IOV_CAP;
    size_t last = first_end_at(ends, k, cap, start + left);   /* the span that holds the frame's last byte */
    size_t m = last < cap ? last - k + 1 : cap - k;
    uint64_t bytes = ends[k + m - 1] - start;
    if (bytes > left) bytes = left;
    return m > 1 && bytes < (uint64_t)SMALL_SPAN * m;
}

/* The bytes of the spans from span k (`inner` bytes in) that fit in `cap`, whole spans first, at least one. */
static uint64_t scatter_bytes(const uint64_t *ends, const uint64_t *len, size_t n, size_t k, uint64_t inner,
                              uint64_t cap)
{
    uint64_t start = ends[k] - len[k] + inner;
    size_t over = first_end_at(ends, k, n, start + cap + 1);   /* the first span that does not fit whole */
    uint64_t fit = over == k ? 0 : ends[over - 1] - start;
    return fit ? fit : cap;
}

/* Receive a frame's `nbytes` payload into the destination spans, starting at byte `off` of the transfer's stream
 * (`ends` = running sums of `len`, n spans).  At most RECV_PIECE bytes per recvmsg, so a stop (*stop set) takes
 * effect within one piece: from then on, and for bytes beyond the spans, the rest of the frame is read into
 * `scratch` and dropped, so the stream stays in sync and nothing more lands in the destination.
 *
 * `poll_ms` > 0: never wait more than `poll_ms` inside a receive (a peer that stalls mid-frame would otherwise hold
 * the destination until it sends again): the socket gets that receive timeout for the frame (SO_RCVTIMEO, two
 * syscalls per frame rather than a poll per wake-up), and *stop is looked at after each timeout.  `consumed`
 * (non-NULL): on a stop, return at once instead of
 * draining, with *consumed = the payload bytes read so far; the caller drops the rest of the frame itself, once
 * it let go of the destination.  Returns the bytes written into the destination, or -errno (-ECONNRESET when
 * the peer closed the stream). */
static long recv_frame(int fd, const uint64_t *addr, const uint64_t *len, const uint64_t *ends, size_t n,
                       uint64_t off, uint64_t nbytes, const volatile int32_t *stop, uint8_t *scratch,
                       size_t scratch_len, int timed, uint64_t *consumed)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {   /* the first span that ends after `off` */
        size_t mid = lo + (hi - lo) / 2;
        if (ends[mid] > off) hi = mid; else lo = mid + 1;
    }
    size_t k = lo;
    uint64_t inner = k < n ? off - (ends[k] - len[k]) : 0;
    uint64_t left = nbytes, written = 0;
    struct iovec iov[IOV_CAP];
    while (left > 0) {
        ssize_t r;
        if (consumed && stop && *stop) { *consumed = nbytes - left; return (long)written; }
        if ((stop && *stop) || k >= n) {
            size_t want = left < scratch_len ? (size_t)left : scratch_len;
            r = recv(fd, scratch, want, 0);
            if (r == 0) return -ECONNRESET;
            if (r < 0) {
                if (errno == EINTR || (timed && (errno == EAGAIN || errno == EWOULDBLOCK))) continue;
                return -(errno ? errno : EIO);
            }
            left -= (uint64_t)r;
            continue;
        }
        if (scratch && scatter_small(ends, len, n, k, inner, left, scratch_len)) {
            uint64_t want = scatter_bytes(ends, len, n, k, inner, left < scratch_len ? left : scratch_len);
            r = recv(fd, scratch, (size_t)want, 0);
            if (r == 0) return -ECONNRESET;
            if (r < 0) {
                if (errno == EINTR || (timed && (errno == EAGAIN || errno == EWOULDBLOCK))) continue;
                return -(errno ? errno : EIO);
            }
            uint64_t got = (uint64_t)r;
            const uint8_t *p = scratch;
            left -= got;
            written += got;
            while (got > 0) {   /* k < n: want never runs past the spans */
                while (inner == 0 && k < n && len[k] <= TINY_SPAN && len[k] <= got) {   /* whole tiny spans first */
                    char *to = (char *)(uintptr_t)addr[k];
                    if (!copy_small(to, (const char *)p, (size_t)len[k])) memcpy(to, p, (size_t)len[k]);
                    p += len[k]; got -= len[k]; k++;
                }
                if (got == 0) break;
                uint64_t take = len[k] - inner;
                if (take > got) take = got;
                char *to = (char *)(uintptr_t)(addr[k] + inner);
                if (!copy_small(to, (const char *)p, (size_t)take)) memcpy(to, p, (size_t)take);
                p += take; got -= take; inner += take;
                if (inner == len[k]) { k++; inner = 0; }
            }
            while (k < n && len[k] == inner) { k++; inner = 0; }
            continue;
        }
        int m = 0;
        uint64_t budget = left < RECV_PIECE ? left : RECV_PIECE, in = inner;
        for (size_t kk = k; budget > 0 && kk < n && m < IOV_CAP; kk++) {
            uint64_t take = len[kk] - in;
            if (take > budget) take = budget;
            if (take) {
                iov[m].iov_base = (void *)(uintptr_t)(addr[kk] + in);
                iov[m].iov_len = (size_t)take;
                m++;
            }
            budget -= take;
            in = 0;
        }
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = iov;
        mh.msg_iovlen = (size_t)m;
        r = recvmsg(fd, &mh, 0);
        if (r == 0) return -ECONNRESET;
        if (r < 0) {
            if (errno == EINTR || (timed && (errno == EAGAIN || errno == EWOULDBLOCK))) continue;   /* look at *stop */
            return -(errno ? errno : EIO);
        }
        uint64_t got = (uint64_t)r;
        left -= got;
        written += got;
        while (k < n && (got > 0 || len[k] == inner)) {
            uint64_t rem = len[k] - inner;
            if (got >= rem) { got -= rem; k++; inner = 0; }
            else { inner += got; got = 0; }
        }
    }
    if (consumed) *consumed = nbytes;
    return (long)written;
}

long adt_recv_frame(int fd, const uint64_t *addr, const uint64_t *len, const uint64_t *ends, size_t n,
                    uint64_t off, uint64_t nbytes, const volatile int32_t *stop, uint8_t *scratch,
                    size_t scratch_len, int poll_ms, uint64_t *consumed)
{
    if (poll_ms <= 0) return recv_frame(fd, addr, len, ends, n, off, nbytes, stop, scratch, scratch_len, 0, consumed);
    struct timeval bound = {poll_ms / 1000, (poll_ms % 1000) * 1000}, none = {0, 0};
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &bound, sizeof bound)) return -(errno ? errno : EIO);
    long got = recv_frame(fd, addr, len, ends, n, off, nbytes, stop, scratch, scratch_len, 1, consumed);
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none) && got >= 0) return -(errno ? errno : EIO);
    return got;
}
