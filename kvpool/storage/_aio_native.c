/* kvpool.storage._aio_native: the SSD tier's one O_DIRECT write through Linux
 * native AIO, submitted and reaped in C (kvpool.storage.direct_aio).
 *
 * submit(ctx, iocb, fd, data, offset, pid) -> int: fill the struct iocb at address
 * iocb (its opcode already set: IOCB_CMD_PWRITE) for a write of all of data's bytes
 * (any object exporting one contiguous buffer, read-only or not) at offset, and
 * io_submit it on the context ctx, the GIL released. Returns 1 (queued), 0 (refused
 * before the kernel saw it: no contiguous buffer, an empty one, or a calling process
 * other than pid, which made the context) or -errno (io_submit refused it). The
 * buffer is released before returning: the caller keeps data alive until the write
 * completed, as the Python path does.
 *
 * reap(ring, iocb, event, budget_ns) -> int: watch the completion ring at address
 * ring (what io_setup returned: struct aio_ring's header of eight u32, then its
 * io_event array), yielding the CPU between looks, the GIL released, until an
 * event is posted or budget_ns passed. A posted event that echoes iocb is copied
 * to the struct io_event at address event (res, then obj) and consumed (the
 * ring's head advanced): 1. The budget ran out first: 0. The posted event is not
 * ours: -1, nothing consumed (the caller then reads it with io_getevents and
 * reports the write lost, as the Python path does).
 *
 * Why in C (issue 17, session 44): a 64 KiB tier put ran 7-10 us of Python before
 * its io_submit reached the kernel and 3-6 us after the completion was posted,
 * against a ~70-90 us raw O_DIRECT pwrite: measured block by block between other
 * disk work (caches cold), the put was 0.81-0.84x the raw write. The ctypes
 * iocb fields, the buffer's address, the getpid check, the ctypes syscall and
 * the ring's reads in ctypes were 3-5 us of that (ctypes path 0.91-0.95x, this
 * one 0.96-1.00x, same processes; 256 KiB: 0.90-0.92x -> 0.95-0.99x).
 *
 * Memory order: the kernel writes the event, then (smp_wmb) moves the tail, and
 * reuses a slot only after the head moved past it. So the tail is loaded with
 * acquire (the event read after it sees what the kernel wrote before moving
 * it) and the head stored with release (after the event was copied). Linux
 * only, where <linux/aio_abi.h> defines the structures.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/aio_abi.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { RING_NR = 1, RING_HEAD = 2, RING_TAIL = 3, RING_HEADER_BYTES = 32 };

static PyObject *submit(PyObject *self, PyObject *args) {
    unsigned long long ctx, iocb_at, offset;
    int fd;
    long pid;
    PyObject *data;
    if (!PyArg_ParseTuple(args, "KKiOKl", &ctx, &iocb_at, &fd, &data, &offset, &pid))
        return NULL;
    if ((long)getpid() != pid)
        return PyLong_FromLong(0); /* a context inherited across fork is not ours */
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not one contiguous piece: the caller writes another way */
        return PyLong_FromLong(0);
    }
    if (view.len == 0) {
        PyBuffer_Release(&view);
        return PyLong_FromLong(0);
    }
    struct iocb *cb = (struct iocb *)(uintptr_t)iocb_at;
    cb->aio_fildes = (uint32_t)fd;
    cb->aio_buf = (uint64_t)(uintptr_t)view.buf;
    cb->aio_nbytes = (uint64_t)view.len;
    cb->aio_offset = (int64_t)offset;
    struct iocb *list[1] = {cb};
    long queued;
    int err;
    Py_BEGIN_ALLOW_THREADS
    queued = syscall(SYS_io_submit, (aio_context_t)ctx, 1L, list);
    err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromLong(queued < 0 ? -err : queued);
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static PyObject *reap(PyObject *self, PyObject *args) {
    unsigned long long ring_at, iocb_at, event_at;
    long long budget_ns;
    if (!PyArg_ParseTuple(args, "KKKL", &ring_at, &iocb_at, &event_at, &budget_ns))
        return NULL;
    uint32_t *ring = (uint32_t *)(uintptr_t)ring_at;
    const struct io_event *posted = (const struct io_event *)(uintptr_t)(ring_at + RING_HEADER_BYTES);
    struct io_event *out = (struct io_event *)(uintptr_t)event_at;
    int result = 0;
    Py_BEGIN_ALLOW_THREADS
    long long end = now_ns() + budget_ns;
    for (;;) {
        uint32_t head = __atomic_load_n(&ring[RING_HEAD], __ATOMIC_RELAXED);
        uint32_t tail = __atomic_load_n(&ring[RING_TAIL], __ATOMIC_ACQUIRE);
        if (head != tail) {
            uint32_t nr = ring[RING_NR];
            if (nr == 0 || head >= nr || posted[head].obj != iocb_at) {
                result = -1;
                break;
            }
            out->res = posted[head].res;
            out->obj = posted[head].obj;
            __atomic_store_n(&ring[RING_HEAD], (head + 1) % nr, __ATOMIC_RELEASE);
            result = 1;
            break;
        }
        if (now_ns() > end)
            break;
        sched_yield();
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"submit", submit, METH_VARARGS,
     "submit(ctx, iocb, fd, data, offset, pid) -> 1 queued, 0 refused here, -errno"},
    {"reap", reap, METH_VARARGS,
     "reap(ring, iocb, event, budget_ns) -> 1 taken, 0 budget ran out, -1 not ours"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_aio_native",
    "The SSD tier's O_DIRECT write submitted and reaped in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__aio_native(void) { return PyModule_Create(&module); }
