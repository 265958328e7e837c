/* fdatasync of many descriptors at once, each on a thread of its own, without the interpreter lock.
 *
 * What a group-commit round needs (storage/group_commit.py): the file system joins concurrent
 * fsyncs into one commit, but Python threads each take the interpreter lock to start and to report
 * an fsync, and on a busy machine those hand-offs cost more than the fsyncs. Here the lock is
 * released once for the whole round. Optional: without a C compiler the round uses Python threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <unistd.h>

typedef struct {
    int fd;
    int error;   /* 0, or the errno of the failed fdatasync */
    int started; /* whether a thread runs it (else it ran in the caller) */
    pthread_t thread;
} job_t;

static void *run_job(void *arg) {
    job_t *job = (job_t *)arg;
    job->error = fdatasync(job->fd) == 0 ? 0 : errno;
    return NULL;
}

static PyObject *fsync_many(PyObject *self, PyObject *fds) {
    PyObject *seq = PySequence_Fast(fds, "fsync_many takes a list of file descriptors");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    job_t *jobs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(job_t));
    if (jobs == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if ((fd == -1 && PyErr_Occurred()) || fd < 0 || fd > INT_MAX) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "not a file descriptor: %ld", fd);
            }
            PyMem_Free(jobs);
            Py_DECREF(seq);
            return NULL;
        }
        jobs[i].fd = (int)fd;
    }
    Py_DECREF(seq);

    Py_BEGIN_ALLOW_THREADS
    pthread_attr_t attr;
    int have_attr = pthread_attr_init(&attr) == 0;
    if (have_attr) {
        pthread_attr_setstacksize(&attr, 64 * 1024);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pthread_create(&jobs[i].thread, have_attr ? &attr : NULL, run_job, &jobs[i]) == 0) {
            jobs[i].started = 1;
        } else {
            run_job(&jobs[i]); /* no thread to be had: this one here, in turn */
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (jobs[i].started) {
            pthread_join(jobs[i].thread, NULL);
        }
    }
    if (have_attr) {
        pthread_attr_destroy(&attr);
    }
    Py_END_ALLOW_THREADS

    PyObject *errors = PyList_New(n);
    for (Py_ssize_t i = 0; errors != NULL && i < n; i++) {
        PyObject *code = PyLong_FromLong(jobs[i].error);
        if (code == NULL) {
            Py_CLEAR(errors);
            break;
        }
        PyList_SET_ITEM(errors, i, code);
    }
    PyMem_Free(jobs);
    return errors;
}

static PyMethodDef methods[] = {
    {"fsync_many", fsync_many, METH_O,
     "fsync_many(fds) -> list of errno (0 for success): fdatasync every descriptor concurrently."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fsync_many", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fsync_many(void) { return PyModule_Create(&module); }
