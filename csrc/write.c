/* A deferred round's pieces written in one GIL-free call: fc_write_pieces (flatcake/store/native_write.py,
 * the write queue's writer thread).
 *
 * Writes n bytes at addr to fd at file offset off, in pieces ending at the file offsets ends[]
 * (ascending, nends of them; the last piece ends at off + n); between two pieces it stops when
 * *readers > 0 (a restore is waiting: the caller pauses, then calls again for the rest).
 * Returns the bytes written (> 0), or -errno when the first write failed (0: it wrote
 * nothing). */
#include <errno.h>
#include <unistd.h>

#include "fc_common.h"
#include "fc_api.h"

FC_API int64_t fc_write_pieces(int64_t fd, int64_t addr, int64_t off, int64_t n, const int64_t *ends, int64_t nends,
                               const volatile int64_t *readers) {
    int64_t done = 0, e = 0;
    while (done < n) {
        while (e < nends && ends[e] <= off + done) e++;
        int64_t stop = (e < nends && ends[e] - off < n) ? ends[e] - off : n;
        while (done < stop) {
            ssize_t r = pwrite((int)fd, (const char *)(intptr_t)addr + done, (size_t)(stop - done),
                               (off_t)(off + done));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) return done ? done : (r < 0 ? -(int64_t)errno : 0);
            done += r;
        }
        if (done < n && *readers > 0) break;  /* a restore is waiting: pause before the next piece */
    }
    return done;
}
