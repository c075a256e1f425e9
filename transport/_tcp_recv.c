/* kvpool.transport._tcp_recv: how the TCP data path's client receives replies.
 *
 * wait_readable(fd, budget_ns, want=1) -> bool: poll(fd, POLLIN, 0) in a loop, the
 * GIL released, until the socket is readable (True: data, EOF or an error is there,
 * so a receive will not sleep; with want > 1, until that many bytes are queued, at
 * most want_limit's and FIRST_WANT_MAX, or the peer shut its side) or budget_ns
 * passed (False). At
 * most max_spinners threads of the process spin at once; a caller over that limit
 * returns False at once ("crowded"), as does a thread whose spinning is paused
 * after a long yield (see "Why spinning pauses" below).
 *
 * recv_all(fd, views, flags, budget_ns) -> int: fill every writable buffer of the
 * list views, in order, from the socket: recvmsg calls on the part not filled yet,
 * each after a spin of up to budget_ns (0: none) for the bytes it will take (see "Why
 * the rest of a large reply waits for a quarter MiB"), the GIL released throughout.
 * Returns the bytes received: all of them, or fewer when the peer closed the
 * connection. An error raises OSError (EAGAIN, the socket's SO_RCVTIMEO, as
 * BlockingIOError); a signal runs Python's handlers, and the receive goes on
 * unless one raised.
 *
 * read_blocks(fd, plan, first_rid, received, heads, waitall_max, budget_ns, size): a
 * pipelined batch of checked reads in one call: the requests built and sent, every
 * reply received as recv_all receives (header and pad into heads, payload into its
 * buffer; each spin for any byte), each header checked; see its comment below.
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
 * Why spinning pauses after a long yield (issue 17, session 30): beside a busy
 * co-runner on the same CPU (another process, a thread of the engine), a yield hands
 * that task the CPU for its whole scheduler slice, ~4 ms on the Intel VM, while a
 * sleeper's wake-up would preempt it: TCP puts and reads of 64 KiB-1 MiB took
 * 4.0-4.3 ms each against 0.18-1.3 ms with no spinning at all. A peer answering
 * on the same CPU gives the CPU back far sooner. So a yield that kept the spinner
 * off its CPU for long_yield_ns (500 us) ends the spin and pauses that thread's
 * spins: they return False at once, and the receive sleeps. The pause is
 * first_pause_ns (10 ms), doubled by each long yield that follows one, up to
 * max_pause_ns (1 s), and back to the first once a spin ends without one: a lasting
 * co-runner costs one slice per second, a one-off (a kernel thread's turn, a peer's
 * long answer on the same CPU) 10 ms of receives that sleep. Per thread, because a
 * thread's co-runner may be its own process's busy thread: a client's background
 * claim thread yielded to its main thread's copies, and the pause it took made the
 * main thread's TCP puts that followed sleep (bench all, 1 MiB put 0.86 -> 0.78).
 * Why the rest of a large reply waits for a quarter MiB (issue 17, session 39): a
 * receive without MSG_WAITALL (the parts of a reply past waitall_max) spun until any
 * byte was queued, so a 1 MiB reply over loopback came in many small receives, each
 * taking the socket as the sender's segments arrived: a checked 1 MiB read ran at
 * 0.83-0.85x a raw socket's blocking receives (spinning off: 0.88-0.89x). Its spin
 * now ends once the receive's whole window or want_max bytes are queued (SIOCINQ
 * after poll says readable), want_max being what arrives within the spin budget at
 * loopback speed (2.5 bytes a ns), at most WANT_MAX and a quarter of the socket's
 * receive buffer: 1 MiB reads 0.90-0.96x (a quarter MiB; 64 / 128 KiB: 0.88-0.93x;
 * half a MiB, more than the budget brings: 0.80-0.81x); 4 / 16 MiB level. A spin that
 * runs out of budget first receives what is there, as before. The first receive of
 * a single reply that large (kvpool.transport.tcp_conn) waits the same way, through
 * wait_readable's want: through the pool, 1 MiB reads 0.84-0.90x -> 0.84-1.00x
 * (seven pairs; data path alone level, 0.91-0.94x). That first receive waits for
 * at most FIRST_WANT_MAX (64 KiB), not a quarter MiB (session 40): until it returns
 * no byte is copied, and waiting longer left more of the copy after the last byte
 * came. Data path alone, medians of pairs with the raw socket, two runs each: over a
 * veth link into another namespace (MTU 1500, each end's receives on its own CPU;
 * bench/veth.py) 256 KiB reads 0.81-0.82x -> 0.90-0.91x (32 KiB: 0.91-0.93x, 128 KiB:
 * 0.86-0.88x), over loopback 1.00-1.04x -> 1.14-1.16x; 1 and 4 MiB level or better
 * (loopback 1 MiB 0.97-1.01x -> 0.96-1.06x). Receives with
 * MSG_WAITALL (a reply of up to waitall_max, whole) still spin for any byte, and so do
 * read_blocks' (a batch's replies, one gather send from the node): there the reader
 * copies each part while the node still sends the rest, and waiting for a quarter MiB
 * left more to copy after the last byte came (8 x 64 KiB: 0.88-0.89x -> 0.83-0.84x).
 * Why fill the whole list here: a pipelined batch's replies land in up to 128
 * buffers; a Python loop of recvmsg_into calls rebuilt that list and re-acquired
 * every buffer on each call, per chunk the kernel had ready. The node takes a
 * write's payload (bytes known to be on their way) the same way.
 *
 * Why one native call for a batch of checked reads (issue 17, session 15): the
 * Python that built a batch's requests and receive buffers and checked each reply
 * header ran on the client's critical path, per call. Measured (a batch of 8 over
 * loopback, client and node pinned apart, spinning off, 6 interleaved rounds of
 * 2000 calls): the client's user CPU per call fell from 115 to 81 us at 64 KiB
 * and from 90 to 46 us at 4 KiB; the wall time per call moved within the noise
 * of this shared VM (p50 264-277 us against 271-283).
 *
 * Invariants: wait_readable never reads a byte (poll only looks); recv_all and
 * read_blocks never read past the last buffer (they ask for exactly what is left); the
 * active-spinner count returns to where it was on every path; the counters only
 * grow (relaxed atomics: statistics, not synchronisation), and each wait adds one
 * to exactly one of ready, timeouts, crowded, long_yields and paused.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/ioctl.h>
#ifndef POLLRDHUP /* Linux's (Python.h defines _GNU_SOURCE); elsewhere a peer's EOF */
#define POLLRDHUP 0 /* ends a spin that wants more than a byte when its budget runs out */
#endif
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define MAX_VIEWS 1024           /* IOV_MAX on Linux */
#define MAX_CALL_BYTES (1 << 30) /* per recvmsg: far inside the kernel's 2 GiB cap */

static atomic_int active; /* threads spinning now */
static atomic_int max_spinners = 1;
/* the pause rule (kvpool.transport.tcp_recv sets its own at import: set_pause) */
static atomic_llong long_yield_ns = 500000LL; /* a yield this long: a co-runner held the CPU */
static atomic_llong first_pause_ns = 10000000LL, max_pause_ns = 1000000000LL;
/* this thread's pause: now_ns() before which its spins return at once, and the pause its
 * next long yield starts (0: first_pause_ns) */
static _Thread_local long long paused_until, next_pause_ns;
static atomic_llong n_waits, n_ready, n_timeouts, n_crowded, n_long_yields, n_paused;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* vDSO: no system call */
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* The most a spin before a receive without MSG_WAITALL waits to see queued (see
 * "Why the rest of a large reply waits for a quarter MiB"), and the loopback speed
 * that sizes it by the spin budget: WANT_PER_NS_X2 / 2 bytes a ns. */
#define WANT_MAX (256 * 1024)
#define FIRST_WANT_MAX (64 * 1024)
#define WANT_PER_NS_X2 5

/* The spin itself; call without the GIL. 1: readable (with want > 1: that many bytes
 * queued, or EOF / an error), 0: budget passed, crowded, a long yield (spinning
 * paused from then on) or paused. */
static int spin(int fd, long long budget_ns, size_t want) {
    if (budget_ns <= 0)
        return 0;
    atomic_fetch_add_explicit(&n_waits, 1, memory_order_relaxed);
    long long now = now_ns();
    if (now < paused_until) {
        atomic_fetch_add_explicit(&n_paused, 1, memory_order_relaxed);
        return 0;
    }
    if (atomic_fetch_add(&active, 1) >= atomic_load(&max_spinners)) {
        atomic_fetch_sub(&active, 1);
        atomic_fetch_add_explicit(&n_crowded, 1, memory_order_relaxed);
        return 0;
    }
    atomic_llong *outcome = &n_timeouts;
    long long end = now + budget_ns, long_yield = atomic_load(&long_yield_ns);
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    for (;;) {
        /* > 0: readable, or POLLHUP / POLLERR / POLLNVAL: a receive will not sleep
         * either (it returns EOF or fails); wanting more than a byte, the spin goes on
         * until that many are queued, or the peer shut its side (POLLRDHUP: no more
         * will come) */
        if (poll(&p, 1, 0) > 0) {
            int queued = 0;
            if (want <= 1 || (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) ||
                ioctl(fd, FIONREAD, &queued) < 0 || (size_t)queued >= want) {
                outcome = &n_ready;
                break;
            }
        }
        long long before = now_ns();
        sched_yield(); /* a thread waiting for this CPU (a commit sender, a peer) runs */
        now = now_ns();
        if (now - before >= long_yield) { /* a co-runner's slice: see the header */
            long long pause = next_pause_ns ? next_pause_ns : atomic_load(&first_pause_ns);
            long long most = atomic_load(&max_pause_ns);
            paused_until = now + pause;
            next_pause_ns = pause < most / 2 ? 2 * pause : most;
            outcome = &n_long_yields;
            break;
        }
        if (now >= end)
            break;
    }
    if (outcome != &n_long_yields)
        next_pause_ns = 0;
    atomic_fetch_sub(&active, 1);
    atomic_fetch_add_explicit(outcome, 1, memory_order_relaxed);
    return outcome == &n_ready;
}

static size_t want_limit(int fd, int flags, long long budget_ns);

static PyObject *wait_readable(PyObject *self, PyObject *args) {
    int fd, ready;
    long long budget_ns;
    Py_ssize_t want = 1;
    if (!PyArg_ParseTuple(args, "iL|n:wait_readable", &fd, &budget_ns, &want))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "wait_readable: fd must be >= 0");
        return NULL;
    }
    size_t most = want > 1 ? want_limit(fd, 0, budget_ns) : 1;
    if (most > FIRST_WANT_MAX) /* a reply's first receive: see the header */
        most = FIRST_WANT_MAX;
    Py_BEGIN_ALLOW_THREADS
    ready = spin(fd, budget_ns, (size_t)want < most ? (size_t)want : most);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}

static void release_all(Py_buffer *bufs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&bufs[i]);
    PyMem_Free(bufs);
}

/* What a spin budget brings at loopback speed, at most WANT_MAX (0: no budget). */
static long long budget_want(long long budget_ns) {
    if (budget_ns >= WANT_MAX) /* (at >= 1 byte a ns that much brings WANT_MAX: no overflow) */
        return WANT_MAX;
    long long want = budget_ns > 0 ? budget_ns * WANT_PER_NS_X2 / 2 : 0;
    return want < WANT_MAX ? want : WANT_MAX;
}

/* The most bytes a spin before one of recv_all's receives waits to see queued: 1
 * (any) with MSG_WAITALL or no budget; else budget_want, at most a quarter of the
 * socket's receive buffer (which must hold them). */
static size_t want_limit(int fd, int flags, long long budget_ns) {
    if ((flags & MSG_WAITALL) || budget_ns <= 0)
        return 1;
    long long want = budget_want(budget_ns);
    int rcvbuf = 0;
    socklen_t len = sizeof(rcvbuf);
    if (getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &len) < 0 || rcvbuf <= 0)
        return 1;
    if (want > rcvbuf / 4)
        want = rcvbuf / 4;
    return want > 1 ? (size_t)want : 1;
}

/* Fill iov[0..n) from fd, in order: recvmsg calls of at most MAX_VIEWS buffers and
 * MAX_CALL_BYTES each, a spin of up to budget_ns before each (until the call's window
 * or want_max bytes are queued; 1: any byte). Call without the GIL.
 * iov is consumed (filled entries zeroed, a part-filled one advanced), so a call
 * after an EINTR goes on where this one stopped. Returns the bytes received; *err:
 * 0, or the errno that stopped it. Fewer bytes than asked and *err 0: EOF. */
static long long fill(int fd, struct iovec *iov, Py_ssize_t n, int flags, long long budget_ns,
                      size_t want_max, int *err) {
    Py_ssize_t first = 0; /* first buffer not full yet */
    long long got = 0;
    *err = 0;
    while (first < n) {
        if (iov[first].iov_len == 0) {
            first++;
            continue;
        }
        /* this call's window: the buffers from `first`, at most MAX_CALL_BYTES */
        Py_ssize_t count = 0;
        size_t window = 0, cut = 0;
        while (first + count < n && count < MAX_VIEWS && window < MAX_CALL_BYTES) {
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
        spin(fd, budget_ns, window < want_max ? window : want_max);
        ssize_t r = recvmsg(fd, &msg, flags);
        if (cut)
            iov[first + count - 1].iov_len += cut;
        if (r < 0) {
            *err = errno;
            break;
        }
        if (r == 0)
            break;
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
    return got;
}

/* fill with the GIL released; an EINTR runs Python's signal handlers (with the GIL)
 * and goes on unless one raised. Returns the bytes received (fewer than asked: EOF),
 * or -1 with a Python error set (OSError; EAGAIN, the socket's timeout, as
 * BlockingIOError). */
static long long fill_all(int fd, struct iovec *iov, Py_ssize_t n, int flags,
                          long long budget_ns, size_t want_max) {
    long long got = 0, r;
    int err;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        r = fill(fd, iov, n, flags, budget_ns, want_max, &err);
        Py_END_ALLOW_THREADS
        got += r;
        if (err == 0)
            return got;
        if (err != EINTR) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0) /* a handler raised: the stream is unknown */
            return -1;
    }
}

/* Send len bytes of buf to fd (the GIL released), as fill_all receives. 0, or -1 with
 * a Python error set. */
static int send_all(int fd, const char *buf, size_t len) {
    size_t done = 0;
    while (done < len) {
        ssize_t r;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        r = send(fd, buf + done, len - done, MSG_NOSIGNAL);
        if (r < 0)
            err = errno;
        Py_END_ALLOW_THREADS
        if (r >= 0) {
            done += (size_t)r;
            continue;
        }
        if (err == EINTR && PyErr_CheckSignals() == 0)
            continue;
        if (err != EINTR) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return -1;
    }
    return 0;
}

/* Get a writable C-contiguous buffer of each object of seq (a list or tuple),
 * n of them, into a new array (release_all frees it). NULL on error. */
static Py_buffer *get_writable(PyObject *const *items, Py_ssize_t n) {
    Py_buffer *bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (bufs == NULL)
        return (Py_buffer *)PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(items[i], &bufs[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            release_all(bufs, i);
            return NULL;
        }
    }
    return bufs;
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
    struct iovec *iov = PyMem_Calloc(n ? n : 1, sizeof(struct iovec));
    if (iov == NULL)
        return PyErr_NoMemory();
    Py_buffer *bufs = get_writable(PySequence_Fast_ITEMS(views), n);
    if (bufs == NULL) {
        PyMem_Free(iov);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        iov[i].iov_base = bufs[i].buf;
        iov[i].iov_len = (size_t)bufs[i].len;
    }
    long long got = fill_all(fd, iov, n, flags, budget_ns, want_limit(fd, flags, budget_ns));
    release_all(bufs, n);
    PyMem_Free(iov);
    return got < 0 ? NULL : PyLong_FromLongLong(got);
}

/* The wire format of a checked read (kvpool.transport.tcp_wire, fencing.IDENT). */
#define REQ_SIZE 24   /* REQ: op, pad, 2 zero bytes, request id, offset, length */
#define IDENT_SIZE 24 /* IDENT: key (16 bytes), block offset */
#define KEY_SIZE 16
#define RESP_SIZE 16  /* RESP: status, pad, 2 zero bytes, request id, length */
#define ALIGN 64      /* a READ payload starts at a multiple of ALIGN in the stream */
#define HEAD_STEP (RESP_SIZE + ALIGN) /* room for one reply's header and largest pad */
#define OP_READ_BLOCK 9
#define ST_OK 0
#define ST_STALE 6

static void put_be(unsigned char *p, unsigned long long v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

static unsigned long long get_be(const unsigned char *p, int bytes) {
    unsigned long long v = 0;
    for (int i = 0; i < bytes; i++)
        v = v << 8 | p[i];
    return v;
}

/* read_blocks(fd, plan, first_rid, received, heads, waitall_max, budget_ns, size)
 *   -> (found, at, received, served), or None
 * A pipelined exchange of checked reads (OP_READ_BLOCK) on a connection: plan is a
 * list of (offset, host buffer, key, block offset) tuples, the transports' reads as
 * the client builds them (the request's IDENT, key and block offset, is packed here:
 * no Python per read); their requests (ids first_rid, first_rid + 1, ... mod 2**32)
 * leave in one send, then every reply is received with
 * scatter receives: reply i's header and pad into heads[i * HEAD_STEP ...], its
 * payload straight into host i. Every reply to a checked read is exactly as long as
 * an ok one (a refusal is padded), so where each lands is known before any arrives:
 * received is the bytes the server has sent on the connection so far, which fixes
 * each pad. A receive of at most waitall_max bytes in all uses MSG_WAITALL.
 * Returns None, nothing sent, when a read is not one this call takes: its buffer not
 * writable C-contiguous memory (a torch tensor, a read-only or strided array), its
 * key not 16 bytes, an offset negative, or its range not inside [0, size): the
 * caller's general path then checks it (raising the usual error) or stages it.
 * Else found (per reply, in order: True ok, False refused as stale) for the
 * replies before at; at is len(plan) when every reply was ok or stale, else the first
 * that was neither (another id, length or pad, another status: the caller reads its
 * header from heads to say what); received: the bytes the server has sent now;
 * served: the payload bytes of the ok replies.
 * Errors: TypeError (a plan entry not such a tuple, an offset not an int); OSError
 * (EAGAIN, the socket's timeout, as BlockingIOError); EOF before the last reply,
 * ConnectionResetError. After an error the stream position is unknown. */
static PyObject *read_blocks(PyObject *self, PyObject *args) {
    int fd;
    PyObject *plan;
    unsigned int first_rid;
    long long received, waitall_max, budget_ns, region_size;
    Py_buffer heads;
    if (!PyArg_ParseTuple(args, "iO!ILw*LLL:read_blocks", &fd, &PyList_Type, &plan, &first_rid,
                          &received, &heads, &waitall_max, &budget_ns, &region_size))
        return NULL;
    PyObject *result = NULL, *found = NULL;
    unsigned char *requests = NULL, *pads = NULL;
    struct iovec *iov = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t n = PyList_GET_SIZE(plan), held = 0; /* held: buffers acquired so far */
    if (fd < 0 || received < 0 || heads.len < n * HEAD_STEP) {
        PyErr_Format(PyExc_ValueError, "read_blocks: fd %d, received %lld, heads of %zd B for %zd",
                     fd, received, heads.len, n);
        goto done;
    }
    bufs = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    requests = PyMem_Calloc(n ? n : 1, REQ_SIZE + IDENT_SIZE);
    pads = PyMem_Calloc(n ? n : 1, 1);
    iov = PyMem_Calloc(n ? 2 * n : 1, sizeof(struct iovec));
    if (!bufs || !requests || !pads || !iov) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* every check before any byte is sent */
        PyObject *item = PyList_GET_ITEM(plan, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_Format(PyExc_TypeError,
                         "read_blocks: plan[%zd] is not (offset, host buffer, key, block offset)", i);
            goto done;
        }
        unsigned long long offsets[2]; /* the read's offset, its block's offset */
        for (int k = 0; k < 2; k++) {
            PyObject *index = PyNumber_Index(PyTuple_GET_ITEM(item, k ? 3 : 0));
            if (index == NULL)
                goto done;
            offsets[k] = PyLong_AsUnsignedLongLong(index);
            Py_DECREF(index);
            if (offsets[k] == (unsigned long long)-1 && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                    goto done;
                PyErr_Clear(); /* negative (or past 2**64): not taken here */
                goto not_taken;
            }
        }
        PyObject *key = PyTuple_GET_ITEM(item, 2);
        if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != KEY_SIZE)
            goto not_taken;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &bufs[i],
                               PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear(); /* not writable contiguous memory: the general path says why */
            goto not_taken;
        }
        held++;
        unsigned long long limit = region_size > 0 ? (unsigned long long)region_size : 0;
        if (offsets[0] > limit || (unsigned long long)bufs[i].len > limit - offsets[0])
            goto not_taken;
        unsigned char *req = requests + i * (REQ_SIZE + IDENT_SIZE);
        req[0] = OP_READ_BLOCK; /* pad and the two bytes after it: 0 (Calloc) */
        put_be(req + 4, (unsigned int)(first_rid + (unsigned int)i), 4);
        put_be(req + 8, offsets[0], 8);
        put_be(req + 16, (unsigned long long)bufs[i].len, 8);
        memcpy(req + REQ_SIZE, PyBytes_AS_STRING(key), KEY_SIZE);
        put_be(req + REQ_SIZE + KEY_SIZE, offsets[1], 8);
    }
    long long at_stream = received; /* the server's bytes before reply i */
    Py_ssize_t nv = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int pad = (int)((ALIGN - (at_stream + RESP_SIZE) % ALIGN) % ALIGN); /* tcp_wire.read_pad */
        pads[i] = (unsigned char)pad;
        iov[nv].iov_base = (char *)heads.buf + i * HEAD_STEP;
        iov[nv++].iov_len = RESP_SIZE + pad;
        if (bufs[i].len) {
            iov[nv].iov_base = bufs[i].buf;
            iov[nv++].iov_len = (size_t)bufs[i].len;
        }
        at_stream += RESP_SIZE + pad + bufs[i].len;
    }
    if (send_all(fd, (const char *)requests, (size_t)n * (REQ_SIZE + IDENT_SIZE)) < 0)
        goto done;
    long long total = at_stream - received;
    /* any byte: see "Why the rest of a large reply waits for a quarter MiB" */
    long long got = fill_all(fd, iov, nv, total <= waitall_max ? MSG_WAITALL : 0, budget_ns, 1);
    if (got < 0)
        goto done;
    if (got < total) {
        PyErr_Format(PyExc_ConnectionResetError,
                     "peer closed the data connection (%lld of %lld B received)", got, total);
        goto done;
    }
    if ((found = PyList_New(0)) == NULL)
        goto done;
    long long served = 0;
    Py_ssize_t at = 0;
    for (; at < n; at++) {
        const unsigned char *h = (const unsigned char *)heads.buf + at * HEAD_STEP;
        unsigned long long length = get_be(h + 8, 8), size = (unsigned long long)bufs[at].len;
        if (get_be(h + 4, 4) != (unsigned int)(first_rid + (unsigned int)at))
            break;
        int ok = h[0] == ST_OK && h[1] == pads[at] && length == size;
        if (!ok && !(h[0] == ST_STALE && length == pads[at] + size))
            break;
        if (PyList_Append(found, ok ? Py_True : Py_False) < 0)
            goto done;
        served += ok ? (long long)size : 0;
    }
    result = Py_BuildValue("(OnLL)", found, at, at_stream, served);
    goto done;
not_taken:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(found);
    if (bufs)
        release_all(bufs, held);
    PyMem_Free(requests);
    PyMem_Free(pads);
    PyMem_Free(iov);
    PyBuffer_Release(&heads);
    return result;
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

static PyObject *set_pause(PyObject *self, PyObject *args) {
    long long long_yield, first, most;
    if (!PyArg_ParseTuple(args, "LLL:set_pause", &long_yield, &first, &most))
        return NULL;
    if (long_yield <= 0 || first < 0 || most < first) {
        PyErr_SetString(PyExc_ValueError,
                        "set_pause: need long_yield_ns > 0 and 0 <= first_pause_ns <= max_pause_ns");
        return NULL;
    }
    atomic_store(&long_yield_ns, long_yield);
    atomic_store(&first_pause_ns, first);
    atomic_store(&max_pause_ns, most);
    next_pause_ns = 0; /* this thread's pause in force ends: the new rule applies from now */
    paused_until = 0;
    Py_RETURN_NONE;
}

static PyObject *want_for_budget(PyObject *self, PyObject *args) {
    long long budget_ns;
    if (!PyArg_ParseTuple(args, "L:want_for_budget", &budget_ns))
        return NULL;
    return PyLong_FromLongLong(budget_want(budget_ns));
}

static PyObject *counters(PyObject *self, PyObject *unused) {
    return Py_BuildValue(
        "{sLsLsLsLsLsLsisL}", "waits", (long long)atomic_load(&n_waits), "ready",
        (long long)atomic_load(&n_ready), "timeouts", (long long)atomic_load(&n_timeouts),
        "crowded", (long long)atomic_load(&n_crowded), "long_yields",
        (long long)atomic_load(&n_long_yields), "paused", (long long)atomic_load(&n_paused),
        "max_spinners", atomic_load(&max_spinners), "next_pause_us",
        (next_pause_ns ? next_pause_ns : atomic_load(&first_pause_ns)) / 1000);
}

static PyMethodDef methods[] = {
    {"wait_readable", wait_readable, METH_VARARGS,
     "wait_readable(fd, budget_ns, want=1) -> bool: poll fd until readable (want > 1: that "
     "many bytes queued, at most 64 KiB: a reply's first receive) or budget_ns passed (GIL "
     "released); False at once when max_spinners threads already spin."},
    {"recv_all", recv_all, METH_VARARGS,
     "recv_all(fd, views, flags, budget_ns) -> int: fill every buffer of the list views "
     "from fd, spinning up to budget_ns before each receive (GIL released); the bytes "
     "received (fewer than asked: the peer closed)."},
    {"read_blocks", read_blocks, METH_VARARGS,
     "read_blocks(fd, plan, first_rid, received, heads, waitall_max, budget_ns, size) -> "
     "(found, at, received, served) or None: a pipelined exchange of checked reads (see the "
     "source's comment)."},
    {"set_max_spinners", set_max_spinners, METH_O,
     "set_max_spinners(n): at most n threads of this process spin at once (0: none)."},
    {"set_pause", set_pause, METH_VARARGS,
     "set_pause(long_yield_ns, first_pause_ns, max_pause_ns): a yield at least long_yield_ns "
     "long pauses the thread's spins, first_pause_ns, doubling up to max_pause_ns while long "
     "yields follow (defaults 500 us, 10 ms, 1 s); ends the calling thread's pause in force."},
    {"want_for_budget", want_for_budget, METH_VARARGS,
     "want_for_budget(budget_ns) -> int: the most bytes a spin of that budget waits to see "
     "queued before a large reply's receive (less where the receive buffer is small)."},
    {"counters", counters, METH_NOARGS,
     "counters() -> dict: waits, ready, timeouts, crowded, long_yields, paused (since "
     "import); max_spinners, next_pause_us (the pause a long yield of this thread starts "
     "now)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvpool.transport._tcp_recv",
    "How the TCP data path's client receives replies (see the source's header).", -1, methods,
};

PyMODINIT_FUNC PyInit__tcp_recv(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "FIRST_WANT_MAX", FIRST_WANT_MAX) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
