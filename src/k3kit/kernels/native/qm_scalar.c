/* qm_scalar.c: the scalar reference of every type, in both arithmetics: the float products' panel
 * decoders and tiles (always through panels), and the int8 products' panel decoders and tiles.
 * Plain C: what every CPU runs, and what every vector path gives bit for bit (tests/kernels).
 * Kept apart from the SIMD files so that the reference reads on its own. */
#include "qm.h"
#include "qm_i8.h"


/* ---- scalar path: the reference -------------------------------------------------------------
 * Per (row of x, row of W): y = sum over sub-blocks, in order, of the sub-block's dot product
 * of weights and x, itself summed in order. Always blocked: one panel per BLK_MB rows of x. */

#define DEFINE_PANEL_SCALAR(T, NAME_LC, HAS_MIN)                                                    \
    void panel_##NAME_LC##_scalar(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk,        \
                                         void *out, int64_t ldw, float *sb, int mode) {             \
        for (int i = 0; i < np; i++)                                                               \
            for (int64_t b = 0; b < nbk; b++) {                                                    \
                const uint8_t *blk = row + i * rb + (b0 + b) * T##_BYTES;                          \
                float s[16], mn[16];                                                               \
                scales_##NAME_LC(blk, s, mn);                                                      \
                for (int j = 0; j < T##_QK / 32; j++) {                                            \
                    const int64_t at = i * ldw + b * T##_QK + 32 * j;                              \
                    uint64_t qw[4];                                                                \
                    int8_t q[32];                                                                  \
                    float v[32];                                                                   \
                    q_##NAME_LC(blk, j, qw);                                                       \
                    memcpy(q, qw, 32);                                                             \
                    for (int e = 0; e < 32; e++) {                                                 \
                        v[e] = (float)q[e];                                                        \
                        if (!T##_FACTORED || mode != PANEL_RAW) v[e] = v[e] * s[SIDX(T, j, e / 16)]; \
                        if (HAS_MIN) v[e] = v[e] - mn[SIDX(T, j, e / 16)];                         \
                    }                                                                              \
                    if (mode == PANEL_BF16)                                                        \
                        for (int e = 0; e < 32; e++) ((uint16_t *)out)[at + e] = bf16_rne(v[e]);   \
                    else                                                                           \
                        memcpy((float *)out + at, v, sizeof v);                                    \
                    if (T##_FACTORED && mode == PANEL_RAW)                                         \
                        sb[i * BLK_SUB + b * (T##_QK / 32) + j] = s[SIDX(T, j, 0)];                \
                }                                                                                  \
            }                                                                                      \
    }

/* One row of W by one row of x over a panel's values (the accumulator in acc between panels);
 * FACTORED types scale each sub-block's sum. */
static inline void mk_scalar(const float *wf, const float *sf, int fact, const float *xr, int64_t kc, float *acc,
                             int first, int last, float *y) {
    float a = first ? 0.0f : *acc;
    for (int64_t j = 0; j < kc; j += 32) {
        float p = 0.0f;
        for (int e = 0; e < 32; e++) p += wf[j + e] * xr[j + e];
        if (fact) a += sf[j / 32] * p;
        else a += p;
    }
    if (last) *y = a;
    else *acc = a;
}

#define SCALAR_TILES(NT)                                                                            \
    for (int t = 0; t < rt; t++)                                                                   \
        for (int i = i0; i < i0 + (NT); i++)                                                       \
            mk_scalar(wb + i * BLK_KC, sb + i * BLK_SUB, fact, xt + t * k, kc, at + (t * BLK_NP + i) * 16, \
                      first, last, yt + t * n_out + i)

static void blocked_scalar(panel_fn panel, int fact, int64_t qk, int64_t bytes, const uint8_t *w, int64_t n0,
                           int64_t n1, int64_t n_out, int64_t k, const float *x, int64_t m, float *y,
                           float *scratch) {
    BLOCKED_LOOPS(BLK_NP, 1, SCALAR_TILES);
}

#define DEFINE_SCALAR(T, NAME_LC, HAS_MIN)                                                          \
    DEFINE_PANEL_SCALAR(T, NAME_LC, HAS_MIN)                                                        \
    void NAME_LC##_scalar(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k,        \
                                 const float *x, int64_t m, float *y, float *scratch) {             \
        blocked_scalar(panel_##NAME_LC##_scalar, T##_FACTORED, T##_QK, T##_BYTES, w, n0, n1, n_out, k, x, \
                       m, y, scratch);                                                             \
    }

DEFINE_SCALAR(Q8_0, q8_0, 0)
DEFINE_SCALAR(Q4_K, q4_k, 1)
DEFINE_SCALAR(Q5_K, q5_k, 1)
DEFINE_SCALAR(Q6_K, q6_k, 0)
DEFINE_SCALAR(Q2_K, q2_k, 1)
DEFINE_SCALAR(Q3_K, q3_k, 0)
DEFINE_SCALAR(IQ2_XXS, iq2_xxs, 0)
DEFINE_SCALAR(IQ2_XS, iq2_xs, 0)
DEFINE_SCALAR(IQ3_XXS, iq3_xxs, 0)
DEFINE_SCALAR(IQ1_S, iq1_s, 0)
DEFINE_SCALAR(IQ1_M, iq1_m, 0)
DEFINE_SCALAR(MXFP4, mxfp4, 0)

/* ---- int8 activations: the scalar reference (the contract: qm_i8.h) ------------------------ */

#define DEFINE_I8PANEL_SCALAR(T, NAME_LC)                                                           \
    void i8panel_##NAME_LC##_scalar(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t kc,        \
                                           uint8_t *wq, float *ws, float *wmn, int u8) {            \
        const int G = I8_G(T), spg = 16 * G / 32;   /* sub-blocks per group */                      \
        const int64_t nsub = kc / 32, ng = (kc + 16 * G - 1) / (16 * G);                           \
        for (int i = 0; i < np; i++) {                                                             \
            uint8_t *qo = wq + (int64_t)i * I8_KC;                                                 \
            float *so = ws + (int64_t)i * I8_GMAX * 16, *mo = wmn + (int64_t)i * I8_GMAX * 16;     \
            memset(qo, u8 ? 0x80 : 0, (size_t)(ng * 16 * G));                                     \
            memset(so, 0, (size_t)ng * 16 * sizeof(float));                                        \
            memset(mo, 0, (size_t)ng * 16 * sizeof(float));                                        \
            float s[16], mn[16] = {0};                                                                     \
            for (int64_t u = 0; u < nsub; u++) {                                                   \
                const uint8_t *blk = row + i * rb + (b0 + u / (T##_QK / 32)) * T##_BYTES;          \
                const int j = (int)(u % (T##_QK / 32));                                            \
                if (j == 0) scales_##NAME_LC(blk, s, mn);                                          \
                uint64_t qw[4];                                                                    \
                int8_t qv[32];                                                                     \
                q_##NAME_LC(blk, j, qw);                                                           \
                memcpy(qv, qw, 32);                                                                \
                const int64_t g = u / spg;                                                         \
                const int ug = (int)(u % spg);                                                     \
                for (int h = 0; h < 32 / G; h++) {                                                 \
                    const int p = lane_of(G, ug, h);                                               \
                    so[g * 16 + p] = s[SIDX(T, j, h)];                                             \
                    mo[g * 16 + p] = mn[SIDX(T, j, h)];                                            \
                    for (int c = 0; c < G / 4; c++)                                                \
                        for (int e = 0; e < 4; e++)                                                \
                            qo[g * 16 * G + 64 * c + 4 * p + e] = (uint8_t)(qv[G * h + 4 * c + e] ^ (u8 ? 0x80 : 0)); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* The float part of a group for one pair: 16 lanes of S into the accumulators. */
static inline void i8_lanes_scalar(const int32_t *S, const float *ws, const float *wmn, const float *dx,
                                   const float *dxs, int has_min, float *acc) {
    for (int p = 0; p < 16; p++) {
        const float f = (float)S[p] * ws[p];
        acc[p] = fmaf(f, dx[p], acc[p]);
        if (has_min) acc[p] = fmaf(-wmn[p], dxs[p], acc[p]);
    }
}

static inline float i8_reduce_scalar(const float *a) {
    float h8[8], h4[4], h2[2];
    for (int i = 0; i < 8; i++) h8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) h4[i] = h8[i] + h8[i + 4];
    for (int i = 0; i < 2; i++) h2[i] = h4[i] + h4[i + 2];
    return h2[0] + h2[1];
}

/* Scalar tiles: every pair of the panel's rows and the block's x rows. */
void i8tiles_scalar(const i8job_t *jb, const uint8_t *wq, const float *ws, const float *wmn, int np,
                           int64_t g0, int64_t ng, int64_t r0, int mb, float *acc, int first, int last,
                           int64_t p0) {
    const xlane_t *xl = jb->xl;
    const int64_t gv = xl->gv;
    for (int t = 0; t < mb; t++) {
        const int64_t r = r0 + t;
        for (int i = 0; i < np; i++) {
            float *a = acc + ((int64_t)t * I8_NP + i) * 16;
            if (first) memset(a, 0, 16 * sizeof(float));
            for (int64_t g = 0; g < ng; g++) {
                const int8_t *xq = xl->q + (r * xl->ngroups + g0 + g) * gv;
                const int8_t *wv = (const int8_t *)wq + (int64_t)i * I8_KC + g * gv;
                int32_t S[16];
                for (int p = 0; p < 16; p++) {
                    int s = 0;
                    for (int c = 0; c < jb->G / 4; c++)
                        for (int e = 0; e < 4; e++) s += wv[64 * c + 4 * p + e] * xq[64 * c + 4 * p + e];
                    S[p] = s;
                }
                const int64_t lx = (r * xl->ngroups + g0 + g) * 16;
                i8_lanes_scalar(S, ws + (int64_t)i * I8_GMAX * 16 + g * 16, wmn + (int64_t)i * I8_GMAX * 16 + g * 16,
                                xl->dx + lx, xl->dxs + lx, jb->has_min, a);
            }
            if (last) jb->y[r * jb->n_out + p0 + i] = i8_reduce_scalar(a);
        }
    }
}

DEFINE_I8PANEL_SCALAR(Q8_0, q8_0)
DEFINE_I8PANEL_SCALAR(Q4_K, q4_k)
DEFINE_I8PANEL_SCALAR(Q5_K, q5_k)
DEFINE_I8PANEL_SCALAR(Q6_K, q6_k)
DEFINE_I8PANEL_SCALAR(Q2_K, q2_k)
DEFINE_I8PANEL_SCALAR(Q3_K, q3_k)
DEFINE_I8PANEL_SCALAR(IQ2_XXS, iq2_xxs)
DEFINE_I8PANEL_SCALAR(IQ2_XS, iq2_xs)
DEFINE_I8PANEL_SCALAR(IQ3_XXS, iq3_xxs)
DEFINE_I8PANEL_SCALAR(IQ1_S, iq1_s)
DEFINE_I8PANEL_SCALAR(IQ1_M, iq1_m)
DEFINE_I8PANEL_SCALAR(MXFP4, mxfp4)
