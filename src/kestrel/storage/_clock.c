/* The clocks read on every request, each from one `clock_gettime`:
 *
 * `perf_counter`, read twice a request (its answer's time) and around every journal write: the
 * monotonic clock in seconds, as `time.perf_counter` reads it on Linux (CLOCK_MONOTONIC), the same
 * float. Python's own reading passes through its nanosecond time type, its overflow checks and its
 * conversion back to seconds: about 110 of the 320 instructions a reading costs compiled code.
 *
 * `now_ms`, the wall clock in milliseconds that a put stamps its items with and expiry compares
 * with: `time.time_ns() // 1_000_000` (CLOCK_REALTIME), where Python makes an int of the
 * nanoseconds and divides it, a second int: about 370 instructions a reading.
 *
 * Their Python twins (src/kestrel/storage/clock.py) serve where the build had no C compiler or the
 * platform's clocks are others.
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

static PyObject *now_ms(PyObject *module, PyObject *unused) {
    struct timespec now;
    if (clock_gettime(CLOCK_REALTIME, &now) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* tv_nsec is within [0, 1e9): the floor of the nanoseconds' division, as Python's `//` */
    return PyLong_FromLongLong((long long)now.tv_sec * 1000LL + now.tv_nsec / 1000000);
}

static PyMethodDef methods[] = {
    {"perf_counter", perf_counter, METH_NOARGS,
     "The monotonic clock in seconds: `time.perf_counter`'s reading, read more cheaply."},
    {"now_ms", now_ms, METH_NOARGS, "The wall clock in milliseconds since the epoch: `time.time_ns() // 1_000_000`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_clock", "The clocks read on every request, read cheaply (src/kestrel/storage/clock.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__clock(void) { return PyModule_Create(&module); }
