/* kvpool.transport._spin_wait: wait for a socket to become readable by polling it,
 * for a bounded time, before the caller blocks in its receive.
 *
 * wait_readable(fd, budget_ns) -> bool: poll(fd, POLLIN, 0) in a loop, the GIL
 * released, until the socket is readable (True: data, EOF or an error is there, so
 * the caller's receive will not sleep) or budget_ns passed (False: the caller's
 * blocking receive waits as it would have). At most max_spinners threads of the
 * process spin at once; a caller over that limit returns False at once.
 *
 * Why (issue 17): on VMs whose idle loop halts the vCPU at once (cpuidle haltpoll
 * with guest_halt_poll_ns = 0 on the 2 vCPU AMD EPYC machines), every receive that
 * sleeps costs a halt, a VM exit and a wake-up interrupt, and the Python that runs
 * after it finds its caches and branch predictors cold. A 64 KiB checked read over
 * loopback took 106 us blocking and 75 us after spinning (bench/RESULTS.md,
 * "Session 11"). Spinning keeps the vCPU running the few tens of microseconds a
 * reply takes; its cost is that CPU time, bounded by budget_ns per wait and by
 * max_spinners per process.
 *
 * Invariants: the socket's bytes and state are never touched (poll only looks);
 * the active-spinner count returns to where it was on every path; the counters only
 * grow (relaxed atomics: statistics, not synchronisation).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <poll.h>
#include <stdatomic.h>
#include <time.h>

static atomic_int active;      /* threads spinning now */
static atomic_int max_spinners = 1;
static atomic_llong n_waits, n_ready, n_timeouts, n_crowded;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* vDSO: no system call */
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static PyObject *wait_readable(PyObject *self, PyObject *args) {
    int fd;
    long long budget_ns;
    if (!PyArg_ParseTuple(args, "iL:wait_readable", &fd, &budget_ns))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "wait_readable: fd must be >= 0");
        return NULL;
    }
    if (budget_ns <= 0)
        return PyBool_FromLong(0);
    atomic_fetch_add_explicit(&n_waits, 1, memory_order_relaxed);
    if (atomic_fetch_add(&active, 1) >= atomic_load(&max_spinners)) {
        atomic_fetch_sub(&active, 1);
        atomic_fetch_add_explicit(&n_crowded, 1, memory_order_relaxed);
        return PyBool_FromLong(0);
    }
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS
    long long end = now_ns() + budget_ns;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    do {
        /* > 0: readable, or POLLHUP / POLLERR / POLLNVAL: the receive will not
         * sleep either (it returns EOF or raises) */
        if (poll(&p, 1, 0) > 0) {
            ready = 1;
            break;
        }
    } while (now_ns() < end);
    Py_END_ALLOW_THREADS
    atomic_fetch_sub(&active, 1);
    atomic_fetch_add_explicit(ready ? &n_ready : &n_timeouts, 1, memory_order_relaxed);
    return PyBool_FromLong(ready);
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
    {"set_max_spinners", set_max_spinners, METH_O,
     "set_max_spinners(n): at most n threads of this process spin at once (0: none)."},
    {"counters", counters, METH_NOARGS,
     "counters() -> dict: waits, ready, timeouts, crowded (since import), max_spinners."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool.transport._spin_wait",
    "Bounded polling of a socket before a blocking receive (see the source's header).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__spin_wait(void) { return PyModule_Create(&module); }
