/* qm_avx2_kquants.c: AVX2's own int8 direct kernels for the K-quants, 1 to I8_DIRECT_ROWS rows
 * of x (what AVX2's default path runs below own_avx2_below's rows; see "few rows on AVX2" in
 * qm_i8_x86.h): Q4_K and Q5_K on one kernel (8 sub-blocks of 32 values a block), Q6_K, Q2_K and
 * Q3_K on another (16 lanes of 16 values a block). One file per type family: the families share
 * the lane layout of their blocks, not the decoding. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"

#ifdef K3_X86

/* 8 vectors of maddubs results (16 pair sums each, sub-blocks 0-7) -> the 8 sub-blocks' sums. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i fold8_epi16(const __m256i *p) {
    const __m256i a = _mm256_hadd_epi16(p[0], p[1]), b = _mm256_hadd_epi16(p[2], p[3]);
    const __m256i c = _mm256_hadd_epi16(p[4], p[5]), d = _mm256_hadd_epi16(p[6], p[7]);
    /* lane 0: each sub-block's sum over its values 0-15, lane 1: over 16-31 */
    const __m256i e = _mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d));
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(e)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(e, 1)));
}
/* Q4_K and Q5_K (q5: the fifth bit from qh, values 0-31; the scales and mins are Q4_K's): a group
 * (two blocks) is lanes 0-7 (its first block) and 8-15. Q5_K's values are twice as large, so 16
 * products no longer fit 16 bits: one row folds 8 products in 16 bits and widens (madd) before the
 * last step; from 2 rows two vectors' products add in 16 bits before madd. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i fold8_epi16_wide(const __m256i *p) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])), ones);
    const __m256i b = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7])), ones);
    /* a: sub-blocks 0-3, b: 4-7; lane 0 over values 0-15, lane 1 over 16-31 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
__attribute__((target(AVX2_TARGET))) INLINE void q4k_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                              int m, int q5) {
    const xlane_t *xl = jb->xl;
    const int bytes = q5 ? Q5_K_BYTES : Q4_K_BYTES, qs0 = q5 ? 48 : 16;
    const int64_t k = jb->k, nb = k / Q4_K_QK, rb = nb * bytes, ng = xl->ngroups, xrow = ng * xl->gv;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * ng * 16, *dxs = xl->dxs + r0 * ng * 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < 2 * ng; b++) {
            const int h = (int)(b & 1);
            const int64_t lx = (b >> 1) * 16 + 8 * h;
            if (b >= nb) {   /* the missing half of a partial last group: zeros, as the other paths */
                for (int t = 0; t < m; t++) {
                    const __m256 a = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(dx + t * ng * 16 + lx), acc[t][h]);
                    acc[t][h] = _mm256_fnmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(dxs + t * ng * 16 + lx), a);
                }
                continue;
            }
            const uint8_t *blk = ri + b * bytes;
            __builtin_prefetch(blk + I8_PREFETCH);
            __builtin_prefetch(blk + I8_PREFETCH + 64);
            if (q5) __builtin_prefetch(blk + I8_PREFETCH + 128);
            __builtin_prefetch(blk + I8_PREFETCH + bytes - 1);
            __m256i v[8];
            for (int i = 0; i < 4; i++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + qs0 + 32 * i));
                v[2 * i] = _mm256_and_si256(q, m4);
                v[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            if (q5) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16)), one8 = _mm256_set1_epi8(1);
                for (int j = 0; j < 8; j++)
                    v[j] = _mm256_or_si256(v[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one8), 4));
            }
            __m256 ws, wm;
            scales_k4_r(blk, &ws, &wm);
            if (m > 1) transpose8(v);   /* v[c]: values 4c .. 4c + 3 of each sub-block, as x's copy in xl->q */
            for (int t = 0; t < m; t++) {
                __m256i s;
                if (m == 1) {
                    const int8_t *xb = xq + t * xrow + b * Q4_K_QK;
                    __m256i p[8];
                    for (int i = 0; i < 8; i++)
                        p[i] = _mm256_maddubs_epi16(v[i], _mm256_loadu_si256((const __m256i *)(xb + 32 * i)));
                    s = q5 ? fold8_epi16_wide(p) : fold8_epi16(p);
                } else if (!q5) {   /* 16 products a 16-bit sum, below 2^15 */
                    const int8_t *xt = xl->q + (r0 + t) * xrow + (b >> 1) * xl->gv + 32 * h;
                    __m256i a16 = _mm256_maddubs_epi16(v[0], _mm256_load_si256((const __m256i *)xt));
                    for (int c = 1; c < 8; c++)
                        a16 = _mm256_add_epi16(a16, _mm256_maddubs_epi16(v[c], _mm256_load_si256((const __m256i *)(xt + 64 * c))));
                    s = _mm256_madd_epi16(a16, ones);
                } else {   /* 4 products of 31 by 128 a 16-bit sum */
                    const int8_t *xt = xl->q + (r0 + t) * xrow + (b >> 1) * xl->gv + 32 * h;
                    s = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2)
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(v[c], _mm256_load_si256((const __m256i *)(xt + 64 * c))),
                                             _mm256_maddubs_epi16(v[c + 1], _mm256_load_si256((const __m256i *)(xt + 64 * c + 64)))),
                            ones));
                }
                const __m256 a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), ws),
                                                 _mm256_loadu_ps(dx + t * ng * 16 + lx), acc[t][h]);
                acc[t][h] = _mm256_fnmadd_ps(wm, _mm256_loadu_ps(dxs + t * ng * 16 + lx), a);
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}

#define Q4K_CALL(A, B, R, M) q4k_rows_avx2(jb, A, B, R, M, 0)
#define Q5K_CALL(A, B, R, M) q4k_rows_avx2(jb, A, B, R, M, 1)
DEFINE_ROWS_AVX2(q4_k, Q4K_CALL)
DEFINE_ROWS_AVX2(q5_k, Q5K_CALL)

/* The K-quants with a scale per 16 values: Q6_K, Q2_K, Q3_K (kind K16_Q6, K16_Q2, K16_Q3). A
 * 256-value block is a group of 16 lanes of 16 values: lane j the first 16 values of the block's
 * 32-value vector j, lane 8 + j its last 16. Every value unsigned, so maddubs takes them as they
 * are: Q6_K's as q + 32 (0-63) with each lane corrected by -32 X (corr >> 2, exactly), Q3_K's as
 * q + 4 (0-7: low bits + 4 x the hmask bit) corrected by -4 X (corr >> 5), Q2_K's as they are
 * (0-3) with its min, the generic path's float steps per lane (lanes256: scale, then the min).
 * Scales (and mins) are moved into lane order (the even sub-blocks of 16, then the odd) before
 * or after they become floats, unchanged. One row: a pair of vectors' pair sums add once in 16
 * bits (4 products of at most 63 by 128, below 2^15) before madd widens them, then two
 * hadd_epi32 and two permutes make the 16 lane sums. From 2 rows the 8 vectors are transposed
 * once (vector c < 4: values 4c .. 4c + 3 of each, lanes 0-7; c >= 4: values 16 + 4(c - 4) ..,
 * lanes 8-15), as x's transposed copy lies. */
enum { K16_Q6, K16_Q2, K16_Q3 };
/* 16 floats in sub-block order -> lanes 0-7 (odd = 0: the even ones) or 8-15 (odd = 1), unchanged. */
__attribute__((target(AVX2_TARGET))) INLINE __m256 evens_ps(const float *s, int odd) {
    const __m256 a = _mm256_loadu_ps(s), b = _mm256_loadu_ps(s + 8);
    const __m256 e = odd ? _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)) : _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
}
/* 16 unsigned scale bytes (in lane order) times d -> lanes 0-7 in *lo, 8-15 in *hi. */
__attribute__((target(AVX2_TARGET))) INLINE void scales_lanes(__m128i v, float d, __m256 *lo, __m256 *hi) {
    const __m256 dv = _mm256_set1_ps(d);
    *lo = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *hi = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
/* Block blk of a kind's row: its 8 vectors (values as above) and its lanes' scales and mins. */
__attribute__((target(AVX2_TARGET))) INLINE void k16_block(const uint8_t *blk, int kind, __m256i *u, __m256 *ws,
                                                           __m256 *wm) {
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0F);
    const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    if (kind == K16_Q6) {
        for (int h = 0; h < 2; h++) {   /* sub-block 4h + g: values 128h + 32g + l */
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(g & 1 ? l1 : l0, 4) : (g & 1 ? l1 : l0), m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m3);
                u[4 * h + g] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
            }
        }
        const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), deint);
        const __m256 d = _mm256_set1_ps(f16v(rd16(blk + 208)));
        ws[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        ws[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    } else if (kind == K16_Q2) {
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * h));
            for (int g = 0; g < 4; g++) u[4 * h + g] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m3);
        }
        const __m128i sm = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)blk), deint), low4 = _mm_set1_epi8(0x0F);
        scales_lanes(_mm_and_si128(sm, low4), f16v(rd16(blk + 80)), &ws[0], &ws[1]);
        scales_lanes(_mm_and_si128(_mm_srli_epi16(sm, 4), low4), f16v(rd16(blk + 82)), &wm[0], &wm[1]);
    } else {
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk), one8 = _mm256_set1_epi8(1);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + g), one8);
                u[4 * h + g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m3), _mm256_slli_epi16(hb, 2));
            }
        }
        float sc[16];
        scales_q3_k_v(blk, sc, NULL);
        ws[0] = evens_ps(sc, 0);
        ws[1] = evens_ps(sc, 1);
    }
}
__attribute__((target(AVX2_TARGET))) INLINE void k16_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                              int m, int kind) {
    const xlane_t *xl = jb->xl;
    const int bytes = kind == K16_Q6 ? Q6_K_BYTES : kind == K16_Q2 ? Q2_K_BYTES : Q3_K_BYTES;
    const int64_t nb = jb->k / 256, rb = nb * bytes, xrow = nb * 256;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * nb * 16, *dxs = xl->dxs + r0 * nb * 16;
    const int32_t *corr = xl->corr + r0 * nb * 16;
    const int shift = kind == K16_Q6 ? 2 : 5;   /* corr >> shift: -32 X (Q6_K), -4 X (Q3_K) */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = ri + b * bytes;
            for (int o = 0; o < bytes; o += 64) __builtin_prefetch(blk + I8_PREFETCH + o);
            __builtin_prefetch(blk + I8_PREFETCH + bytes - 1);
            __m256i u[8];
            __m256 ws[2], wm[2];
            k16_block(blk, kind, u, ws, wm);
            if (m > 1) transpose8(u);
            for (int t = 0; t < m; t++) {
                __m256i lo, hi;
                if (m == 1) {
                    fold8_pairs(u, xq + b * 256, NULL, &lo, &hi);
                } else {   /* 2 chunks a 16-bit sum (4 products) */
                    const int8_t *xt = xl->q + (r0 + t) * xrow + b * 256;
                    __m256i a[4];
                    for (int i = 0; i < 4; i++) {
                        const int c = 2 * (i & 1), o = 32 * (i >> 1);   /* lanes 0-7 from u[c], 8-15 from u[4 + c] */
                        a[i] = _mm256_madd_epi16(
                            _mm256_add_epi16(
                                _mm256_maddubs_epi16(u[4 * (i >> 1) + c], _mm256_load_si256((const __m256i *)(xt + 64 * c + o))),
                                _mm256_maddubs_epi16(u[4 * (i >> 1) + c + 1], _mm256_load_si256((const __m256i *)(xt + 64 * c + 64 + o)))),
                            ones);
                    }
                    lo = _mm256_add_epi32(a[0], a[1]);
                    hi = _mm256_add_epi32(a[2], a[3]);
                }
                const int64_t lx = t * nb * 16 + 16 * b;
                if (kind != K16_Q2) {
                    lo = _mm256_add_epi32(lo, _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), shift));
                    hi = _mm256_add_epi32(hi, _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx + 8)), shift));
                }
                acc[t][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), ws[0]), _mm256_loadu_ps(dx + lx), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), ws[1]), _mm256_loadu_ps(dx + lx + 8), acc[t][1]);
                if (kind == K16_Q2) {
                    acc[t][0] = _mm256_fnmadd_ps(wm[0], _mm256_loadu_ps(dxs + lx), acc[t][0]);
                    acc[t][1] = _mm256_fnmadd_ps(wm[1], _mm256_loadu_ps(dxs + lx + 8), acc[t][1]);
                }
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}
#define Q6K_CALL(A, B, R, M) k16_rows_avx2(jb, A, B, R, M, K16_Q6)
#define Q2K_CALL(A, B, R, M) k16_rows_avx2(jb, A, B, R, M, K16_Q2)
#define Q3K_CALL(A, B, R, M) k16_rows_avx2(jb, A, B, R, M, K16_Q3)
DEFINE_ROWS_AVX2(q6_k, Q6K_CALL)
DEFINE_ROWS_AVX2(q2_k, Q2K_CALL)
DEFINE_ROWS_AVX2(q3_k, Q3K_CALL)

#endif
