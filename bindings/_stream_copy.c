/* kvpool.bindings._stream_copy: one host copy that bypasses the CPU caches.
 *
 * copy(dst, src): copy the C-contiguous buffer src into the writable,
 * C-contiguous buffer dst of the same length, with non-temporal (streaming)
 * stores and the source prefetched non-temporally, the GIL released.
 *
 * Why (issue 17): a put of a large block writes bytes another process reads
 * later (the node's shared arena), never this core. An ordinary copy first reads
 * every destination line into the cache (read-for-ownership: a third memory
 * transfer per byte) and evicts the caller's working set doing it. glibc only
 * streams above x86_non_temporal_threshold, 240 MiB on these VMs (it derives it
 * from the shared cache size), so numpy's copy of a 1-16 MiB block never does.
 * Measured on a 2 vCPU AMD EPYC (kvpool bench copy, bench/RESULTS.md "Session 10"):
 * 1.2-1.7x numpy's copy from 64 KiB to 16 MiB, destinations out of the caches.
 *
 * Invariants:
 * - on return every byte of dst equals src's, and an SFENCE has ordered the
 *   streaming stores before any store the caller makes next (the seal record
 *   that tells another process the block is whole: kvpool.transport.shm_seal);
 * - overlapping buffers are copied with memmove (never streamed);
 * - without x86-64 (or without SSE2, which x86-64 guarantees) this is memcpy:
 *   KERNEL says which loop runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif

#define LINE 64
#define PREFETCH_AHEAD 512 /* bytes: eight lines ahead of the loads */

typedef void (*stream_fn)(char *, const char *, size_t);

#if KV_X86
/* Both kernels: an unaligned head by memcpy up to dst's next line (head_bytes),
 * whole lines streamed, the tail by memcpy, then the fence. */
static size_t head_bytes(const char *d, size_t n) {
    size_t head = (LINE - ((uintptr_t)d & (LINE - 1))) & (LINE - 1);
    return head < n ? head : n;
}

__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t n) {
    size_t head = head_bytes(d, n);
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= LINE; n -= LINE, d += LINE, s += LINE) {
        _mm_prefetch(s + PREFETCH_AHEAD, _MM_HINT_NTA);
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
    }
    _mm_sfence();
    memcpy(d, s, n);
}

static void stream_sse2(char *d, const char *s, size_t n) {
    size_t head = head_bytes(d, n);
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= LINE; n -= LINE, d += LINE, s += LINE) {
        _mm_prefetch(s + PREFETCH_AHEAD, _MM_HINT_NTA);
        for (int i = 0; i < LINE; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    }
    _mm_sfence();
    memcpy(d, s, n);
}
#endif

static void plain_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }

static stream_fn kernel = plain_copy;

static PyObject *stream_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src) takes exactly two buffers");
        return NULL;
    }
    Py_buffer dst, src;
    if (PyObject_GetBuffer(args[0], &dst, PyBUF_CONTIG) < 0)
        return NULL; /* not writable, or not C-contiguous: the exporter's error */
    if (PyObject_GetBuffer(args[1], &src, PyBUF_CONTIG_RO) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: dst is %zd bytes, src %zd", dst.len, src.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }
    char *d = dst.buf;
    const char *s = src.buf;
    size_t n = (size_t)dst.len;
    int overlap = n && d < s + n && s < d + n;
    Py_BEGIN_ALLOW_THREADS
    if (overlap)
        memmove(d, s, n);
    else
        kernel(d, s, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))stream_copy, METH_FASTCALL,
     "copy(dst, src, /): copy src into dst (same length, C-contiguous) with streaming "
     "stores, the GIL released; fenced before it returns."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_stream_copy", "Streaming (cache-bypassing) host copies.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__stream_copy(void) {
    const char *name = "memcpy";
#if KV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        kernel = stream_avx2, name = "avx2";
    else
        kernel = stream_sse2, name = "sse2";
#endif
    PyObject *m = PyModule_Create(&module_def);
    if (m != NULL && PyModule_AddStringConstant(m, "KERNEL", name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
