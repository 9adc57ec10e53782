/* The KDA (Kimi Delta Attention) recurrence, T rows of B sequences x H heads in one pass.
 *
 * Per sequence b, head h and row t, with the state S [dk, dv] (S[i, j] maps key dim i to value
 * dim j), e = exp(g) the row's per-key-dim decay, k, q [dk], v [dv], beta a scalar:
 *     S'      = S * e[:, None]
 *     kv[j]   = sum_i S'[i, j] k[i]
 *     delta   = (v - kv) * beta
 *     S''     = S' + k[:, None] * delta[None, :]
 *     o[j]    = (sum_i S''[i, j] q[i]) * scale
 * which is kda.delta_step followed by kda.delta_rule's output (the torch code, kept as the
 * reference and the fallback).
 *
 * Why it exists: torch runs those lines as ~7 separate passes over the state (6.3 MB a K3
 * sequence: 96 heads of 128 x 128 floats), so a decode pass of 8 sequences streams ~350 MB per
 * KDA layer. Every line above touches column j of S only (and delta[j], kv[j], o[j] are per
 * column), so a block of columns can run all its steps while it sits in L1: each head's state
 * is read from memory once and written once, for any number of rows T (prefill, a verify block).
 *
 * The contract (tests/models/test_kda_fused.py):
 * - Each element is computed in one fixed order, the same on every path: S' and S'' are the
 *   same roundings as torch's elementwise ops (the caller passes e = torch.exp(g)), and the two
 *   column sums kv[j] and o[j] add the 128 products i = 0, 1, ... in order into one float per
 *   column. Vector lanes are columns, so the AVX-512, AVX2 and scalar paths give the same bits
 *   (no FMA anywhere: the build passes -ffp-contract=off, and the vector code multiplies then
 *   adds). The sums' order differs from torch's einsum, so against the torch path results agree
 *   to float32 rounding, not bit for bit.
 * - A (sequence, head) is one unit of work done by one thread, whatever the other sequences are:
 *   a sequence's results are the same alone, batched with others, and for any thread count.
 *   Threads (OpenMP, resolving to the libgomp torch has loaded, as in native/qm_module.c) split the
 *   B * H units.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define K3_X86 1
#endif

#define INLINE static inline __attribute__((always_inline))
/* The largest value dim the scalar path's per-column sums hold on the stack. */
#define MAX_DV 4096

/* One row's inputs for one (sequence, head), and where its outputs go. */
typedef struct {
    const float *e, *k, *q;     /* [dk] decay, key, query (q NULL: no output wanted) */
    const float *v;             /* [dv] */
    float beta, scale;
    float *o;                   /* [dv] or NULL */
} row_t;

/* Columns j0 .. j0 + n - 1 of one step: src and dst point at S[0, 0] (row stride dv); they may
 * be the same state (in place: each element is read before it is written). */
static void cols_scalar(const float *src, float *dst, const row_t *r, int64_t dk, int64_t dv, int64_t j0,
                        int64_t n) {
    float kv[MAX_DV], d[MAX_DV];
    for (int64_t j = 0; j < n; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *row = src + i * dv + j0;
        const float ei = r->e[i], ki = r->k[i];
        for (int64_t j = 0; j < n; j++) kv[j] = kv[j] + (row[j] * ei) * ki;
    }
    for (int64_t j = 0; j < n; j++) {
        d[j] = (r->v[j0 + j] - kv[j]) * r->beta;
        kv[j] = 0.0f;                                   /* now the output sums */
    }
    for (int64_t i = 0; i < dk; i++) {
        const float *row = src + i * dv + j0;
        float *out = dst + i * dv + j0;
        const float ei = r->e[i], ki = r->k[i], qi = r->q ? r->q[i] : 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float s = row[j] * ei + ki * d[j];
            out[j] = s;
            kv[j] = kv[j] + s * qi;
        }
    }
    if (r->o)
        for (int64_t j = 0; j < n; j++) r->o[j0 + j] = kv[j] * r->scale;
}

#ifdef K3_X86
/* The same as cols_scalar on NV vectors of columns, the sums held in registers. */
#define DEF_COLS(NAME, TARGET, VEC, W, LOAD, STORE, SET1, ZERO, ADD, SUB, MUL, NV)                           \
    static __attribute__((target(TARGET))) void NAME(const float *src, float *dst, const row_t *r, int64_t dk, \
                                                     int64_t dv, int64_t j0) {                               \
        VEC acc[NV], d[NV];                                                                                    \
        for (int c = 0; c < NV; c++) acc[c] = ZERO();                                                          \
        for (int64_t i = 0; i < dk; i++) {                                                                     \
            const float *row = src + i * dv + j0;                                                              \
            const VEC ei = SET1(r->e[i]), ki = SET1(r->k[i]);                                                  \
            for (int c = 0; c < NV; c++) acc[c] = ADD(acc[c], MUL(MUL(LOAD(row + W * c), ei), ki));            \
        }                                                                                                      \
        const VEC beta = SET1(r->beta);                                                                        \
        for (int c = 0; c < NV; c++) {                                                                         \
            d[c] = MUL(SUB(LOAD(r->v + j0 + W * c), acc[c]), beta);                                            \
            acc[c] = ZERO();                                                                                   \
        }                                                                                                      \
        if (r->q) {                                                                                            \
            for (int64_t i = 0; i < dk; i++) {                                                                 \
                const float *row = src + i * dv + j0;                                                          \
                float *out = dst + i * dv + j0;                                                                \
                const VEC ei = SET1(r->e[i]), ki = SET1(r->k[i]), qi = SET1(r->q[i]);                          \
                for (int c = 0; c < NV; c++) {                                                                 \
                    const VEC s = ADD(MUL(LOAD(row + W * c), ei), MUL(ki, d[c]));                              \
                    STORE(out + W * c, s);                                                                     \
                    acc[c] = ADD(acc[c], MUL(s, qi));                                                          \
                }                                                                                              \
            }                                                                                                  \
            if (r->o) {                                                                                        \
                const VEC scale = SET1(r->scale);                                                              \
                for (int c = 0; c < NV; c++) STORE(r->o + j0 + W * c, MUL(acc[c], scale));                     \
            }                                                                                                  \
        } else {                                                                                               \
            for (int64_t i = 0; i < dk; i++) {                                                                 \
                const float *row = src + i * dv + j0;                                                          \
                float *out = dst + i * dv + j0;                                                                \
                const VEC ei = SET1(r->e[i]), ki = SET1(r->k[i]);                                              \
                for (int c = 0; c < NV; c++) STORE(out + W * c, ADD(MUL(LOAD(row + W * c), ei), MUL(ki, d[c]))); \
            }                                                                                                  \
        }                                                                                                      \
    }

#define AVX512_TARGET "avx512f"
#define AVX2_TARGET "avx2"
#define COLS512(NV) DEF_COLS(cols512_##NV, AVX512_TARGET, __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, \
                             _mm512_set1_ps, _mm512_setzero_ps, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps, NV)
#define COLS256(NV) DEF_COLS(cols256_##NV, AVX2_TARGET, __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, \
                             _mm256_set1_ps, _mm256_setzero_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps, NV)
COLS512(1) COLS512(2) COLS512(3) COLS512(4) COLS512(5) COLS512(6) COLS512(7) COLS512(8)
COLS256(1) COLS256(2) COLS256(3) COLS256(4) COLS256(5) COLS256(6) COLS256(7) COLS256(8)

typedef void (*cols_fn)(const float *, float *, const row_t *, int64_t, int64_t, int64_t);
static const cols_fn COLS512_FN[9] = {NULL, cols512_1, cols512_2, cols512_3, cols512_4,
                                      cols512_5, cols512_6, cols512_7, cols512_8};
static const cols_fn COLS256_FN[9] = {NULL, cols256_1, cols256_2, cols256_3, cols256_4,
                                      cols256_5, cols256_6, cols256_7, cols256_8};
#endif

/* 0 scalar, 1 AVX2, 2 AVX-512F: the best path this CPU runs (set at import). */
static int use_simd = 0;

typedef struct {
    const float *s_in;
    float *s_out;
    const float *q, *k, *v, *e, *beta;
    float *o;
    int64_t B, T, H, dk, dv;
    float scale;
    int level;
} job_t;

/* All T rows of unit u = b * H + h, block of columns by block of columns: a block (64 KB of a
 * 128 x 128 head at most) stays in cache for every row. */
static void run_unit(const job_t *jb, int64_t u) {
    const int64_t b = u / jb->H, h = u % jb->H, dk = jb->dk, dv = jb->dv;
    const int64_t base = u * dk * dv;
    int width = 1;   /* floats per vector */
#ifdef K3_X86
    if (jb->level == 2) width = 16;
    else if (jb->level == 1) width = 8;
#endif
    const int64_t block = width > 1 ? 8 * width : dv;
    for (int64_t j0 = 0; j0 < dv; j0 += block) {
        const int64_t n = dv - j0 < block ? dv - j0 : block;
        for (int64_t t = 0; t < jb->T; t++) {
            const int64_t rk = ((b * jb->T + t) * jb->H + h);   /* row index into [B, T, H, ...] */
            const row_t r = {jb->e + rk * dk, jb->k + rk * dk, jb->q ? jb->q + rk * dk : NULL, jb->v + rk * dv,
                             jb->beta[rk], jb->scale, jb->o ? jb->o + rk * dv : NULL};
            const float *src = (t == 0 ? jb->s_in : jb->s_out) + base;
            float *dst = jb->s_out + base;
            int64_t done = 0;
#ifdef K3_X86
            const int64_t nv = n / width;
            if (width == 16 && nv) COLS512_FN[nv](src, dst, &r, dk, dv, j0);
            else if (width == 8 && nv) COLS256_FN[nv](src, dst, &r, dk, dv, j0);
            done = width > 1 ? nv * width : 0;
#endif
            if (done < n) cols_scalar(src, dst, &r, dk, dv, j0 + done, n - done);
        }
    }
}

/* State elements a call updates (units x rows x dk x dv) below which it runs on the calling thread:
 * waking a team that sleeps (k3kit runs OpenMP passive) costs ~50-90 us, where the mini's decode
 * row (2 heads of 64 x 64) is ~3 us of work; a K3 row (64 heads of 128 x 128) is far above it. */
#define KDA_PARALLEL_FROM (1 << 18)

static void run(const job_t *jb, int threads) {
    const int64_t units = jb->B * jb->H;
    if (threads > units) threads = (int)units;
    if (units * jb->T * jb->dk * jb->dv < KDA_PARALLEL_FROM) threads = 1;
#ifdef _OPENMP
    if (threads > 1) {
        /* dynamic: on a shared machine a thread that loses its core leaves its units to the
         * others instead of holding up the call (a unit's bits do not depend on its thread) */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
        for (int64_t u = 0; u < units; u++) run_unit(jb, u);
        return;
    }
#endif
    for (int64_t u = 0; u < units; u++) run_unit(jb, u);
}

/* An optional float32 buffer argument: None -> buf->buf NULL. */
static int get_buffer(PyObject *obj, Py_buffer *buf, int writable, const char *name, Py_ssize_t want) {
    memset(buf, 0, sizeof(*buf));
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, buf, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (buf->len != want * (Py_ssize_t)sizeof(float)) {
        PyErr_Format(PyExc_ValueError, "kda_rows: %s buffer is %zd bytes, expected %zd", name, buf->len,
                     want * (Py_ssize_t)sizeof(float));
        PyBuffer_Release(buf);
        buf->buf = NULL;
        buf->obj = NULL;
        return -1;
    }
    return 0;
}

/* kda_rows(s_in, s_out, q, k, v, e, beta, o, B, T, H, dk, dv, scale, simd=-1, threads=1):
 * T steps of the recurrence above for B sequences x H heads. Contiguous float32 buffers:
 * s_in, s_out [B, H, dk, dv] (the same buffer = in place; otherwise they must not overlap),
 * q, k, e [B, T, H, dk] (e = exp(g)), v and o [B, T, H, dv], beta [B, T, H]. q and o may be
 * None (a replay that needs only the state). simd: -1 the best path, else 0 scalar, 1 AVX2,
 * 2 AVX-512 (capped at what the CPU has): the same bits on each. threads: split the B * H
 * (sequence, head) units (the same bits for any count). */
static PyObject *py_kda_rows(PyObject *self, PyObject *args) {
    PyObject *objs[8];
    Py_ssize_t B, T, H, dk, dv;
    float scale;
    int simd = -1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnnnnf|ii", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          &objs[6], &objs[7], &B, &T, &H, &dk, &dv, &scale, &simd, &threads))
        return NULL;
    if (B < 0 || T < 0 || H < 0 || dk < 1 || dv < 1 || dv > MAX_DV) {
        PyErr_Format(PyExc_ValueError, "kda_rows: bad dimensions (dk and dv must be 1..%d)", MAX_DV);
        return NULL;
    }
    static const char *names[8] = {"s_in", "s_out", "q", "k", "v", "e", "beta", "o"};
    const Py_ssize_t state = B * H * dk * dv, rows = B * T * H;
    const Py_ssize_t want[8] = {state, state, rows * dk, rows * dk, rows * dv, rows * dk, rows, rows * dv};
    const int writable[8] = {0, 1, 0, 0, 0, 0, 0, 1};
    const int optional[8] = {0, 0, 1, 0, 0, 0, 0, 1};
    Py_buffer bufs[8];
    int got = 0;
    for (; got < 8; got++) {
        if (!optional[got] && objs[got] == Py_None) {
            PyErr_Format(PyExc_TypeError, "kda_rows: %s may not be None", names[got]);
            break;
        }
        if (get_buffer(objs[got], &bufs[got], writable[got], names[got], want[got]) < 0) break;
    }
    PyObject *ret = NULL;
    if (got == 8) {
        const int level = simd < 0 || simd > use_simd ? use_simd : simd;
        const job_t jb = {bufs[0].buf, bufs[1].buf, bufs[2].buf, bufs[3].buf, bufs[4].buf, bufs[5].buf,
                          bufs[6].buf, bufs[7].buf, B, T, H, dk, dv, scale, level};
        Py_BEGIN_ALLOW_THREADS
        if (T > 0) run(&jb, threads < 1 ? 1 : threads);
        else if (jb.s_out != jb.s_in) memcpy(jb.s_out, jb.s_in, (size_t)state * sizeof(float));
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    for (int i = 0; i < got; i++)
        if (bufs[i].obj != NULL) PyBuffer_Release(&bufs[i]);
    return ret;
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(use_simd == 2 ? "avx512" : use_simd == 1 ? "avx2" : "scalar");
}

static PyMethodDef methods[] = {
    {"kda_rows", py_kda_rows, METH_VARARGS, "T steps of the KDA recurrence for B x H heads (see the source)."},
    {"simd", py_simd, METH_NOARGS, "The best path the CPU runs: 'avx512', 'avx2' or 'scalar'."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kda", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__kda(void) {
#ifdef K3_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) use_simd = 1;
    if (use_simd && __builtin_cpu_supports("avx512f")) use_simd = 2;
#endif
    return PyModule_Create(&module);
}
