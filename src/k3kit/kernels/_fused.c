/* Row-wise elementwise steps of a K3 layer, each one call instead of 4-12 torch ops.
 *
 * Why it exists: on a decode row the arithmetic of a norm or a gate is a few hundred floats, and
 * torch spends more time dispatching its 4-12 ops (and Python building them) than computing them;
 * a K3 decode step runs ~8 norms, 2 residual mixes and a gate per layer. These functions do each
 * step in one pass over a row, called from k3kit.kernels.fused with the tensors' addresses (a
 * tensor's `.numpy()` is itself an aten op; the wrapper checks dtype, device, contiguity and
 * shapes before it passes an address).
 *
 * The contract (tests/kernels/test_fused.py):
 * - Every row is computed by one thread in one fixed order, whatever the other rows are: a row's
 *   results are the same alone, batched, and for any thread count (batch invariance).
 * - The norms follow ggml's ggml_compute_forward_rms_norm_f32: the squares x*x rounded to float,
 *   summed in double (here in 8 double lanes, then the lanes in order: within double rounding of
 *   ggml's one running sum, so float results agree with ggml's except where a double-rounded sum
 *   sits on a float rounding boundary), mean = (float)(sum / n), scale = 1.0f / sqrtf(mean + eps),
 *   y = x * scale * w. torch's float32 mean differs from that in the last bit at times; against
 *   the torch steps results agree to float32 rounding.
 * - No FMA anywhere (-ffp-contract=off): each product and sum rounds as it is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
/* rows * width below this run on the calling thread (a thread team costs more than the work) */
#define PARALLEL_FROM 65536
/* the most checkpoints a residual mix takes (K3: one per block of layers, 93 / block size) */
#define MAX_BANK 64

static double sum_squares(const float *x, int64_t n) {
    double acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += (double)(x[i + l] * x[i + l]);
    for (int l = 0; i < n; i++, l++) acc[l] += (double)(x[i] * x[i]);
    double s = 0.0;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* ggml's rms scale of a row: 1 / sqrt(mean(x^2) + eps), the mean rounded to float */
static float rms_scale(const float *x, int64_t n, float eps) {
    const float mean = (float)(sum_squares(x, n) / (double)n);
    return 1.0f / sqrtf(mean + eps);
}

static int threads_for(int64_t rows, int64_t width, int threads) {
    if (threads < 1 || rows * width < PARALLEL_FROM) return 1;
    return rows < threads ? (int)rows : threads;
}

/* y = x * scale(x) * w [* gate], row by row; w may be NULL (no weight), gate NULL (none) */
static void norm_rows(const float *x, const float *w, const float *gate, float *y, int64_t rows, int64_t n,
                      float eps, int l2, int threads) {
    const int nt = threads_for(rows, n, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        const float scale = l2 ? 1.0f / sqrtf((float)sum_squares(xr, n) + eps) : rms_scale(xr, n, eps);
        const float *gr = gate ? gate + r * n : NULL;
        for (int64_t i = 0; i < n; i++) {
            float v = xr[i] * scale;
            if (w) v = v * w[i];
            if (gr) v = v * gr[i];
            yr[i] = v;
        }
    }
}

/* exp, tanh and sigmoid on 8 floats at a time (GCC vector extensions: SSE2 pairs on any x86-64,
 * wider where the clone for the CPU runs), Cephes' single-precision polynomials (within 2 ulp
 * over the float range; exp clamps to [-87.3, 88.3]). There is no scalar path: a short tail
 * runs through a zero-padded vector, and every lane runs the same operations, each rounded (no
 * FMA), so a value's bits depend neither on the vector width nor on its neighbours. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
#define VL 8

static inline vf sel(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }

static inline vf exp_v(vf x) {
    x = sel(x < splat(-87.3f), splat(-87.3f), x);        /* 2^n stays a normal float */
    x = sel(x > splat(88.3f), splat(88.3f), x);
    const vf fx = x * 1.44269504088896341f + 0.5f;
    vi n = __builtin_convertvector(fx, vi);
    n = n + (__builtin_convertvector(n, vf) > fx);       /* floor: -1 where truncation rounded up */
    const vf fn = __builtin_convertvector(n, vf);
    vf r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    return p * (vf)((n + 127) << 23);
}

static inline vf sigmoid_v(vf x) { return 1.0f / (1.0f + exp_v(-x)); }

static inline vf tanh_v(vf x) {
    const vi sign = (vi)x & (int32_t)0x80000000;
    const vf ax = (vf)((vi)x & 0x7fffffff);
    const vf z = x * x;                                  /* |x| < 0.625: the odd polynomial */
    vf p = splat(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const vf small = x + x * z * p;
    const vf big = (vf)((vi)(1.0f - 2.0f / (exp_v(2.0f * ax) + 1.0f)) | sign);   /* else from exp */
    return sel(ax < splat(0.625f), small, big);
}

static inline vf load_v(const float *p, int64_t n) {
    vf v = splat(0.0f);
    memcpy(&v, p, (size_t)(n < VL ? n : VL) * sizeof(float));
    return v;
}

static inline void store_v(float *p, vf v, int64_t n) { memcpy(p, &v, (size_t)(n < VL ? n : VL) * sizeof(float)); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* K3's situ: beta * tanh(g / beta) * sigmoid(g) * (lb > 0 ? lb * tanh(u / lb) : u) */
VECTOR_CLONES static void situ_span(const float *g, const float *u, float *y, int64_t n, float beta, float lb) {
    const float ib = 1.0f / beta, il = lb > 0.0f ? 1.0f / lb : 0.0f;
    for (int64_t i = 0; i < n; i += VL) {
        const vf gv = load_v(g + i, n - i), uv = load_v(u + i, n - i);
        const vf a = (tanh_v(gv * ib) * beta) * sigmoid_v(gv);
        store_v(y + i, a * (lb > 0.0f ? tanh_v(uv * il) * lb : uv), n - i);
    }
}

#define SITU_CHUNK 16384

static void situ_rows(const float *g, const float *u, float *y, int64_t n, float beta, float lb, int threads) {
    const int64_t chunks = (n + SITU_CHUNK - 1) / SITU_CHUNK;
    const int nt = threads_for(n, 1, threads) > chunks ? (int)chunks : threads_for(n, 1, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t a = c * SITU_CHUNK, len = n - a < SITU_CHUNK ? n - a : SITU_CHUNK;
        situ_span(g + a, u + a, y + a, len, beta, lb);
    }
}

/* SiLU in place over n values: y / (1 + exp(-y)) */
VECTOR_CLONES static void silu_span(float *o, int64_t n) {
    for (int64_t i = 0; i < n; i += VL) {
        const vf v = load_v(o + i, n - i);
        store_v(o + i, v / (1.0f + exp_v(-v)), n - i);
    }
}

/* The attn-res mix of one row: scores s_i = sum_j (x_ij * scale(x_i)) * w_j over the bank's rows
 * and the current row (last), p = softmax(s), y = sum_i p_i x_i over the bank in order, + p_cur cur. */
static void mix_rows(const float *const *bank, int64_t nb, const float *cur, const float *w, float *y,
                     int64_t rows, int64_t n, float eps, int threads) {
    const int nt = threads_for(rows, n * (nb + 1), threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t r = 0; r < rows; r++) {
        float s[MAX_BANK + 1];
        for (int64_t b = 0; b <= nb; b++) {
            const float *xr = (b < nb ? bank[b] : cur) + r * n;
            const float scale = rms_scale(xr, n, eps);
            double acc[LANES] = {0};
            int64_t i = 0;
            for (; i + LANES <= n; i += LANES)
                for (int l = 0; l < LANES; l++) acc[l] += (double)((xr[i + l] * scale) * w[i + l]);
            for (int l = 0; i < n; i++, l++) acc[l] += (double)((xr[i] * scale) * w[i]);
            double t = 0.0;
            for (int l = 0; l < LANES; l++) t += acc[l];
            s[b] = (float)t;
        }
        float mx = s[0];
        for (int64_t b = 1; b <= nb; b++) mx = s[b] > mx ? s[b] : mx;
        float tot = 0.0f;
        for (int64_t b = 0; b <= nb; b++) {
            s[b] = expf(s[b] - mx);
            tot = tot + s[b];
        }
        for (int64_t b = 0; b <= nb; b++) s[b] = s[b] / tot;
        float *yr = y + r * n;
        const float *cr = cur + r * n;
        for (int64_t i = 0; i < n; i++) {
            float v = bank[0][r * n + i] * s[0];
            for (int64_t b = 1; b < nb; b++) v = v + bank[b][r * n + i] * s[b];
            yr[i] = v + cr[i] * s[nb];
        }
    }
}

/* KDA's three depthwise causal convs + SiLU for B sequences: window [B, 3, K-1, C] (past inputs),
 * x [B, T, 3, C], taps [3, K, C] (tap j of each channel); out [3, B, T, C] (q, k, v after SiLU, each
 * contiguous), new_window [B, 3, K-1, C]. y[t] = xx[t] w_0 + xx[t+1] w_1 + ... in that order (the
 * torch steps' products and sums), then y / (1 + exp(-y)). */
static void conv_rows(const float *window, const float *x, const float *taps, float *out, float *new_window,
                      int64_t B, int64_t T, int64_t C, int64_t K, int64_t rs, int64_t cs, int threads) {
    const int nt = threads_for(B * 3, T * C * K, threads);
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int64_t u = 0; u < B * 3; u++) {
        const int64_t b = u / 3, i = u % 3;
        const float *win = window + (b * 3 + i) * (K - 1) * C;
        const float *w = taps + i * K * C;
        /* xx[s] is the window's row s for s < K-1, else x's row s - (K-1) */
#define XX(s) ((s) < K - 1 ? win + (s) * C : x + (b * T + (s) - (K - 1)) * rs + i * cs)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + ((i * B + b) * T + t) * C;
            const float *x0 = XX(t);
            for (int64_t c = 0; c < C; c++) o[c] = x0[c] * w[c];
            for (int64_t j = 1; j < K; j++) {
                const float *xj = XX(t + j), *wj = w + j * C;
                for (int64_t c = 0; c < C; c++) o[c] = o[c] + xj[c] * wj[c];
            }
            silu_span(o, C);
        }
        float *nw = new_window + (b * 3 + i) * (K - 1) * C;
        for (int64_t s = 0; s < K - 1; s++) memcpy(nw + s * C, XX(T + s), (size_t)C * sizeof(float));
#undef XX
    }
}

/* The routed experts' outputs back onto their rows: y [P, d] in grouped order, order [P] (int64
 * pair indices n * k + j), w [N, k] routing weights; out[n] = y_(n,0) w_(n,0) + y_(n,1) w_(n,1)
 * + ... added in slot order j, each product rounded, then each sum (ggml's order; the torch steps'
 * index_put of y * w and slot sum give the same bits). Every pair must be routed (P = N * k);
 * where[n * k + j] is that pair's row of y (the inverse of order). */
static void slot_rows(const float *y, const int64_t *where, const float *w, float *out, int64_t N, int64_t k,
                      int64_t d) {
    for (int64_t n = 0; n < N; n++) {
        float *o = out + n * d;
        const float *y0 = y + where[n * k] * d;
        const float w0 = w[n * k];
        for (int64_t c = 0; c < d; c++) o[c] = y0[c] * w0;
        for (int64_t j = 1; j < k; j++) {
            const float *yj = y + where[n * k + j] * d;
            const float wj = w[n * k + j];
            for (int64_t c = 0; c < d; c++) o[c] = o[c] + yj[c] * wj;
        }
    }
}

/* NeoX rotary embedding of the first rd dims of each head: y = x * cos + rot(x) * sin, rot(x) =
 * [-x2, x1] over the two halves of those dims, cos and sin one [rd] row per token (shared by its
 * heads), the dims past rd copied. Each product and the sum round as written (no FMA), as torch's
 * `x * cos + rot * sin` rounds them: the same bits. */
static void rope_rows(const float *x, const float *cos_t, const float *sin_t, float *y, int64_t rows,
                      int64_t heads, int64_t hd, int64_t rd) {
    const int64_t half = rd / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_t + r * rd, *s = sin_t + r * rd;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + (r * heads + h) * hd;
            float *yr = y + (r * heads + h) * hd;
            for (int64_t i = 0; i < half; i++) {
                const float a = xr[i] * c[i], b = -xr[i + half] * s[i];
                yr[i] = a + b;
            }
            for (int64_t i = half; i < rd; i++) {
                const float a = xr[i] * c[i], b = xr[i - half] * s[i];
                yr[i] = a + b;
            }
            for (int64_t i = rd; i < hd; i++) yr[i] = xr[i];
        }
    }
}

/* DSpark's Markov chain, greedy: for k = 0 .. n-1, w1s[k] = W1[prev] (prev = the anchor, then
 * the token just chosen), rows[k][j] = base[k][j] + (sum over i in order of w1s[k][i] * W2[j][i]),
 * toks[k] = prev = argmax rows[k] (the first of equal maxima; a NaN wins, as torch.argmax has it).
 * W1 [V, r] and W2 transposed, w2t [r, V], float32: each rank step is one pass over the row,
 * vectorized across the vocabulary, every value's sum in the same order. One thread: the chain is
 * sequential and a row is a few hundred thousand multiply-adds at most. */
/* bits (NULL for none): one row's grammar bitmask of W words (bit t % 32 of word t / 32: token t
 * allowed; tokens from 32 W on are not), for a chain of one row: its token is then the best
 * allowed one (the first of equal maxima, a NaN winning; the first allowed token where every
 * allowed value is -inf), which is the argmax whenever the argmax is allowed. */
VECTOR_CLONES static void markov_chain(const float *base, const float *w1, const float *w2t, int64_t anchor,
                                       float *rows, int64_t *toks, float *w1s, int64_t n, int64_t V, int64_t r,
                                       const uint32_t *bits, int64_t W) {
    int64_t prev = anchor;
    for (int64_t k = 0; k < n; k++) {
        float *wk = w1s + k * r;
        memcpy(wk, w1 + prev * r, (size_t)r * sizeof(float));
        const float *bk = base + k * V;
        float *rk = rows + k * V;
        for (int64_t j = 0; j < V; j++) rk[j] = 0.0f;
        for (int64_t i = 0; i < r; i++) {
            const float c = wk[i], *col = w2t + i * V;
            for (int64_t j = 0; j < V; j++) rk[j] = rk[j] + c * col[j];
        }
        int64_t best = 0;
        float bv = 0.0f;
        int nan_seen = 0, any = 0;
        for (int64_t j = 0; j < V; j++) {
            const float v = bk[j] + rk[j];
            rk[j] = v;
            if (nan_seen) continue;
            if (bits != NULL && (j >= 32 * W || !((bits[j >> 5] >> (j & 31)) & 1u))) continue;
            if (v != v) { best = j; nan_seen = 1; }
            else if (!any || v > bv) { best = j; bv = v; }
            any = 1;
        }
        toks[k] = prev = best;
    }
}

#define PTR(T, a) ((T *)(uintptr_t)(a))

/* rms_norm(x, w, gate, y, rows, n, eps, l2=0, threads=1): addresses of contiguous float32 buffers
 * (w [n], gate [rows, n], x and y [rows, n]; w and gate 0 for none; y may be x). l2: the delta
 * rule's L2 norm (sum instead of mean, no weight). */
static PyObject *py_rms_norm(PyObject *self, PyObject *args) {
    Py_ssize_t x, w, gate, y, rows, n;
    float eps;
    int l2 = 0, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnf|ii", &x, &w, &gate, &y, &rows, &n, &eps, &l2, &threads)) return NULL;
    if (!x || !y || rows < 0 || n < 1) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    norm_rows(PTR(const float, x), PTR(const float, w), PTR(const float, gate), PTR(float, y), rows, n, eps, l2,
              threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* situ(g, u, y, n, beta, lb, threads=1): n elements (addresses of float32 buffers; y may be g or u) */
static PyObject *py_situ(PyObject *self, PyObject *args) {
    Py_ssize_t g, u, y, n;
    float beta, lb;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnff|i", &g, &u, &y, &n, &beta, &lb, &threads)) return NULL;
    if (!g || !u || !y || n < 0) {
        PyErr_SetString(PyExc_ValueError, "situ: bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    situ_rows(PTR(const float, g), PTR(const float, u), PTR(float, y), n, beta, lb, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* res_mix(bank, cur, w, y, rows, n, eps, threads=1): bank a tuple of 1..MAX_BANK addresses of
 * [rows, n] float32 buffers, cur and y [rows, n] (y must not be an input), w [n]. */
static PyObject *py_res_mix(PyObject *self, PyObject *args) {
    PyObject *bank;
    Py_ssize_t cur, w, y, rows, n;
    float eps;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!nnnnnf|i", &PyTuple_Type, &bank, &cur, &w, &y, &rows, &n, &eps, &threads))
        return NULL;
    const Py_ssize_t nb = PyTuple_GET_SIZE(bank);
    if (nb < 1 || nb > MAX_BANK || !cur || !w || !y || rows < 0 || n < 1) {
        PyErr_Format(PyExc_ValueError, "res_mix: bad buffers or sizes (1..%d checkpoints)", MAX_BANK);
        return NULL;
    }
    const float *ptrs[MAX_BANK];
    for (Py_ssize_t b = 0; b < nb; b++) {
        const Py_ssize_t a = PyLong_AsSsize_t(PyTuple_GET_ITEM(bank, b));
        if (a == -1 && PyErr_Occurred()) return NULL;
        ptrs[b] = PTR(const float, a);
    }
    Py_BEGIN_ALLOW_THREADS
    mix_rows(ptrs, nb, PTR(const float, cur), PTR(const float, w), PTR(float, y), rows, n, eps, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* short_conv(window, x, taps, out, new_window, B, T, C, K, threads=1, rs=3C, cs=C): addresses (see
 * conv_rows); x's row (b, t) of conv i starts at x + (b*T + t)*rs + i*cs floats (rs = 3C, cs = C:
 * [B, T, 3, C] contiguous; rs = C, cs = B*T*C: [3, B*T, C]); new_window must not overlap window or x. */
static PyObject *py_short_conv(PyObject *self, PyObject *args) {
    Py_ssize_t window, x, taps, out, new_window, B, T, C, K, rs = -1, cs = -1;
    int threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnn|inn", &window, &x, &taps, &out, &new_window, &B, &T, &C, &K, &threads,
                          &rs, &cs))
        return NULL;
    if (rs < 0) rs = 3 * C;
    if (cs < 0) cs = C;
    if (!window || !x || !taps || !out || !new_window || B < 0 || T < 0 || C < 1 || K < 2 || rs < C || cs < C) {
        PyErr_SetString(PyExc_ValueError, "short_conv: bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    conv_rows(PTR(const float, window), PTR(const float, x), PTR(const float, taps), PTR(float, out),
              PTR(float, new_window), B, T, C, K, rs, cs, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* slot_sum(y, order, w, out, N, k, d): addresses (see slot_rows); order must be a permutation of
 * 0 .. N*k-1 (checked). */
static PyObject *py_slot_sum(PyObject *self, PyObject *args) {
    Py_ssize_t y, order, w, out, N, k, d;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &y, &order, &w, &out, &N, &k, &d)) return NULL;
    if (!y || !order || !w || !out || N < 0 || k < 1 || d < 1) {
        PyErr_SetString(PyExc_ValueError, "slot_sum: bad buffers or sizes");
        return NULL;
    }
    const int64_t *ord = PTR(const int64_t, order);
    int64_t *where = PyMem_Malloc((size_t)(N * k > 0 ? N * k : 1) * sizeof(int64_t));
    if (where == NULL) return PyErr_NoMemory();
    for (int64_t i = 0; i < N * k; i++) where[i] = -1;
    for (int64_t i = 0; i < N * k; i++) {
        if (ord[i] < 0 || ord[i] >= N * k || where[ord[i]] >= 0) {
            PyMem_Free(where);
            PyErr_SetString(PyExc_ValueError, "slot_sum: order is not a permutation of the pairs");
            return NULL;
        }
        where[ord[i]] = i;
    }
    Py_BEGIN_ALLOW_THREADS
    slot_rows(PTR(const float, y), where, PTR(const float, w), PTR(float, out), N, k, d);
    Py_END_ALLOW_THREADS
    PyMem_Free(where);
    Py_RETURN_NONE;
}

/* add(a, b, y, n, nb=0): y = a + b over n floats (nb > 0: b [nb] added to each row of nb);
 * mul(a, b, y, n): y = a * b; scale(a, s, y, rows, n, period=0): y[r, i] = a[r, i] * s[r] (period
 * > 0: s[r % period], one float per head of rows of heads). Each result one IEEE operation on the same two floats as torch's add
 * and mul of float32 tensors (a Python scalar is taken as the float32 torch would make of it), so
 * the same bits; y may be a or b. A decode row's residual adds and KDA's gate arithmetic were
 * torch ops, each costing more in the dispatcher than its 256 or 128 additions. */
/* route's weights [T, k] from the sigmoid scores probs [T, E] and the chosen ids [T, k] (int64):
   each score gathered; with renormalisation their sum accumulated in double in slot order and
   rounded once to float (torch's CPU cumsum, ggml's sum_rows), clamped below at wmin (a NaN sum
   passes, as torch's clamp_min), each score divided by it; then times the scaling factor (a
   float32) unless it is 0 or 1. Each step one IEEE float operation, as torch's. */
static PyObject *py_route_weights(PyObject *self, PyObject *args) {
    Py_ssize_t probs, ids, out, T, k, E;
    int renorm;
    double wmin, factor;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnidd", &probs, &ids, &out, &T, &k, &E, &renorm, &wmin, &factor)) return NULL;
    if (!probs || !ids || !out || T < 0 || k < 1 || E < 1) {
        PyErr_SetString(PyExc_ValueError, "route_weights: bad buffers or sizes");
        return NULL;
    }
    const float *P = PTR(const float, probs);
    const int64_t *I = PTR(const int64_t, ids);
    float *W = PTR(float, out);
    const float m = (float)wmin, f = (float)factor;
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *p = P + t * E;
        const int64_t *id = I + t * k;
        float *w = W + t * k;
        for (Py_ssize_t j = 0; j < k; j++) {
            if (id[j] < 0 || id[j] >= E) {
                PyErr_SetString(PyExc_ValueError, "route_weights: an expert id outside [0, E)");
                return NULL;
            }
            w[j] = p[id[j]];
        }
        if (renorm) {
            double acc = 0.0;
            for (Py_ssize_t j = 0; j < k; j++) acc += (double)w[j];
            float sum = (float)acc;
            if (!(sum >= m) && sum == sum) sum = m;
            for (Py_ssize_t j = 0; j < k; j++) w[j] = w[j] / sum;
        }
        if (factor != 0.0 && factor != 1.0)
            for (Py_ssize_t j = 0; j < k; j++) w[j] = w[j] * f;
    }
    Py_RETURN_NONE;
}
static PyObject *py_add(PyObject *self, PyObject *args) {
    Py_ssize_t a, b, y, n, nb = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnn|n", &a, &b, &y, &n, &nb)) return NULL;
    if (!a || !b || !y || n < 0 || nb < 0 || (nb > 0 && n % nb)) {
        PyErr_SetString(PyExc_ValueError, "add: bad buffers or sizes");
        return NULL;
    }
    const float *pa = PTR(const float, a), *pb = PTR(const float, b);
    float *py = PTR(float, y);
    if (nb == 0 || nb == n) {
        for (Py_ssize_t i = 0; i < n; i++) py[i] = pa[i] + pb[i];
    } else {                            /* b [nb] broadcast over the rows of a [n / nb, nb] */
        for (Py_ssize_t r = 0; r < n; r += nb)
            for (Py_ssize_t i = 0; i < nb; i++) py[r + i] = pa[r + i] + pb[i];
    }
    Py_RETURN_NONE;
}

static PyObject *py_mul(PyObject *self, PyObject *args) {
    Py_ssize_t a, b, y, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnn", &a, &b, &y, &n)) return NULL;
    if (!a || !b || !y || n < 0) {
        PyErr_SetString(PyExc_ValueError, "mul: bad buffers or size");
        return NULL;
    }
    const float *pa = PTR(const float, a), *pb = PTR(const float, b);
    float *py = PTR(float, y);
    for (Py_ssize_t i = 0; i < n; i++) py[i] = pa[i] * pb[i];
    Py_RETURN_NONE;
}

static PyObject *py_scale(PyObject *self, PyObject *args) {
    Py_ssize_t a, s, y, rows, n, period = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnn|n", &a, &s, &y, &rows, &n, &period)) return NULL;
    if (!a || !s || !y || rows < 0 || n < 0 || period < 0) {
        PyErr_SetString(PyExc_ValueError, "scale: bad buffers or sizes");
        return NULL;
    }
    const float *pa = PTR(const float, a), *ps = PTR(const float, s);
    float *py = PTR(float, y);
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float c = ps[period ? r % period : r];
        for (Py_ssize_t i = 0; i < n; i++) py[r * n + i] = pa[r * n + i] * c;
    }
    Py_RETURN_NONE;
}

/* copy_rows(src, ss, dst, ds, rows, n): rows of n floats from src (row stride ss floats) to dst
 * (row stride ds): a strided copy or a concatenation's part (MLA's per-head query pieces), the
 * floats as they are. */
static PyObject *py_copy_rows(PyObject *self, PyObject *args) {
    Py_ssize_t src, ss, dst, ds, rows, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnn", &src, &ss, &dst, &ds, &rows, &n)) return NULL;
    if (!src || !dst || rows < 0 || n < 0 || ss < n || ds < n) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: bad buffers, strides or sizes");
        return NULL;
    }
    for (Py_ssize_t r = 0; r < rows; r++)
        memmove(PTR(float, dst) + r * ds, PTR(const float, src) + r * ss, (size_t)n * sizeof(float));
    Py_RETURN_NONE;
}

/* rope_neox(x, cos, sin, y, rows, heads, hd, rd): x and y [rows, heads, hd] (y may not be x),
 * cos and sin [rows, rd], rd even and <= hd */
static PyObject *py_rope_neox(PyObject *self, PyObject *args) {
    Py_ssize_t x, c, s, y, rows, heads, hd, rd;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnn", &x, &c, &s, &y, &rows, &heads, &hd, &rd)) return NULL;
    if (!x || !c || !s || !y || x == y || rows < 0 || heads < 1 || rd < 2 || rd % 2 || rd > hd) {
        PyErr_SetString(PyExc_ValueError, "rope_neox: bad buffers or sizes");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_rows(PTR(const float, x), PTR(const float, c), PTR(const float, s), PTR(float, y), rows, heads, hd, rd);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* markov_greedy(base, w1, w2t, anchor, rows, toks, w1s, n, V, r): base and rows [n, V] float32,
 * w1 [V, r] and w2t [r, V] float32, toks [n] int64, w1s [n, r] float32; 0 <= anchor < V */
static PyObject *py_markov_greedy(PyObject *self, PyObject *args) {
    Py_ssize_t base, w1, w2t, anchor, rows, toks, w1s, n, V, r;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &base, &w1, &w2t, &anchor, &rows, &toks, &w1s, &n, &V, &r))
        return NULL;
    if (!base || !w1 || !w2t || !rows || !toks || !w1s || n < 0 || V < 1 || r < 1 || anchor < 0 || anchor >= V) {
        PyErr_SetString(PyExc_ValueError, "markov_greedy: bad buffers, sizes or anchor");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    markov_chain(PTR(const float, base), PTR(const float, w1), PTR(const float, w2t), anchor, PTR(float, rows),
                 PTR(int64_t, toks), PTR(float, w1s), n, V, r, NULL, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* markov_masked(base, w1, w2t, prev, row, w1row, bits, V, r, W) -> token: one row of the chain
 * (markov_greedy's, n = 1, after `prev`) whose token is the best one a grammar's bitmask bits
 * [W] int32 allows. */
static PyObject *py_markov_masked(PyObject *self, PyObject *args) {
    Py_ssize_t base, w1, w2t, prev, row, w1row, bits, V, r, W;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnn", &base, &w1, &w2t, &prev, &row, &w1row, &bits, &V, &r, &W))
        return NULL;
    if (!base || !w1 || !w2t || !row || !w1row || !bits || V < 1 || r < 1 || W < 1 || prev < 0 || prev >= V) {
        PyErr_SetString(PyExc_ValueError, "markov_masked: bad buffers, sizes or token");
        return NULL;
    }
    int64_t tok = 0;
    Py_BEGIN_ALLOW_THREADS
    markov_chain(PTR(const float, base), PTR(const float, w1), PTR(const float, w2t), prev, PTR(float, row), &tok,
                 PTR(float, w1row), 1, V, r, PTR(const uint32_t, bits), W);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)tok);
}

/* A grammar's token mask on rows of logits: y[r, t] = x[r, t] where bit t % 32 of word t / 32 of row
 * r's bitmask is set (t < 32 W), else -inf. A copy or -inf: the same values as the torch ops
 * (shift, and, masked_fill) it replaces, in one pass instead of ten ops over the vocabulary. */
static void mask_rows(const float *x, const uint32_t *bits, float *y, int64_t R, int64_t V, int64_t W) {
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * V;
        const uint32_t *br = bits + r * W;
        float *yr = y + r * V;
        const int64_t n = V < 32 * W ? V : 32 * W;
        for (int64_t t = 0; t < n; t++) yr[t] = (br[t >> 5] >> (t & 31)) & 1u ? xr[t] : -INFINITY;
        for (int64_t t = n; t < V; t++) yr[t] = -INFINITY;
    }
}

/* apply_bitmask(x, bits, y, R, V, W): x, y [R, V] float32 (y may not be x), bits [R, W] int32 */
static PyObject *py_apply_bitmask(PyObject *self, PyObject *args) {
    Py_ssize_t x, bits, y, R, V, W;
    (void)self;
    if (!PyArg_ParseTuple(args, "nnnnnn", &x, &bits, &y, &R, &V, &W)) return NULL;
    if (!x || !bits || !y || x == y || R < 0 || V < 0 || W < 0) {
        PyErr_SetString(PyExc_ValueError, "apply_bitmask: bad buffers or sizes");
        return NULL;
    }
    mask_rows(PTR(const float, x), PTR(const uint32_t, bits), PTR(float, y), R, V, W);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"apply_bitmask", py_apply_bitmask, METH_VARARGS, "A grammar's token bitmask on rows of logits (-inf where off)."},
    {"add", py_add, METH_VARARGS, "y = a + b over n floats."},
    {"route_weights", py_route_weights, METH_VARARGS, "A MoE router's weights of its chosen experts, as torch's ops."},
    {"copy_rows", py_copy_rows, METH_VARARGS, "Rows of floats from one stride to another."},
    {"mul", py_mul, METH_VARARGS, "y = a * b over n floats."},
    {"scale", py_scale, METH_VARARGS, "y = a * s per row (s one float a row)."},
    {"markov_greedy", py_markov_greedy, METH_VARARGS, "DSpark's greedy Markov chain over a draft block."},
    {"markov_masked", py_markov_masked, METH_VARARGS, "One row of DSpark's greedy Markov chain under a bitmask."},
    {"rope_neox", py_rope_neox, METH_VARARGS, "NeoX rotary embedding of rows of heads."},
    {"slot_sum", py_slot_sum, METH_VARARGS, "Routed experts' outputs onto their rows, weighted, in slot order."},
    {"short_conv", py_short_conv, METH_VARARGS, "KDA's q/k/v causal convs and SiLU."},
    {"rms_norm", py_rms_norm, METH_VARARGS, "ggml's RMS norm (or the L2 norm) of rows, times a weight and a gate."},
    {"situ", py_situ, METH_VARARGS, "K3's situ activation over n elements."},
    {"res_mix", py_res_mix, METH_VARARGS, "K3's attn-res mix of rows over a bank of checkpoints."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
