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
 * after a call's setup. Here a record's body is checksummed in one pass once it is copied: where
 * the CPU multiplies without carries (PCLMULQDQ), folding 16 bytes a step (the method of Intel's
 * "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ Instruction", its constants for
 * CRC-32/IEEE bit-reflected), the rest eight bytes a step by tables made at the module's import
 * (slicing-by-8); without it, long bodies to zlib, which is faster there than the tables. */
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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <emmintrin.h>
#include <wmmintrin.h>
#define CAN_FOLD 1
static int can_fold;

/* The running (inverted) CRC after the `n` bytes at `p`, `n` a multiple of 16, at least 16. */
__attribute__((target("pclmul,sse2"))) static uint32_t crc_fold(uint32_t crc, const unsigned char *p, size_t n) {
    const __m128i by_128 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0); /* x^(128+32), x^(128-32) mod P */
    const __m128i by_64 = _mm_set_epi64x(0, 0x0163cd6124);              /* x^64 mod P */
    const __m128i barrett = _mm_set_epi64x(0x01f7011641, 0x01db710641); /* floor(x^64 / P), P */
    const __m128i low32 = _mm_set_epi32(0, -1, 0, -1);
    __m128i x = _mm_xor_si128(_mm_loadu_si128((const __m128i *)p), _mm_cvtsi32_si128((int)crc));
    for (p += 16, n -= 16; n > 0; p += 16, n -= 16) {
        __m128i low = _mm_clmulepi64_si128(x, by_128, 0x00);
        __m128i high = _mm_clmulepi64_si128(x, by_128, 0x11);
        x = _mm_xor_si128(_mm_xor_si128(low, high), _mm_loadu_si128((const __m128i *)p));
    }
    /* 128 bits to 64, to 32 (Barrett's reduction) */
    x = _mm_xor_si128(_mm_srli_si128(x, 8), _mm_clmulepi64_si128(x, by_128, 0x10));
    x = _mm_xor_si128(_mm_srli_si128(x, 4), _mm_clmulepi64_si128(_mm_and_si128(x, low32), by_64, 0x00));
    __m128i t = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x, low32), barrett, 0x10), low32);
    x = _mm_xor_si128(x, _mm_clmulepi64_si128(t, barrett, 0x00));
    return (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(x, 4));
}
#endif

static uint32_t crc_own(uint32_t crc, const unsigned char *p, size_t n) {
    crc = ~crc;
#ifdef CAN_FOLD
    if (can_fold && n >= 16) {
        size_t whole = n & ~(size_t)15;
        crc = crc_fold(crc, p, whole);
        p += whole;
        n -= whole;
    }
#endif
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

static uint32_t crc_update(uint32_t crc, const unsigned char *p, Py_ssize_t n) {
#ifdef CAN_FOLD
    if (can_fold) {
        return crc_own(crc, p, (size_t)n);
    }
#endif
    if (n < SHORT_CRC_LIMIT) {
        return crc_own(crc, p, (size_t)n);
    }
    uLong z = crc;
    while (n > 0) { /* zlib takes an unsigned int a call */
        uInt chunk = n > (Py_ssize_t)UINT_MAX ? UINT_MAX : (uInt)n;
        z = crc32(z, p, chunk);
        p += chunk;
        n -= chunk;
    }
    return (uint32_t)z;
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

/* append_record(out, head, offset, data): `out` (a bytearray) gains
 * u32 body size | u32 CRC-32 of the body | head (the name field, u64 place) | u64 offset | `data`,
 * one piece or a list of parts, and True is returned; False, with nothing appended, where a piece
 * is not bytes. */
static PyObject *append_record(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "append_record(out, head, offset, data)");
        return NULL;
    }
    PyObject *out = args[0], *head_bytes = args[1], *data = args[3];
    if (!PyByteArray_CheckExact(out) || !PyBytes_CheckExact(head_bytes)) {
        PyErr_SetString(PyExc_TypeError, "append_record takes a bytearray and a record's head");
        return NULL;
    }
    int many = PyList_CheckExact(data); /* else one piece, which must be bytes as each part must */
    PyObject *const *pieces = many ? (PyObject *const *)((PyListObject *)data)->ob_item : &args[3];
    Py_ssize_t parts = many ? PyList_GET_SIZE(data) : 1;
    unsigned long long offset = PyLong_AsUnsignedLongLong(args[2]);
    if (offset == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t head_size = PyBytes_GET_SIZE(head_bytes);
    Py_ssize_t size = head_size + 8;
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *part = pieces[i];
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
    unsigned char *body = head + 8;
    unsigned char *p = body;
    memcpy(p, PyBytes_AS_STRING(head_bytes), (size_t)head_size);
    p += head_size;
    put_u64(p, (uint64_t)offset);
    p += 8;
    for (Py_ssize_t i = 0; i < parts; i++) {
        PyObject *part = pieces[i];
        Py_ssize_t n = PyBytes_GET_SIZE(part);
        memcpy(p, PyBytes_AS_STRING(part), (size_t)n);
        p += n;
    }
    put_u32(head, (uint32_t)size);
    put_u32(head + 4, crc_update(0, body, p - body));
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
#ifdef CAN_FOLD
    __builtin_cpu_init();
    can_fold = __builtin_cpu_supports("pclmul");
#endif
    return PyModule_Create(&module);
}
