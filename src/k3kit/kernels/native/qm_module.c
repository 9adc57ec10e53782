/* qm_module.c: the CPython module k3kit.kernels._qmatmul (signatures: ../_qmatmul.pyi). Argument
 * parsing and checks, buffers and threads for the one-matrix entries (matmul, matmul_q8,
 * quantize_q8, dequantize), init_tables, the queries, the method table and PyInit__qmatmul. The
 * entries that run many matrices per call are in qm_module_multi.c; the kernels they call are
 * chosen in qm_dispatch.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "qm.h"
#include "qm_i8.h"
#include "qm_module.h"

typedef struct {
    kernel_fn fn;
    const uint8_t *w;
    const float *x;
    float *y;
    float *scratch;       /* SCRATCH_FLOATS per thread, or NULL */
    int64_t n0, n1, n_out, k, m;
} job_t;

/* Split the output columns over `threads` OpenMP threads (split_threads' count). Built against
 * libgomp, this resolves to the libgomp torch has already loaded (same soname), so the split runs
 * on torch's own worker threads: no second pool competing for the cores with torch's spinning
 * one. Each column is computed by one thread with the same arithmetic, so the split does not
 * change results. */
static void run_split(job_t base, int threads) {
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) {
            const int64_t n0 = base.n_out * t / threads, n1 = base.n_out * (t + 1) / threads;
            base.fn(base.w, n0, n1, base.n_out, base.k, base.x, base.m, base.y,
                    base.scratch ? base.scratch + (int64_t)t * SCRATCH_FLOATS : NULL);
        }
        return;
    }
#endif
    (void)threads;
    base.fn(base.w, 0, base.n_out, base.n_out, base.k, base.x, base.m, base.y, base.scratch);
}

/* A float32 array argument: a buffer, or an int, the address of `floats` floats that the caller
 * vouches for (Python callers that have just made the tensors and checked their shapes: a decode
 * step's products skip building a buffer object for each). An address gets a buffer without an
 * owner (its release is a no-op) whose length is the expected one, so the size checks below pass. */
static int float_arg(PyObject *o, Py_buffer *b, int writable, Py_ssize_t floats) {
    if (PyLong_Check(o)) {
        void *p = PyLong_AsVoidPtr(o);
        if (p == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a null address for a float32 array");
            return -1;
        }
        memset(b, 0, sizeof *b);
        b->buf = p;
        b->len = floats < 0 ? 0 : floats * (Py_ssize_t)sizeof(float);
        b->readonly = !writable;
        return 0;
    }
    return PyObject_GetBuffer(o, b, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE);
}

/* matmul(qtype, w, x, y, n_out, k, m, simd=-1, threads=1, path=-1): y[m, n_out] = x[m, k] @ W.T
 * for a ggml matrix W[n_out, k] of type qtype (a GGMLQuantizationType value). w, x and y are
 * contiguous buffers (uint8, float32, float32); sizes are checked here. simd: -1 the best path,
 * else 0 scalar, 1 AVX2, 2 AVX-512 (capped at what the CPU has). threads: split the output
 * columns over this many threads (small products use fewer). path: -1 per-row tiles below the
 * type's blocked_from rows and panels from there, 0 tiles, 1 panels (the same bits either way;
 * for tests and benchmarks). Panels get SCRATCH_FLOATS floats of scratch per thread. */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    Py_ssize_t n_out, k, m;
    int qtype, simd = -1, threads = 1, path = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*w*nnn|iii", &qtype, &w, &x, &y, &n_out, &k, &m, &simd, &threads, &path))
        return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    if (qt == NULL) {
        PyErr_Format(PyExc_ValueError, "matmul: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "matmul: %s needs the IQ grids (init_tables was not called)", qt->name);
    } else if (n_out < 0 || k < 0 || m < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "matmul: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w.len != n_out * (k / qt->qk) * qt->bytes) {
        PyErr_Format(PyExc_ValueError, "matmul: %s weight buffer is %zd bytes, expected %zd", qt->name, w.len,
                     (Py_ssize_t)(n_out * (k / qt->qk) * qt->bytes));
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || y.len != m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul: activation or output buffer has the wrong size");
    } else {
        const int level = simd < 0 || simd > use_simd ? use_simd : simd;
        const int nthreads = split_threads(n_out, k, threads);
        /* the scalar path always uses panels; the vector paths from the type's blocked_from rows
         * (path: -1 so, 0 per-row tiles, 1 panels) */
        const int blocked = level == 0 || (path < 0 ? m >= qt->blocked_from : path > 0);
        float *scratch = NULL;
        if (blocked && m > 0 && n_out > 0 && k > 0)
            scratch = aligned_alloc(64, (size_t)nthreads * SCRATCH_FLOATS * sizeof(float));
        if (blocked && m > 0 && n_out > 0 && k > 0 && scratch == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        const job_t job = {qt->fn[level], w.buf, x.buf, y.buf, scratch, 0, n_out, n_out, k, m};
        Py_BEGIN_ALLOW_THREADS
        if (k == 0) memset(y.buf, 0, (size_t)y.len);   /* empty sums (the drivers walk k) */
        else run_split(job, nthreads);
        Py_END_ALLOW_THREADS
        free(scratch);
        ret = Py_NewRef(Py_None);
    }
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

#ifdef K3_X86
static long amx_calls = 0;    /* products that ran the AMX path (tests read it) */
#endif

/* quantize_q8(x, out, act_type, m, k, variant=1): rows of x (float32 [m, k]) as ggml blocks of
 * act_type (8 = Q8_0: 34 bytes per 32 values; 15 = Q8_K: 292 bytes per 256). variant (Q8_0
 * only): 0 quantize_row_q8_0_ref, 1 ggml-cpu's x86 quantize_row_q8_0. */
static PyObject *py_quantize_q8(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    Py_ssize_t m, k;
    int act, variant = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*inn|i", &x, &out, &act, &m, &k, &variant)) return NULL;
    PyObject *ret = NULL;
    const int qk = act == 15 ? 256 : 32, bytes = act == 15 ? Q8_K_BYTES : 34;
    if (act != 8 && act != 15) {
        PyErr_Format(PyExc_ValueError, "quantize_q8: activation type %d is neither Q8_0 (8) nor Q8_K (15)", act);
    } else if (m < 0 || k < 0 || k % qk) {
        PyErr_Format(PyExc_ValueError, "quantize_q8: bad dimensions (k must be a multiple of %d)", qk);
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || out.len != m * (k / qk) * bytes) {
        PyErr_SetString(PyExc_ValueError, "quantize_q8: input or output buffer has the wrong size");
    } else {
        for (Py_ssize_t r = 0; r < m; r++) {
            const float *xr = (const float *)x.buf + r * k;
            uint8_t *o = (uint8_t *)out.buf + r * (k / qk) * bytes;
            if (act == 15) quantize_q8_k_any(xr, k, o);
            else quantize_q8_0_row(xr, k, o, variant);
        }
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return ret;
}

/* matmul_q8(qtype, w, x, y, n_out, k, m, simd=-1, threads=1, variant=1): y[m, n_out] = x @ W.T
 * in ggml's arithmetic: each row of x rounded to the type's activation blocks (Q8_0 with
 * `variant` as quantize_q8, or Q8_K), then integer dot products (see "int8 activations" in qm_i8.h).
 * simd: -1 best, 0 scalar, 1 AVX2, 2 AVX512-VNNI (capped at what the CPU runs); every level gives
 * the same bits. Output columns split over `threads`. path: -1 by the row count (direct below
 * the type's direct_below rows, panels from there; on AVX512-VNNI the folding 512-bit direct path
 * below ft_from rows, the transposed one below ft_below, panels from there), 0 the direct path's
 * 256-bit form, 1 panels, 2 the folding 512-bit direct path (on AVX512-VNNI, else as 0), 3 as -1
 * but with the 256-bit direct path and its thresholds (the kernels before the 512-bit path, for
 * benchmarks), 4 the transposed 512-bit direct path (AVX512-VNNI, else as 0), 5 as -1 without the
 * transposed path, the folding one below fast_below rows (the kernels before it, for
 * benchmarks): the same bits on every path and level. */
static PyObject *py_matmul_q8(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    PyObject *x_obj, *y_obj;
    Py_ssize_t n_out, k, m;
    int qtype, simd = -1, threads = 1, variant = 1, path = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*OOnnn|iiii", &qtype, &w, &x_obj, &y_obj, &n_out, &k, &m, &simd, &threads,
                          &variant, &path))
        return NULL;
    if (float_arg(x_obj, &x, 0, m * k) < 0) {
        PyBuffer_Release(&w);
        return NULL;
    }
    if (float_arg(y_obj, &y, 1, m * n_out) < 0) {
        PyBuffer_Release(&w);
        PyBuffer_Release(&x);
        return NULL;
    }
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    const i8type_t *it = find_i8type(qtype);
    if (qt == NULL || it == NULL) {
        PyErr_Format(PyExc_ValueError, "matmul_q8: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "matmul_q8: %s needs the IQ grids (init_tables was not called)", qt->name);
    } else if (n_out < 0 || k < 0 || m < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "matmul_q8: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w.len != n_out * (k / qt->qk) * qt->bytes) {
        PyErr_Format(PyExc_ValueError, "matmul_q8: %s weight buffer is %zd bytes, expected %zd", qt->name, w.len,
                     (Py_ssize_t)(n_out * (k / qt->qk) * qt->bytes));
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || y.len != m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul_q8: activation or output buffer has the wrong size");
    } else if (m == 0 || n_out == 0 || k == 0) {
        if (y.len) memset(y.buf, 0, (size_t)y.len);
        ret = Py_NewRef(Py_None);
    } else {
        const int level = simd < 0 || simd > use_i8 ? use_i8 : simd;
        const int nthreads = split_threads(n_out, k, threads);
        const int64_t gv = 16 * (int64_t)it->G, ngroups = (k + gv - 1) / gv;
        const int64_t qbytes = it->act_q8k ? k / 256 * Q8_K_BYTES : k / 32 * 34;
        const int64_t rb = k / qt->qk * qt->bytes;
        xlane_t xl = {NULL, NULL, NULL, NULL, NULL, ngroups, gv, NULL, NULL, NULL, NULL};
        xl.xn = aligned_alloc(64, (size_t)(m * ngroups * gv + 64));
        xl.dx = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        xl.dxs = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        xl.corr = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        uint8_t *qbuf = malloc((size_t)qbytes + 64);
#ifdef K3_X86
        const int amx_from = qtype == 8 ? AMX_FROM_Q8_0 : qtype == 39 ? AMX_FROM_MXFP4 : 0;
        const int amx = use_amx && level == 2 && amx_from > 0 && (path == 6 || (path < 0 && m >= amx_from));
#else
        const int amx = 0;
#endif
        if (path == 6) path = -1;
        const int auto_path = path < 0 || path == 3 || path == 5, d256 = path == 0 || path == 3;
        const int below = level == 2 && path < 0 ? it->ft_below : level == 2 && path == 5 ? it->fast_below
                          : level == 1 && path < 0 ? own_avx2_below(qtype, it->direct_below) : it->direct_below;
        const int direct = !amx && level > 0 && (auto_path ? m < below : path == 0 || path == 2 || path == 4);
        const int transposed = direct && level == 2 && !d256 && (path == 4 || (path < 0 && m >= it->ft_from));
        const i8direct_fn dfn0 = !direct ? NULL : transposed ? it->direct[4] : level == 2 && !d256 ? it->direct[3]
                                                                                                : it->direct[level];
        /* on the default path: the type's own direct kernel where it has one */
        const i8direct_fn dfn = path >= 0 ? dfn0 : own_direct_fn(it, qtype, dfn0, m);
        const int64_t nsubp = ngroups * 16, nxb = (m + 7) / 8;
#ifdef K3_X86
        const int64_t scratch_bytes = amx ? (AMX_SCRATCH_BYTES(nsubp) + 63) / 64 * 64 : I8_SCRATCH_BYTES;
#else
        const int64_t scratch_bytes = I8_SCRATCH_BYTES;
#endif
        uint8_t *scratch = direct ? NULL : aligned_alloc(64, (size_t)(nthreads * scratch_bytes));
        int8_t *amx_xb = amx ? aligned_alloc(64, (size_t)(nxb * nsubp * 512)) : NULL;   /* (nsubp / 2) * 1024 */
        float *amx_dxv = amx ? aligned_alloc(64, (size_t)(nxb * nsubp * 16) * sizeof(float)) : NULL;
        /* the transposed bytes: for the panels and as the source of the transposed path's copy; the
         * other direct paths read xn (a decode row's layout work: ~halved) */
        const int own_t = level == 1 && m > 1 && dfn != dfn0;   /* AVX2's own kernels: x's transposed copy */
        if ((!direct && !amx) || transposed || own_t) xl.q = aligned_alloc(64, (size_t)(m * ngroups * gv + 64));
        if (transposed) {
            xl.qt = aligned_alloc(64, (size_t)(m * ngroups * gv + 64));
            xl.dxt = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
            xl.dxst = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
            xl.corrt = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        }
        if ((((!direct && !amx) || transposed || own_t) && !xl.q) || (amx && (!amx_xb || !amx_dxv)) || !xl.xn || !xl.dx || !xl.dxs || !xl.corr || !qbuf
            || (!direct && !scratch) || (transposed && (!xl.qt || !xl.dxt || !xl.dxst || !xl.corrt))) {
            PyErr_NoMemory();
        } else {
            const i8job_t jb = {w.buf, it->panel[level > 0], qt->qk, qt->bytes, n_out, k, m,
                                it->G, it->has_min, level, &xl, y.buf, dfn,
                                m > 8 ? (I8_CHUNK_BYTES + rb - 1) / rb : 0};
            Py_BEGIN_ALLOW_THREADS
            for (int64_t r = 0; r < m; r++)
                prepare_x_row((const float *)x.buf + r * k, k, it->act_q8k, variant, it->G, qbuf, &xl, r);
#ifdef K3_X86
            if (amx) {
                amx_prepare_x(&xl, m, nsubp, amx_xb, amx_dxv);
                const amxjob_t aj = {w.buf, qtype, n_out, k, m, rb, k / 32, nsubp, amx_xb, amx_dxv, y.buf};
#ifdef _OPENMP
                if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
                    for (int t = 0; t < nthreads; t++)
                        amx_columns(&aj, n_out * t / nthreads, n_out * (t + 1) / nthreads, scratch + (int64_t)t * scratch_bytes);
                } else
#endif
                    amx_columns(&aj, 0, n_out, scratch);
            } else
#endif
#ifdef _OPENMP
            if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
                for (int t = 0; t < nthreads; t++)
                    i8_columns(&jb, n_out * t / nthreads, n_out * (t + 1) / nthreads,
                               scratch + (int64_t)t * I8_SCRATCH_BYTES);
            } else
#endif
                i8_columns(&jb, 0, n_out, scratch);
            Py_END_ALLOW_THREADS
#ifdef K3_X86
            amx_calls += amx;
#endif
            ret = Py_NewRef(Py_None);
        }
        free(xl.q);
        free(xl.xn);
        free(xl.dx);
        free(xl.dxs);
        free(xl.corr);
        free(xl.qt);
        free(xl.dxt);
        free(xl.dxst);
        free(xl.corrt);
        free(qbuf);
        free(scratch);
        free(amx_xb);
        free(amx_dxv);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

/* amx() -> (in use, products run on it so far): whether matmul_q8 takes AMX-INT8 for Q8_0 and
 * MXFP4 products of many rows (the CPU has it, Linux granted the tile state, K3KIT_NO_AMX unset). */
static PyObject *py_amx(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#ifdef K3_X86
    return Py_BuildValue("(Ol)", use_amx ? Py_True : Py_False, amx_calls);
#else
    return Py_BuildValue("(Ol)", Py_False, 0L);
#endif
}

static PyObject *py_simd_i8(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    static const char *names[] = {"scalar", "avx2", "avx512vnni"};
    return PyUnicode_FromString(names[use_i8]);
}

/* ---- dequantize: rows of W as float32 or bfloat16 ------------------------------------------
 * The panel decoders' PANEL_F32 / PANEL_BF16 modes over whole rows. QuantizedMatrix uses this
 * for products with many rows and a 16-bit compute dtype: a chunk of W's rows dequantized into a
 * bounded buffer, multiplied by torch's GEMM, the next chunk into the same buffer. */
static void dequant_rows(const qtype_t *qt, int level, const uint8_t *w, int64_t n0, int64_t n1, int64_t k,
                         void *out, int bf16) {
    const panel_fn panel = qt->panel[level > 0];
    const int64_t nb = k / qt->qk, rb = nb * qt->bytes;
    for (int64_t p0 = n0; p0 < n1; p0 += BLK_NP) {
        const int np = n1 - p0 < BLK_NP ? (int)(n1 - p0) : BLK_NP;
        void *dst = bf16 ? (void *)((uint16_t *)out + p0 * k) : (void *)((float *)out + p0 * k);
        panel(w + p0 * rb, rb, np, 0, nb, dst, k, NULL, bf16 ? PANEL_BF16 : PANEL_F32);
    }
}

/* dequantize(qtype, w, out, n_rows, k, bf16=0, simd=-1, threads=1): the n_rows x k matrix W held
 * as its bytes in w into out (contiguous float32, or bfloat16 bits as 2-byte items with bf16=1),
 * rows split over threads. */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    Py_buffer w, out;
    Py_ssize_t n_rows, k;
    int qtype, bf16 = 0, simd = -1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*w*nn|iii", &qtype, &w, &out, &n_rows, &k, &bf16, &simd, &threads)) return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    const Py_ssize_t item = bf16 ? 2 : 4;
    if (qt == NULL) {
        PyErr_Format(PyExc_ValueError, "dequantize: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "dequantize: %s needs the IQ grids (init_tables was not called)",
                     qt->name);
    } else if (n_rows < 0 || k < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "dequantize: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w.len != n_rows * (k / qt->qk) * qt->bytes) {
        PyErr_Format(PyExc_ValueError, "dequantize: %s weight buffer is %zd bytes, expected %zd", qt->name, w.len,
                     (Py_ssize_t)(n_rows * (k / qt->qk) * qt->bytes));
    } else if (out.len != n_rows * k * item) {
        PyErr_SetString(PyExc_ValueError, "dequantize: output buffer has the wrong size");
    } else {
        const int level = simd < 0 || simd > use_simd ? use_simd : simd;
        const int nthreads = split_threads(n_rows, k, threads);
        (void)nthreads;
        Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
        if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
            for (int t = 0; t < nthreads; t++)
                dequant_rows(qt, level, w.buf, n_rows * t / nthreads, n_rows * (t + 1) / nthreads, k, out.buf, bf16);
        } else
#endif
            dequant_rows(qt, level, w.buf, 0, n_rows, k, out.buf, bf16);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return ret;
}

/* Check one table argument, `entries` rows of `width` int8 values each in [lo, hi], and pack
 * it (times `mul`) into 64- or 32-bit words at dst. */
static int load_table(const char *name, Py_buffer *buf, Py_ssize_t entries, int width, int lo, int hi, int mul,
                      void *dst) {
    if (buf->len != entries * width) {
        PyErr_Format(PyExc_ValueError, "init_tables: %s has %zd bytes, expected %zd", name, buf->len,
                     entries * width);
        return -1;
    }
    const int8_t *src = buf->buf;
    for (Py_ssize_t e = 0; e < entries; e++) {
        uint64_t word = 0;
        for (int j = 0; j < width; j++) {
            const int v = src[e * width + j];
            if (v < lo || v > hi) {
                PyErr_Format(PyExc_ValueError, "init_tables: %s entry %zd has value %d outside [%d, %d]", name,
                             e, v, lo, hi);
                return -1;
            }
            word |= (uint64_t)(uint8_t)(int8_t)(v * mul) << (8 * j);
        }
        if (width == 8) ((uint64_t *)dst)[e] = word;
        else ((uint32_t *)dst)[e] = (uint32_t)word;
    }
    return 0;
}

/* init_tables(iq2xxs, iq2xs, iq3xxs, iq1s, ksigns): ggml's iq2xxs_grid [256 x 8], iq2xs_grid
 * [512 x 8], iq3xxs_grid [256 x 4] (uint8 values), iq1s_grid [2048 x 8] (int8 -1/0/1) and
 * ksigns_iq2xs [128] as contiguous byte buffers. The grid values must stay int8 after a sign
 * (and, for IQ1, after the factor 8), which the checks enforce. Everything is checked before
 * anything is replaced: a rejected call leaves the tables as they were. */
static PyObject *py_init_tables(PyObject *self, PyObject *args) {
    static uint64_t g2xxs[256], g2xs[512], g1[2048], signs[128];
    static uint32_t g3xxs[256];
    Py_buffer b[5];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*", &b[0], &b[1], &b[2], &b[3], &b[4])) return NULL;
    int ok = load_table("iq2xxs", &b[0], 256, 8, 1, 62, 1, g2xxs) == 0 &&
             load_table("iq2xs", &b[1], 512, 8, 1, 127, 1, g2xs) == 0 &&
             load_table("iq3xxs", &b[2], 256, 4, 1, 62, 1, g3xxs) == 0 &&
             load_table("iq1s", &b[3], 2048, 8, -1, 1, 8, g1) == 0;
    if (ok && b[4].len != 128) {
        PyErr_Format(PyExc_ValueError, "init_tables: ksigns has %zd bytes, expected 128", b[4].len);
        ok = 0;
    }
    if (ok) {
        const uint8_t *ks = b[4].buf;
        for (int i = 0; i < 128; i++) {
            uint64_t mask = 0;
            for (int j = 0; j < 8; j++)
                if (ks[i] >> j & 1) mask |= 0xFFULL << (8 * j);
            signs[i] = mask;
        }
        memcpy(IQ2XXS_GRID, g2xxs, sizeof g2xxs);
        memcpy(IQ2XS_GRID, g2xs, sizeof g2xs);
        memcpy(IQ3XXS_GRID, g3xxs, sizeof g3xxs);
        memcpy(IQ1S_GRID8, g1, sizeof g1);
        memcpy(SIGN_MASK, signs, sizeof signs);
        tables_ready = 1;
    }
    for (int i = 0; i < 5; i++) PyBuffer_Release(&b[i]);
    return ok ? Py_NewRef(Py_None) : NULL;
}

static PyObject *py_simd(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    static const char *names[] = {"scalar", "avx2", "avx512"};
    return PyUnicode_FromString(names[use_simd]);
}

static PyObject *py_types(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *t = PyTuple_New(N_QTYPES);
    if (t == NULL) return NULL;
    for (int i = 0; i < N_QTYPES; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(QTYPES[i].ggml_type));
    return t;
}

/* tiling(qtype): the many-row drivers' geometry, so tests and benchmarks can size products that
 * cross every edge. */
static PyObject *py_tiling(PyObject *self, PyObject *args) {
    int qtype;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &qtype)) return NULL;
    const qtype_t *qt = find_qtype(qtype);
    if (qt == NULL) return PyErr_Format(PyExc_ValueError, "tiling: no native kernel for ggml type %d", qtype);
    return Py_BuildValue("{sisisisisi}", "blocked_from", qt->blocked_from, "panel_rows", BLK_NP, "panel_values",
                         BLK_KC, "row_block", BLK_MB, "factored", qt->factored);
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "y = x @ W.T for a quantized ggml W (see the module source)."},
    {"dequantize", py_dequantize, METH_VARARGS, "W's rows as float32 or bfloat16 (see the module source)."},
    {"init_tables", py_init_tables, METH_VARARGS, "Load the IQ grids and ksigns (gguf-py's data)."},
    {"simd", py_simd, METH_NOARGS, "The best path the CPU runs: 'avx512', 'avx2' or 'scalar'."},
    {"types", py_types, METH_NOARGS, "The ggml type ids with a native kernel."},
    {"tiling", py_tiling, METH_VARARGS, "The many-row drivers' geometry (rows, panel sizes)."},
    {"quantize_q8", py_quantize_q8, METH_VARARGS, "Rows of x as ggml Q8_0 / Q8_K blocks (ggml's bytes)."},
    {"matmul_q8", py_matmul_q8, METH_VARARGS, "y = x @ W.T in ggml's int8-activation arithmetic."},
    {"simd_i8", py_simd_i8, METH_NOARGS, "The best int8 path: 'avx512vnni', 'avx2' or 'scalar'."},
    {"amx", py_amx, METH_NOARGS, "(AMX-INT8 in use, products run on it): see the module source."},
    {"matmul_heads", py_matmul_heads, METH_VARARGS, "y[h] = x[h] @ W_h.T for a stack of per-head ggml matrices."},
    {"experts_q8", py_experts_q8, METH_VARARGS, "Every routed expert's product of one projection, int8 arithmetic."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qmatmul", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__qmatmul(void) {
    init_e8m0();
    qm_detect_cpu();
    return PyModule_Create(&module);
}
