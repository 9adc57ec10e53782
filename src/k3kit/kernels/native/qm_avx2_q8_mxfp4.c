/* qm_avx2_q8_mxfp4.c: AVX2's own int8 direct kernel for the types with a scale per 32 values,
 * Q8_0 and MXFP4 (a group is 16 blocks, lane p block p), 1 to I8_DIRECT_ROWS rows of x (see "few
 * rows on AVX2" in qm_i8_x86.h). A file per type family, as the other qm_avx2_*.c. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"

#ifdef K3_X86

/* Q8_0 and MXFP4 (a scale per 32 values: a group is 16 blocks, lane p block p): one vector of a
 * block's values times x, 8 pair sums of 4 products; fold_lanes makes the group's 16 lane sums.
 * Q8_0's values are signed, so |q| . (x with q's sign) as the generic path; MXFP4's are table
 * values, looked up as KV + 12 (0-24, unsigned: maddubs takes them as they are) and each lane
 * sum corrected by -12 X (X its bytes' sum: from corr = -128 X, exactly). */
#define MX_BIAS 12
/* Block b of a Q8_0 (its 32 values) or MXFP4 (KV + MX_BIAS, values 0-15 | 16-31) row in a
 * vector and its scale in *sc; past the row's nb blocks (a partial last group) zeros, as the other
 * paths. kv: the biased MXFP4 table in both lanes. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i block16_avx2(const uint8_t *ri, int64_t b, int64_t nb, int mx,
                                                               __m256i kv, float *sc) {
    if (b >= nb) {
        *sc = 0.0f;
        return _mm256_setzero_si256();
    }
    const uint8_t *blk = ri + b * (mx ? MXFP4_BYTES : Q8_0_BYTES);
    __builtin_prefetch(blk + I8_PREFETCH);
    if (mx) {
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 1)));
        const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                             _mm256_set1_epi8(0x0F));
        *sc = E8M0_HALF[blk[0]];
        return _mm256_shuffle_epi8(kv, nib);
    }
    *sc = f16v(rd16(blk));
    return _mm256_loadu_si256((const __m256i *)(blk + 2));
}
__attribute__((target(AVX2_TARGET))) INLINE void row16_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                           int m, int mx) {
    const xlane_t *xl = jb->xl;
    const int64_t bytes = mx ? MXFP4_BYTES : Q8_0_BYTES, nb = jb->k / 32, rb = nb * bytes, ng = xl->ngroups;
    const int64_t xrow = ng * xl->gv;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * ng * 16;
    const int32_t *corr = xl->corr + r0 * ng * 16;
    const __m256i ones = _mm256_set1_epi16(1);
    int8_t kvb[16];
    for (int i = 0; i < 16; i++) kvb[i] = (int8_t)(KV[i] + MX_BIAS);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvb));
    __m256 acc[I8_DIRECT_ROWS][2];
    __m256i p[16];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng && m > 1; g++)
            for (int h = 0; h < 2; h++) {   /* 8 blocks a vector each, transposed: v[c] = values 4c .. 4c + 3 of each */
                __m256i v[8], va[8];
                float sc[8] __attribute__((aligned(32)));
                for (int u = 0; u < 8; u++) v[u] = block16_avx2(ri, 16 * g + 8 * h + u, nb, mx, kv, &sc[u]);
                transpose8(v);
                if (!mx)
                    for (int c = 0; c < 8; c++) va[c] = _mm256_abs_epi8(v[c]);
                const __m256 ws = _mm256_load_ps(sc);
                for (int t = 0; t < m; t++) {
                    const int8_t *xt = xl->q + (r0 + t) * xrow + g * xl->gv + 32 * h;
                    const int64_t lx = t * ng * 16 + g * 16 + 8 * h;
                    __m256i S;
                    if (mx) {   /* 4 chunks a 16-bit sum: 8 products of 24 by 127, below 2^15 */
                        __m256i a0 = _mm256_maddubs_epi16(v[0], _mm256_load_si256((const __m256i *)xt));
                        __m256i a1 = _mm256_maddubs_epi16(v[4], _mm256_load_si256((const __m256i *)(xt + 256)));
                        for (int c = 1; c < 4; c++) {
                            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(v[c], _mm256_load_si256((const __m256i *)(xt + 64 * c))));
                            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(v[c + 4], _mm256_load_si256((const __m256i *)(xt + 256 + 64 * c))));
                        }
                        const __m256i c0 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), 5);
                        S = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(a0, ones), _mm256_madd_epi16(a1, ones)),
                                             _mm256_add_epi32(c0, _mm256_add_epi32(c0, c0)));
                    } else {
                        S = _mm256_setzero_si256();
                        for (int c = 0; c < 8; c++) {
                            const __m256i xv = _mm256_load_si256((const __m256i *)(xt + 64 * c));
                            S = _mm256_add_epi32(S, _mm256_madd_epi16(_mm256_maddubs_epi16(va[c], _mm256_sign_epi8(xv, v[c])), ones));
                        }
                    }
                    acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S), ws), _mm256_loadu_ps(dx + lx), acc[t][h]);
                }
            }
        for (int64_t g = 0; g < ng && m == 1; g++) {
            float sc[16] __attribute__((aligned(32)));
            for (int u = 0; u < 16; u++) {
                const int64_t b = 16 * g + u;
                const __m256i v = block16_avx2(ri, b, nb, mx, kv, &sc[u]);
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
                p[u] = _mm256_madd_epi16(mx ? _mm256_maddubs_epi16(v, xv)
                                            : _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xv, v)), ones);
            }
            __m256i lo, hi;
            fold_lanes(p, 32, &lo, &hi);
            const int64_t lx = g * 16;
            if (mx) {   /* corr >> 5 = -4 X */
                const __m256i c0 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), 5);
                const __m256i c1 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx + 8)), 5);
                lo = _mm256_add_epi32(lo, _mm256_add_epi32(c0, _mm256_add_epi32(c0, c0)));
                hi = _mm256_add_epi32(hi, _mm256_add_epi32(c1, _mm256_add_epi32(c1, c1)));
            }
            acc[0][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_load_ps(sc)), _mm256_loadu_ps(dx + lx),
                                        acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_load_ps(sc + 8)),
                                        _mm256_loadu_ps(dx + lx + 8), acc[0][1]);
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}

#define Q80_CALL(A, B, R, M) row16_avx2(jb, A, B, R, M, 0)
#define MX_CALL(A, B, R, M) row16_avx2(jb, A, B, R, M, 1)
DEFINE_ROWS_AVX2(q8_0, Q80_CALL)
DEFINE_ROWS_AVX2(mxfp4, MX_CALL)


#endif
