/* What the C helpers' system calls share: the descriptor a call is made on, read from a Python int,
 * and what follows a call that failed. Each helper is an extension module of its own, so each
 * includes this header (setup.py: `include_dirs`); its functions are static, a copy in each. */
#ifndef KESTREL_SYSTEM_CALLS_H
#define KESTREL_SYSTEM_CALLS_H

#include <Python.h>

#include <errno.h>
#include <limits.h>

/* `fd` read from `obj` into `out`: 0, or -1 with the error set (as os.write's argument). A closed
 * socket's -1 passes, for its call to fail with EBADF. */
static inline int descriptor(PyObject *obj, int *out) {
    long fd = PyLong_AsLong(obj);
    if (fd == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (fd < INT_MIN || fd > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%ld is not a file descriptor", fd);
        return -1;
    }
    *out = (int)fd;
    return 0;
}

/* After a failed system call: 1 to make it again (interrupted, and the signals' handlers ran), or 0
 * with the error set (its errno's OSError, or what a handler raised), as PEP 475 has os.write. */
static inline int again(void) {
    if (errno != EINTR) {
        PyErr_SetFromErrno(PyExc_OSError);
        return 0;
    }
    return PyErr_CheckSignals() == 0;
}

#endif
