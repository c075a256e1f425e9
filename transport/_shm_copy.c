/* kvpool.transport._shm_copy: a same-host block copy and its record, in one call.
 *
 * A same-host client reads a block straight out of the node's shared arena
 * between two reads of the block's identity record (kvpool.transport.shm_ident),
 * and writes one into a claimed range followed by its seal record
 * (kvpool.transport.shm_seal). In Python each of those is four or five calls
 * around the copy (record checks, the arena slice, the copy's dispatch, the
 * record's packing), ~1.5-2.5 us at 1 MiB once the copy has pushed the
 * interpreter's state out of the CPU caches (issue 17, bench/RESULTS.md
 * "Session 22"). Here each is one call.
 *
 * read_checked(dst, arena, idents, block_offset, start, key, way) -> int
 *     Copy arena[block_offset + start : + len(dst)] into dst only while the
 *     identity record of block_offset names ``key`` (16 bytes), has an even,
 *     non-zero seq and covers [start, start + len(dst)); then read the seq
 *     again. 1: the bytes are that block's, whole. 0: a miss (a negative or
 *     unaligned block offset, a negative start, no such record, or it changed
 *     during the copy: dst holds no meaningful bytes). -1: the record names
 *     the block but the range lies outside the arena (nothing copied; the
 *     caller raises).
 *
 * read_checked_many(plan, arena, idents, length, way) -> list or None
 *     read_checked of each (offset, dst, key, block offset) of a batch of reads of
 *     ``length`` bytes, one call (see its comment).
 *
 * write_sealed(arena, src, seals, offset, epoch, alloc_id, key, parent, mark, way) -> int
 *     Copy src into arena[offset : offset + len(src)], then write the seal
 *     record of offset: its fields (epoch, allocation, size, has-parent, key,
 *     parent or zeros), then ``mark`` (SEALED or NODE_COMMITS) in its sealed
 *     word last, then for NODE_COMMITS rings the doorbell (doorbell_ring).
 *     1: done. 0: no record for offset, or a key or parent not 16 bytes: nothing
 *     copied or written. -1: the range lies outside the arena, a negative offset
 *     included (nothing copied; the caller raises).
 *
 * doorbell_ring(seals, value, force) / doorbell_wait(seals, timeout_ns)
 *     The seal file's doorbell as a futex, so that the node's commit thread sleeps
 *     until a same-host writer asks it to commit instead of polling (see their
 *     comments and the protocol in kvpool.transport.shm_doorbell). write_sealed
 *     rings it the same way.
 *
 * ``way``: 1 copies with the streaming kernel (copy_kernels.h), 0 with memcpy
 * (numpy's copy of contiguous bytes), as kvpool.bindings.stream_copy learned
 * for the block's size. The copy runs with the GIL released; every buffer is
 * held (exported) for the whole call, so a concurrent close of the mapping
 * waits for it (the mapping is unmapped when the last export goes).
 *
 * Record layouts (native byte order), the same as the Python modules' structs
 * (tests/test_shm_copy.py checks one side against the other):
 * - identity: record block_offset / 4096 of 32 bytes: seq u64, size u64, key 16 B;
 * - seal: a 128-byte header (the doorbell is its word 8, the node's sleeping word its
 *   word 9), then record
 *   offset / 4096 of 72 bytes: sealed u64, epoch u64, alloc id u64, size u64,
 *   has parent u64, key 16 B, parent 16 B.
 *
 * Memory ordering: the seq is loaded with acquire before the record's fields
 * and the copy, and an acquire fence orders the copy's loads before the second
 * load of seq (a seqlock reader); the seal record's fields are stored before
 * its sealed word, stored with release, after the copy (whose streaming stores
 * the kernel fenced). On x86-64 these are compiler barriers; the same code is
 * correct on weakly ordered CPUs, where the Python fallbacks are not (untested).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "copy_kernels.h"

#define ALIGN 4096
#define IDENT_RECORD 32
#define SEAL_HEADER 128
#define SEAL_RECORD 72
#define DOORBELL_WORD 8
#define SLEEPING_WORD 9 /* the node's commit thread sleeps on the doorbell: a ring wakes it */
#define NODE_COMMITS 2
#define RING_WRITER 1 /* the doorbell's value: a writer rang; the node itself hurries with 2 */

static kv_copy_fn kernel = kv_plain_copy;

/* A 16-byte key from a bytes object; NULL (no error set) if it is not one. */
static const char *key16(PyObject *obj) {
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != 16)
        return NULL;
    return PyBytes_AS_STRING(obj);
}

/* Export args[i] into views[i] with flags[i], for i < n: 0; or -1 with the
 * exporter's error set and every view taken so far released. */
static int export_all(PyObject *const *args, const int *flags, Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(args[i], &views[i], flags[i]) < 0) {
            while (i--)
                PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_all(Py_buffer *views, int n) {
    while (n--)
        PyBuffer_Release(&views[n]);
}

/* The doorbell's futex word: the 32-bit half of the u64 doorbell holding its low bits. */
static uint32_t *doorbell32(uint64_t *words) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (uint32_t *)&words[DOORBELL_WORD] + 1;
#else
    return (uint32_t *)&words[DOORBELL_WORD];
#endif
}

/* Ring the doorbell (value: RING_WRITER, or the node's own hurry) and wake the node's
 * commit thread if it said it sleeps on it (force: wake it whatever it said). The ring
 * is a sequentially consistent store, so either this load sees the node's sleeping word
 * or the node's futex wait, which follows its own such store, sees the ring (the
 * protocol: kvpool.transport.shm_doorbell). Runs without the GIL. */
static void ring_and_wake(uint64_t *words, uint64_t value, int force) {
    __atomic_store_n(&words[DOORBELL_WORD], value, __ATOMIC_SEQ_CST);
    if (force || __atomic_load_n(&words[SLEEPING_WORD], __ATOMIC_SEQ_CST))
        syscall(SYS_futex, doorbell32(words), FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* The seal file's words from a writable buffer of at least its header; NULL with a
 * Python error set otherwise (the view released). */
static uint64_t *seal_header(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (view->len < SEAL_HEADER || (uintptr_t)view->buf % 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "not a seal file's mapping");
        return NULL;
    }
    return view->buf;
}

/* doorbell_ring(seals, value, force) -> None: ring_and_wake, for the Python paths. */
static PyObject *doorbell_ring(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "doorbell_ring(seals, value, force)");
        return NULL;
    }
    uint64_t value = PyLong_AsUnsignedLongLong(args[1]);
    if (value == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    int force = PyObject_IsTrue(args[2]);
    Py_buffer view;
    uint64_t *words = force < 0 ? NULL : seal_header(args[0], &view);
    if (words == NULL)
        return NULL;
    ring_and_wake(words, value, force);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* doorbell_wait(seals, timeout_ns) -> None: the node's commit thread waits, without the
 * GIL, until the doorbell is rung (a non-zero value: it returns at once if it already
 * is), a signal comes or timeout_ns passed; the doorbell is left as it is
 * (SealRecords.rung reads and clears it). It says so in the sleeping word for the
 * wait, so that writers' rings wake it. One thread of the node waits at a time (it
 * alone writes the sleeping word). */
static PyObject *doorbell_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "doorbell_wait(seals, timeout_ns)");
        return NULL;
    }
    long long timeout_ns = PyLong_AsLongLong(args[1]);
    if (timeout_ns == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer view;
    uint64_t *words = seal_header(args[0], &view);
    if (words == NULL)
        return NULL;
    if (timeout_ns < 0)
        timeout_ns = 0;
    struct timespec wait = {timeout_ns / 1000000000LL, timeout_ns % 1000000000LL};
    Py_BEGIN_ALLOW_THREADS
    __atomic_store_n(&words[SLEEPING_WORD], 1, __ATOMIC_SEQ_CST);
    /* sleeps only while the word is still 0 (checked atomically by the kernel); an
     * EINTR, EAGAIN (rung already) or ETIMEDOUT return all mean: look again */
    syscall(SYS_futex, doorbell32(words), FUTEX_WAIT, 0, &wait, NULL, 0);
    __atomic_store_n(&words[SLEEPING_WORD], 0, __ATOMIC_SEQ_CST);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* One checked read's record checks and copy (no Python object touched: callers run
 * it without the GIL): 1 read, 0 miss, -1 outside the arena, as read_checked. */
static long checked_copy(char *d, size_t n, const Py_buffer *arena, const Py_buffer *idents,
                         Py_ssize_t block_offset, Py_ssize_t start, const char *key, int way) {
    if (key == NULL || block_offset < 0 || start < 0 || block_offset % ALIGN)
        return 0; /* no block starts there: a miss, as in Python */
    size_t slot = (size_t)block_offset / ALIGN;
    if ((slot + 1) * IDENT_RECORD > (size_t)idents->len)
        return 0;
    const uint64_t *record = (const uint64_t *)((const char *)idents->buf + slot * IDENT_RECORD);
    uint64_t seq = __atomic_load_n(&record[0], __ATOMIC_ACQUIRE);
    if ((seq & 1) || seq == 0 || (uint64_t)start + n > record[1] || memcmp(record + 2, key, 16))
        return 0;
    size_t from = (size_t)block_offset + (size_t)start; /* the record's checks came first */
    if (from > (size_t)arena->len || n > (size_t)arena->len - from)
        return -1;
    kv_copy(kernel, way, d, (const char *)arena->buf + from, n);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return __atomic_load_n(&record[0], __ATOMIC_ACQUIRE) == seq;
}

static PyObject *read_checked(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "read_checked(dst, arena, idents, block_offset, start, key, way)");
        return NULL;
    }
    Py_ssize_t block_offset = PyLong_AsSsize_t(args[3]);
    if (block_offset == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[4]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (block_offset < 0 || start < 0) /* no block starts there: a miss, as in Python */
        return PyLong_FromLong(0);
    const char *key = key16(args[5]);
    int way = PyObject_IsTrue(args[6]);
    if (way < 0)
        return NULL;
    static const int flags[3] = {PyBUF_CONTIG, PyBUF_SIMPLE, PyBUF_SIMPLE};
    Py_buffer views[3]; /* dst (writable), arena, idents */
    if (export_all(args, flags, views, 3) < 0)
        return NULL;
    long result;
    Py_BEGIN_ALLOW_THREADS
    result = checked_copy(views[0].buf, (size_t)views[0].len, &views[1], &views[2], block_offset,
                          start, key, way);
    Py_END_ALLOW_THREADS
    release_all(views, 3);
    return PyLong_FromLong(result);
}

/* read_checked_many(plan, arena, idents, length, way) -> list of 1 / 0 / -1, or None
 * read_checked of each (offset, dst, key, block offset) of the list plan (the
 * transports' reads; start = offset - block offset), one copy way for all: a batch
 * of same-size reads whose way is settled, in one call, the GIL released once for
 * every copy. None, nothing copied, when a dst is not writable contiguous memory of
 * exactly length bytes or an offset is not an int that fits (the caller reads them
 * one by one, which raises the usual error). TypeError: a plan entry not such a
 * tuple. */
static PyObject *read_checked_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_checked_many(plan: list, arena, idents, length, way)");
        return NULL;
    }
    PyObject *plan = args[0], *result = NULL;
    Py_ssize_t length = PyLong_AsSsize_t(args[3]);
    if (length == -1 && PyErr_Occurred())
        return NULL;
    int way = PyObject_IsTrue(args[4]);
    if (way < 0)
        return NULL;
    static const int flags[2] = {PyBUF_SIMPLE, PyBUF_SIMPLE};
    Py_buffer maps[2]; /* arena, idents */
    if (export_all(args + 1, flags, maps, 2) < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(plan), held = 0;
    Py_buffer *dsts = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    Py_ssize_t *at = PyMem_Calloc(n ? 2 * n : 1, sizeof(Py_ssize_t)); /* block offset, start */
    char *keys = PyMem_Calloc(n ? n : 1, 17); /* each key copied, byte 16: 1 if it is one */
    long *got = PyMem_Calloc(n ? n : 1, sizeof(long));
    if (!dsts || !at || !keys || !got) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(plan, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
            PyErr_Format(PyExc_TypeError,
                         "read_checked_many: plan[%zd] is not (offset, dst, key, block offset)", i);
            goto done;
        }
        Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
        Py_ssize_t block = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3));
        if ((offset == -1 || block == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            goto not_taken;
        }
        at[2 * i] = block;
        at[2 * i + 1] = offset - block;
        const char *key = key16(PyTuple_GET_ITEM(item, 2));
        if (key != NULL) { /* copied: the plan may change once the GIL is released */
            memcpy(keys + 17 * i, key, 16);
            keys[17 * i + 16] = 1;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &dsts[i], PyBUF_CONTIG) < 0) {
            PyErr_Clear();
            goto not_taken;
        }
        held++;
        if (dsts[i].len != length)
            goto not_taken;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        got[i] = checked_copy(dsts[i].buf, (size_t)length, &maps[0], &maps[1], at[2 * i],
                              at[2 * i + 1], keys[17 * i + 16] ? keys + 17 * i : NULL, way);
    Py_END_ALLOW_THREADS
    if ((result = PyList_New(n)) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromLong(got[i]);
        if (value == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, value);
    }
    goto done;
not_taken:
    result = Py_NewRef(Py_None);
done:
    while (held--)
        PyBuffer_Release(&dsts[held]);
    release_all(maps, 2);
    PyMem_Free(dsts);
    PyMem_Free(at);
    PyMem_Free(keys);
    PyMem_Free(got);
    return result;
}

static PyObject *write_sealed(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(
            PyExc_TypeError,
            "write_sealed(arena, src, seals, offset, epoch, alloc_id, key, parent, mark, way)");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[3]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    if (offset < 0) /* outside the arena: the caller raises its usual error */
        return PyLong_FromLong(-1);
    uint64_t epoch = PyLong_AsUnsignedLongLong(args[4]);
    if (epoch == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    uint64_t alloc_id = PyLong_AsUnsignedLongLong(args[5]);
    if (alloc_id == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    const char *key = key16(args[6]);
    const char *parent = args[7] == Py_None ? NULL : key16(args[7]);
    int bad_parent = args[7] != Py_None && parent == NULL;
    uint64_t mark = PyLong_AsUnsignedLongLong(args[8]);
    if (mark == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    int way = PyObject_IsTrue(args[9]);
    if (way < 0)
        return NULL;
    static const int flags[3] = {PyBUF_WRITABLE, PyBUF_CONTIG_RO, PyBUF_WRITABLE};
    Py_buffer views[3]; /* arena, src, seals */
    if (export_all(args, flags, views, 3) < 0)
        return NULL;
    Py_buffer arena = views[0], src = views[1], seals = views[2];
    long result = 0;
    size_t n = (size_t)src.len;
    if ((size_t)offset > (size_t)arena.len || n > (size_t)arena.len - (size_t)offset) {
        result = -1;
        goto done;
    }
    size_t at = SEAL_HEADER + (size_t)offset / ALIGN * SEAL_RECORD;
    if (key == NULL || bad_parent || offset % ALIGN || at + SEAL_RECORD > (size_t)seals.len)
        goto done;
    uint64_t *words = seals.buf;
    uint64_t *record = (uint64_t *)((char *)seals.buf + at);
    char *d = (char *)arena.buf + offset;
    const char *s = src.buf;
    Py_BEGIN_ALLOW_THREADS
    kv_copy(kernel, way, d, s, n);
    record[1] = epoch;
    record[2] = alloc_id;
    record[3] = (uint64_t)n;
    record[4] = parent != NULL;
    memcpy(record + 5, key, 16);
    if (parent != NULL)
        memcpy(record + 7, parent, 16);
    else
        memset(record + 7, 0, 16);
    __atomic_store_n(&record[0], mark, __ATOMIC_RELEASE); /* last: the node reads it first */
    if (mark == NODE_COMMITS)
        ring_and_wake(words, RING_WRITER, 0);
    Py_END_ALLOW_THREADS
    result = 1;
done:
    release_all(views, 3);
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"read_checked", (PyCFunction)(void (*)(void))read_checked, METH_FASTCALL,
     "read_checked(dst, arena, idents, block_offset, start, key, way, /) -> 1 read, 0 miss, "
     "-1 outside the arena: a same-host read checked against its identity record."},
    {"read_checked_many", (PyCFunction)(void (*)(void))read_checked_many, METH_FASTCALL,
     "read_checked_many(plan, arena, idents, length, way, /) -> [1 / 0 / -1 per read] or None: "
     "read_checked of each (offset, dst, key, block offset), one call for a batch."},
    {"write_sealed", (PyCFunction)(void (*)(void))write_sealed, METH_FASTCALL,
     "write_sealed(arena, src, seals, offset, epoch, alloc_id, key, parent, mark, way, /) -> "
     "1 written and sealed, 0 no record, -1 outside the arena: a same-host put's copy and "
     "its seal record."},
    {"doorbell_ring", (PyCFunction)(void (*)(void))doorbell_ring, METH_FASTCALL,
     "doorbell_ring(seals, value, force, /) -> None: ring the seal file's doorbell and wake "
     "the node's commit thread if it sleeps on it (force: in any case)."},
    {"doorbell_wait", (PyCFunction)(void (*)(void))doorbell_wait, METH_FASTCALL,
     "doorbell_wait(seals, timeout_ns, /) -> None: wait (GIL released) until the doorbell "
     "is rung or timeout_ns passed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_shm_copy",
    "Same-host block copies bracketed by their identity or seal record.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shm_copy(void) { return kv_create_module(&module_def, &kernel); }
