/* kvpool.transport._tcp_serve: a node's checked TCP read (READ_BLOCK), served in one call.
 *
 * serve_reads(region, idents, readers, fd, inbox, at, end, sent, max_n, max_bytes)
 *     -> (served, bytes sent, payload bytes) | None
 *     (the node's three first, fixed per server: kvpool.transport.tcp_read_gate)
 *     inbox[at:end] holds pipelined requests; each READ_BLOCK (kvpool.transport.tcp_wire
 *     READ_BLOCK_REQ, 48 bytes: op, pad, request id, offset, length, then IDENT: key,
 *     block offset; big-endian) is served here when the identity record of its block
 *     offset (``idents``: kvpool.transport.shm_ident's records, 32 bytes per 4 KiB
 *     granule: seq u64, size u64, key 16 B, native order) names that key, whole (seq
 *     even, not 0) and covering [offset, offset + length) inside ``region``. Served:
 *     the whole requests from the first, as long as each is one served here, at most
 *     max_n (and MAX_READS) of them, up to the one whose payload brings the total to
 *     max_bytes (tcp_checked_reads' GATHER_*): each block's reader count (``readers``,
 *     one u32 per granule) goes up, their replies (an ok READ_RESP, its pad to the
 *     stream's 64-byte alignment given ``sent``, the region's bytes) go in one gather
 *     send with the GIL released, and the counts go down again. None when the first
 *     is not one served here (any other op, a bad range, a record that does not name
 *     that block now, its count at its limit): nothing sent, and the Python path
 *     (kvpool.transport.tcp_checked_reads) answers it, with the node's block table;
 *     the caller answers the requests after the ones served the same way. A failed
 *     send raises OSError (EAGAIN: the socket's SO_SNDTIMEO) with the counts back down.
 *
 * Why (issue 17, session 49): the Python path's fence check (the table's lock, its
 * dict, the entry and its stamp) and reply cost a checked 1 MiB read ~8-12 us more
 * than the same read served without it, seen by the client, each read finding those
 * objects out of the caches the previous reply's megabyte went through.
 *
 * Why the count holds the block (kvpool.transport.tcp_read_gate): the record is checked
 * and the count raised in this one call, holding the GIL; the table (the record's only
 * writer, Python, under the GIL as well) retracts the records of the blocks a claim or
 * an SSD load overlaps *before* it reads their counts. So either this call ran first
 * and the table sees the read in flight (it waits), or it runs after and sees the
 * retracted record (nothing sent). Bytes of a range a newer write may fill are never
 * sent. This leans on the GIL: a free-threaded build would need the table's side in
 * sequentially consistent atomics too (untested there).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define OP_READ_BLOCK 9
#define REQUEST 48 /* tcp_wire.READ_BLOCK_REQ.size */
#define RESP 16    /* tcp_wire.RESP.size (and READ_RESP's) */
#define WIRE_ALIGN 64
#define GRANULE 4096 /* shm_ident.ALIGN */
#define RECORD 32    /* shm_ident.RECORD.size */
#define KEY 16
#define MAX_READS 64 /* requests one batch serves at most (tcp_checked_reads.GATHER_MAX) */

static uint64_t get_be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static void put_be(unsigned char *p, uint64_t v, int n) {
    for (int i = n - 1; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

/* Every byte of iov[0:n] sent (sendmsg, EINTR retried, iov consumed); 0, or an errno. */
static int send_all(int fd, struct iovec *iov, int n) {
    int first = 0;
    while (first < n) {
        struct msghdr msg = {0};
        msg.msg_iov = iov + first;
        msg.msg_iovlen = (size_t)(n - first);
        ssize_t got = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        while (first < n && (size_t)got >= iov[first].iov_len) {
            got -= (ssize_t)iov[first].iov_len;
            first++;
        }
        if (first < n) {
            iov[first].iov_base = (char *)iov[first].iov_base + got;
            iov[first].iov_len -= (size_t)got;
        }
    }
    return 0;
}

/* The node's buffers, held until the replies are sent (an arena or record file closed
 * meanwhile stays mapped until then): 0; -1 (no error set) when one cannot be had
 * (closed already: the node stopping), nothing held. */
static int hold_buffers(PyObject *const *args, Py_buffer *views) {
    static const int flags[3] = {PyBUF_SIMPLE, PyBUF_SIMPLE, PyBUF_WRITABLE};
    for (int i = 0; i < 3; i++) {
        if (PyObject_GetBuffer(args[i], &views[i], flags[i]) < 0) {
            PyErr_Clear();
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    if ((uintptr_t)views[1].buf % 8 || (uintptr_t)views[2].buf % 4) {
        for (int i = 0; i < 3; i++)
            PyBuffer_Release(&views[i]);
        return -1;
    }
    return 0;
}

/* Request ``req`` (48 bytes) admitted: its block's count (raised), its range in out;
 * NULL when it is not one served here (see serve_reads). Runs holding the GIL. */
static uint32_t *admit(const unsigned char *req, const Py_buffer *views, uint64_t *range) {
    if (req[0] != OP_READ_BLOCK)
        return NULL;
    uint64_t offset = get_be(req + 8, 8), length = get_be(req + 16, 8);
    uint64_t block = get_be(req + 24 + KEY, 8), slot = block / GRANULE;
    uint64_t size = (uint64_t)views[0].len;
    if (block % GRANULE || offset < block || length > size || offset > size - length ||
        (slot + 1) * RECORD > (uint64_t)views[1].len ||
        (slot + 1) * sizeof(uint32_t) > (uint64_t)views[2].len)
        return NULL;
    const uint64_t *record = (const uint64_t *)((const char *)views[1].buf + slot * RECORD);
    uint32_t *count = (uint32_t *)views[2].buf + slot;
    uint64_t seq = __atomic_load_n(&record[0], __ATOMIC_ACQUIRE);
    if ((seq & 1) || seq == 0 || offset - block + length > record[1] ||
        memcmp(record + 2, req + 24, KEY) ||
        __atomic_load_n(count, __ATOMIC_RELAXED) == UINT32_MAX)
        return NULL;
    __atomic_add_fetch(count, 1, __ATOMIC_SEQ_CST); /* held: see "Why the count" above */
    range[0] = offset;
    range[1] = length;
    return count;
}

/* Serve the admitted prefix of the whole requests in inbox[at:end] (at most max_n, up
 * to max_bytes of payload): how many (0: the first was not admitted, nothing sent); the
 * bytes sent and the payload's in out; -1 with an OSError set when the send failed. */
static Py_ssize_t serve(PyObject *const *args, int fd, PyObject *inbox, Py_ssize_t at,
                        Py_ssize_t end, long long sent, Py_ssize_t max_n, uint64_t max_bytes,
                        uint64_t *out) {
    unsigned char requests[MAX_READS * REQUEST];
    Py_buffer view;
    if (PyObject_GetBuffer(inbox, &view, PyBUF_SIMPLE) < 0)
        return -1;
    if (end > view.len)
        end = view.len;
    Py_ssize_t whole = at >= 0 && end > at ? (end - at) / REQUEST : 0;
    if (whole > max_n)
        whole = max_n;
    if (whole > MAX_READS)
        whole = MAX_READS;
    if (whole > 0)
        memcpy(requests, (const char *)view.buf + at, (size_t)(whole * REQUEST));
    PyBuffer_Release(&view);
    Py_buffer views[3];
    if (whole <= 0 || hold_buffers(args, views) < 0)
        return 0;
    unsigned char heads[MAX_READS][RESP + WIRE_ALIGN];
    struct iovec iov[2 * MAX_READS];
    uint32_t *counts[MAX_READS];
    Py_ssize_t n = 0;
    uint64_t total = 0, payload = 0, range[2];
    while (n < whole && payload < max_bytes &&
           (counts[n] = admit(requests + n * REQUEST, views, range)) != NULL) {
        uint64_t at_head = (uint64_t)sent + total + RESP; /* the stream offset after the header */
        size_t pad = (size_t)((WIRE_ALIGN - at_head % WIRE_ALIGN) % WIRE_ALIGN);
        unsigned char *head = heads[n];
        memset(head, 0, RESP + pad);
        head[1] = (unsigned char)pad; /* status 0 (ST_OK), then the pad's length */
        memcpy(head + 4, requests + n * REQUEST + 4, 4); /* the request id, as it came */
        put_be(head + 8, range[1], 8);
        iov[2 * n] = (struct iovec){head, RESP + pad};
        iov[2 * n + 1] = (struct iovec){(char *)views[0].buf + range[0], (size_t)range[1]};
        total += RESP + pad + range[1];
        payload += range[1];
        n++;
    }
    int err = 0;
    if (n > 0) {
        Py_BEGIN_ALLOW_THREADS
        err = send_all(fd, iov, (int)(2 * n));
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            __atomic_sub_fetch(counts[i], 1, __ATOMIC_SEQ_CST);
    }
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&views[i]);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    out[0] = total;
    out[1] = payload;
    return n;
}

/* The fd argument: an int that can be one. */
static int fd_arg(PyObject *obj) {
    long fd = PyLong_AsLong(obj);
    if (fd == -1 && PyErr_Occurred())
        return -1;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return -1;
    }
    return (int)fd;
}

static PyObject *serve_reads(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "serve_reads(region, idents, readers, fd, inbox, at, "
                                         "end, sent, max_n, max_bytes)");
        return NULL;
    }
    int fd = fd_arg(args[3]);
    Py_ssize_t at = PyLong_AsSsize_t(args[5]), end = PyLong_AsSsize_t(args[6]);
    long long sent = PyLong_AsLongLong(args[7]);
    Py_ssize_t max_n = PyLong_AsSsize_t(args[8]);
    unsigned long long max_bytes = PyLong_AsUnsignedLongLong(args[9]);
    if (fd < 0 || PyErr_Occurred())
        return NULL;
    uint64_t out[2];
    Py_ssize_t n = serve(args, fd, args[4], at, end, sent, max_n, max_bytes, out);
    if (n < 0)
        return NULL;
    if (n == 0)
        Py_RETURN_NONE;
    return Py_BuildValue("nKK", n, (unsigned long long)out[0], (unsigned long long)out[1]);
}

static PyMethodDef methods[] = {
    {"serve_reads", (PyCFunction)(void (*)(void))serve_reads, METH_FASTCALL,
     "Serve the prefix of a pipelined batch of checked reads served here; None if none."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvpool.transport._tcp_serve",
    "A node's checked TCP reads served in one call (see the C source's header).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tcp_serve(void) { return PyModule_Create(&module_def); }
