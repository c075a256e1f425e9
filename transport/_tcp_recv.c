/* kvpool.transport._tcp_recv: how the TCP data path's client receives replies.
 *
 * wait_readable(fd, budget_ns) -> bool: poll(fd, POLLIN, 0) in a loop, the GIL
 * released, until the socket is readable (True: data, EOF or an error is there, so
 * a receive will not sleep) or budget_ns passed (False: a receive would wait). At
 * most max_spinners threads of the process spin at once; a caller over that limit
 * returns False at once ("crowded").
 *
 * recv_all(fd, views, flags, budget_ns) -> int: fill every writable buffer of the
 * list views, in order, from the socket: recvmsg calls on the part not filled yet,
 * each after a wait_readable of budget_ns (0: none), the GIL released throughout.
 * Returns the bytes received: all of them, or fewer when the peer closed the
 * connection. An error raises OSError (EAGAIN, the socket's SO_RCVTIMEO, as
 * BlockingIOError); a signal runs Python's handlers, and the receive goes on
 * unless one raised.
 *
 * Why spin (issue 17): on VMs whose idle loop halts the vCPU at once (cpuidle
 * haltpoll with guest_halt_poll_ns = 0 on the 2 vCPU AMD EPYC machines), each
 * receive that sleeps costs a halt, a VM exit and a wake-up interrupt, and the
 * Python that runs after it finds its caches and branch predictors cold: a 64 KiB
 * checked read over loopback ran at 0.77x a raw socket sleeping, 1.0-1.1x spinning
 * (bench/RESULTS.md, "Session 11"). The cost is that CPU time: at most budget_ns
 * per receive, on at most max_spinners threads. The spin yields the CPU between
 * polls (sched_yield), so a thread that is ready to run on it is not held up: the
 * spinner only keeps a CPU that nothing else wants.
 * Why fill the whole list here: a pipelined batch's replies land in up to 128
 * buffers; a Python loop of recvmsg_into calls rebuilt that list and re-acquired
 * every buffer on each call, per chunk the kernel had ready. The node takes a
 * write's payload (bytes known to be on their way) the same way.
 *
 * Invariants: wait_readable never reads a byte (poll only looks); recv_all never
 * reads past the last buffer (it asks for exactly what is left); the
 * active-spinner count returns to where it was on every path; the counters only
 * grow (relaxed atomics: statistics, not synchronisation).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define MAX_VIEWS 1024           /* IOV_MAX on Linux */
#define MAX_CALL_BYTES (1 << 30) /* per recvmsg: far inside the kernel's 2 GiB cap */

static atomic_int active; /* threads spinning now */
static atomic_int max_spinners = 1;
static atomic_llong n_waits, n_ready, n_timeouts, n_crowded;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* vDSO: no system call */
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The spin itself; call without the GIL. 1: readable, 0: budget passed or crowded. */
static int spin(int fd, long long budget_ns) {
    if (budget_ns <= 0)
        return 0;
    atomic_fetch_add_explicit(&n_waits, 1, memory_order_relaxed);
    if (atomic_fetch_add(&active, 1) >= atomic_load(&max_spinners)) {
        atomic_fetch_sub(&active, 1);
        atomic_fetch_add_explicit(&n_crowded, 1, memory_order_relaxed);
        return 0;
    }
    int ready = 0;
    long long end = now_ns() + budget_ns;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    do {
        /* > 0: readable, or POLLHUP / POLLERR / POLLNVAL: a receive will not sleep
         * either (it returns EOF or fails) */
        if (poll(&p, 1, 0) > 0) {
            ready = 1;
            break;
        }
        sched_yield(); /* a thread waiting for this CPU (a commit sender, a peer) runs */
    } while (now_ns() < end);
    atomic_fetch_sub(&active, 1);
    atomic_fetch_add_explicit(ready ? &n_ready : &n_timeouts, 1, memory_order_relaxed);
    return ready;
}

static PyObject *wait_readable(PyObject *self, PyObject *args) {
    int fd, ready;
    long long budget_ns;
    if (!PyArg_ParseTuple(args, "iL:wait_readable", &fd, &budget_ns))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "wait_readable: fd must be >= 0");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    ready = spin(fd, budget_ns);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}

static void release_all(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

static PyObject *recv_all(PyObject *self, PyObject *args) {
    int fd, flags;
    PyObject *views;
    long long budget_ns;
    if (!PyArg_ParseTuple(args, "iO!iL:recv_all", &fd, &PyList_Type, &views, &flags, &budget_ns))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "recv_all: fd must be >= 0");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(views);
    if (n > MAX_VIEWS) {
        PyErr_Format(PyExc_ValueError, "recv_all: %zd buffers, at most %d", n, MAX_VIEWS);
        return NULL;
    }
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc(n ? n : 1, sizeof(struct iovec));
    if (bufs == NULL || iov == NULL) {
        PyMem_Free(bufs);
        PyMem_Free(iov);
        return PyErr_NoMemory();
    }
    Py_ssize_t held = 0;
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(views, held), &bufs[held],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            release_all(bufs, held);
            PyMem_Free(iov);
            return NULL;
        }
        iov[held].iov_base = bufs[held].buf;
        iov[held].iov_len = (size_t)bufs[held].len;
    }
    Py_ssize_t first = 0; /* first buffer not full yet */
    long long got = 0;
    int err = 0;
    while (first < n) {
        if (iov[first].iov_len == 0) {
            first++;
            continue;
        }
        /* this call's window: the buffers from `first`, at most MAX_CALL_BYTES */
        Py_ssize_t count = 0;
        size_t window = 0, cut = 0;
        while (first + count < n && window < MAX_CALL_BYTES) {
            size_t len = iov[first + count].iov_len;
            if (window + len > MAX_CALL_BYTES) {
                cut = len - (MAX_CALL_BYTES - window); /* lent back after the call */
                iov[first + count].iov_len -= cut;
                len -= cut;
            }
            window += len;
            count++;
        }
        struct msghdr msg = {.msg_iov = &iov[first], .msg_iovlen = (size_t)count};
        ssize_t r;
        Py_BEGIN_ALLOW_THREADS
        spin(fd, budget_ns);
        r = recvmsg(fd, &msg, flags);
        if (r < 0)
            err = errno;
        Py_END_ALLOW_THREADS
        if (cut)
            iov[first + count - 1].iov_len += cut;
        if (r < 0) {
            if (err == EINTR) {
                err = 0;
                if (PyErr_CheckSignals() < 0) { /* a handler raised: the stream is unknown */
                    release_all(bufs, n);
                    PyMem_Free(iov);
                    return NULL;
                }
                continue;
            }
            break;
        }
        if (r == 0)
            break; /* EOF: the caller sees fewer bytes than it asked for */
        got += r;
        size_t left = (size_t)r;
        while (left && first < n) { /* advance past what this call filled */
            if (left >= iov[first].iov_len) {
                left -= iov[first].iov_len;
                iov[first].iov_len = 0;
                first++;
            } else {
                iov[first].iov_base = (char *)iov[first].iov_base + left;
                iov[first].iov_len -= left;
                left = 0;
            }
        }
    }
    release_all(bufs, n);
    PyMem_Free(iov);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError); /* EAGAIN: BlockingIOError */
    }
    return PyLong_FromLongLong(got);
}

static PyObject *set_max_spinners(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > 1 << 20) {
        PyErr_SetString(PyExc_ValueError, "max spinners must be between 0 and 2**20");
        return NULL;
    }
    atomic_store(&max_spinners, (int)n);
    Py_RETURN_NONE;
}

static PyObject *counters(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{sLsLsLsLsi}", "waits", (long long)atomic_load(&n_waits), "ready",
                         (long long)atomic_load(&n_ready), "timeouts",
                         (long long)atomic_load(&n_timeouts), "crowded",
                         (long long)atomic_load(&n_crowded), "max_spinners",
                         atomic_load(&max_spinners));
}

static PyMethodDef methods[] = {
    {"wait_readable", wait_readable, METH_VARARGS,
     "wait_readable(fd, budget_ns) -> bool: poll fd until readable or budget_ns passed "
     "(GIL released); False at once when max_spinners threads already spin."},
    {"recv_all", recv_all, METH_VARARGS,
     "recv_all(fd, views, flags, budget_ns) -> int: fill every buffer of the list views "
     "from fd, spinning up to budget_ns before each receive (GIL released); the bytes "
     "received (fewer than asked: the peer closed)."},
    {"set_max_spinners", set_max_spinners, METH_O,
     "set_max_spinners(n): at most n threads of this process spin at once (0: none)."},
    {"counters", counters, METH_NOARGS,
     "counters() -> dict: waits, ready, timeouts, crowded (since import), max_spinners."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool.transport._tcp_recv",
    "How the TCP data path's client receives replies (see the source's header).", -1, methods,
};

PyMODINIT_FUNC PyInit__tcp_recv(void) { return PyModule_Create(&module); }
