/* Room at the end of a receive buffer, so that a receive lands where the request is parsed.
 *
 * Python's bytearray cannot grow without writing its new bytes (zeros, or a copy of something):
 * `lengthen` makes it longer by `room` bytes left as they are, for a `recv_into` to fill; the caller
 * then cuts it back to what came (`del buf[end:]`). Its Python twin is the copy it saves: a receive
 * into a scratch buffer appended to the bytearray (src/kestrel/service/socket_io.py, which serves
 * alone where the build had no C compiler).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *lengthen(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyByteArray_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "lengthen(buf: bytearray, room: int)");
        return NULL;
    }
    PyObject *buf = args[0];
    Py_ssize_t room = PyLong_AsSsize_t(args[1]);
    if (room == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t have = PyByteArray_GET_SIZE(buf);
    if (room < 0 || room > PY_SSIZE_T_MAX - have) {
        PyErr_Format(PyExc_ValueError, "cannot lengthen a buffer of %zd bytes by %zd", have, room);
        return NULL;
    }
    /* Resizing never writes the new bytes; it raises BufferError while a view of `buf` is held. */
    if (PyByteArray_Resize(buf, have + room) < 0) {
        return NULL;
    }
    return PyLong_FromSsize_t(have);
}

static PyMethodDef functions[] = {
    {"lengthen", (PyCFunction)(void (*)(void))lengthen, METH_FASTCALL,
     "Make a bytearray `room` bytes longer, the new bytes unwritten; return its old length."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.service._receive",
    "Receive buffers grown without writing (see src/kestrel/service/socket_io.py).", -1, functions,
};

PyMODINIT_FUNC PyInit__receive(void) {
    return PyModule_Create(&module);
}
