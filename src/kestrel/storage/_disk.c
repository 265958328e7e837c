/* A journal append's system calls, `write` and the gathering writes of `writev_all`, made with the
 * interpreter's lock held while no worker thread needs it.
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
 * does (a count, or OSError with the errno), and `writev_all` as `writev_all_python`, which stay
 * their twins where the build had no C compiler (src/kestrel/storage/disk.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#include "system_calls.h"

/* Calls running on worker threads (`workers`), counted by the event loop's thread alone, under the
 * interpreter's lock. */
static Py_ssize_t working;

/* The system call `call`, the lock given up around it while a call runs on a worker thread. */
#define HELD_UNLESS_WORKING(call) \
    do { \
        if (working) { \
            Py_BEGIN_ALLOW_THREADS \
            call; \
            Py_END_ALLOW_THREADS \
        } else { \
            call; \
        } \
    } while (0)

/* write(fd, data) -> int: how many bytes of `data` file `fd` took. Raises OSError. */
static PyObject *write_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "write(fd: int, data: bytes)");
        return NULL;
    }
    int fd;
    if (descriptor(args[0], &fd) < 0) {
        return NULL;
    }
    Py_buffer data;
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    ssize_t n;
    for (;;) {
        HELD_UNLESS_WORKING(n = write(fd, data.buf, (size_t)data.len));
        if (n >= 0 || !again()) {
            break;
        }
    }
    PyBuffer_Release(&data);
    return n < 0 ? NULL : PyLong_FromSsize_t(n);
}

/* Pieces a gathering write keeps on the stack; more are allocated. */
#define STACK_PIECES 16

/* writev_all(fd, pieces) -> int: every byte of `pieces`, in their order, written to file `fd` in
 * gathering writes of up to IOV_MAX pieces each, a short write gone on with from where it stopped
 * (a write that takes nothing is the disk full: ENOSPC); how many bytes. Raises OSError. */
static PyObject *writev_all_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "writev_all(fd: int, pieces: list[bytes])");
        return NULL;
    }
    int fd;
    if (descriptor(args[0], &fd) < 0) {
        return NULL;
    }
    PyObject *pieces = PySequence_Fast(args[1], "writev_all() arg 2 must be a sequence");
    if (pieces == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(pieces);
    Py_buffer stack_buffers[STACK_PIECES];
    struct iovec stack_vectors[STACK_PIECES];
    Py_buffer *buffers = stack_buffers;
    struct iovec *vectors = stack_vectors;
    if (count > STACK_PIECES) {
        buffers = PyMem_New(Py_buffer, count);
        vectors = PyMem_New(struct iovec, count);
        if (buffers == NULL || vectors == NULL) {
            PyMem_Free(buffers);
            PyMem_Free(vectors);
            Py_DECREF(pieces);
            return PyErr_NoMemory();
        }
    }
    PyObject *result = NULL;
    Py_ssize_t held = 0;  /* buffers taken, each released at the end */
    Py_ssize_t total = 0;
    for (; held < count; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(pieces, held), &buffers[held], PyBUF_SIMPLE) < 0) {
            goto done;
        }
        vectors[held].iov_base = buffers[held].buf;
        vectors[held].iov_len = (size_t)buffers[held].len;
        total += buffers[held].len;
    }
    Py_ssize_t at = 0;  /* the first piece not wholly written */
    for (;;) {
        while (at < count && vectors[at].iov_len == 0) {
            at++;
        }
        if (at == count) {
            break;
        }
        int batch = count - at < IOV_MAX ? (int)(count - at) : IOV_MAX;
        ssize_t n;
        HELD_UNLESS_WORKING(n = writev(fd, vectors + at, batch));
        if (n < 0) {
            if (again()) {
                continue;
            }
            goto done;
        }
        if (n == 0) {
            errno = ENOSPC;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        for (; n > 0; at++) {  /* past what was written; a piece written in part goes on from there */
            if ((size_t)n < vectors[at].iov_len) {
                vectors[at].iov_base = (char *)vectors[at].iov_base + n;
                vectors[at].iov_len -= (size_t)n;
                break;
            }
            n -= (ssize_t)vectors[at].iov_len;
        }
    }
    result = PyLong_FromSsize_t(total);
done:
    while (held > 0) {
        PyBuffer_Release(&buffers[--held]);
    }
    if (count > STACK_PIECES) {
        PyMem_Free(buffers);
        PyMem_Free(vectors);
    }
    Py_DECREF(pieces);
    return result;
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
    {"writev_all", (PyCFunction)(void (*)(void))writev_all_held, METH_FASTCALL,
     "Write every byte of `pieces` in order to file `fd` in gathering writes, holding the interpreter's lock unless "
     "a worker thread runs; how many bytes."},
    {"workers", workers, METH_O,
     "Add `change` to the calls running on worker threads (while any runs, a write gives the lock up); how many run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.storage._disk",
    "A journal append's writes with the interpreter's lock held (see src/kestrel/storage/disk.py).", -1,
    functions,
};

PyMODINIT_FUNC PyInit__disk(void) {
    return PyModule_Create(&module);
}
