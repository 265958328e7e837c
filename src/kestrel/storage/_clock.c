/* The clock read twice on every request (its answer's time) and around every journal write: the
 * monotonic clock in seconds, as `time.perf_counter` reads it on Linux (CLOCK_MONOTONIC), from one
 * `clock_gettime` and a float. Python's own reading passes through its nanosecond time type, its
 * overflow checks and its conversion back to seconds: about 110 of the 320 instructions a reading
 * costs compiled code. Its Python twin, `time.perf_counter`, serves where the build had no C
 * compiler or the platform's performance counter is another clock (src/kestrel/storage/clock.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <time.h>

static PyObject *perf_counter(PyObject *module, PyObject *unused) {
    struct timespec now;
    if (clock_gettime(CLOCK_MONOTONIC, &now) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* as Python makes its seconds of the nanoseconds, so that the two readings are the same float */
    long long ns = (long long)now.tv_sec * 1000000000LL + now.tv_nsec;
    return PyFloat_FromDouble((double)ns / 1e9);
}

static PyMethodDef methods[] = {
    {"perf_counter", perf_counter, METH_NOARGS,
     "The monotonic clock in seconds: `time.perf_counter`'s reading, read more cheaply."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_clock", "The monotonic clock, read cheaply (src/kestrel/storage/clock.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__clock(void) { return PyModule_Create(&module); }
