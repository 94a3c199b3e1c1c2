/* A lane's descriptor table (adt.h: adt_lane_table): the spans of a gather or scatter between device memory and
 * one host buffer, merged where they continue each other and cut into the lane's pieces.  Shared by the runtimes'
 * tables (cuda.c, acl.c); no runtime's types here.
 */
#include "adt.h"

/* A run of device memory (`dev`, `l` bytes) and its place in the host buffer as the lane's pieces, from piece k:
 * sources at out[0, count), destinations at out[count, 2 count), lengths at out[2 count, 3 count) (only counted
 * without `out`).  Returns the pieces written so far. */
static size_t lane_pieces(const adt_device_lane *lane, uint64_t *out, size_t count, size_t k, uint64_t dev,
                          uint64_t host, uint64_t l, int to_host)
{
    while (l) {
        uint64_t p = lane->piece && l > lane->piece ? lane->piece : l;
        if (out) {
            out[k] = to_host ? dev : host;
            out[count + k] = to_host ? host : dev;
            out[2 * count + k] = p;
        }
        k++;
        dev += p; host += p; l -= p;
    }
    return k;
}

/* The descriptors of n spans and the host buffer they are laid out in back to back, spans merged where they
 * continue each other (zero-length ones skipped); see lane_pieces.  Returns the number of pieces. */
size_t adt_lane_table(const adt_device_lane *lane, const uint64_t *addr, const uint64_t *len, size_t n,
                      uint64_t host, int to_host, uint64_t *out, size_t count)
{
    size_t k = 0;
    uint64_t off = 0, run = 0, run_host = 0, run_len = 0;
    for (size_t i = 0; i < n; i++) {
        if (!len[i]) continue;
        if (run_len && run + run_len == addr[i]) run_len += len[i];
        else {
            k = lane_pieces(lane, out, count, k, run, run_host, run_len, to_host);
            run = addr[i]; run_host = host + off; run_len = len[i];
        }
        off += len[i];
    }
    return lane_pieces(lane, out, count, k, run, run_host, run_len, to_host);
}
