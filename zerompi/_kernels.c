/* zerompi._kernels: the fused Adam/AdamW step, one pass over memory.
 *
 * The same IEEE operations, in the same order and in the array's own precision,
 * as the blocked numpy kernel in adam.py and the reference in reference.py: the
 * scalars are rounded to the element type first (as numpy does with a Python
 * float), and the build turns off floating-point contraction (-ffp-contract=off)
 * so that no multiply-add is fused. A world of one rank therefore still
 * reproduces the reference bit for bit; only the memory traffic changes: each
 * element of p, m, v is read and written once and g read once (28 bytes per
 * float32 element) instead of a dozen passes over a cache-sized block.
 *
 * The loop releases the GIL, so a progress thread can drive MPI meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* One portable binary that still uses the widest vectors the CPU has: GCC compiles
 * the loop for each target and picks one when the module loads. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

#define ADAM_LOOP(T, SQRT)                                                         \
    CLONES static void adam_##T(T *restrict p, const T *restrict g, T *restrict m,       \
                         T *restrict v, Py_ssize_t n, double lr_, double b1_,      \
                         double b2_, double eps_, double wd_, int decoupled,       \
                         double bc1_, double bc2_, double div_) {                  \
        const T lr = (T)lr_, b1 = (T)b1_, b2 = (T)b2_, eps = (T)eps_;              \
        const T omb1 = (T)(1.0 - b1_), omb2 = (T)(1.0 - b2_);                      \
        const T wd = (T)wd_, bc1 = (T)bc1_, bc2 = (T)bc2_, div = (T)div_;          \
        const int divide = div_ != 1.0, l2 = wd_ != 0.0 && !decoupled,             \
                  dec = wd_ != 0.0 && decoupled;                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                       \
            T gi = g[i];                                                           \
            const T pi = p[i];                                                     \
            if (divide) gi = gi / div;                                             \
            if (l2) gi = gi + pi * wd;                                             \
            const T mi = m[i] * b1 + gi * omb1;                                    \
            const T vi = v[i] * b2 + (gi * gi) * omb2;                             \
            T u = (mi / bc1) / (SQRT(vi / bc2) + eps);                             \
            if (dec) u = u + pi * wd;                                              \
            m[i] = mi;                                                             \
            v[i] = vi;                                                             \
            p[i] = pi - u * lr;                                                    \
        }                                                                          \
    }

ADAM_LOOP(float, sqrtf)
ADAM_LOOP(double, sqrt)

static int
get_vector(PyObject *obj, Py_buffer *view, int writable, const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %scontiguous float32/float64 array",
                     name, writable ? "writable " : "");
        return -1;
    }
    return 0;
}

static char
element_kind(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if ((f[0] == 'f' && view->itemsize == 4) || (f[0] == 'd' && view->itemsize == 8))
        return f[0];
    return 0;
}

PyDoc_STRVAR(adam_doc,
"adam(param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay,\n"
"     decoupled, bc1, bc2, divisor)\n\n"
"One Adam/AdamW step in place on four contiguous 1-D arrays of one dtype\n"
"(float32 or float64). grad is read only. bc1 and bc2 are the bias corrections\n"
"1 - beta**t; divisor averages a summed gradient.");

static PyObject *
adam(PyObject *self, PyObject *args)
{
    PyObject *objs[4];
    double lr, b1, b2, eps, wd, bc1, bc2, div;
    int decoupled;
    if (!PyArg_ParseTuple(args, "OOOOdddddpddd", &objs[0], &objs[1], &objs[2], &objs[3],
                          &lr, &b1, &b2, &eps, &wd, &decoupled, &bc1, &bc2, &div))
        return NULL;
    static const char *names[4] = {"param", "grad", "exp_avg", "exp_avg_sq"};
    Py_buffer views[4];
    int got = 0;
    PyObject *result = NULL;
    for (; got < 4; got++)
        if (get_vector(objs[got], &views[got], got != 1, names[got]) < 0) goto done;
    char kind = element_kind(&views[0]);
    if (!kind) {
        PyErr_Format(PyExc_TypeError, "param must be float32 or float64, got format '%s'",
                     views[0].format);
        goto done;
    }
    for (int i = 1; i < 4; i++) {
        if (element_kind(&views[i]) != kind) {
            PyErr_Format(PyExc_TypeError, "%s has format '%s', param '%s'", names[i],
                         views[i].format, views[0].format);
            goto done;
        }
        if (views[i].len != views[0].len) {
            PyErr_Format(PyExc_ValueError, "%s has %zd bytes, param %zd", names[i],
                         views[i].len, views[0].len);
            goto done;
        }
    }
    Py_ssize_t n = views[0].len / views[0].itemsize;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        adam_float(views[0].buf, views[1].buf, views[2].buf, views[3].buf, n, lr, b1, b2,
                   eps, wd, decoupled, bc1, bc2, div);
    else
        adam_double(views[0].buf, views[1].buf, views[2].buf, views[3].buf, n, lr, b1, b2,
                    eps, wd, decoupled, bc1, bc2, div);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    return result;
}

#define LANES 16
#define STATS_LOOP(T)                                                               \
    CLONES static void stats_##T(const T *restrict g, Py_ssize_t n,                  \
                                 Py_ssize_t *nonfinite, double *sumsq) {             \
        double acc[LANES] = {0.0}, total = 0.0;                                    \
        Py_ssize_t bad = 0, i = 0;                                                 \
        for (; i + LANES <= n; i += LANES)  /* LANES partial sums: vectorizable */ \
            for (int j = 0; j < LANES; j++) {                                      \
                const double x = (double)g[i + j];                                 \
                acc[j] += x * x;                                                   \
            }                                                                      \
        for (; i < n; i++) total += (double)g[i] * (double)g[i];                   \
        for (int j = 0; j < LANES; j++) total += acc[j];                           \
        if (!isfinite(total))                                                      \
            for (Py_ssize_t i = 0; i < n; i++) bad += !isfinite(g[i]);             \
        *nonfinite = bad;                                                          \
        *sumsq = total;                                                            \
    }

STATS_LOOP(float)
STATS_LOOP(double)

PyDoc_STRVAR(grad_stats_doc,
"grad_stats(grad) -> (nonfinite, sumsq)\n\n"
"Sum of squares of a contiguous float32/float64 array, accumulated in float64 in\n"
"one pass, and the number of non-finite elements (counted only when the sum is\n"
"not finite). A float64 array of finite values may overflow the sum: the caller\n"
"rescales then.");

static PyObject *
grad_stats(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    if (get_vector(arg, &view, 0, "grad") < 0) return NULL;
    char kind = element_kind(&view);
    if (!kind) {
        PyErr_Format(PyExc_TypeError, "grad must be float32 or float64, got format '%s'",
                     view.format);
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t n = view.len / view.itemsize, bad = 0;
    double total = 0.0;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        stats_float(view.buf, n, &bad, &total);
    else
        stats_double(view.buf, n, &bad, &total);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(nd)", bad, total);
}

static PyMethodDef methods[] = {
    {"adam", adam, METH_VARARGS, adam_doc},
    {"grad_stats", grad_stats, METH_O, grad_stats_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "zerompi._kernels",
    "Compiled kernels of zerompi (optional: adam.py falls back to numpy without them).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    return PyModule_Create(&module);
}
