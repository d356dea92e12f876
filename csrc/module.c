/* The Python module flatcake._native: nothing but a name to import. FlatCake's C loops are
 * plain C functions in this same shared object (the other files of csrc/), which
 * flatcake/native/loops.py loads by the module's __file__ with ctypes and binds by name.
 *
 * SOURCE_HASH: sha256 of the csrc/ sources this object was built from (setup.py passes it), so
 * that a source checkout whose C changed since the last build reports the loops as stale
 * instead of running old code. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifndef FC_SOURCE_HASH
#define FC_SOURCE_HASH ""
#endif

static struct PyModuleDef fc_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "FlatCake's C loops: C functions in this shared object, bound through ctypes by flatcake.native.loops.",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&fc_module);
    if (m && PyModule_AddStringConstant(m, "SOURCE_HASH", FC_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
