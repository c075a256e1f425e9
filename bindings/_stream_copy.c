/* kvpool.bindings._stream_copy: one host copy that bypasses the CPU caches.
 *
 * copy(dst, src): copy the C-contiguous buffer src into the writable,
 * C-contiguous buffer dst of the same length, with non-temporal (streaming)
 * stores and the source prefetched non-temporally, the GIL released. The
 * loops, why they stream and their invariants: copy_kernels.h. KERNEL says
 * which loop runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "copy_kernels.h"

static kv_copy_fn kernel = kv_plain_copy;

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
    Py_BEGIN_ALLOW_THREADS
    kv_copy(kernel, 1, d, s, n);
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

PyMODINIT_FUNC PyInit__stream_copy(void) { return kv_create_module(&module_def, &kernel); }
