"""The C++ kernels behind the layer Ops, and the base class that compiles them with BLAS.

One support-code string serves every Op in this package: C++ templates over the element type
(``float`` for float32 graphs, ``double`` for the float64 gradient checks) that work on raw,
C-contiguous arrays. Each Op's ``c_code`` only unpacks its inputs and calls one entry point,
which validates shapes, allocates the output and sets a Python exception on failure.

Layer geometry (stride, padding, window, ...) travels as runtime ``ParamsType`` values, so one
compiled module serves every layer of a network: a cold start compiles each Op once per dtype
instead of once per layer.
"""

from __future__ import annotations

from typing import Any

from pytensor.link.c.params_type import ParamsType
from pytensor.scalar import float64, int64
from pytensor.tensor.blas import blas_header_text
from pytensor.tensor.blas_c import BaseBLAS

from theanompi.pytensor_env import blas_symbol_prefix

__all__ = ["KernelOp", "int_params", "float_params", "C_TYPES"]

#: PyTensor dtype -> (C++ element type, numpy type number)
C_TYPES = {"float32": ("npy_float32", "NPY_FLOAT32"), "float64": ("npy_float64", "NPY_FLOAT64")}

# Bump when the C++ below changes: PyTensor keys its compile cache on it.
_VERSION = 10

SUPPORT = r"""
#include <string.h>
#include <stdlib.h>
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads() { return 1; }
static inline int omp_get_thread_num() { return 0; }
#endif

extern "C" {
/* OpenBLAS's thread count (weak: absent from other BLAS libraries) */
void BLAS_PREFIXopenblas_set_num_threads(int) __attribute__((weak));
int BLAS_PREFIXopenblas_get_num_threads(void) __attribute__((weak));
}

namespace tmpi {

/* The kernels run without the GIL (TMPI_NOGIL below), so that a communication thread can start
   and finish exchanges while the step computes: they touch no Python object and report a
   failure as one of these codes, which raised() turns into the Python error afterwards. */
enum { NOMEM = -2, BAD_ARGMAX = -3 };

static int raised(int code) {
    if (code == NOMEM) PyErr_NoMemory();
    else if (code == BAD_ARGMAX)
        PyErr_SetString(PyExc_ValueError, "pool2d grad: argmax index outside the input plane");
    return code ? -1 : 0;
}

/* err = call, a kernel run with the GIL released; a failure code becomes the Python error */
#define TMPI_NOGIL(err, call)                                                                 \
    do {                                                                                      \
        PyThreadState* tmpi_ts_ = PyEval_SaveThread();                                        \
        err = (call);                                                                         \
        PyEval_RestoreThread(tmpi_ts_);                                                       \
        err = tmpi::raised(err);                                                              \
    } while (0)

/* While alive, OpenBLAS runs single-threaded: the caller parallelises over samples with
   OpenMP instead, so BLAS's own threads never compete with ours for the cores. */
struct SerialBlas {
    int saved = 0;
    explicit SerialBlas(bool on) {
        if (on && BLAS_PREFIXopenblas_get_num_threads && BLAS_PREFIXopenblas_set_num_threads) {
            saved = BLAS_PREFIXopenblas_get_num_threads();
            if (saved > 1) BLAS_PREFIXopenblas_set_num_threads(1);
        }
    }
    ~SerialBlas() { if (saved > 1) BLAS_PREFIXopenblas_set_num_threads(saved); }
};

/* Scratch memory of the calling thread, kept for the life of the process: freed and
   re-allocated every call, a buffer of megabytes would be a fresh mmap whose page faults
   (which the kernel serialises between threads) cost more than the work done in it. */
static void* scratch(int slot, size_t bytes) {
    static thread_local void* buf[4] = {NULL, NULL, NULL, NULL};
    static thread_local size_t cap[4] = {0, 0, 0, 0};
    if (cap[slot] < bytes) {
        free(buf[slot]);
        buf[slot] = malloc(bytes);
        cap[slot] = buf[slot] ? bytes : 0;
    }
    return buf[slot];
}
enum { COLS, ROWS, ACC, AUX };

static inline void gemm(char ta, char tb, int m, int n, int k, npy_float32 alpha,
                        const npy_float32* A, int lda, const npy_float32* B, int ldb,
                        npy_float32 beta, npy_float32* C, int ldc) {
    sgemm_(&ta, &tb, &m, &n, &k, &alpha, A, &lda, B, &ldb, &beta, C, &ldc);
}
static inline void gemm(char ta, char tb, int m, int n, int k, npy_float64 alpha,
                        const npy_float64* A, int lda, const npy_float64* B, int ldb,
                        npy_float64 beta, npy_float64* C, int ldc) {
    dgemm_(&ta, &tb, &m, &n, &k, &alpha, A, &lda, B, &ldb, &beta, C, &ldc);
}

/* A C-contiguous view of `a` as type `typenum` and `ndim` dims (new reference), else NULL
   with a Python exception naming `what`. */
static PyArrayObject* contiguous(PyArrayObject* a, int typenum, int ndim, const char* what) {
    if (PyArray_NDIM(a) != ndim || PyArray_TYPE(a) != typenum) {
        PyErr_Format(PyExc_ValueError, "%s must be a %d-d array of the graph's float type", what, ndim);
        return NULL;
    }
    return (PyArrayObject*)PyArray_FromAny((PyObject*)a, PyArray_DescrFromType(typenum), ndim, ndim,
                                           NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
}

/* Make *out a C-contiguous array of `shape`, reusing the previous output when it fits. */
static int prepare_output(PyArrayObject** out, int ndim, const npy_intp* shape, int typenum) {
    PyArrayObject* o = *out;
    if (o && PyArray_NDIM(o) == ndim && PyArray_TYPE(o) == typenum && PyArray_IS_C_CONTIGUOUS(o)) {
        bool same = true;
        for (int i = 0; i < ndim; ++i) same = same && PyArray_DIMS(o)[i] == shape[i];
        if (same) return 0;
    }
    Py_XDECREF(o);
    *out = (PyArrayObject*)PyArray_EMPTY(ndim, (npy_intp*)shape, typenum, 0);
    return *out ? 0 : -1;
}

/* ----------------------------------------------------------------- convolution (im2col + GEMM)
   The patch matrix of one sample has K = C*kh*kw rows, ordered (c, i, j), and P = Ho*Wo
   columns; samples of one chunk sit side by side (row stride ld = m*P). */

/* Output columns ox whose input column ox*s - p + j lies inside [0, n): [*lo, *hi). */
static inline void valid_range(int j, int s, int p, int n, int out, int* lo, int* hi) {
    int a = p - j, b = n - 1 + p - j;
    int l = a > 0 ? (a + s - 1) / s : 0;
    int h = b >= 0 ? b / s + 1 : 0;
    if (h > out) h = out;
    if (l > h) l = h;
    *lo = l; *hi = h;
}

template <typename T>
static void im2col(const T* x, int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw,
                   int Ho, int Wo, T* cols, npy_intp ld) {
    for (int c = 0; c < C; ++c) {
        for (int i = 0; i < kh; ++i) {
            for (int j = 0; j < kw; ++j) {
                const T* xc = x + (npy_intp)c * H * W;
                T* row = cols + ((npy_intp)(c * kh + i) * kw + j) * ld;
                int lo, hi;
                valid_range(j, sw, pw, W, Wo, &lo, &hi);
                for (int oy = 0; oy < Ho; ++oy) {
                    T* dst = row + (npy_intp)oy * Wo;
                    int iy = oy * sh - ph + i;
                    if (iy < 0 || iy >= H || lo >= hi) {
                        for (int ox = 0; ox < Wo; ++ox) dst[ox] = 0;
                        continue;
                    }
                    const T* src = xc + (npy_intp)iy * W + (j - pw);  /* src[ox*sw], ox in [lo, hi) */
                    for (int ox = 0; ox < lo; ++ox) dst[ox] = 0;
                    if (sw == 1) for (int ox = lo; ox < hi; ++ox) dst[ox] = src[ox];
                    else for (int ox = lo; ox < hi; ++ox) dst[ox] = src[(npy_intp)ox * sw];
                    for (int ox = hi; ox < Wo; ++ox) dst[ox] = 0;
                }
            }
        }
    }
}

/* The adjoint of im2col: add every patch entry back onto its input pixel (dx pre-zeroed). */
template <typename T>
static void col2im(const T* cols, npy_intp ld, int C, int H, int W, int kh, int kw, int sh, int sw,
                   int ph, int pw, int Ho, int Wo, T* dx) {
    for (int c = 0; c < C; ++c) {
        T* dc = dx + (npy_intp)c * H * W;
        for (int i = 0; i < kh; ++i) {
            for (int j = 0; j < kw; ++j) {
                const T* row = cols + ((npy_intp)(c * kh + i) * kw + j) * ld;
                int lo, hi;
                valid_range(j, sw, pw, W, Wo, &lo, &hi);
                for (int oy = 0; oy < Ho; ++oy) {
                    int iy = oy * sh - ph + i;
                    if (iy < 0 || iy >= H) continue;
                    const T* src = row + (npy_intp)oy * Wo;
                    T* dst = dc + (npy_intp)iy * W + (j - pw);
                    if (sw == 1) for (int ox = lo; ox < hi; ++ox) dst[ox] += src[ox];
                    else for (int ox = lo; ox < hi; ++ox) dst[(npy_intp)ox * sw] += src[ox];
                }
            }
        }
    }
}

struct ConvGeom {
    int B, C, H, W, F, kh, kw, sh, sw, ph, pw, G, Ho, Wo;
    npy_intp budget;  /* patch-matrix elements per chunk */
    int Fg() const { return F / G; }
    int Kg() const { return (C / G) * kh * kw; }
    npy_intp P() const { return (npy_intp)Ho * Wo; }
    npy_intp K() const { return (npy_intp)C * kh * kw; }
    /* 1x1, stride 1, no padding: a sample's (C, H*W) block already is its patch matrix */
    bool direct() const { return kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0; }
    /* samples per GEMM: enough to make the GEMM wide, few enough that the patches stay in cache */
    int chunk() const {
        if (direct()) return 1;
        npy_intp per = K() * P();
        npy_intp m = budget / (per > 0 ? per : 1);
        return (int)(m < 1 ? 1 : (m > B ? (B > 0 ? B : 1) : m));
    }
};

static int check_geom(ConvGeom& g) {
    if (g.G < 1 || g.sh < 1 || g.sw < 1 || g.ph < 0 || g.pw < 0 || g.budget < 1) {
        PyErr_Format(PyExc_ValueError, "conv2d: bad stride/pad/groups/chunk (%d,%d)/(%d,%d)/%d/%ld",
                     g.sh, g.sw, g.ph, g.pw, g.G, (long)g.budget);
        return -1;
    }
    if (g.C % g.G || g.F % g.G) {
        PyErr_Format(PyExc_ValueError, "conv2d: groups=%d must divide channels %d and filters %d",
                     g.G, g.C, g.F);
        return -1;
    }
    if (g.H + 2 * g.ph < g.kh || g.W + 2 * g.pw < g.kw || g.kh < 1 || g.kw < 1) {
        PyErr_Format(PyExc_ValueError, "conv2d: kernel %dx%d does not fit the padded input %dx%d",
                     g.kh, g.kw, g.H + 2 * g.ph, g.W + 2 * g.pw);
        return -1;
    }
    g.Ho = (g.H + 2 * g.ph - g.kh) / g.sh + 1;
    g.Wo = (g.W + 2 * g.pw - g.kw) / g.sw + 1;
    return 0;
}

/* The patch matrix (K, m*P) of samples n0..n0+m-1: `cols`, or the input itself when direct. */
template <typename T>
static const T* patches(const ConvGeom& g, const T* x, int n0, int m, T* cols) {
    const npy_intp in = (npy_intp)g.C * g.H * g.W, P = g.P();
    if (g.direct()) return x + n0 * in;
    for (int l = 0; l < m; ++l)
        im2col(x + (n0 + l) * in, g.C, g.H, g.W, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.Ho, g.Wo,
               cols + l * P, (npy_intp)m * P);
    return cols;
}

/* (m, F, P) block of a batch array -> (F, m*P), the layout of a chunk's GEMMs */
template <typename T>
static void to_rows(const T* batch, int m, int F, npy_intp P, T* rows) {
    for (int f = 0; f < F; ++f)
        for (int l = 0; l < m; ++l)
            memcpy(rows + (npy_intp)f * m * P + l * P, batch + ((npy_intp)l * F + f) * P, sizeof(T) * P);
}

/* Run body(n0, m, cols, rows, thread) over the batch in chunks of samples.

   With several OpenMP threads and at least as many samples, the chunks are dealt to the
   threads (each with its own scratch, BLAS single-threaded): batch parallelism, as Caffe's
   and PyTorch's CPU convolutions do. Otherwise the chunks run in order and each GEMM uses
   BLAS's threads. Chunks hold about g.budget patch elements, at most B / threads samples. */
template <typename T, typename Body>
static int each_chunk(const ConvGeom& g, bool need_rows, Body body) {
    const int threads = omp_get_max_threads();
    const bool parallel = threads > 1 && g.B >= threads;
    int nb = g.chunk();
    if (parallel) { const int fair = (g.B + threads - 1) / threads; nb = nb < fair ? nb : fair; }
    const int nchunks = (g.B + nb - 1) / nb;
    const npy_intp cols_n = g.direct() ? 0 : g.K() * nb * g.P();
    const npy_intp rows_n = need_rows && nb > 1 ? (npy_intp)g.F * nb * g.P() : 0;
    int failed = 0;
    SerialBlas serial(parallel);
    #pragma omp parallel if (parallel) reduction(|: failed)
    {
        T* cols = cols_n ? (T*)scratch(COLS, sizeof(T) * cols_n) : NULL;
        T* rows = rows_n ? (T*)scratch(ROWS, sizeof(T) * rows_n) : NULL;
        const bool ok = (!cols_n || cols) && (!rows_n || rows);
        failed = !ok;
        #pragma omp for schedule(static)
        for (int c = 0; c < nchunks; ++c) {
            if (!ok) continue;
            const int n0 = c * nb, m = nb < g.B - n0 ? nb : g.B - n0;
            body(n0, m, cols, rows, omp_get_thread_num());
        }
    }
    if (failed) return NOMEM;
    return 0;
}

/* out (B, F, Ho, Wo) = conv(x (B, C, H, W), w (F, C/G, kh, kw)) + b (F,) (b may be NULL),
   then v * (v > 0) when relu (the rectifier applied while the rows are in cache) */
template <typename T>
static int conv_forward(const ConvGeom& g, const T* x, const T* w, const T* b, T* out, bool relu) {
    const npy_intp P = g.P();
    const int Fg = g.Fg(), Kg = g.Kg();
    return each_chunk<T>(g, true, [&](int n0, int m, T* cols, T* rows, int) {
        const npy_intp NP = m * P;
        const T* src = patches(g, x, n0, m, cols);
        T* dst = m == 1 ? out + (npy_intp)n0 * g.F * P : rows;
        for (int k = 0; k < g.G; ++k)
            gemm('N', 'N', (int)NP, Fg, Kg, (T)1, src + (npy_intp)k * Kg * NP, (int)NP,
                 w + (npy_intp)k * Fg * Kg, Kg, (T)0, dst + (npy_intp)k * Fg * NP, (int)NP);
        /* back to (m, F, P), adding the bias (and rectifying) while the rows are in cache */
        for (int f = 0; f < g.F; ++f) {
            const T bias = b ? b[f] : (T)0;
            for (int l = 0; l < m; ++l) {
                T* o = out + ((npy_intp)(n0 + l) * g.F + f) * P;
                const T* r = m == 1 ? o : rows + (npy_intp)f * NP + l * P;
                if (relu) {
                    for (npy_intp p = 0; p < P; ++p) {
                        const T v = r[p] + bias;
                        o[p] = v * (T)(v > (T)0);  /* as ReLU's x * (x > 0): NaN stays NaN */
                    }
                } else {
                    for (npy_intp p = 0; p < P; ++p) o[p] = r[p] + bias;
                }
            }
        }
    });
}

/* dw (F, C/G, kh, kw) and db (F,) of sum((conv(x, w) + b) * gz) */
template <typename T>
static int conv_grad_weights(const ConvGeom& g, const T* x, const T* gz, T* dw, T* db) {
    const npy_intp P = g.P(), DW = (npy_intp)g.F * g.Kg();
    const int Fg = g.Fg(), Kg = g.Kg(), threads = omp_get_max_threads();
    #pragma omp parallel for schedule(static)
    for (int f = 0; f < g.F; ++f) {
        double acc = 0;
        for (int n = 0; n < g.B; ++n) {
            const T* r = gz + ((npy_intp)n * g.F + f) * P;
            T part = 0;
            for (npy_intp p = 0; p < P; ++p) part += r[p];
            acc += part;
        }
        db[f] = (T)acc;
    }
    /* one accumulator per thread, summed in thread order: the same bits for the same threads */
    T* acc = (T*)scratch(ACC, sizeof(T) * DW * threads);
    if (!acc) return NOMEM;
    memset(acc, 0, sizeof(T) * DW * threads);
    const int err = each_chunk<T>(g, true, [&](int n0, int m, T* cols, T* rows, int t) {
        const npy_intp NP = m * P;
        const T* src = patches(g, x, n0, m, cols);
        const T* gsrc = gz + (npy_intp)n0 * g.F * P;
        if (m > 1) { to_rows(gsrc, m, g.F, P, rows); gsrc = rows; }
        for (int k = 0; k < g.G; ++k)
            gemm('T', 'N', Kg, Fg, (int)NP, (T)1, src + (npy_intp)k * Kg * NP, (int)NP,
                 gsrc + (npy_intp)k * Fg * NP, (int)NP, (T)1, acc + t * DW + (npy_intp)k * Fg * Kg, Kg);
    });
    if (!err) {
        memcpy(dw, acc, sizeof(T) * DW);
        for (int t = 1; t < threads; ++t)
            for (npy_intp i = 0; i < DW; ++i) dw[i] += acc[t * DW + i];
    }
    return err;
}

/* dx (B, C, H, W) of sum(conv(x, w) * gz) */
template <typename T>
static int conv_grad_inputs(const ConvGeom& g, const T* w, const T* gz, T* dx) {
    const npy_intp P = g.P(), in = (npy_intp)g.C * g.H * g.W;
    const int Fg = g.Fg(), Kg = g.Kg();
    return each_chunk<T>(g, true, [&](int n0, int m, T* cols, T* rows, int) {
        const npy_intp NP = m * P;
        const T* gsrc = gz + (npy_intp)n0 * g.F * P;
        if (m > 1) { to_rows(gsrc, m, g.F, P, rows); gsrc = rows; }
        T* dst = g.direct() ? dx + n0 * in : cols;
        for (int k = 0; k < g.G; ++k)
            gemm('N', 'T', (int)NP, Kg, Fg, (T)1, gsrc + (npy_intp)k * Fg * NP, (int)NP,
                 w + (npy_intp)k * Fg * Kg, Kg, (T)0, dst + (npy_intp)k * Kg * NP, (int)NP);
        if (!g.direct()) {
            memset(dx + n0 * in, 0, sizeof(T) * m * in);
            for (int l = 0; l < m; ++l)
                col2im(cols + l * P, NP, g.C, g.H, g.W, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.Ho,
                       g.Wo, dx + (n0 + l) * in);
        }
    });
}

/* ----------------------------------------------------------------------------------- pooling
   Window (oy, ox) covers rows [oy*sh - ph, +kh) and columns [ox*sw - pw, +kw), clipped to the
   input: padding never wins a max and never counts in a mean. */

static inline npy_intp floordiv(npy_intp a, npy_intp b) { return a >= 0 ? a / b : -((b - a - 1) / b); }

/* Output side of a pooling window (the C twin of ops.pool.pool_output_size) */
static inline int pool_out(npy_intp n, int k, int s, int p, int ceil_mode) {
    const npy_intp span = n + 2 * p - k;
    npy_intp out = (ceil_mode ? -floordiv(-span, s) : floordiv(span, s)) + 1;
    if (ceil_mode && (out - 1) * s >= n + p) out -= 1;  /* the last window starts inside */
    return (int)out;
}

struct PoolGeom {
    int planes, H, W, kh, kw, sh, sw, ph, pw, Ho, Wo;
};

static int check_pool(const PoolGeom& g) {
    if (g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1 || g.ph < 0 || g.pw < 0 || g.ph >= g.kh ||
        g.pw >= g.kw || g.Ho < 1 || g.Wo < 1 ||
        (npy_intp)(g.Ho - 1) * g.sh - g.ph >= g.H || (npy_intp)(g.Wo - 1) * g.sw - g.pw >= g.W) {
        PyErr_Format(PyExc_ValueError,
                     "pool2d: window %dx%d stride %dx%d pad %dx%d output %dx%d does not fit a "
                     "%dx%d input", g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.Ho, g.Wo, g.H, g.W);
        return -1;
    }
    return 0;
}

static inline void window(int o, int s, int p, int k, int n, int* lo, int* hi) {
    int a = o * s - p, b = a + k;
    *lo = a > 0 ? a : 0;
    *hi = b < n ? b : n;
}

/* f(o, y0, y1, x0, x1) for each output o of a plane, row-major, with its clipped window */
template <typename F>
static inline void for_each_window(const PoolGeom& g, F f) {
    for (int oy = 0; oy < g.Ho; ++oy) {
        int y0, y1;
        window(oy, g.sh, g.ph, g.kh, g.H, &y0, &y1);
        for (int ox = 0; ox < g.Wo; ++ox) {
            int x0, x1;
            window(ox, g.sw, g.pw, g.kw, g.W, &x0, &x1);
            f((npy_intp)oy * g.Wo + ox, y0, y1, x0, x1);
        }
    }
}

/* out = the max (is_max) or mean of each window; for max, idx (may be NULL) = the offset in
   the plane of the window's first maximum (row-major), which the gradient scatters to. */
template <typename T>
static void pool_forward(const PoolGeom& g, bool is_max, const T* x, T* out, npy_int32* idx) {
    const npy_intp HW = (npy_intp)g.H * g.W, O = (npy_intp)g.Ho * g.Wo;
    #pragma omp parallel for schedule(static)
    for (npy_intp q = 0; q < g.planes; ++q) {
        const T* xp = x + q * HW;
        T* op = out + q * O;
        npy_int32* ip = idx ? idx + q * O : NULL;
        for_each_window(g, [&](npy_intp o, int y0, int y1, int x0, int x1) {
            if (is_max) {
                npy_intp best = (npy_intp)y0 * g.W + x0;
                T m = xp[best];
                for (int y = y0; y < y1; ++y) {
                    const T* r = xp + (npy_intp)y * g.W;
                    for (int xx = x0; xx < x1; ++xx)
                        if (r[xx] > m) { m = r[xx]; best = (npy_intp)y * g.W + xx; }
                }
                op[o] = m;
                if (ip) ip[o] = (npy_int32)best;
            } else {
                T acc = 0;
                for (int y = y0; y < y1; ++y) {
                    const T* r = xp + (npy_intp)y * g.W;
                    for (int xx = x0; xx < x1; ++xx) acc += r[xx];
                }
                op[o] = acc / (T)((y1 - y0) * (x1 - x0));
            }
        });
    }
}

/* dx of sum(pool(x) * gz): max sends each gz to idx (its window's first maximum, as in Caffe
   and PyTorch), mean shares it over the window */
template <typename T>
static int pool_backward(const PoolGeom& g, bool is_max, const npy_int32* idx, const T* gz, T* dx) {
    const npy_intp HW = (npy_intp)g.H * g.W, O = (npy_intp)g.Ho * g.Wo;
    int bad = 0;
    #pragma omp parallel for schedule(static) reduction(|: bad)
    for (npy_intp q = 0; q < g.planes; ++q) {
        const T* gp = gz + q * O;
        T* dp = dx + q * HW;
        memset(dp, 0, sizeof(T) * HW);
        if (is_max) {
            const npy_int32* ip = idx + q * O;
            for (npy_intp o = 0; o < O; ++o) {
                if (ip[o] < 0 || ip[o] >= HW) { bad = 1; continue; }
                dp[ip[o]] += gp[o];
            }
            continue;
        }
        for_each_window(g, [&](npy_intp o, int y0, int y1, int x0, int x1) {
            const T share = gp[o] / (T)((y1 - y0) * (x1 - x0));
            for (int y = y0; y < y1; ++y)
                for (int xx = x0; xx < x1; ++xx) dp[(npy_intp)y * g.W + xx] += share;
        });
    }
    if (bad) return BAD_ARGMAX;
    return 0;
}

/* --------------------------------------------------------------------------------------- LRN
   scale_c = k + alpha/n * sum_{|c'-c| <= n/2} x_c'^2,   y_c = x_c * scale_c^-beta  */

template <typename T>
static void lrn_scale(const T* x, int C, npy_intp P, int n, T k, T alpha, T* scale) {
    const int half = n / 2;
    const T a = alpha / (T)n;
    for (int c = 0; c < C; ++c) {
        T* s = scale + (npy_intp)c * P;
        for (npy_intp p = 0; p < P; ++p) s[p] = 0;
        const int lo = c - half > 0 ? c - half : 0, hi = c + half < C - 1 ? c + half : C - 1;
        for (int d = lo; d <= hi; ++d) {
            const T* xd = x + (npy_intp)d * P;
            for (npy_intp p = 0; p < P; ++p) s[p] += xd[p] * xd[p];
        }
        for (npy_intp p = 0; p < P; ++p) s[p] = k + a * s[p];
    }
}

template <typename T>
static int lrn_forward(int B, int C, npy_intp P, int n, T k, T alpha, T beta, const T* x, T* y) {
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        T* scale = (T*)scratch(COLS, sizeof(T) * C * P);
        failed = !scale;
        #pragma omp for schedule(static)
        for (int b = 0; b < B; ++b) {
            if (failed) continue;
            const T* xb = x + (npy_intp)b * C * P;
            T* yb = y + (npy_intp)b * C * P;
            lrn_scale(xb, C, P, n, k, alpha, scale);
            for (npy_intp i = 0; i < (npy_intp)C * P; ++i) yb[i] = xb[i] * pow(scale[i], -beta);
        }
    }
    if (failed) return NOMEM;
    return 0;
}

/* dx_c = gy_c scale_c^-beta - (2 alpha beta / n) x_c sum_{|c'-c| <= n/2} gy_c' x_c' scale_c'^(-beta-1) */
template <typename T>
static int lrn_backward(int B, int C, npy_intp P, int n, T k, T alpha, T beta, const T* x,
                        const T* gy, T* dx) {
    const int half = n / 2;
    const T coef = (T)2 * alpha * beta / (T)n;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        T* scale = (T*)scratch(COLS, sizeof(T) * C * P);
        T* t = (T*)scratch(AUX, sizeof(T) * C * P);
        failed = !scale || !t;
        #pragma omp for schedule(static)
        for (int b = 0; b < B; ++b) {
            if (failed) continue;
            const npy_intp off = (npy_intp)b * C * P;
            const T *xb = x + off, *gb = gy + off;
            T* db = dx + off;
            lrn_scale(xb, C, P, n, k, alpha, scale);
            for (npy_intp i = 0; i < (npy_intp)C * P; ++i) {
                const T sb = pow(scale[i], -beta);
                db[i] = gb[i] * sb;
                t[i] = gb[i] * xb[i] * sb / scale[i];
            }
            for (int c = 0; c < C; ++c) {
                const int lo = c - half > 0 ? c - half : 0, hi = c + half < C - 1 ? c + half : C - 1;
                T* dc = db + (npy_intp)c * P;
                const T* xc = xb + (npy_intp)c * P;
                for (int d = lo; d <= hi; ++d) {
                    const T* td = t + (npy_intp)d * P;
                    for (npy_intp p = 0; p < P; ++p) dc[p] -= coef * xc[p] * td[p];
                }
            }
        }
    }
    if (failed) return NOMEM;
    return 0;
}

}  // namespace tmpi
"""


def int_params(*names: str) -> ParamsType:
    """A ``ParamsType`` of int64 fields with these names (read in C as ``params->name``)."""
    return ParamsType(**{n: int64 for n in names})


def float_params(**kinds: str) -> ParamsType:
    """A ``ParamsType`` from ``name="int"|"float"`` pairs."""
    return ParamsType(**{n: (int64 if k == "int" else float64) for n, k in kinds.items()})


class KernelOp(BaseBLAS):
    """Base of the layer Ops: BLAS flags and headers from PyTensor, plus :data:`SUPPORT`.

    Subclasses declare ``__props__`` (which double as ``params_type`` fields) and write a
    ``c_code`` that calls one ``tmpi::`` entry point; :meth:`c_types` gives the element type.
    """

    def c_support_code(self, **kwargs: Any) -> str:
        return blas_header_text() + SUPPORT.replace("BLAS_PREFIX", blas_symbol_prefix())

    def c_compile_args(self, **kwargs: Any) -> list[str]:
        # OpenMP spreads the samples (convolution chunks, pooling planes, LRN) over the
        # OMP_NUM_THREADS threads that theanompi.pytensor_env sets (cores / local ranks)
        return [*super().c_compile_args(**kwargs), "-fopenmp"]

    def c_code_cache_version(self) -> tuple[int, ...]:
        from pytensor.tensor.blas_headers import blas_header_version

        return (_VERSION, *blas_header_version())

    @staticmethod
    def c_types(dtype: str) -> tuple[str, str]:
        """(C++ element type, numpy type number) for a float32/float64 node."""
        if dtype not in C_TYPES:
            raise TypeError(f"layer ops support float32 and float64, got {dtype}")
        return C_TYPES[dtype]
