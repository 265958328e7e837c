/* A journal append's system call, made with the interpreter's lock held while no worker thread
 * needs it.
 *
 * `os.write` gives the lock up around every write and takes it back after, so that other threads
 * run meanwhile: a mutex, a condition signalled and a mutex again each way, about 500 instructions
 * an append (callgrind, 2026-11-29: a journal append 2,255 with `os.write`, 1,758 with this). An
 * append's write lands in the page cache and is made on the event loop's thread, which waits for it
 * either way. While a call runs on a worker thread (the runtime's `run_blocking`: a pack, a
 * manifest's rewrite, a checkpoint), the write gives the lock up as `os.write` does: a loop that
 * never waits would otherwise keep it from the worker's Python until the interpreter made it let go
 * (its switch interval, 5 ms, a wait and a hand-over of the lock each time), which under batches of
 * 100 cost more futex calls and system time than the append saved. `write` answers as `os.write`
 * does (a count, or OSError with the errno), which stays its twin where the build had no C
 * compiler (src/kestrel/storage/disk.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <unistd.h>

/* Calls running on worker threads (`workers`), counted by the event loop's thread alone, under the
 * interpreter's lock. */
static Py_ssize_t working;

/* write(fd, data) -> int: how many bytes of `data` file `fd` took. Raises OSError. */
static PyObject *write_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write(fd: int, data: bytes)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < INT_MIN || fd > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "%ld is not a file descriptor", fd);
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    ssize_t n;
    for (;;) {
        if (working) {
            Py_BEGIN_ALLOW_THREADS
            n = write((int)fd, data.buf, (size_t)data.len);
            Py_END_ALLOW_THREADS
        } else {
            n = write((int)fd, data.buf, (size_t)data.len);
        }
        if (n >= 0) {
            break;
        }
        if (errno != EINTR) {
            PyBuffer_Release(&data);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        if (PyErr_CheckSignals() < 0) {
            PyBuffer_Release(&data);
            return NULL;
        }
    }
    PyBuffer_Release(&data);
    return PyLong_FromSsize_t(n);
}

/* workers(change) -> int: add `change` to the calls running on worker threads; how many run now. */
static PyObject *workers(PyObject *self, PyObject *change) {
    Py_ssize_t delta = PyLong_AsSsize_t(change);
    if (delta == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (working + delta < 0) {
        PyErr_Format(PyExc_ValueError, "%zd calls on worker threads would end where %zd run", -delta, working);
        return NULL;
    }
    working += delta;
    return PyLong_FromSsize_t(working);
}

static PyMethodDef functions[] = {
    {"write", (PyCFunction)(void (*)(void))write_held, METH_FASTCALL,
     "Write `data` to file `fd`, holding the interpreter's lock unless a worker thread runs; how many bytes it took."},
    {"workers", workers, METH_O,
     "Add `change` to the calls running on worker threads (while any runs, a write gives the lock up); how many run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.storage._disk",
    "A journal append's write with the interpreter's lock held (see src/kestrel/storage/disk.py).", -1,
    functions,
};

PyMODINIT_FUNC PyInit__disk(void) {
    return PyModule_Create(&module);
}
