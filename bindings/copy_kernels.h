/* The host copy kernels shared by kvpool's C extensions (header only).
 *
 * kvpool.bindings._stream_copy (a put's or a read's copy of a large block) and
 * kvpool.transport._shm_copy (the same copy bracketed by a same-host block's
 * identity or seal record) copy with the same loops; each extension picks one
 * at import (``kv_pick_kernel``, called by ``kv_create_module``, which is
 * compiled where Python.h was included first).
 *
 * Why streaming (issue 17): a put of a large block writes bytes another
 * process reads later (the node's shared arena), never this core. An ordinary
 * copy first reads every destination line into the cache (read-for-ownership:
 * a third memory transfer per byte) and evicts the caller's working set doing
 * it. glibc only streams above x86_non_temporal_threshold, 240 MiB on these VMs
 * (it derives it from the shared cache size), so numpy's copy of a 1-16 MiB
 * block never does. Measured on a 2 vCPU AMD EPYC (kvpool bench copy,
 * bench/RESULTS.md "Session 10"): 1.2-1.7x numpy's copy from 64 KiB to 16 MiB,
 * destinations out of the caches.
 *
 * Invariants of every kernel: on return every byte of dst equals src's, and an
 * SFENCE has ordered the streaming stores before any store the caller makes
 * next (a seal record that tells another process the block is whole:
 * kvpool.transport.shm_seal). ``kv_copy`` copies overlapping buffers with
 * memmove (never streamed). Without x86-64 the streaming kernel is memcpy.
 */
#ifndef KVPOOL_COPY_KERNELS_H
#define KVPOOL_COPY_KERNELS_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KV_X86 1
#else
#define KV_X86 0
#endif

#define KV_LINE 64
#define KV_PREFETCH_AHEAD 512 /* bytes: eight lines ahead of the loads */

typedef void (*kv_copy_fn)(char *, const char *, size_t);

#if KV_X86
/* Both kernels: an unaligned head by memcpy up to dst's next line (head_bytes),
 * whole lines streamed, the tail by memcpy, then the fence. */
static size_t kv_head_bytes(const char *d, size_t n) {
    size_t head = (KV_LINE - ((uintptr_t)d & (KV_LINE - 1))) & (KV_LINE - 1);
    return head < n ? head : n;
}

__attribute__((target("avx2"))) static void kv_stream_avx2(char *d, const char *s, size_t n) {
    size_t head = kv_head_bytes(d, n);
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= KV_LINE; n -= KV_LINE, d += KV_LINE, s += KV_LINE) {
        _mm_prefetch(s + KV_PREFETCH_AHEAD, _MM_HINT_NTA);
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
    }
    _mm_sfence();
    memcpy(d, s, n);
}

static void kv_stream_sse2(char *d, const char *s, size_t n) {
    size_t head = kv_head_bytes(d, n);
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= KV_LINE; n -= KV_LINE, d += KV_LINE, s += KV_LINE) {
        _mm_prefetch(s + KV_PREFETCH_AHEAD, _MM_HINT_NTA);
        for (int i = 0; i < KV_LINE; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    }
    _mm_sfence();
    memcpy(d, s, n);
}
#endif

static void kv_plain_copy(char *d, const char *s, size_t n) { memcpy(d, s, n); }

/* The streaming kernel this CPU runs, and its name ("avx2", "sse2" or "memcpy"). */
static kv_copy_fn kv_pick_kernel(const char **name) {
#if KV_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        *name = "avx2";
        return kv_stream_avx2;
    }
    *name = "sse2";
    return kv_stream_sse2;
#else
    *name = "memcpy";
    return kv_plain_copy;
#endif
}

#ifdef Py_PYTHON_H
/* A copy extension's module, created from ``def``: the kernel this CPU runs goes
 * to *kernel and its name is exported as KERNEL. */
static PyObject *kv_create_module(PyModuleDef *def, kv_copy_fn *kernel) {
    const char *name;
    *kernel = kv_pick_kernel(&name);
    PyObject *m = PyModule_Create(def);
    if (m != NULL && PyModule_AddStringConstant(m, "KERNEL", name) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif

/* Copy n bytes: with ``stream`` by the streaming kernel, else by memcpy (what
 * numpy's copy of contiguous bytes runs); overlapping buffers by memmove. */
static void kv_copy(kv_copy_fn stream_kernel, int stream, char *d, const char *s, size_t n) {
    if (n && d < s + n && s < d + n)
        memmove(d, s, n);
    else if (stream)
        stream_kernel(d, s, n);
    else
        memcpy(d, s, n);
}

#endif
