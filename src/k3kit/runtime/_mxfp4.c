/* MXFP4 weights times float32 activations, without dequantizing the weights first.
 *
 * y[r, n] = sum_b d(e[n, b]) * sum_j kv(q[n, b, j]) * x[r, 32 b + j]
 *
 * W is a ggml MXFP4 matrix of n_out rows of k values: per row k/32 blocks of 17 bytes
 * (ggml-common.h block_mxfp4: e8m0 exponent e, then 16 bytes; element j is the low nibble
 * of byte j, element j + 16 its high nibble). kv is e2m1 doubled and d = 2^(e - 128) is the
 * halved scale (ggml's kvalues_mxfp4 and ggml_e8m0_to_fp32_half), so kv * d is exactly the
 * value ggml's dequantize_row_mxfp4 produces. The products and sums are float32, in this
 * file's order: the result agrees with "dequantize, then matmul in float32" to float32
 * rounding, not bit for bit.
 *
 * Why it exists: a routed expert that misses the cache would otherwise be dequantized whole
 * (11M values for a K3 expert matrix) just to be multiplied by one or a few rows. Reading the
 * 17-byte blocks directly costs about what one pass over the quantized bytes costs, and lets
 * the expert cache hold quantized bytes (4x the experts per MiB of bf16).
 *
 * AVX-512 and AVX2+FMA paths are chosen at run time by what the CPU has; the scalar path is
 * the reference and the fallback. A call may split its output columns over OpenMP threads
 * (the caller passes torch's thread count); each column's sum is the same either way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define K3_X86 1
#endif

#define QK 32
#define BLOCK_BYTES 17
#define ROW_TILE 4

static const int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static float E8M0_HALF[256];

static void init_tables(void) {
    for (int e = 0; e < 256; e++) {
        uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
        memcpy(&E8M0_HALF[e], &bits, sizeof bits);
    }
}

/* Each path computes output columns [n0, n1) of y[m, n_out]. */
static void matmul_scalar(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k,
                          const float *x, int64_t m, float *y) {
    const int64_t nb = k / QK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * nb * BLOCK_BYTES;
        for (int64_t r = 0; r < m; r++) {
            const float *xr = x + r * k;
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = row + b * BLOCK_BYTES;
                const float *xb = xr + b * QK;
                float s = 0.0f;
                for (int j = 0; j < QK / 2; j++) {
                    s += (float)KV[blk[1 + j] & 0x0F] * xb[j];
                    s += (float)KV[blk[1 + j] >> 4] * xb[j + QK / 2];
                }
                sum += E8M0_HALF[blk[0]] * s;
            }
            y[r * n_out + n] = sum;
        }
    }
}

#ifdef K3_X86
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One output row n against RT activation rows: each block is decoded once into four
 * 8-lane float vectors and used by every row of the tile. RT is a constant at each call
 * site, so the accumulators stay in registers. */
__attribute__((target("avx2,fma"), always_inline)) static inline void tile_avx2(
    const uint8_t *row, int64_t nb, const float *x, int64_t k, int RT, float *out, int64_t ldo) {
    const __m128i kv = _mm_loadu_si128((const __m128i *)KV);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m256 acc[ROW_TILE];
    for (int t = 0; t < RT; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * BLOCK_BYTES;
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
        const __m128i lo = _mm_shuffle_epi8(kv, _mm_and_si128(q, low4));
        const __m128i hi = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        const __m256 d = _mm256_broadcast_ss(&E8M0_HALF[blk[0]]);
        for (int t = 0; t < RT; t++) {
            const float *xb = x + t * k + b * QK;
            __m256 s0 = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
            __m256 s1 = _mm256_mul_ps(w2, _mm256_loadu_ps(xb + 16));
            s0 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s0);
            s1 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s1);
            acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s0, s1), d, acc[t]);
        }
    }
    for (int t = 0; t < RT; t++) out[t * ldo] = hsum256(acc[t]);
}

/* The same with 16-lane vectors: a block's 32 values are two vectors, so decoding costs half
 * the instructions of the AVX2 path. */
__attribute__((target("avx512f"), always_inline)) static inline void tile_avx512(
    const uint8_t *row, int64_t nb, const float *x, int64_t k, int RT, float *out, int64_t ldo) {
    const __m128i kv = _mm_loadu_si128((const __m128i *)KV);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m512 acc[ROW_TILE];
    for (int t = 0; t < RT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * BLOCK_BYTES;
        const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
        const __m128i lo = _mm_shuffle_epi8(kv, _mm_and_si128(q, low4));
        const __m128i hi = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
        const __m512 d = _mm512_set1_ps(E8M0_HALF[blk[0]]);
        for (int t = 0; t < RT; t++) {
            const float *xb = x + t * k + b * QK;
            __m512 s = _mm512_mul_ps(w0, _mm512_loadu_ps(xb));
            s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), s);
            acc[t] = _mm512_fmadd_ps(s, d, acc[t]);
        }
    }
    for (int t = 0; t < RT; t++) out[t * ldo] = _mm512_reduce_add_ps(acc[t]);
}

/* The driver over output columns [n0, n1) for one vector path: full row tiles, then the rest
 * with a constant tile height so each call inlines into its own register allocation. One
 * definition for both paths; the target attribute must match the tile function's. */
#define DEFINE_MATMUL(NAME, TARGET, TILE)                                                           \
    __attribute__((target(TARGET))) static void NAME(const uint8_t *w, int64_t n0, int64_t n1,    \
                                                     int64_t n_out, int64_t k, const float *x,   \
                                                     int64_t m, float *y) {                      \
        const int64_t nb = k / QK;                                                                 \
        for (int64_t n = n0; n < n1; n++) {                                                        \
            const uint8_t *row = w + n * nb * BLOCK_BYTES;                                         \
            int64_t r = 0;                                                                         \
            for (; r + ROW_TILE <= m; r += ROW_TILE)                                               \
                TILE(row, nb, x + r * k, k, ROW_TILE, y + r * n_out + n, n_out);                   \
            switch (m - r) {                                                                       \
            case 3: TILE(row, nb, x + r * k, k, 3, y + r * n_out + n, n_out); break;               \
            case 2: TILE(row, nb, x + r * k, k, 2, y + r * n_out + n, n_out); break;               \
            case 1: TILE(row, nb, x + r * k, k, 1, y + r * n_out + n, n_out); break;               \
            default: break;                                                                        \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_MATMUL(matmul_avx2, "avx2,fma", tile_avx2)
DEFINE_MATMUL(matmul_avx512, "avx512f", tile_avx512)
#endif

/* 0 scalar, 1 AVX2+FMA, 2 AVX-512F: the best this CPU runs, set at import. */
static int use_simd = 0;

typedef struct {
    const uint8_t *w;
    const float *x;
    float *y;
    int64_t n0, n1, n_out, k, m;
    int level;
} job_t;

static void *run_job(void *arg) {
    const job_t *j = arg;
#ifdef K3_X86
    if (j->level == 2) {
        matmul_avx512(j->w, j->n0, j->n1, j->n_out, j->k, j->x, j->m, j->y);
        return NULL;
    }
    if (j->level == 1) {
        matmul_avx2(j->w, j->n0, j->n1, j->n_out, j->k, j->x, j->m, j->y);
        return NULL;
    }
#endif
    matmul_scalar(j->w, j->n0, j->n1, j->n_out, j->k, j->x, j->m, j->y);
    return NULL;
}

#define MAX_THREADS 256
/* Below this many weights a call is over before threads would have started. */
#define MIN_WEIGHTS_PER_THREAD (1 << 19)

/* Split the output columns over `threads` OpenMP threads. Built against libgomp, this resolves
 * to the libgomp torch has already loaded (same soname), so the split runs on torch's own
 * worker threads: no second pool competing for the cores with torch's spinning one. */
static void run_split(job_t base, int threads) {
    const int64_t work = base.n_out * base.k;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && work / threads < MIN_WEIGHTS_PER_THREAD) threads = (int)(work / MIN_WEIGHTS_PER_THREAD);
    if (threads > base.n_out) threads = (int)base.n_out;
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) {
            job_t j = base;
            j.n0 = base.n_out * t / threads;
            j.n1 = base.n_out * (t + 1) / threads;
            run_job(&j);
        }
        return;
    }
#endif
    run_job(&base);
}

/* matmul(w, x, y, n_out, k, m, simd=-1, threads=1): y[m, n_out] = x[m, k] @ W.T for MXFP4
 * W[n_out, k]. w, x and y are contiguous buffers (uint8, float32, float32); sizes are checked
 * here. simd: -1 the best path, else 0 scalar, 1 AVX2, 2 AVX-512 (capped at what the CPU has).
 * threads: split the output columns over this many threads (small products use fewer). */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    Py_ssize_t n_out, k, m;
    int simd = -1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*w*nnn|ii", &w, &x, &y, &n_out, &k, &m, &simd, &threads)) return NULL;
    PyObject *ret = NULL;
    if (n_out < 0 || k < 0 || m < 0 || k % QK) {
        PyErr_SetString(PyExc_ValueError, "matmul: bad dimensions (k must be a multiple of 32)");
    } else if (w.len != n_out * (k / QK) * BLOCK_BYTES) {
        PyErr_Format(PyExc_ValueError, "matmul: weight buffer is %zd bytes, expected %zd", w.len,
                     n_out * (k / QK) * BLOCK_BYTES);
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || y.len != m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul: activation or output buffer has the wrong size");
    } else {
        const job_t job = {w.buf, x.buf, y.buf, 0, n_out, n_out, k, m,
                           simd < 0 || simd > use_simd ? use_simd : simd};
        Py_BEGIN_ALLOW_THREADS
        run_split(job, threads);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

static PyObject *py_simd(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    static const char *names[] = {"scalar", "avx2", "avx512"};
    return PyUnicode_FromString(names[use_simd]);
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "y = x @ W.T for an MXFP4 W (see the module source)."},
    {"simd", py_simd, METH_NOARGS, "The best path the CPU runs: 'avx512', 'avx2' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_mxfp4", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mxfp4(void) {
    init_tables();
#ifdef K3_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) use_simd = 1;
    if (use_simd && __builtin_cpu_supports("avx512f")) use_simd = 2;
#endif
    return PyModule_Create(&module);
}
