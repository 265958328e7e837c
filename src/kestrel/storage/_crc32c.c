/* CRC32C (Castagnoli, reflected 0x82F63B78), the checksum of the queue manifest: slice-by-8 tables,
 * or the SSE 4.2 crc32 instruction where the processor has it. src/kestrel/storage/crc32c.py holds
 * the table-driven Python reference, which tests/storage/test_manifest.py compares this with, and
 * which serves where the build had no C compiler. The GIL is released for large buffers: start-up
 * and rotation checksum whole journal files.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CRC_HARDWARE 1
#endif

static uint32_t crc_table[8][256];
static int crc_hardware; /* the processor has the SSE 4.2 crc32 instruction */

static void crc_init(void) {
#ifdef CRC_HARDWARE
    __builtin_cpu_init();
    crc_hardware = __builtin_cpu_supports("sse4.2");
#endif
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++) {
        for (int t = 1; t < 8; t++) {
            crc_table[t][n] = (crc_table[t - 1][n] >> 8) ^ crc_table[0][crc_table[t - 1][n] & 0xFF];
        }
    }
}

static uint32_t crc_update(uint32_t crc, const unsigned char *p, Py_ssize_t n) {
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF]
              ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF]
              ^ crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n-- > 0) {
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    }
    return ~crc;
}

#ifdef CRC_HARDWARE
/* The SSE 4.2 crc32 instruction computes CRC32C itself, 8 bytes at a time (about ten times the
   table's speed); used when the processor has it (checked once, at import). */
__attribute__((target("sse4.2"))) static uint32_t crc_update_sse42(uint32_t crc, const unsigned char *p,
                                                                   Py_ssize_t n) {
    uint64_t c = ~crc;
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = __builtin_ia32_crc32di(c, word);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n-- > 0) {
        c32 = __builtin_ia32_crc32qi(c32, *p++);
    }
    return ~c32;
}
#endif


static PyObject *crc32c(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "crc32c(data, crc=0)");
        return NULL;
    }
    unsigned long start = 0;
    if (nargs == 2) {
        start = PyLong_AsUnsignedLong(args[1]);
        if (start == (unsigned long)-1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint32_t crc = (uint32_t)start;
    uint32_t (*update)(uint32_t, const unsigned char *, Py_ssize_t) = crc_update;
#ifdef CRC_HARDWARE
    if (crc_hardware) {
        update = crc_update_sse42;
    }
#endif
    if (view.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        crc = update(crc, view.buf, view.len);
        Py_END_ALLOW_THREADS
    } else {
        crc = update(crc, view.buf, view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(crc);
}

static PyMethodDef functions[] = {
    {"crc32c", (PyCFunction)(void (*)(void))crc32c, METH_FASTCALL, "CRC32C of a buffer, continuing from crc."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kestrel.storage._crc32c", "CRC32C, compiled (see src/kestrel/storage/crc32c.py).",
    -1, functions,
};

PyMODINIT_FUNC PyInit__crc32c(void) {
    crc_init();
    return PyModule_Create(&module);
}
