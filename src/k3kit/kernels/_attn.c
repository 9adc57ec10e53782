/* The two float32 products of MLA's latent attention over many rows, with AVX-512.
 *
 * Why it exists: a prompt chunk's attention (k3kit.models.kimi_k3.mla.attend) is two products per
 * group of rows, scores = Q Kᵀ over the cached latents and out = P V, and torch hands them to MKL,
 * which on AMD processors runs its AVX2 code (about 100 GFLOPS on one Zen 5 core for these shapes,
 * where AVX-512 allows twice that). On the shipped mini at 4-7k positions they are half of a
 * prompt's time. Called from k3kit.kernels.attn with the tensors' addresses.
 *
 * The contract (tests/kernels/test_attn.py):
 * - scores_nt: y[i, j] = scale * (sum over k of a[i, k] * b[j, k]), k in order 0..K-1 in one
 *   float accumulator per output (fused multiply-adds), then one rounding by the scale.
 * - probs_v: y[i, j] = sum over k of a[i, k] * b[k, j], k in order in one fused accumulator.
 * - Every output's arithmetic is fixed by its row and column alone: the same bits whatever the
 *   other rows are, the thread count, or where the caller cut its rows.
 * - Only with AVX-512F (`available()`); elsewhere the caller runs torch's products.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#define MR 6           /* rows per micro-kernel */
#define NT_COLS 32     /* scores: key columns per packed panel (two vectors) */
#define PV_COLS 64     /* values: output columns per micro-kernel (four vectors) */
#define PARALLEL_FROM (1 << 22)   /* multiply-adds below this run on the calling thread */
#define PV_KBLOCK 256   /* values: keys per pass over the output rows (their values stay in L2) */

#define AVX512 __attribute__((target("avx512f")))

static int threads_for(int64_t work, int64_t units, int threads) {
    if (threads < 1 || work < PARALLEL_FROM) return 1;
    return units < threads ? (int)(units > 0 ? units : 1) : threads;
}

/* b's rows j0..j0+NT_COLS-1 (columns of bᵀ) packed as p[k][NT_COLS], zero past n */
AVX512 static void pack_panel(const float *b, int64_t ldb, int64_t n, int64_t K, int64_t j0, float *p) {
    const int64_t cols = n - j0 < NT_COLS ? n - j0 : NT_COLS;
    for (int64_t k = 0; k < K; k++) {
        float *pk = p + k * NT_COLS;
        int64_t c = 0;
        for (; c < cols; c++) pk[c] = b[(j0 + c) * ldb + k];
        for (; c < NT_COLS; c++) pk[c] = 0.0f;
    }
}

/* MR rows of a (stride lda, rows past `rows` read from zeros) against one packed panel */
AVX512 static inline __attribute__((always_inline)) void nt_kernel(const float *a, int64_t lda, int rows, const float *p, int64_t K, float scale,
                             float *y, int64_t ldy, int64_t cols) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const float *ar[MR];
    static const float zeros[1] = {0.0f};
    for (int r = 0; r < MR; r++) ar[r] = r < rows ? a + r * lda : zeros;
    const int64_t step[MR] = {rows > 0, rows > 1, rows > 2, rows > 3, rows > 4, rows > 5};
    for (int64_t k = 0; k < K; k++) {
        const __m512 b0 = _mm512_loadu_ps(p + k * NT_COLS);
        const __m512 b1 = _mm512_loadu_ps(p + k * NT_COLS + 16);
        for (int r = 0; r < MR; r++) {
            const __m512 x = _mm512_set1_ps(ar[r][k * step[r]]);
            acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
        }
    }
    const __m512 s = _mm512_set1_ps(scale);
    const __mmask16 m0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int r = 0; r < MR; r++) {    /* a constant bound: acc stays in registers */
        if (r >= rows) continue;
        _mm512_mask_storeu_ps(y + r * ldy, m0, _mm512_mul_ps(acc[r][0], s));
        _mm512_mask_storeu_ps(y + r * ldy + 16, m1, _mm512_mul_ps(acc[r][1], s));
    }
}

/* b [n, K] (stride ldb) packed for scores_nt: panel q at p + q * K * NT_COLS */
AVX512 static void pack_keys(const float *b, int64_t ldb, int64_t n, int64_t K, float *p, int threads) {
    const int64_t panels = (n + NT_COLS - 1) / NT_COLS;
    const int nt = threads_for(n * K * 16, panels, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t q = 0; q < panels; q++) pack_panel(b, ldb, n, K, q * NT_COLS, p + q * K * NT_COLS);
}

/* y[m, n] (stride ldy) = scale * a[m, K] (stride lda) · bᵀ, b [n, K] packed by pack_keys */
AVX512 static void scores_nt(const float *a, int64_t lda, const float *p, float *y, int64_t ldy,
                             int64_t m, int64_t n, int64_t K, float scale, int threads) {
    const int64_t panels = (n + NT_COLS - 1) / NT_COLS;
    const int nt = threads_for(m * n * K, panels, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t q = 0; q < panels; q++) {
        const int64_t j0 = q * NT_COLS;
        const int64_t cols = n - j0 < NT_COLS ? n - j0 : NT_COLS;
        for (int64_t i0 = 0; i0 < m; i0 += MR) {
            const int rows = (int)(m - i0 < MR ? m - i0 : MR);
            nt_kernel(a + i0 * lda, lda, rows, p + q * K * NT_COLS, K, scale, y + i0 * ldy + j0, ldy, cols);
        }
    }
}

/* MR rows of y[:, j0:j0+PV_COLS] += ap · b[k0:k1, j0:j0+PV_COLS], ap the rows' a[:, k0:k1] packed
 * k-major (ap[(k - k0) * MR + r], zeros for rows past `rows`); `first`: start from 0 */
AVX512 static inline __attribute__((always_inline)) void pv_kernel(const float *ap, int rows, const float *b, int64_t ldb, int64_t k0, int64_t k1,
                             float *y, int64_t ldy, int64_t cols, int first) {
    __m512 acc[MR][4];
    __mmask16 mk[4];
    for (int v = 0; v < 4; v++) {
        const int64_t c = cols - 16 * v;
        mk[v] = c >= 16 ? 0xFFFF : c <= 0 ? 0 : (__mmask16)((1u << c) - 1);
    }
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < 4; v++)
            acc[r][v] = first || r >= rows ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mk[v], y + r * ldy + 16 * v);
    for (int64_t k = k0; k < k1; k++, ap += MR) {
        const float *bk = b + k * ldb;
        const __m512 b0 = _mm512_maskz_loadu_ps(mk[0], bk);
        const __m512 b1 = _mm512_maskz_loadu_ps(mk[1], bk + 16);
        const __m512 b2 = _mm512_maskz_loadu_ps(mk[2], bk + 32);
        const __m512 b3 = _mm512_maskz_loadu_ps(mk[3], bk + 48);
        for (int r = 0; r < MR; r++) {
            const __m512 x = _mm512_set1_ps(ap[r]);
            acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(x, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(x, b3, acc[r][3]);
        }
    }
    for (int r = 0; r < MR; r++)      /* a constant bound: acc stays in registers */
        if (r < rows)
            for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mk[v], acc[r][v]);
}

/* y[m, n] (stride ldy) = a[m, K] (stride lda) · b[K, n] (stride ldb); each output's sum runs over k
 * in order (a block of keys at a time, the accumulator kept in y between blocks: no extra rounding).
 * A block of keys' values is read once from memory and used by every row of the thread's share
 * before the next (a long context's values do not fit a cache: reading them once per six rows
 * made the product memory-bound, 3x slower than MKL at K3's 16k positions). */
AVX512 static int probs_v(const float *a, int64_t lda, const float *b, int64_t ldb, float *y, int64_t ldy,
                          int64_t m, int64_t n, int64_t K, int threads) {
    const int64_t blocks = (m + MR - 1) / MR;
    const int nt = threads_for(m * n * K, blocks, threads);
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const int me = nt > 1 ? omp_get_thread_num() : 0;
        const int64_t q0 = blocks * me / nt, q1 = blocks * (me + 1) / nt;   /* this thread's row blocks */
        float *ap = malloc((size_t)((q1 - q0) * PV_KBLOCK * MR) * sizeof(float) + 1);
        if (!ap) {
#pragma omp atomic write
            failed = 1;
        } else {
            int64_t k0 = 0;
            do {
                const int64_t k1 = K - k0 < PV_KBLOCK ? K : k0 + PV_KBLOCK;
                for (int64_t q = q0; q < q1; q++) {
                    const int64_t i0 = q * MR;
                    const int rows = (int)(m - i0 < MR ? m - i0 : MR);
                    float *aq = ap + (q - q0) * PV_KBLOCK * MR;
                    for (int64_t k = k0; k < k1; k++)
                        for (int r = 0; r < MR; r++) aq[(k - k0) * MR + r] = r < rows ? a[(i0 + r) * lda + k] : 0.0f;
                }
                for (int64_t j0 = 0; j0 < n; j0 += PV_COLS)
                    for (int64_t q = q0; q < q1; q++) {
                        const int64_t i0 = q * MR;
                        const int rows = (int)(m - i0 < MR ? m - i0 : MR);
                        pv_kernel(ap + (q - q0) * PV_KBLOCK * MR, rows, b + j0, ldb, k0, k1, y + i0 * ldy + j0, ldy,
                                  n - j0, k0 == 0);
                    }
                k0 = k1;
            } while (k0 < K);
            free(ap);
        }
    }
    return failed ? -1 : 0;
}

/* exp of 16 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial,
 * then scaled by 2^n), within 2 ulp; x below -87.3 gives 0 (a masked score's probability is 0). */
AVX512 static __m512 exp16(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.72283f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n));
}

/* In place, the softmax of each of `rows` rows of n (stride ld) over its first `see` columns,
 * row r seeing min(n, first + r / heads) (a causal group: the rows of query i, head h at
 * r = i * heads + h; first >= n: every column); the columns past it become 0. One thread a row,
 * in a fixed order: a row's bits depend on its values alone. */
AVX512 static void softmax_rows(float *x, int64_t ld, int64_t rows, int64_t n, int64_t heads, int64_t first,
                                int threads) {
    const int nt = threads_for(rows * n * 16, rows, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * ld;
        const int64_t see = first + r / heads < n ? first + r / heads : n;
        __m512 mv = _mm512_set1_ps(-INFINITY);
        int64_t j = 0;
        for (; j + 16 <= see; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(xr + j));
        const __mmask16 tail = (__mmask16)((1u << (see - j)) - 1);
        mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, xr + j));
        const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 sv = _mm512_setzero_ps();
        for (j = 0; j + 16 <= see; j += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(xr + j), mx));
            _mm512_storeu_ps(xr + j, e);
            sv = _mm512_add_ps(sv, e);
        }
        if (tail) {
            const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, xr + j), mx)));
            _mm512_mask_storeu_ps(xr + j, tail, e);
            sv = _mm512_add_ps(sv, e);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sv));
        for (j = 0; j + 16 <= see; j += 16) _mm512_storeu_ps(xr + j, _mm512_mul_ps(_mm512_loadu_ps(xr + j), inv));
        if (tail) _mm512_mask_storeu_ps(xr + j, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + j), inv));
        if (see < n) memset(xr + see, 0, (size_t)(n - see) * sizeof(float));
    }
}

#define PTR(T, x) ((T *)(uintptr_t)(x))

static int have_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* pack_keys(b, ldb, n, k, p, threads): p holds ceil(n / 32) * 32 * k floats */
static PyObject *py_pack_keys(PyObject *self, PyObject *args) {
    Py_ssize_t b, ldb, n, k, p;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnn|i", &b, &ldb, &n, &k, &p, &threads)) return NULL;
    if (!have_avx512() || !b || !p || n < 1 || k < 1 || ldb < k) {
        PyErr_SetString(PyExc_ValueError, "pack_keys: no AVX-512, or bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pack_keys(PTR(const float, b), ldb, n, k, PTR(float, p), threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* scores_nt(a, lda, p, y, ldy, m, n, k, scale, threads): p from pack_keys */
static PyObject *py_scores_nt(PyObject *self, PyObject *args) {
    Py_ssize_t a, lda, p, y, ldy, m, n, k;
    float scale;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnf|i", &a, &lda, &p, &y, &ldy, &m, &n, &k, &scale, &threads))
        return NULL;
    if (!have_avx512() || !a || !p || !y || m < 0 || n < 1 || k < 1 || lda < k || ldy < n) {
        PyErr_SetString(PyExc_ValueError, "scores_nt: no AVX-512, or bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    scores_nt(PTR(const float, a), lda, PTR(const float, p), PTR(float, y), ldy, m, n, k, scale, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* probs_v(a, lda, b, ldb, y, ldy, m, n, k, threads) */
static PyObject *py_probs_v(PyObject *self, PyObject *args) {
    Py_ssize_t a, lda, b, ldb, y, ldy, m, n, k;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnn|i", &a, &lda, &b, &ldb, &y, &ldy, &m, &n, &k, &threads)) return NULL;
    if (!have_avx512() || !a || !b || !y || m < 0 || n < 1 || k < 0 || lda < k || ldb < n || ldy < n) {
        PyErr_SetString(PyExc_ValueError, "probs_v: no AVX-512, or bad buffers or sizes");
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = probs_v(PTR(const float, a), lda, PTR(const float, b), ldb, PTR(float, y), ldy, m, n, k, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* softmax(x, ld, rows, n, heads, first, threads) */
static PyObject *py_softmax(PyObject *self, PyObject *args) {
    Py_ssize_t x, ld, rows, n, heads, first;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnn|i", &x, &ld, &rows, &n, &heads, &first, &threads)) return NULL;
    if (!have_avx512() || !x || rows < 0 || n < 1 || ld < n || heads < 1 || first < 1) {
        PyErr_SetString(PyExc_ValueError, "softmax: no AVX-512, or bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    softmax_rows(PTR(float, x), ld, rows, n, heads, first, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_available(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(have_avx512());
}

static PyMethodDef methods[] = {
    {"pack_keys", py_pack_keys, METH_VARARGS, "Keys packed for scores_nt."},
    {"scores_nt", py_scores_nt, METH_VARARGS, "scale * A Bᵀ in float32 (attention scores), B packed."},
    {"probs_v", py_probs_v, METH_VARARGS, "A B in float32 (attention probabilities times values)."},
    {"softmax", py_softmax, METH_VARARGS, "Causal softmax of a group's score rows in place."},
    {"available", py_available, METH_NOARGS, "Whether this CPU runs the kernels (AVX-512F)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attn", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__attn(void) { return PyModule_Create(&module); }
