/* qm_avx2_iquants.c: AVX2's own int8 direct kernels for the IQ types a K3 file stores its experts
 * in, 1 to I8_DIRECT_ROWS rows of x (see "few rows on AVX2" in qm_i8_x86.h): IQ1_S, IQ2_XXS and
 * IQ3_XXS on one kernel, IQ1_M on another (IQ2_XS has none: the generic direct path runs). A file
 * per type family, as the other qm_avx2_*.c. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"

#ifdef K3_X86


/* IQ1_S, IQ2_XXS and IQ3_XXS (lanes as Q4_K's: a group is two blocks of 8 sub-blocks), 1 to
 * I8_DIRECT_ROWS rows: a block is decoded once, then each row folds its own products (no
 * transpose: these types' decoding, grid lookups, outweighs the fold).
 * IQ1_S: values 8 grid + delta looked up as before (qv_iq1_s), then + 9 (0-18, unsigned: maddubs
 * takes them as they are) and each lane corrected by -9 X (from corr >> 7 = -X, exactly); a
 * block's 8 sub-blocks fold in 16 bits for two rounds (8 products of 18 by 127, below 2^15), then
 * madd widens them.
 * IQ3_XXS and IQ2_XXS: the grid rows are magnitudes (1-62: init_tables holds them to that), so
 * maddubs takes them as they are and the signs go onto x instead (sign_epi8 by the sign mask or 1:
 * the products of the generic |q| . (x with q's sign)); a pair of sub-blocks' pair sums add once in
 * 16 bits (4 products of 62 by 127, below 2^15) before madd widens them, then Q6_K's one-row fold.
 * Scales as scales_iq3_xxs / scales_iq2_xxs compute them, 8 at a time. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i grid_iq3_xxs(const uint8_t *q) {
    return _mm256_set_epi32((int)IQ3XXS_GRID[q[7]], (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[5]],
                            (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[2]],
                            (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[0]]);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i grid_iq2_xxs(const uint8_t *q) {
    return _mm256_set_epi64x((long long)IQ2XXS_GRID[q[3]], (long long)IQ2XXS_GRID[q[2]], (long long)IQ2XXS_GRID[q[1]],
                             (long long)IQ2XXS_GRID[q[0]]);
}
/* IQ2_XXS's and IQ3_XXS's four 7-bit sign indices of a sub-block: 0xFF where negative, else 1. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i signs_xxs(uint32_t aux) {
    return _mm256_or_si256(_mm256_set_epi64x((long long)SIGN_MASK[(aux >> 21) & 127], (long long)SIGN_MASK[(aux >> 14) & 127],
                                             (long long)SIGN_MASK[(aux >> 7) & 127], (long long)SIGN_MASK[aux & 127]),
                           _mm256_set1_epi8(1));
}
__attribute__((target(AVX2_TARGET))) INLINE void iq_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                             int m, int kind) {
    const int mag = kind != 0;   /* IQ3_XXS, IQ2_XXS: grid magnitudes, the signs onto x */
    const xlane_t *xl = jb->xl;
    const int64_t qk = 256, bytes = kind == 2 ? IQ2_XXS_BYTES : kind ? IQ3_XXS_BYTES : IQ1_S_BYTES;   /* all QK 256 */
    const int64_t nb = jb->k / qk, rb = nb * bytes, ng = xl->ngroups, xrow = ng * xl->gv;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * ng * 16;
    const int32_t *corr = xl->corr + r0 * ng * 16;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < 2 * ng; b++) {
            const int h = (int)(b & 1);
            const int64_t lx = (b >> 1) * 16 + 8 * h;
            if (b >= nb) {   /* the missing half of a partial last group: zeros, as the other paths */
                for (int t = 0; t < m; t++)
                    acc[t][h] = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(dx + t * ng * 16 + lx), acc[t][h]);
                continue;
            }
            const uint8_t *blk = ri + b * bytes;
            __builtin_prefetch(blk + I8_PREFETCH);
            __builtin_prefetch(blk + I8_PREFETCH + bytes - 1);
            __m256i v[8], sg[8];
            __m256 ws;
            if (mag) {
                uint32_t a[8];
                for (int j = 0; j < 8; j++) {
                    a[j] = rd32(kind == 2 ? blk + 6 + 8 * j : blk + 66 + 4 * j);
                    v[j] = kind == 2 ? grid_iq2_xxs(blk + 2 + 8 * j) : grid_iq3_xxs(blk + 2 + 8 * j);
                    sg[j] = signs_xxs(a[j]);
                }
                const __m256i aux = _mm256_loadu_si256((const __m256i *)a);
                const __m256 sc = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_cvtepi32_ps(_mm256_srli_epi32(aux, 28)));
                ws = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(f16v(rd16(blk))), sc), _mm256_set1_ps(kind == 2 ? 0.25f : 0.5f));
            } else {
                for (int j = 0; j < 8; j++) v[j] = _mm256_add_epi8(qv_iq1_s(blk, j), _mm256_set1_epi8(9));
                const __m256i qh8 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 34)));
                const __m256i ls = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh8, 12),
                                                                                       _mm256_set1_epi32(7)), 1),
                                                    _mm256_set1_epi32(1));
                ws = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(f16v(rd16(blk))), _mm256_cvtepi32_ps(ls)),
                                   _mm256_set1_ps(0.125f));
            }
            for (int t = 0; t < m; t++) {
                const int8_t *xb = xq + t * xrow + b * qk;
                __m256i s;
                if (mag) {
                    __m256i lo, hi;
                    fold8_pairs(v, xb, sg, &lo, &hi);
                    s = _mm256_add_epi32(lo, hi);
                } else {
                    __m256i p[8];
                    for (int j = 0; j < 8; j++)
                        p[j] = _mm256_maddubs_epi16(v[j], _mm256_loadu_si256((const __m256i *)(xb + 32 * j)));
                    /* lane 0: sums over each sub-block's values 0-15, lane 1: 16-31 */
                    const __m256i a0 = _mm256_hadd_epi16(p[0], p[1]), a1 = _mm256_hadd_epi16(p[2], p[3]);
                    const __m256i a2 = _mm256_hadd_epi16(p[4], p[5]), a3 = _mm256_hadd_epi16(p[6], p[7]);
                    const __m256i m0 = _mm256_madd_epi16(_mm256_hadd_epi16(a0, a1), ones);
                    const __m256i m1 = _mm256_madd_epi16(_mm256_hadd_epi16(a2, a3), ones);
                    s = _mm256_add_epi32(_mm256_permute2x128_si256(m0, m1, 0x20), _mm256_permute2x128_si256(m0, m1, 0x31));
                    const __m256i c = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + t * ng * 16 + lx)), 7);   /* -X */
                    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_slli_epi32(c, 3), c));
                }
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), ws), _mm256_loadu_ps(dx + t * ng * 16 + lx),
                                            acc[t][h]);
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}
/* IQ1_M (lanes as Q6_K's: a group is one block, 16 lanes of 16 values: lanes 0-7 the first halves
 * of its 8 sub-blocks, 8-15 the second halves), 1 to I8_DIRECT_ROWS rows. Values 8 grid + delta
 * (qv_iq1_m) + 9 (0-18, unsigned: maddubs takes them as they are), each lane corrected by -9 X
 * (corr >> 7 = -X, exactly); Q6_K's one-row fold per row; the 16 scales as scales_iq1_m computes
 * them, 8 at a time. */
__attribute__((target(AVX2_TARGET))) INLINE void iq1m_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                               int m) {
    const xlane_t *xl = jb->xl;
    const int64_t nb = jb->k / IQ1_M_QK, rb = nb * IQ1_M_BYTES, xrow = nb * IQ1_M_QK;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * nb * 16;
    const int32_t *corr = xl->corr + r0 * nb * 16;
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = ri + b * IQ1_M_BYTES;
            __builtin_prefetch(blk + I8_PREFETCH);
            __builtin_prefetch(blk + I8_PREFETCH + IQ1_M_BYTES - 1);
            __m256i v[8];
            for (int j = 0; j < 8; j++) v[j] = _mm256_add_epi8(qv_iq1_m(blk, j), _mm256_set1_epi8(9));
            const uint16_t sc[4] = {rd16(blk + 48), rd16(blk + 50), rd16(blk + 52), rd16(blk + 54)};
            const float d = f16v((uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                            (sc[3] & 0xf000)));
            int32_t l1[8], l2[8];
            for (int j = 0; j < 8; j++) {
                l1[j] = 2 * ((sc[j / 2] >> (6 * (j % 2))) & 0x7) + 1;
                l2[j] = 2 * ((sc[j / 2] >> (6 * (j % 2) + 3)) & 0x7) + 1;
            }
            const __m256 dv = _mm256_set1_ps(d), eighth = _mm256_set1_ps(0.125f);
            const __m256 ws_lo = _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)l1))), eighth);
            const __m256 ws_hi = _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)l2))), eighth);
            for (int t = 0; t < m; t++) {
                __m256i lo, hi;
                fold8_pairs(v, xq + t * xrow + b * IQ1_M_QK, NULL, &lo, &hi);
                const int64_t lx = t * nb * 16 + 16 * b;
                const __m256i c0 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), 7);       /* -X */
                const __m256i c1 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx + 8)), 7);
                lo = _mm256_add_epi32(lo, _mm256_add_epi32(_mm256_slli_epi32(c0, 3), c0));
                hi = _mm256_add_epi32(hi, _mm256_add_epi32(_mm256_slli_epi32(c1, 3), c1));
                acc[t][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), ws_lo), _mm256_loadu_ps(dx + lx), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), ws_hi), _mm256_loadu_ps(dx + lx + 8), acc[t][1]);
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}
#define IQ1M_CALL(A, B, R, M) iq1m_rows_avx2(jb, A, B, R, M)
DEFINE_ROWS_AVX2(iq1_m, IQ1M_CALL)
#define IQ1S_CALL(A, B, R, M) iq_rows_avx2(jb, A, B, R, M, 0)
#define IQ3XXS_CALL(A, B, R, M) iq_rows_avx2(jb, A, B, R, M, 1)
#define IQ2XXS_CALL(A, B, R, M) iq_rows_avx2(jb, A, B, R, M, 2)
DEFINE_ROWS_AVX2(iq1_s, IQ1S_CALL)
DEFINE_ROWS_AVX2(iq3_xxs, IQ3XXS_CALL)
DEFINE_ROWS_AVX2(iq2_xxs, IQ2XXS_CALL)

#endif
