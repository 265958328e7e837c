/* A commit log record appended to a turn's buffer in one call (the layout: the docstring of
 * src/kestrel/storage/commit_log.py). Every change under `sync_journal: always` encodes one, so
 * its fields are packed and its CRC-32 (zlib's, as the Python's `zlib.crc32`) taken here rather
 * than by a struct packer and a checksum call per field. `commit_log.append_record_python` is
 * the reference, which tests/storage/test_commit_log.py compares this with, and which serves
 * where the build had no C compiler or no zlib, and for what this declines (a part not bytes).
 *
 * Beside it, zlib's `crc32_combine`: the CRC-32 of two ranges joined, from theirs and the second's
 * length, with which the torn-tail rule checks a record's body from CRC-32s of the tail's prefixes
 * (`commit_log.RangeChecksums`); `commit_log.crc32_combine_python` is its reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <zlib.h>

/* zlib's crc32 takes short pieces (a record's 16 bytes of fields, a small item) a byte at a time
 * after a call's setup; this takes them eight bytes a step (slicing-by-8 over tables made at the
 * module's import), the same CRC-32/IEEE, and leaves longer ones, where zlib's own is faster, to it. */
#define SHORT_CRC_LIMIT 256
static uint32_t crc_tables[8][256];

static void crc_tables_make(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        crc_tables[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = crc_tables[0][n];
        for (int k = 1; k < 8; k++) {
            c = crc_tables[0][c & 0xFF] ^ (c >> 8);
            crc_tables[k][n] = c;
        }
    }
}

static uint32_t crc_short(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        w ^= crc;
        crc = crc_tables[7][w & 0xFF] ^ crc_tables[6][(w >> 8) & 0xFF] ^ crc_tables[5][(w >> 16) & 0xFF] ^
              crc_tables[4][(w >> 24) & 0xFF] ^ crc_tables[3][(w >> 32) & 0xFF] ^
              crc_tables[2][(w >> 40) & 0xFF] ^ crc_tables[1][(w >> 48) & 0xFF] ^ crc_tables[0][w >> 56];
    }
#endif
    for (; n > 0; p++, n--) {
        crc = crc_tables[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
    }
    return ~crc;
}

static uLong crc_update(uLong crc, const unsigned char *p, Py_ssize_t n) {
    if (n < SHORT_CRC_LIMIT) {
        return crc_short((uint32_t)crc, p, (size_t)n);
    }
    while (n > 0) { /* zlib takes an unsigned int a call */
        uInt chunk = n > (Py_ssize_t)UINT_MAX ? UINT_MAX : (uInt)n;
        crc = crc32(crc, p, chunk);
        p += chunk;
        n -= chunk;
    }
    return crc;
}

static void put_u32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

static void put_u64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (unsigned char)(v >> (8 * i));
    }
}

/* append_record(out, name, name_crc, place, offset, data): `out` (a bytearray) gains
 * u32 body size | u32 CRC-32 of the body | name | u64 place | u64 offset | the parts of `data`,
 * and True is returned; False, with nothing appended, where a part is not bytes. */
static PyObject *append_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "append_record(out, name, name_crc, place, offset, data)");
        return NULL;
    }
    PyObject *out = args[0], *name = args[1], *data = args[5];
    if (!PyByteArray_CheckExact(out) || !PyBytes_CheckExact(name) || !PyList_CheckExact(data)) {
        PyErr_SetString(PyExc_TypeError, "append_record takes a bytearray, a name's bytes and a list of parts");
        return NULL;
    }
    unsigned long name_crc = PyLong_AsUnsignedLong(args[2]);
    if (name_crc == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long long place = PyLong_AsUnsignedLongLong(args[3]);
    if (place == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[4]);
    if (offset == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (name_crc > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_OverflowError, "name_crc is not a CRC-32");
        return NULL;
    }
    Py_ssize_t parts = PyList_GET_SIZE(data);
    Py_ssize_t name_size = PyBytes_GET_SIZE(name);
    Py_ssize_t size = name_size + 16;
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *part = PyList_GET_ITEM(data, i);
        if (!PyBytes_Check(part)) {
            Py_RETURN_FALSE;
        }
        size += PyBytes_GET_SIZE(part);
    }
    if ((uint64_t)size > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "a commit log record's body is at most 4 GiB");
        return NULL;
    }
    Py_ssize_t at = PyByteArray_GET_SIZE(out);
    Py_ssize_t end = at + 8 + size;
    /* A turn's buffer grows a record at a time: past what it holds, twice as large (a bytearray
       grown by more than an eighth is reallocated to the exact size, a copy each record), then
       cut to `end` within that room, which costs nothing. */
    Py_ssize_t room = ((PyByteArrayObject *)out)->ob_alloc;
    if (end >= room && room <= PY_SSIZE_T_MAX / 2 && PyByteArray_Resize(out, end > 2 * room ? end : 2 * room) < 0) {
        return NULL;
    }
    if (PyByteArray_Resize(out, end) < 0) {
        return NULL;
    }
    unsigned char *head = (unsigned char *)PyByteArray_AS_STRING(out) + at;
    unsigned char *p = head + 8;
    memcpy(p, PyBytes_AS_STRING(name), (size_t)name_size);
    p += name_size;
    unsigned char *fields = p;
    put_u64(p, (uint64_t)place);
    put_u64(p + 8, (uint64_t)offset);
    p += 16;
    uLong crc = crc_short((uint32_t)name_crc, fields, 16);
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *part = PyList_GET_ITEM(data, i);
        Py_ssize_t n = PyBytes_GET_SIZE(part);
        memcpy(p, PyBytes_AS_STRING(part), (size_t)n);
        crc = crc_update(crc, p, n);
        p += n;
    }
    put_u32(head, (uint32_t)size);
    put_u32(head + 4, (uint32_t)crc);
    Py_RETURN_TRUE;
}

/* crc32_combine(crc1, crc2, length): the CRC-32 of A + B from A's, B's and B's length. */
static PyObject *combine(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "crc32_combine(crc1, crc2, length)");
        return NULL;
    }
    unsigned long crcs[2];
    for (int i = 0; i < 2; i++) {
        crcs[i] = PyLong_AsUnsignedLong(args[i]);
        if (crcs[i] == (unsigned long)-1 && PyErr_Occurred()) {
            return NULL;
        }
        if (crcs[i] > 0xFFFFFFFFul) {
            PyErr_SetString(PyExc_OverflowError, "not a CRC-32");
            return NULL;
        }
    }
    long long length = PyLong_AsLongLong(args[2]);
    if (length == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (length < 0 || (long long)(z_off_t)length != length) {
        PyErr_SetString(PyExc_ValueError, "crc32_combine: a length from 0 to z_off_t's largest");
        return NULL;
    }
    return PyLong_FromUnsignedLong(crc32_combine((uLong)crcs[0], (uLong)crcs[1], (z_off_t)length));
}

static PyMethodDef functions[] = {
    {"crc32_combine", (PyCFunction)(void (*)(void))combine, METH_FASTCALL,
     "The CRC-32 of two ranges joined (commit_log.crc32_combine_python)."},
    {"append_record", (PyCFunction)(void (*)(void))append_record, METH_FASTCALL,
     "Append a commit log record to a bytearray (commit_log.append_record_python)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.storage._log_record",
    "A commit log record's encoding and zlib's crc32_combine, compiled (see src/kestrel/storage/commit_log.py).",
    -1, functions,
};

PyMODINIT_FUNC PyInit__log_record(void) {
    crc_tables_make();
    return PyModule_Create(&module);
}
