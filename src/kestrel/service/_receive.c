/* A connection's socket system calls, and room at the end of a receive buffer.
 *
 * `receive` and `send` are the system calls a request/response connection makes for each request,
 * made straight on the descriptor: the socket module's methods parse their arguments by keyword,
 * build an argument tuple and, when nothing is there, raise BlockingIOError, at each call. Here a
 * socket with nothing to receive answers -1 and one with no room to send 0. Their Python twins
 * (src/kestrel/service/socket_io.py) serve where the build had no C compiler, with the same answers.
 *
 * Python's bytearray cannot grow without writing its new bytes (zeros, or a copy of something):
 * `receive_in_place` makes room for `room` bytes at its end, left as they are, receives into it and
 * keeps what came, the block as it is. Its Python twin is the copy it saves: a receive into a
 * scratch buffer appended to the bytearray (`receive`, and src/kestrel/service/socket_io.py, which
 * serves alone where the build had no C compiler).
 *
 * `drop_answered` takes the bytes of the requests answered off the front of a receive buffer. Python's
 * `del buf[:end]` that empties it also gives back its block (a bytearray cut below half its block is
 * reallocated to fit), which the next receive then grows again: a free and two allocations a request.
 * Emptied, a buffer whose block is at most `KEEP_BLOCK` bytes keeps it (a small request's, or a
 * receive in place's least room); a larger one (a large request's) is let go as before, as is any
 * buffer with a request's bytes left after `end`; and both receives land in the block it kept
 * wherever it has room (`make_room`), smaller requests among larger.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <sys/socket.h>

#include "system_calls.h"

/* What a receive lands in before it is appended: the most any connection asks for (`MAX_CHUNK`).
 * The GIL is held from the receive to the copy, so one buffer serves every thread. */
#define MAX_CHUNK (256 * 1024)
static char scratch[MAX_CHUNK];

/* Set the length of a bytearray, within its block and with no view of it held, as its own resize
 * would leave it: its bytes always end with a NUL. */
static void set_length(PyByteArrayObject *buf, Py_ssize_t length) {
    Py_SET_SIZE(buf, length);
    buf->ob_start[length] = '\0';
}

/* Make `buf` able to hold `length` bytes: within its block as it is, where the block has the room
 * and no view of it is held (a resize to under half its block would give the block back: a get's
 * request after a put's, a reallocation to shrink, then one to grow, each request); else resized,
 * which never writes the new bytes and raises BufferError while a view is held. 0, or -1 with the
 * error set; its length is the caller's to set (`set_length`). */
static int make_room(PyByteArrayObject *buf, Py_ssize_t length) {
    if (buf->ob_exports == 0 && (buf->ob_start - buf->ob_bytes) + length < buf->ob_alloc) {
        return 0;
    }
    return PyByteArray_Resize((PyObject *)buf, length);
}

/* Up to `room` bytes from socket `fd` into `into`: how many (0: the end of the stream), -1 when
 * nothing is there yet, or -2 with the error set (OSError, or what a signal's handler raised). */
static ssize_t received(int fd, char *into, size_t room) {
    ssize_t n;
    while ((n = recv(fd, into, room, 0)) < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return -1;
        }
        if (!again()) {
            return -2;
        }
    }
    return n;
}

/* Both receives' arguments, (fd, buf, count): a descriptor, a bytearray and an int, read into the
 * three; 0, or -1 with the error set (TypeError naming `usage` for a wrong count or buffer). */
static int receive_arguments(PyObject *const *args, Py_ssize_t nargs, const char *usage, int *fd,
                             PyByteArrayObject **buf, Py_ssize_t *count) {
    if (nargs != 3 || !PyByteArray_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (descriptor(args[0], fd) < 0) {
        return -1;
    }
    *buf = (PyByteArrayObject *)args[1];
    *count = PyLong_AsSsize_t(args[2]);
    return *count == -1 && PyErr_Occurred() ? -1 : 0;
}

/* receive(fd, buf, chunk) -> int: up to `chunk` bytes from the socket appended to the bytearray
 * `buf`; how many (0: the end of the stream), or -1 when nothing is there yet. Raises OSError. */
static PyObject *receive(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int fd;
    PyByteArrayObject *buf;
    Py_ssize_t chunk;
    if (receive_arguments(args, nargs, "receive(fd: int, buf: bytearray, chunk: int)", &fd, &buf,
                          &chunk) < 0) {
        return NULL;
    }
    if (chunk <= 0 || chunk > MAX_CHUNK) {
        PyErr_Format(PyExc_ValueError, "receive chunk %zd is not within 1..%d", chunk, MAX_CHUNK);
        return NULL;
    }
    ssize_t n = received(fd, scratch, (size_t)chunk);
    if (n < 0) {
        return n == -1 ? PyLong_FromLong(-1) : NULL;
    }
    Py_ssize_t have = Py_SIZE(buf);
    if (n > 0) {
        if (make_room(buf, have + n) < 0) {
            return NULL;  /* the bytes are lost with the connection, which this error ends */
        }
        set_length(buf, have + n);
        memcpy(buf->ob_start + have, scratch, (size_t)n);
    }
    return PyLong_FromSsize_t(n);
}

/* send(fd, data) -> int: how many bytes of `data` the socket took (0: it had no room). Raises OSError.
 * A reply is bytes, read where it is; anything else (a memoryview of a reply's rest) through the
 * buffer protocol, whose filling and release cost about 70 instructions a call. */
static PyObject *send_some(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send(fd: int, data: bytes)");
        return NULL;
    }
    int fd;
    if (descriptor(args[0], &fd) < 0) {
        return NULL;
    }
    Py_buffer data;
    int viewed = !PyBytes_CheckExact(args[1]);
    if (viewed) {
        if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
            return NULL;
        }
    } else {
        data.buf = PyBytes_AS_STRING(args[1]);  /* bytes never move nor change while referenced */
        data.len = PyBytes_GET_SIZE(args[1]);
    }
    ssize_t n;
    PyObject *result = NULL;
    while ((n = send(fd, data.buf, (size_t)data.len, MSG_NOSIGNAL)) < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            n = 0;
            break;
        }
        if (!again()) {
            goto done;
        }
    }
    result = PyLong_FromSsize_t(n);
done:
    if (viewed) {
        PyBuffer_Release(&data);
    }
    return result;
}

/* receive_in_place(fd, buf, room) -> int: up to `room` bytes from the socket received straight into
 * room made at the end of the bytearray `buf`, which keeps what came (its block as it is, for the
 * next receive or for `drop_answered` to give back); how many (0: the end of the stream), or -1
 * when nothing is there yet. Raises OSError, and BufferError while a view of `buf` is held. */
static PyObject *receive_in_place(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int fd;
    PyByteArrayObject *buf;
    Py_ssize_t room;
    if (receive_arguments(args, nargs, "receive_in_place(fd: int, buf: bytearray, room: int)", &fd, &buf,
                          &room) < 0) {
        return NULL;
    }
    Py_ssize_t have = Py_SIZE(buf);
    if (room <= 0 || room > PY_SSIZE_T_MAX - have) {
        PyErr_Format(PyExc_ValueError, "cannot receive %zd bytes into a buffer of %zd", room, have);
        return NULL;
    }
    if (make_room(buf, have + room) < 0) {
        return NULL;
    }
    ssize_t n = received(fd, buf->ob_start + have, (size_t)room);
    set_length(buf, have + (n > 0 ? n : 0));  /* within the block */
    if (n < 0) {
        return n == -1 ? PyLong_FromLong(-1) : NULL;
    }
    return PyLong_FromSsize_t(n);
}

/* The largest block an emptied receive buffer keeps for the next request: a small request's, or the
 * least room of a receive in place and what it follows (`IN_PLACE_LEAST_ROOM`,
 * src/kestrel/service/socket_io.py), so that an idle connection holds at most this. */
#define KEEP_BLOCK (16 * 1024)

/* drop_answered(buf, end): `del buf[:end]`, keeping a small block when that empties `buf`. */
static PyObject *drop_answered(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyByteArray_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "drop_answered(buf: bytearray, end: int)");
        return NULL;
    }
    PyByteArrayObject *buf = (PyByteArrayObject *)args[0];
    Py_ssize_t end = PyLong_AsSsize_t(args[1]);
    if (end == -1 && PyErr_Occurred()) {
        return NULL;
    }
    /* Not while a view of it is held: then `del` raises BufferError, as it should. */
    if (end >= Py_SIZE(buf) && buf->ob_exports == 0 && buf->ob_alloc <= KEEP_BLOCK) {
        if (Py_SIZE(buf) > 0) {
            buf->ob_start = buf->ob_bytes;
            set_length(buf, 0);
        }
        Py_RETURN_NONE;
    }
    if (PySequence_DelSlice((PyObject *)buf, 0, end) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef functions[] = {
    {"receive", (PyCFunction)(void (*)(void))receive, METH_FASTCALL,
     "Append up to `chunk` bytes from socket `fd` to a bytearray; how many, -1 when none is there yet."},
    {"send", (PyCFunction)(void (*)(void))send_some, METH_FASTCALL,
     "Send what socket `fd` takes of `data` at once; how many bytes (0: no room)."},
    {"receive_in_place", (PyCFunction)(void (*)(void))receive_in_place, METH_FASTCALL,
     "Receive up to `room` bytes from socket `fd` straight onto the end of a bytearray; how many, -1 when none is there yet."},
    {"drop_answered", (PyCFunction)(void (*)(void))drop_answered, METH_FASTCALL,
     "`del buf[:end]`, a small block kept when that empties the bytearray."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.service._receive",
    "A connection's socket system calls, received into buffers grown without writing (see src/kestrel/service/socket_io.py).", -1, functions,
};

PyMODINIT_FUNC PyInit__receive(void) {
    return PyModule_Create(&module);
}
