/* qm_float_simd.c: the float products' vector paths, AVX-512F and AVX2+FMA+F16C: per type the
 * per-row tiles of each (few rows), the one panel decoder both share (many rows), and the panel
 * drivers. One file, not one per type family: the per-type code is qm_x86.h's decoders put
 * through the same macros, and the two levels share the panels. x86 only (chosen at run time,
 * qm_dispatch.c); the scalar reference is qm_scalar.c. */
#include "qm.h"
#include "qm_x86.h"

#ifdef K3_X86

/* ---- vector paths --------------------------------------------------------------------------
 * 16 (AVX-512) or 8 (AVX2) lanes: a sub-block's weights are made once for a tile of W rows and
 * used by every row of x in the tile; each (x row, W row) pair has one vector accumulator,
 * summed across its lanes at the end. */

/* ---- few rows: per-row tiles ----------------------------------------------------------------
 * Weights of sub-block j for NT rows of W, exactly ggml's values (a product, then a
 * difference), then for each of RT rows of x: acc[i][t] += w[i] . x[t] over the 32 values
 * (lane-wise: products of the first halves, fused with those of the second, then added). */
#define DEFINE_TILE512(T, NAME_LC, HAS_MIN)                                                          \
    __attribute__((target(AVX512_TARGET))) INLINE void tile_##NAME_LC##_avx512(                      \
        const uint8_t *row, int64_t rb, int NT, int64_t nb, const float *x, int64_t k, int RT,       \
        float *out, int64_t ldo) {                                                                  \
        __m512 acc[4][4];                                                                           \
        float s[4][16], mn[4][16];                                                                  \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) acc[i][t] = _mm512_setzero_ps();                           \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            PREFETCH_BLOCKS(T, row, rb, NT, b, nb);                                                 \
            for (int i = 0; i < NT; i++) scales_##NAME_LC##_v(row + i * rb + b * T##_BYTES, s[i], mn[i]); \
            _Pragma("GCC unroll 8") for (int j = 0; j < T##_QK / 32; j++) {                         \
                __m512 w0[4], w1[4], sv[4];                                                         \
                for (int i = 0; i < NT; i++) {                                                      \
                    const __m256i q = qv_##NAME_LC(row + i * rb + b * T##_BYTES, j);                 \
                    w0[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));    \
                    w1[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))); \
                    sv[i] = _mm512_set1_ps(s[i][SIDX(T, j, 0)]);                                    \
                    if (!T##_FACTORED) {                                                            \
                        w0[i] = _mm512_mul_ps(w0[i], sv[i]);                                        \
                        w1[i] = _mm512_mul_ps(w1[i], _mm512_set1_ps(s[i][SIDX(T, j, 1)]));          \
                    }                                                                               \
                    if (HAS_MIN) {                                                                  \
                        w0[i] = _mm512_sub_ps(w0[i], _mm512_set1_ps(mn[i][SIDX(T, j, 0)]));         \
                        w1[i] = _mm512_sub_ps(w1[i], _mm512_set1_ps(mn[i][SIDX(T, j, 1)]));         \
                    }                                                                               \
                }                                                                                   \
                for (int t = 0; t < RT; t++) {                                                      \
                    const float *xb = x + t * k + b * T##_QK + 32 * j;                              \
                    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);           \
                    for (int i = 0; i < NT; i++)                                                    \
                        acc[i][t] = T##_FACTORED                                                    \
                                        ? _mm512_fmadd_ps(_mm512_fmadd_ps(w1[i], x1, _mm512_mul_ps(w0[i], x0)), sv[i], acc[i][t]) \
                                        : _mm512_add_ps(acc[i][t], _mm512_fmadd_ps(w1[i], x1, _mm512_mul_ps(w0[i], x0))); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) out[t * ldo + i] = _mm512_reduce_add_ps(acc[i][t]);        \
    }

/* The weights of one row's sub-block as four 8-lane vectors (values 0-7, 8-15, 16-23, 24-31):
 * what the AVX2 tiles multiply, and what the panels hold for both vector paths. */
#define DECODE256(T, NAME_LC, HAS_MIN, BLK, J, S, MN, W)                                             \
    do {                                                                                           \
        const __m256i q_ = qv_##NAME_LC(BLK, J);                                                   \
        const __m128i lo_ = _mm256_castsi256_si128(q_), hi_ = _mm256_extracti128_si256(q_, 1);     \
        W[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo_));                                      \
        W[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo_, 8)));                   \
        W[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi_));                                      \
        W[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi_, 8)));                   \
        if (!T##_FACTORED) {                                                                       \
            const __m256 s0_ = _mm256_set1_ps((S)[SIDX(T, J, 0)]), s1_ = _mm256_set1_ps((S)[SIDX(T, J, 1)]); \
            W[0] = _mm256_mul_ps(W[0], s0_);                                                       \
            W[1] = _mm256_mul_ps(W[1], s0_);                                                       \
            W[2] = _mm256_mul_ps(W[2], s1_);                                                       \
            W[3] = _mm256_mul_ps(W[3], s1_);                                                       \
        }                                                                                          \
        if (HAS_MIN) {                                                                             \
            const __m256 m0_ = _mm256_set1_ps((MN)[SIDX(T, J, 0)]), m1_ = _mm256_set1_ps((MN)[SIDX(T, J, 1)]); \
            W[0] = _mm256_sub_ps(W[0], m0_);                                                       \
            W[1] = _mm256_sub_ps(W[1], m0_);                                                       \
            W[2] = _mm256_sub_ps(W[2], m1_);                                                       \
            W[3] = _mm256_sub_ps(W[3], m1_);                                                       \
        }                                                                                          \
    } while (0)

/* The same with 8 lanes: a sub-block is four vectors; per row, (w0 x0 + w1 x1) + (w2 x2 + w3 x3). */
#define DEFINE_TILE256(T, NAME_LC, HAS_MIN)                                                          \
    __attribute__((target(AVX2_TARGET))) INLINE void tile_##NAME_LC##_avx2(                          \
        const uint8_t *row, int64_t rb, int NT, int64_t nb, const float *x, int64_t k, int RT,       \
        float *out, int64_t ldo) {                                                                  \
        __m256 acc[4][4];                                                                           \
        float s[4][16], mn[4][16];                                                                  \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) acc[i][t] = _mm256_setzero_ps();                           \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            PREFETCH_BLOCKS(T, row, rb, NT, b, nb);                                                 \
            for (int i = 0; i < NT; i++) scales_##NAME_LC##_v(row + i * rb + b * T##_BYTES, s[i], mn[i]); \
            _Pragma("GCC unroll 8") for (int j = 0; j < T##_QK / 32; j++) {                         \
                __m256 w[4][4], sv[4];                                                              \
                for (int i = 0; i < NT; i++) {                                                      \
                    DECODE256(T, NAME_LC, HAS_MIN, row + i * rb + b * T##_BYTES, j, s[i], mn[i], w[i]); \
                    sv[i] = _mm256_set1_ps(s[i][SIDX(T, j, 0)]);                                    \
                }                                                                                   \
                for (int t = 0; t < RT; t++) {                                                      \
                    const float *xb = x + t * k + b * T##_QK + 32 * j;                              \
                    for (int i = 0; i < NT; i++) {                                                  \
                        const __m256 p = _mm256_fmadd_ps(w[i][1], _mm256_loadu_ps(xb + 8),          \
                                                         _mm256_mul_ps(w[i][0], _mm256_loadu_ps(xb))); \
                        const __m256 r = _mm256_fmadd_ps(w[i][3], _mm256_loadu_ps(xb + 24),         \
                                                         _mm256_mul_ps(w[i][2], _mm256_loadu_ps(xb + 16))); \
                        acc[i][t] = T##_FACTORED ? _mm256_fmadd_ps(_mm256_add_ps(p, r), sv[i], acc[i][t]) \
                                                 : _mm256_add_ps(acc[i][t], _mm256_add_ps(p, r));   \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) out[t * ldo + i] = hsum256(acc[i][t]);                     \
    }

/* The per-row driver over output columns [n0, n1): tiles of NT_MAX rows of W (then single rows)
 * by 4 rows of x (then 2, 1). */
#define ROW_TILES(NAME_LC, LVL, NT)                                                                  \
    do {                                                                                           \
        const uint8_t *row = w + n * rb;                                                           \
        int64_t r = 0;                                                                             \
        for (; r + 4 <= m; r += 4) tile_##NAME_LC##_##LVL(row, rb, NT, nb, x + r * k, k, 4, y + r * n_out + n, n_out); \
        if (r + 2 <= m) {                                                                          \
            tile_##NAME_LC##_##LVL(row, rb, NT, nb, x + r * k, k, 2, y + r * n_out + n, n_out);    \
            r += 2;                                                                                \
        }                                                                                          \
        if (r < m) tile_##NAME_LC##_##LVL(row, rb, NT, nb, x + r * k, k, 1, y + r * n_out + n, n_out); \
    } while (0)

/* ---- many rows on the vector paths: panels (see "many rows" in qm.h) -----------------------
 * Both vector paths share one panel decoder per type (8-lane, the AVX2 tiles' DECODE256: the
 * same lane-wise operations as the 16-lane tile, so the same floats). Each panel row's next
 * values are prefetched while it is decoded: they are needed one panel later. */
/* 8 floats to bfloat16, as bf16_rne. */
__attribute__((target(AVX2_TARGET))) INLINE __m128i bf16x8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

#define DEFINE_PANEL(T, NAME_LC, HAS_MIN)                                                           \
    __attribute__((target(AVX2_TARGET))) void panel_##NAME_LC##_avx2(                               \
        const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk, void *out, int64_t ldw, float *sb, \
        int mode) {                                                                                \
        for (int i = 0; i < np; i++) {                                                             \
            const uint8_t *ri = row + i * rb + b0 * T##_BYTES;                                     \
            for (int64_t o = 0; o < nbk * T##_BYTES; o += 64) __builtin_prefetch(ri + nbk * T##_BYTES + o); \
            for (int64_t b = 0; b < nbk; b++) {                                                    \
                const uint8_t *blk = ri + b * T##_BYTES;                                           \
                float s[16], mn[16];                                                               \
                scales_##NAME_LC##_v(blk, s, mn);                                                  \
                _Pragma("GCC unroll 8") for (int j = 0; j < T##_QK / 32; j++) {                    \
                    const int64_t at = i * ldw + b * T##_QK + 32 * j;                              \
                    __m256 wv[4];                                                                  \
                    DECODE256(T, NAME_LC, HAS_MIN, blk, j, s, mn, wv);                             \
                    if (T##_FACTORED && mode != PANEL_RAW)                                         \
                        for (int l = 0; l < 4; l++) wv[l] = _mm256_mul_ps(wv[l], _mm256_set1_ps(s[SIDX(T, j, 0)])); \
                    if (mode == PANEL_BF16)                                                        \
                        for (int l = 0; l < 4; l++) _mm_storeu_si128((__m128i *)((uint16_t *)out + at + 8 * l), bf16x8(wv[l])); \
                    else                                                                           \
                        for (int l = 0; l < 4; l++) _mm256_storeu_ps((float *)out + at + 8 * l, wv[l]); \
                    if (T##_FACTORED && mode == PANEL_RAW)                                         \
                        sb[i * BLK_SUB + b * (T##_QK / 32) + j] = s[SIDX(T, j, 0)];                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* NT rows of a panel by RT rows of x: the per-row tiles' operations, the weights loaded from the
 * panel instead of decoded. */
__attribute__((target(AVX512_TARGET))) INLINE void mk512(const float *wb, const float *sb, int NT, const float *x,
                                                         int64_t k, int RT, int64_t nsub, int FACT, float *acc,
                                                         int first, int last, float *y, int64_t n_out) {
    __m512 a[4][4];
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++)
            a[i][t] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (t * BLK_NP + i) * 16);
    for (int64_t j = 0; j < nsub; j++) {
        __m512 w0[4], w1[4];
        for (int i = 0; i < NT; i++) {
            w0[i] = _mm512_load_ps(wb + i * BLK_KC + 32 * j);
            w1[i] = _mm512_load_ps(wb + i * BLK_KC + 32 * j + 16);
        }
        for (int t = 0; t < RT; t++) {
            const __m512 x0 = _mm512_loadu_ps(x + t * k + 32 * j), x1 = _mm512_loadu_ps(x + t * k + 32 * j + 16);
            for (int i = 0; i < NT; i++) {
                const __m512 p = _mm512_fmadd_ps(w1[i], x1, _mm512_mul_ps(w0[i], x0));
                a[i][t] = FACT ? _mm512_fmadd_ps(p, _mm512_set1_ps(sb[i * BLK_SUB + j]), a[i][t])
                               : _mm512_add_ps(a[i][t], p);
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++) {
            if (last) y[t * n_out + i] = _mm512_reduce_add_ps(a[i][t]);
            else _mm512_store_ps(acc + (t * BLK_NP + i) * 16, a[i][t]);
        }
}

__attribute__((target(AVX2_TARGET))) INLINE void mk256(const float *wb, const float *sb, int NT, const float *x,
                                                       int64_t k, int RT, int64_t nsub, int FACT, float *acc,
                                                       int first, int last, float *y, int64_t n_out) {
    __m256 a[2][4];
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++)
            a[i][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + (t * BLK_NP + i) * 16);
    for (int64_t j = 0; j < nsub; j++)
        for (int t = 0; t < RT; t++) {
            const float *xb = x + t * k + 32 * j;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            for (int i = 0; i < NT; i++) {
                const float *wf = wb + i * BLK_KC + 32 * j;
                const __m256 p = _mm256_fmadd_ps(_mm256_load_ps(wf + 8), x1, _mm256_mul_ps(_mm256_load_ps(wf), x0));
                const __m256 r = _mm256_fmadd_ps(_mm256_load_ps(wf + 24), x3, _mm256_mul_ps(_mm256_load_ps(wf + 16), x2));
                a[i][t] = FACT ? _mm256_fmadd_ps(_mm256_add_ps(p, r), _mm256_set1_ps(sb[i * BLK_SUB + j]), a[i][t])
                               : _mm256_add_ps(a[i][t], _mm256_add_ps(p, r));
            }
        }
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++) {
            if (last) y[t * n_out + i] = hsum256(a[i][t]);
            else _mm256_store_ps(acc + (t * BLK_NP + i) * 16, a[i][t]);
        }
}

/* Tile shapes: AVX-512's 32 registers hold 4 x 4 accumulators and 4 rows' weights; AVX2's 16
 * hold 2 x 4 accumulators and one row of x (the weights are memory operands). */
#define MK_CALL(MK, NT, RT, FACT)                                                                   \
    MK(wb + i0 * BLK_KC, sb + i0 * BLK_SUB, NT, xt, k, RT, kc / 32, FACT, at + i0 * 16, first, last, yt + i0, n_out)
#define MK_TILES(MK, NT, FACT)                                                                      \
    switch (rt) {                                                                                  \
    case 4: MK_CALL(MK, NT, 4, FACT); break;                                                       \
    case 3: MK_CALL(MK, NT, 3, FACT); break;                                                       \
    case 2: MK_CALL(MK, NT, 2, FACT); break;                                                       \
    default: MK_CALL(MK, NT, 1, FACT); break;                                                      \
    }
#define TILES512_0(NT) MK_TILES(mk512, NT, 0)
#define TILES512_1(NT) MK_TILES(mk512, NT, 1)
#define TILES256_0(NT) MK_TILES(mk256, NT, 0)
#define TILES256_1(NT) MK_TILES(mk256, NT, 1)

#define DEFINE_BLOCKED(LVL, TARGET, NT_MAX, FACT, TILES)                                            \
    __attribute__((target(TARGET))) static void blocked_##LVL##_##FACT(                             \
        panel_fn panel, int64_t qk, int64_t bytes, const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, \
        int64_t k, const float *x, int64_t m, float *y, float *scratch) {                          \
        BLOCKED_LOOPS(NT_MAX, 4, TILES);                                                           \
    }
DEFINE_BLOCKED(avx512, AVX512_TARGET, 4, 0, TILES512_0)
DEFINE_BLOCKED(avx512, AVX512_TARGET, 4, 1, TILES512_1)
DEFINE_BLOCKED(avx2, AVX2_TARGET, 2, 0, TILES256_0)
DEFINE_BLOCKED(avx2, AVX2_TARGET, 2, 1, TILES256_1)

/* A type's entry point on a vector path: panels for many rows (the caller passes scratch then),
 * per-row tiles for few. */
#define DEFINE_DRIVER(T, NAME_LC, LVL, TARGET, NT_MAX)                                               \
    __attribute__((target(TARGET))) void NAME_LC##_##LVL(const uint8_t *w, int64_t n0, int64_t n1,        \
                                                                int64_t n_out, int64_t k, const float *x, \
                                                                int64_t m, float *y, float *scratch) { \
        const int64_t nb = k / T##_QK, rb = nb * T##_BYTES;                                          \
        if (scratch != NULL) {                                                                       \
            (T##_FACTORED ? blocked_##LVL##_1 : blocked_##LVL##_0)(panel_##NAME_LC##_avx2, T##_QK, T##_BYTES, \
                                                                   w, n0, n1, n_out, k, x, m, y, scratch); \
            return;                                                                                  \
        }                                                                                            \
        int64_t n = n0;                                                                              \
        if (NT_MAX > 1 && m >= 4)                                                                    \
            for (; n + NT_MAX <= n1; n += NT_MAX) ROW_TILES(NAME_LC, LVL, NT_MAX);                   \
        for (; n < n1; n++) ROW_TILES(NAME_LC, LVL, 1);                                              \
    }

/* W rows per per-row tile: AVX-512 has 32 registers, room for 4 x 4 accumulators and 4 rows'
 * weights; AVX2's 16 hold one row's four weight vectors and four accumulators. */
#define DEFINE_TYPE(T, NAME_LC, HAS_MIN)                                                             \
    DEFINE_TILE512(T, NAME_LC, HAS_MIN)                                                              \
    DEFINE_TILE256(T, NAME_LC, HAS_MIN)                                                              \
    DEFINE_PANEL(T, NAME_LC, HAS_MIN)                                                                \
    DEFINE_DRIVER(T, NAME_LC, avx512, AVX512_TARGET, 4)                                              \
    DEFINE_DRIVER(T, NAME_LC, avx2, AVX2_TARGET, 1)
DEFINE_TYPE(Q8_0, q8_0, 0)
DEFINE_TYPE(Q4_K, q4_k, 1)
DEFINE_TYPE(Q5_K, q5_k, 1)
DEFINE_TYPE(Q6_K, q6_k, 0)
DEFINE_TYPE(Q2_K, q2_k, 1)
DEFINE_TYPE(Q3_K, q3_k, 0)
DEFINE_TYPE(IQ2_XXS, iq2_xxs, 0)
DEFINE_TYPE(IQ2_XS, iq2_xs, 0)
DEFINE_TYPE(IQ3_XXS, iq3_xxs, 0)
DEFINE_TYPE(IQ1_S, iq1_s, 0)
DEFINE_TYPE(IQ1_M, iq1_m, 0)
DEFINE_TYPE(MXFP4, mxfp4, 0)

#endif
