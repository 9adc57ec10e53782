/* qm_i8_x86.h: the 256-bit integer helpers the int8 x86 files share (qm_i8_simd.c, the AVX2
 * kernels qm_avx2_<family>.c, the AVX512-VNNI kernels qm_vnni_*.c): the 8 x 8 transpose, the
 * fixed 16-lane reduction every path ends with, the folds of partial sums into lane sums, the
 * direct paths' prefetch distance, and the AVX2 kernels' entry points. always_inline, so a
 * header. x86 only. */
#ifndef K3_QM_I8_X86_H
#define K3_QM_I8_X86_H

#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"

#ifdef K3_X86

/* 8 x 8 transpose of 32-bit elements. */
__attribute__((target(AVX2_TARGET))) INLINE void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* Reduce 16 lanes (two 8-lane halves) as i8_reduce_scalar. */
__attribute__((target(AVX2_TARGET))) INLINE float i8_reduce256(__m256 lo, __m256 hi) {
    const __m256 h8 = _mm256_add_ps(lo, hi);
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
}

/* How far ahead in W's row the direct path asks for blocks: one row streams at a time, so
 * further than the tiles' PREFETCH_BYTES (measured: 768 -> 2048 bytes took a one-row Q4_K
 * 7168 x 2048 product from 1.29 to 0.88 ms; 4096 no better). */
#ifndef I8_PREFETCH
#define I8_PREFETCH 2048
#endif

/* 16 (G = 32) or 8 (G = 16) vectors of 8 partial sums -> the group's 16 lane sums in lo | hi. */
__attribute__((target(AVX2_TARGET))) INLINE void fold_lanes(const __m256i *p, int G, __m256i *lo, __m256i *hi) {
    if (G == 32) {
        __m256i a[8], b[4];
        for (int i = 0; i < 8; i++) a[i] = _mm256_hadd_epi32(p[2 * i], p[2 * i + 1]);
        for (int i = 0; i < 4; i++) b[i] = _mm256_hadd_epi32(a[2 * i], a[2 * i + 1]);
        /* b[i] = [4i .. 4i+3 first halves | their second halves] of sub-blocks 4i .. 4i + 3 */
        const __m256i s0 = _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20),
                                            _mm256_permute2x128_si256(b[0], b[1], 0x31));
        const __m256i s1 = _mm256_add_epi32(_mm256_permute2x128_si256(b[2], b[3], 0x20),
                                            _mm256_permute2x128_si256(b[2], b[3], 0x31));
        *lo = s0;
        *hi = s1;
    } else {
        __m256i a[4], b[2];
        for (int i = 0; i < 4; i++) a[i] = _mm256_hadd_epi32(p[2 * i], p[2 * i + 1]);
        for (int i = 0; i < 2; i++) b[i] = _mm256_hadd_epi32(a[2 * i], a[2 * i + 1]);
        *lo = _mm256_permute2x128_si256(b[0], b[1], 0x20);   /* first halves of sub-blocks 0-7 */
        *hi = _mm256_permute2x128_si256(b[0], b[1], 0x31);   /* second halves */
    }
}

/* 8 sub-blocks' unsigned vectors times x (sub-block j's 32 values at xb + 32 j; with sg, x with
 * those signs first), a pair of sub-blocks' pair sums added once in 16 bits (4 products, at most
 * 63 by 127: below 2^15) before madd widens them: sub-block j's sum over its values 0-15 in lane j
 * of *lo, over 16-31 in lane j of *hi. */
__attribute__((target(AVX2_TARGET))) INLINE void fold8_pairs(const __m256i *v, const int8_t *xb, const __m256i *sg,
                                                            __m256i *lo, __m256i *hi) {
    __m256i w[4];
    for (int i = 0; i < 4; i++) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xb + 64 * i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 64 * i + 32));
        if (sg != NULL) {
            x0 = _mm256_sign_epi8(x0, sg[2 * i]);
            x1 = _mm256_sign_epi8(x1, sg[2 * i + 1]);
        }
        w[i] = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_maddubs_epi16(v[2 * i], x0), _mm256_maddubs_epi16(v[2 * i + 1], x1)),
                                 _mm256_set1_epi16(1));
    }
    const __m256i g0 = _mm256_hadd_epi32(w[0], w[1]), g1 = _mm256_hadd_epi32(w[2], w[3]);
    *lo = _mm256_permute2x128_si256(g0, g1, 0x20);
    *hi = _mm256_permute2x128_si256(g0, g1, 0x31);
}

/* ---- few rows on AVX2: kernels of their own -------------------------------------------------
 * The 256-bit direct path (qm_i8_simd.c) is generic: per sub-block |q| . (x with q's sign) (abs, sign,
 * maddubs, madd), the lane sums folded by hadd_epi32, every scale and min stored to memory and
 * reloaded per group. For the types a K3 trunk and its experts are stored in (Q4_K, Q8_0,
 * MXFP4, the IQ1/IQ2/IQ3 expert types, Q2_K and Q3_K, the experts of "Q2" files, and Q5_K and
 * Q6_K, the trunk and LM head of Q4_K_M-style mixes) that is up to 3x the instructions the product needs. These kernels give the same
 * integer sums and the same float steps per lane (so the same bits as every other path) with
 * fewer, for 1 to I8_DIRECT_ROWS rows of x (a block is decoded once for all of them). Q4_K's
 * values are unsigned, so maddubs takes them as they are; MXFP4's table values are looked up as
 * unsigned too (qm_avx2_q8_mxfp4.c); the scales and mins stay in registers. For one row (compiled apart, the
 * row count a constant) a block's 8 sub-blocks' 16-bit partial sums fold with 7 hadd_epi16
 * (every partial sum stays below 2^15: at most 16 products of 15 by 127). From 2 rows the 8
 * decoded vectors (8 sub-blocks, or 8 blocks of Q8_0 / MXFP4) are transposed once instead
 * (transpose8: vector c then holds values 4c .. 4c + 3 of each, the panels' lane layout), and
 * each row of x, read from its transposed copy (xl->q), needs one maddubs per vector and adds,
 * no fold: the transpose is paid once for all the rows, the fold was paid per row. */

#define DEFINE_ROWS_AVX2(NAME_LC, CALL)                                                             \
    __attribute__((target(AVX2_TARGET))) void i8rows_##NAME_LC##_avx2(const i8job_t *jb, int64_t n0, int64_t n1,        \
                                                                          int64_t r0, int m) {      \
        if (m == 1) CALL(n0, n1, r0, 1);                                                           \
        else CALL(n0, n1, r0, m);                                                                  \
    }

#endif /* K3_X86 */

#endif
