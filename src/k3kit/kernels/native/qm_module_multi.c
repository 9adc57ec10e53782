/* qm_module_multi.c: the module's entries that run many matrices in one call: matmul_heads (a
 * stack of per-head matrices, MLA's attn_k_b / attn_v_b) and experts_q8 (a layer's routed experts,
 * one projection or gate and up together), each in one parallel region, each matrix's result bit
 * for bit the one-matrix entry's (qm_module.c). Apart from qm_module.c to keep both files short. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "qm.h"
#include "qm_i8.h"
#include "qm_module.h"

/* ---- stacks of per-head matrices (MLA's attn_k_b / attn_v_b) ----------------------------------
 * A 3-D ggml tensor [k, n_out, heads] is `heads` matrices, each multiplying its own rows of x.
 * One call runs every head, so a decode step pays one call per stack instead of one per head. */

/* One thread's int8 buffers for m rows of x (prepare_x_row's layout), its q8 row and panels. */
typedef struct {
    xlane_t xl;
    uint8_t *qbuf, *scratch;
} heads_buf_t;

static void heads_buf_free(heads_buf_t *b) {
    free(b->xl.q);
    free(b->xl.xn);
    free(b->xl.dx);
    free(b->xl.dxs);
    free(b->xl.corr);
    free(b->xl.qt);
    free(b->xl.dxt);
    free(b->xl.dxst);
    free(b->xl.corrt);
    free(b->qbuf);
    free(b->scratch);
    memset(b, 0, sizeof *b);
}

/* Sizes as matmul_q8 allocates them; 0 when out of memory. */
static int heads_buf_alloc(heads_buf_t *b, int64_t m, int64_t ngroups, int64_t gv, int64_t qbytes,
                           int transposed, int panels) {
    memset(b, 0, sizeof *b);
    b->xl.ngroups = ngroups;
    b->xl.gv = gv;
    const size_t vals = (size_t)(m * ngroups * gv + 64), lanes = (size_t)(m * ngroups * 16 * 4 + 64);
    b->xl.q = aligned_alloc(64, vals);
    b->xl.xn = aligned_alloc(64, vals);
    b->xl.dx = aligned_alloc(64, lanes);
    b->xl.dxs = aligned_alloc(64, lanes);
    b->xl.corr = aligned_alloc(64, lanes);
    b->qbuf = malloc((size_t)qbytes + 64);
    int ok = b->xl.q && b->xl.xn && b->xl.dx && b->xl.dxs && b->xl.corr && b->qbuf;
    if (transposed) {
        b->xl.qt = aligned_alloc(64, vals);
        b->xl.dxt = aligned_alloc(64, lanes);
        b->xl.dxst = aligned_alloc(64, lanes);
        b->xl.corrt = aligned_alloc(64, lanes);
        ok = ok && b->xl.qt && b->xl.dxt && b->xl.dxst && b->xl.corrt;
    }
    if (panels) {
        b->scratch = aligned_alloc(64, (size_t)I8_SCRATCH_BYTES);
        ok = ok && b->scratch;
    }
    return ok;
}

/* The same buffers as heads_buf_alloc (no panels), carved from `*arena` (advanced; NULL: only
 * counted, the bytes added to *need): a call with many segments makes one allocation instead of
 * six to ten per segment (a verify pass's routed experts: ~20 segments of one or two rows, where
 * the allocations cost about what the products do). Carved buffers are freed with the arena. */
static void heads_buf_carve(heads_buf_t *b, uint8_t **arena, size_t *need, int64_t m, int64_t ngroups,
                            int64_t gv, int64_t qbytes, int transposed) {
    const size_t vals = (size_t)(m * ngroups * gv + 64), lanes = (size_t)(m * ngroups * 16 * 4 + 64);
    const size_t sizes[10] = {vals, vals, lanes, lanes, lanes, (size_t)qbytes + 64,
                              transposed ? vals : 0, transposed ? lanes : 0, transposed ? lanes : 0,
                              transposed ? lanes : 0};
    void **where[10] = {(void **)&b->xl.q, (void **)&b->xl.xn, (void **)&b->xl.dx, (void **)&b->xl.dxs,
                        (void **)&b->xl.corr, (void **)&b->qbuf, (void **)&b->xl.qt, (void **)&b->xl.dxt,
                        (void **)&b->xl.dxst, (void **)&b->xl.corrt};
    memset(b, 0, sizeof *b);
    b->xl.ngroups = ngroups;
    b->xl.gv = gv;
    for (int i = 0; i < 10; i++) {
        if (sizes[i] == 0) continue;
        const size_t n = (sizes[i] + 63) / 64 * 64;
        if (arena != NULL) {
            *where[i] = *arena;
            *arena += n;
        }
        *need += n;
    }
}

/* What every head of one call shares. */
typedef struct {
    const uint8_t *w;
    const float *x;
    float *y;
    int64_t heads, n_out, k, m, w_stride;
    const qtype_t *qt;
    const i8type_t *it;
    int level, i8;
    i8direct_fn dfn;       /* int8: the direct path's kernel, NULL for panels */
    int64_t nchunk;        /* int8: as matmul_q8's */
} heads_job_t;

/* Head h's x rows into b (int8 only). */
static void heads_prepare(const heads_job_t *hj, int64_t h, heads_buf_t *b) {
    for (int64_t r = 0; r < hj->m; r++)
        prepare_x_row(hj->x + (h * hj->m + r) * hj->k, hj->k, hj->it->act_q8k, 1, hj->it->G, b->qbuf, &b->xl, r);
}

/* Columns [n0, n1) of head h: int8 from b's prepared rows, or the float kernel (fscratch:
 * SCRATCH_FLOATS floats, or NULL for the per-row tiles). */
static void heads_columns(const heads_job_t *hj, int64_t h, const heads_buf_t *b, float *fscratch, int64_t n0,
                          int64_t n1) {
    const uint8_t *w = hj->w + h * hj->w_stride;
    float *y = hj->y + h * hj->m * hj->n_out;
    if (hj->i8) {
        const i8job_t jb = {w, hj->it->panel[hj->level > 0], hj->qt->qk, hj->qt->bytes, hj->n_out, hj->k, hj->m,
                            hj->it->G, hj->it->has_min, hj->level, &b->xl, y, hj->dfn, hj->nchunk};
        i8_columns(&jb, n0, n1, b->scratch);
    } else {
        hj->qt->fn[hj->level](w, n0, n1, hj->n_out, hj->k, hj->x + h * hj->m * hj->k, hj->m, y, fscratch);
    }
}

/* matmul_heads(qtype, w, x, y, heads, n_out, k, m, w_stride, i8=1, simd=-1, threads=1): for every
 * h < heads, y[h] = x[h] @ W_h.T with W_h the ggml matrix [n_out, k] of type qtype starting at byte
 * h * w_stride of w; x float32 [heads, m, k], y float32 [heads, m, n_out], contiguous. i8 = 1:
 * ggml's int8 arithmetic, each head's result bit for bit matmul_q8(qtype, W_h, x[h], y[h], n_out,
 * k, m, simd) (variant 1, path -1); i8 = 0: the float kernels, bit for bit matmul(...) (path -1).
 * simd as the matching single-matrix entry. Threads: whole heads per thread when the heads are
 * at least as many as the threads (each thread quantizes the x rows it multiplies), else head by
 * head with W_h's output columns split; a result never depends on the split. */
PyObject *py_matmul_heads(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    Py_ssize_t heads, n_out, k, m, w_stride;
    int qtype, i8 = 1, simd = -1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*w*nnnnn|iii", &qtype, &w, &x, &y, &heads, &n_out, &k, &m, &w_stride, &i8,
                          &simd, &threads))
        return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    const i8type_t *it = find_i8type(qtype);
    const Py_ssize_t rb = qt != NULL && k >= 0 ? k / qt->qk * qt->bytes : 0;
    if (qt == NULL || (i8 && it == NULL)) {
        PyErr_Format(PyExc_ValueError, "matmul_heads: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "matmul_heads: %s needs the IQ grids (init_tables was not called)",
                     qt->name);
    } else if (heads < 0 || n_out < 0 || k < 0 || m < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "matmul_heads: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w_stride < n_out * rb || (heads > 0 && w.len < (heads - 1) * w_stride + n_out * rb)) {
        PyErr_Format(PyExc_ValueError, "matmul_heads: %s weight buffer of %zd bytes does not hold %zd heads of "
                     "%zd bytes at a stride of %zd", qt->name, w.len, heads, n_out * rb, w_stride);
    } else if (x.len != heads * m * k * (Py_ssize_t)sizeof(float)
               || y.len != heads * m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul_heads: activation or output buffer has the wrong size");
    } else if (heads == 0 || m == 0 || n_out == 0 || k == 0) {
        if (y.len) memset(y.buf, 0, (size_t)y.len);
        ret = Py_NewRef(Py_None);
    } else {
        heads_job_t hj = {w.buf, x.buf, y.buf, heads, n_out, k, m, w_stride, qt, it, 0, i8 != 0, NULL, 0};
        int nthreads = split_threads(heads * n_out, k, threads);
        const int by_head = heads >= nthreads, nbuf = by_head ? nthreads : 1;
        int panels, transposed = 0;
        int64_t ngroups = 0, gv = 0, qbytes = 0;
        if (hj.i8) {   /* matmul_q8's choice of path, for path -1 */
            hj.level = simd < 0 || simd > use_i8 ? use_i8 : simd;
            gv = 16 * (int64_t)it->G;
            ngroups = (k + gv - 1) / gv;
            qbytes = it->act_q8k ? k / 256 * Q8_K_BYTES : k / 32 * 34;
            const int direct = hj.level > 0 && m < (hj.level == 2 ? it->ft_below : it->direct_below);
            transposed = direct && hj.level == 2 && m >= it->ft_from;
            hj.dfn = !direct ? NULL : transposed ? it->direct[4] : hj.level == 2 ? it->direct[3]
                                                                                 : it->direct[hj.level];
            hj.nchunk = m > 8 ? (I8_CHUNK_BYTES + rb - 1) / rb : 0;
            panels = !direct;
        } else {
            hj.level = simd < 0 || simd > use_simd ? use_simd : simd;
            panels = hj.level == 0 || m >= qt->blocked_from;
        }
        heads_buf_t bufs[MAX_THREADS];
        float *fscratch = NULL;
        int ok = 1;
        memset(bufs, 0, sizeof bufs);
        if (hj.i8) {
            for (int t = 0; t < nbuf; t++)
                ok = ok && heads_buf_alloc(&bufs[t], m, ngroups, gv, qbytes, transposed, 0);
            for (int t = 0; t < nthreads && panels; t++)     /* column splits need one panel each */
                ok = ok && (bufs[t].scratch = aligned_alloc(64, (size_t)I8_SCRATCH_BYTES)) != NULL;
        } else if (panels) {
            fscratch = aligned_alloc(64, (size_t)nthreads * SCRATCH_FLOATS * sizeof(float));
            ok = fscratch != NULL;
        }
        if (!ok) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            if (by_head) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
#endif
                for (int t = 0; t < nthreads; t++) {
                    float *fs = fscratch ? fscratch + (int64_t)t * SCRATCH_FLOATS : NULL;
                    for (int64_t h = heads * t / nthreads; h < heads * (t + 1) / nthreads; h++) {
                        if (hj.i8) heads_prepare(&hj, h, &bufs[t]);
                        heads_columns(&hj, h, &bufs[t], fs, 0, n_out);
                    }
                }
            } else {
                for (int64_t h = 0; h < heads; h++) {
                    if (hj.i8) heads_prepare(&hj, h, &bufs[0]);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
#endif
                    for (int t = 0; t < nthreads; t++) {
                        heads_buf_t b = bufs[0];
                        b.scratch = bufs[t].scratch;
                        heads_columns(&hj, h, &b, fscratch ? fscratch + (int64_t)t * SCRATCH_FLOATS : NULL,
                                      n_out * t / nthreads, n_out * (t + 1) / nthreads);
                    }
                }
            }
            Py_END_ALLOW_THREADS
            ret = Py_NewRef(Py_None);
        }
        for (int t = 0; t < MAX_THREADS; t++) heads_buf_free(&bufs[t]);
        free(fscratch);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

/* ---- a layer's routed experts in one call per projection ---------------------------------------
 * A decode step runs each routed expert on one row: per expert and projection, matmul_q8 would
 * quantize that row again and fork and join the threads again. experts_q8 runs every expert's
 * product of one projection (or gate and up together) in one parallel region, each segment of
 * x quantized once for all the matrices that multiply it. */

/* experts_q8(qtype, ws, x, y, counts, n_out, k, per, threads=1, rows=None): x float32 [P, k] is segments
 * of counts[s] rows (P = sum(counts), segment s from row sum(counts[:s])), ws a sequence of
 * len(counts) * per weight buffers, each a ggml matrix [n_out, k] of type qtype; matrix j < per
 * of segment s (ws[s * per + j]) multiplies that segment's rows into y[j] (float32 [per, P,
 * n_out]) at the same rows. Each segment's result is bit for bit matmul_q8(qtype, ws[s * per +
 * j], x_s, y_s, n_out, k, counts[s]) (variant 1, path -1: the same kernels for the same row
 * count), the output columns of every product split over the threads inside one parallel
 * region; a result never depends on the split. rows (a sequence of P ints, or None): x is then
 * float32 [X, k] and row i of the segments is x's row rows[i] (each in [0, X)): the rows a
 * routing sends to several experts are read where they are, not gathered into a copy first. */
PyObject *py_experts_q8(PyObject *self, PyObject *args) {
    PyObject *ws_obj, *counts_obj, *rows_obj = Py_None;
    Py_buffer x, y;
    Py_ssize_t n_out, k;
    int qtype, per, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOy*w*Onni|iO", &qtype, &ws_obj, &x, &y, &counts_obj, &n_out, &k, &per, &threads,
                          &rows_obj))
        return NULL;
    PyObject *ret = NULL, *ws_seq = NULL, *counts_seq = NULL, *rows_seq = NULL;
    Py_buffer *wb = NULL;
    int64_t *cnt = NULL, *xrow = NULL;
    uint8_t *arena = NULL;
    heads_buf_t *bufs = NULL;
    uint8_t *scratch = NULL;
    Py_ssize_t nw = 0, got = 0, E = 0, P = 0;
    const qtype_t *qt = find_qtype(qtype);
    const i8type_t *it = find_i8type(qtype);
    if (qt == NULL || it == NULL) {
        PyErr_Format(PyExc_ValueError, "experts_q8: no native kernel for ggml type %d", qtype);
        goto done;
    }
    if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "experts_q8: %s needs the IQ grids (init_tables was not called)", qt->name);
        goto done;
    }
    if (n_out < 0 || k < 0 || per < 1 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "experts_q8: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
        goto done;
    }
    ws_seq = PySequence_Fast(ws_obj, "experts_q8: ws must be a sequence of buffers");
    counts_seq = ws_seq ? PySequence_Fast(counts_obj, "experts_q8: counts must be a sequence of ints") : NULL;
    if (counts_seq == NULL) goto done;
    E = PySequence_Fast_GET_SIZE(counts_seq);
    nw = PySequence_Fast_GET_SIZE(ws_seq);
    if (nw != E * per) {
        PyErr_Format(PyExc_ValueError, "experts_q8: %zd weights for %zd segments of %d matrices", nw, E, per);
        goto done;
    }
    const int64_t rb = k / qt->qk * qt->bytes;
    cnt = malloc(sizeof *cnt * (size_t)(E + 1));
    wb = calloc((size_t)(nw + 1), sizeof *wb);
    bufs = calloc((size_t)(E + 1), sizeof *bufs);
    if (!cnt || !wb || !bufs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < E; s++) {
        cnt[s] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(counts_seq, s));
        if (cnt[s] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "experts_q8: negative row count");
            goto done;
        }
        P += cnt[s];
    }
    for (; got < nw; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(ws_seq, got), &wb[got], PyBUF_SIMPLE) < 0) goto done;
        if (wb[got].len != n_out * rb) {
            PyErr_Format(PyExc_ValueError, "experts_q8: %s weight %zd is %zd bytes, expected %zd", qt->name, got,
                         wb[got].len, (Py_ssize_t)(n_out * rb));
            got++;
            goto done;
        }
    }
    if (rows_obj != Py_None) {
        const Py_ssize_t X = k > 0 ? x.len / (k * (Py_ssize_t)sizeof(float)) : 0;
        rows_seq = PySequence_Fast(rows_obj, "experts_q8: rows must be a sequence of ints");
        if (rows_seq == NULL) goto done;
        if (PySequence_Fast_GET_SIZE(rows_seq) != P || x.len != X * k * (Py_ssize_t)sizeof(float)) {
            PyErr_SetString(PyExc_ValueError, "experts_q8: rows do not name one x row per segment row");
            goto done;
        }
        xrow = malloc(sizeof *xrow * (size_t)(P + 1));
        if (!xrow) {
            PyErr_NoMemory();
            goto done;
        }
        for (Py_ssize_t i = 0; i < P; i++) {
            xrow[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(rows_seq, i));
            if (xrow[i] < 0 || xrow[i] >= X) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "experts_q8: a row is outside x");
                goto done;
            }
        }
    } else if (x.len != P * k * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "experts_q8: activation buffer has the wrong size");
        goto done;
    }
    if (y.len != per * P * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "experts_q8: output buffer has the wrong size");
        goto done;
    }
    if (P == 0 || n_out == 0 || k == 0) {
        if (y.len) memset(y.buf, 0, (size_t)y.len);
        ret = Py_NewRef(Py_None);
        goto done;
    }
    {
        const int level = use_i8;
        const int nthreads = split_threads(n_out, k * (int64_t)nw, threads);
        const int64_t gv = 16 * (int64_t)it->G, ngroups = (k + gv - 1) / gv;
        const int64_t qbytes = it->act_q8k ? k / 256 * Q8_K_BYTES : k / 32 * 34;
        /* per segment, matmul_q8's path -1 for its row count; the segments' buffers in one arena */
        i8direct_fn *dfn = calloc((size_t)(E + 1), sizeof *dfn);
        int *tr = calloc((size_t)(E + 1), sizeof *tr);
        int ok = dfn != NULL && tr != NULL, any_panels = 0;
        size_t need = 0;
        for (Py_ssize_t s = 0; s < E && ok; s++) {
            const int64_t m = cnt[s];
            if (m == 0) continue;
            const int direct = level > 0 && m < (level == 2 ? it->ft_below : own_avx2_below(qtype, it->direct_below));
            const int transposed = direct && level == 2 && m >= it->ft_from;
            const i8direct_fn d0 = !direct ? NULL : transposed ? it->direct[4] : level == 2 ? it->direct[3]
                                                                                            : it->direct[level];
            dfn[s] = own_direct_fn(it, qtype, d0, m);
            any_panels |= !direct;
            tr[s] = transposed;
            heads_buf_carve(&bufs[s], NULL, &need, m, ngroups, gv, qbytes, transposed);
        }
        if (ok) {
            arena = aligned_alloc(64, need + 64);
            ok = arena != NULL;
            uint8_t *cursor = arena;
            size_t used = 0;
            for (Py_ssize_t s = 0; s < E && ok; s++)
                if (cnt[s] > 0) heads_buf_carve(&bufs[s], &cursor, &used, cnt[s], ngroups, gv, qbytes, tr[s]);
        }
        free(tr);
        if (ok && any_panels) {
            scratch = aligned_alloc(64, (size_t)nthreads * I8_SCRATCH_BYTES);
            ok = scratch != NULL;
        }
        if (!ok) {
            free(dfn);
            PyErr_NoMemory();
            goto done;
        }
        const float *xs = x.buf;
        float *ys = y.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t s = 0, off = 0; s < E; off += cnt[s], s++)
            for (int64_t r = 0; r < cnt[s]; r++)
                prepare_x_row(xs + (xrow ? xrow[off + r] : off + r) * k, k, it->act_q8k, 1, it->G, bufs[s].qbuf,
                              &bufs[s].xl, r);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
#endif
        for (int t = 0; t < nthreads; t++) {
            const int64_t n0 = n_out * t / nthreads, n1 = n_out * (t + 1) / nthreads;
            uint8_t *sc = scratch ? scratch + (int64_t)t * I8_SCRATCH_BYTES : NULL;
            for (Py_ssize_t s = 0, off = 0; s < E; off += cnt[s], s++) {
                const int64_t m = cnt[s];
                if (m == 0) continue;
                for (int j = 0; j < per; j++) {
                    const i8job_t jb = {wb[s * per + j].buf, it->panel[level > 0], qt->qk, qt->bytes, n_out, k, m,
                                        it->G, it->has_min, level, &bufs[s].xl, ys + ((int64_t)j * P + off) * n_out,
                                        dfn[s], m > 8 ? (I8_CHUNK_BYTES + rb - 1) / rb : 0};
                    i8_columns(&jb, n0, n1, sc);
                }
            }
        }
        Py_END_ALLOW_THREADS
        free(dfn);
        ret = Py_NewRef(Py_None);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&wb[i]);
    free(arena);      /* every segment's buffers (carved: never freed one by one) */
    free(bufs);
    free(wb);
    free(cnt);
    free(xrow);
    free(scratch);
    Py_XDECREF(ws_seq);
    Py_XDECREF(counts_seq);
    Py_XDECREF(rows_seq);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

