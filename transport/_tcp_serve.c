/* kvpool.transport._tcp_serve: a node's checked TCP read (READ_BLOCK), served in one call.
 *
 * serve_read(region, idents, readers, fd, inbox, at, sent) -> int | None
 *     (the node's three first, fixed per server: kvpool.transport.tcp_read_gate)
 *     inbox[at:at + 48] is one READ_BLOCK request (kvpool.transport.tcp_wire
 *     READ_BLOCK_REQ: op, pad, request id, offset, length, then IDENT: key, block
 *     offset; big-endian). Served here when the identity record of the block offset
 *     (``idents``: kvpool.transport.shm_ident's records, 32 bytes per 4 KiB granule:
 *     seq u64, size u64, key 16 B, native order) names that key, whole (seq even, not
 *     0) and covering [offset, offset + length) inside ``region``: the block's reader
 *     count (``readers``, one u32 per granule) goes up, the reply (an ok READ_RESP,
 *     its pad to the stream's 64-byte alignment given ``sent``, the region's bytes)
 *     is sent with the GIL released, and the count goes down again. Returns the
 *     bytes sent; None when the request is not one served here (any other op, a
 *     bad range, a record that does not name that block now, the count at its
 *     limit): nothing sent, and the Python path (kvpool.transport.tcp_checked_reads)
 *     answers it, with the node's block table. A failed send raises OSError
 *     (EAGAIN: the socket's SO_SNDTIMEO) with the count back down.
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

/* The whole reply: sendmsg until every byte left, EINTR retried; 0, or an errno. */
static int send_reply(int fd, unsigned char *head, size_t head_len, const char *payload,
                      size_t length) {
    struct iovec iov[2] = {{head, head_len}, {(void *)payload, length}};
    int first = 0;
    while (first < 2) {
        struct msghdr msg = {0};
        msg.msg_iov = iov + first;
        msg.msg_iovlen = 2 - first;
        ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        while (first < 2 && (size_t)n >= iov[first].iov_len) {
            n -= (ssize_t)iov[first].iov_len;
            first++;
        }
        if (first < 2) {
            iov[first].iov_base = (char *)iov[first].iov_base + n;
            iov[first].iov_len -= (size_t)n;
        }
    }
    return 0;
}

static PyObject *serve_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "serve_read(region, idents, readers, fd, inbox, at, sent)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[3]);
    Py_ssize_t at = PyLong_AsSsize_t(args[5]);
    long long sent = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    unsigned char request[REQUEST];
    Py_buffer view;
    if (PyObject_GetBuffer(args[4], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int whole = at >= 0 && view.len >= REQUEST && at <= view.len - REQUEST;
    if (whole)
        memcpy(request, (const char *)view.buf + at, REQUEST);
    PyBuffer_Release(&view);
    if (!whole || request[0] != OP_READ_BLOCK)
        Py_RETURN_NONE;
    uint32_t rid = (uint32_t)get_be(request + 4, 4);
    uint64_t offset = get_be(request + 8, 8), length = get_be(request + 16, 8);
    uint64_t block = get_be(request + 24 + KEY, 8);

    /* Held until the reply is sent: an arena or record file closed meanwhile stays
     * mapped until then. One that is closed already (the node stopping): None. */
    Py_buffer region, idents, readers;
    if (PyObject_GetBuffer(args[0], &region, PyBUF_SIMPLE) < 0)
        goto not_exported;
    if (PyObject_GetBuffer(args[1], &idents, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&region);
        goto not_exported;
    }
    if (PyObject_GetBuffer(args[2], &readers, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&idents);
        PyBuffer_Release(&region);
        goto not_exported;
    }
    PyObject *result = NULL;
    uint64_t slot = block / GRANULE;
    uint64_t size = (uint64_t)region.len;
    int taken = block % GRANULE == 0 && offset >= block && length <= size &&
                offset <= size - length && (slot + 1) * RECORD <= (uint64_t)idents.len &&
                (slot + 1) * sizeof(uint32_t) <= (uint64_t)readers.len &&
                (uintptr_t)idents.buf % 8 == 0 && (uintptr_t)readers.buf % 4 == 0;
    uint32_t *count = taken ? (uint32_t *)readers.buf + slot : NULL;
    if (taken) {
        const uint64_t *record = (const uint64_t *)((const char *)idents.buf + slot * RECORD);
        uint64_t seq = __atomic_load_n(&record[0], __ATOMIC_ACQUIRE);
        taken = !(seq & 1) && seq != 0 && offset - block + length <= record[1] &&
                memcmp(record + 2, request + 24, KEY) == 0 &&
                __atomic_load_n(count, __ATOMIC_RELAXED) != UINT32_MAX;
    }
    if (!taken) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    __atomic_add_fetch(count, 1, __ATOMIC_SEQ_CST); /* held: see "Why the count" above */
    unsigned char head[RESP + WIRE_ALIGN] = {0};
    size_t pad = (size_t)((WIRE_ALIGN - (sent + RESP) % WIRE_ALIGN) % WIRE_ALIGN);
    head[1] = (unsigned char)pad; /* status 0 (ST_OK), then the pad's length */
    put_be(head + 4, rid, 4);
    put_be(head + 8, length, 8);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = send_reply((int)fd, head, RESP + pad, (const char *)region.buf + offset, (size_t)length);
    Py_END_ALLOW_THREADS
    __atomic_sub_fetch(count, 1, __ATOMIC_SEQ_CST);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromUnsignedLongLong(RESP + pad + length);
done:
    PyBuffer_Release(&readers);
    PyBuffer_Release(&idents);
    PyBuffer_Release(&region);
    return result;
not_exported:
    PyErr_Clear();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"serve_read", (PyCFunction)(void (*)(void))serve_read, METH_FASTCALL,
     "Serve one checked read whose block's identity record names it; None if not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvpool.transport._tcp_serve",
    "A node's checked TCP read served in one call (see the C source's header).", -1, methods,
};

PyMODINIT_FUNC PyInit__tcp_serve(void) { return PyModule_Create(&module_def); }
