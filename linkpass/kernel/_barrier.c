/* linkpass.kernel._barrier: fence() -- a full CPU memory barrier (barrier.h), callable from Python.
 *
 * The entropy table's seqlock needs its stores to reach other cores in program order ("seq odd;
 * slots; seq even") and a reader's loads to happen in program order. x86-64 gives both (TSO);
 * aarch64 and other weakly ordered CPUs need a barrier between the steps, which Python cannot
 * express. Every bytecode before the call has finished its stores, so the barrier orders them
 * against every store after it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "barrier.h"

static PyObject *fence(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    lp_full_barrier();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fence", fence, METH_NOARGS, "A full memory barrier: loads and stores before it complete before any after it."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_barrier", NULL, 0, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__barrier(void) { return PyModule_Create(&module); }
