/* qm_vnni_kquants.c: the AVX512-VNNI direct paths of the K-quants (Q4_K, Q5_K: two blocks a
 * group; Q6_K, Q2_K, Q3_K: one): their group decoders (the operand bytes as vpdpbusd takes them
 * and the lane scales as vectors) and the folding and transposed paths instantiated for them
 * (qm_vnni.h). One file per type family: a family's decoders are what its kernels differ in. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"
#include "qm_vnni.h"

#ifdef K3_X86

DEFINE_FD_GENERIC(Q4_K, q4_k)
DEFINE_FD_GENERIC(Q5_K, q5_k)
DEFINE_FD_GENERIC(Q6_K, q6_k)
DEFINE_FD_GENERIC(Q2_K, q2_k)
DEFINE_FD_GENERIC(Q3_K, q3_k)

/* Q4_K (two blocks a group): sub-blocks 2t, 2t + 1 are the low and high nibbles of qs[32 t ..]. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_q4_k(const uint8_t *gp, __m512i *z) {
    const __m512i sh = counts(0, 4), m4 = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 4; t++)
            z[4 * s + t] = _mm512_and_si512(_mm512_srlv_epi16(bcast32(gp + s * Q4_K_BYTES + 16 + 32 * t), sh), m4);
}
/* Q5_K: the same plus bit 2t (2t + 1) of qh[] as the fifth bit. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_q5_k(const uint8_t *gp, __m512i *z) {
    const __m512i sh = counts(0, 4), m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    for (int s = 0; s < 2; s++) {
        const __m512i qh = bcast32(gp + s * Q5_K_BYTES + 16);
        for (int t = 0; t < 4; t++) {
            const __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(bcast32(gp + s * Q5_K_BYTES + 48 + 32 * t), sh), m4);
            const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(qh, counts(2 * t, 2 * t + 1)), one);
            z[4 * s + t] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
        }
    }
}
/* Q6_K (one block a group): sub-blocks 2m, 2m + 1 = 4h + g, g + 1 (h = m / 2, g = 2 (m % 2)): the
 * low (m even) or high nibbles of ql[64 h .. 64 h + 63], bits 2g of qh[32 h ..] on top; unsigned. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_q6_k(const uint8_t *gp, __m512i *z) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
    for (int m = 0; m < 4; m++) {
        const int h = m >> 1, g = 2 * (m & 1);
        const __m512i ql = _mm512_loadu_si512(gp + 64 * h);
        const __m512i lo = _mm512_and_si512(m & 1 ? _mm512_srli_epi16(ql, 4) : ql, m4);
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(bcast32(gp + 128 + 32 * h), counts(2 * g, 2 * g + 2)), three);
        z[m] = _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
    }
}
/* Q2_K: sub-blocks 2m, 2m + 1: bits 4 (m % 2) and 4 (m % 2) + 2 of qs[32 (m / 2) ..]. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_q2_k(const uint8_t *gp, __m512i *z) {
    const __m512i three = _mm512_set1_epi8(3);
    for (int m = 0; m < 4; m++)
        z[m] = _mm512_and_si512(_mm512_srlv_epi16(bcast32(gp + 16 + 32 * (m >> 1)), counts(4 * (m & 1), 4 * (m & 1) + 2)), three);
}

/* Lane scales as vectors (the same products as scales_T_v, in lane order). */
__attribute__((target(VNNI_TARGET))) INLINE void k4_scales(const uint8_t *b, __m256 *s, __m256 *mn) {
    const uint32_t a = rd32(b + 4), c = rd32(b + 8), e = rd32(b + 12);
    const uint64_t sc = (a & 0x3F3F3F3Fu) | (uint64_t)((e & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t m = (c & 0x3F3F3F3Fu) | (uint64_t)(((e >> 4) & 0x0F0F0F0Fu) | ((c >> 2) & 0x30303030u)) << 32;
    *s = _mm256_mul_ps(_mm256_set1_ps(f16v(rd16(b))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    *mn = _mm256_mul_ps(_mm256_set1_ps(f16v(rd16(b + 2))), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m))));
}
#define DEFINE_ZS_K4(NAME_LC, BYTES)                                                                \
    __attribute__((target(VNNI_TARGET))) INLINE void zs_##NAME_LC(const uint8_t *gp, __m512 *ws, __m512 *wm) { \
        __m256 s0, m0, s1, m1;                                                                     \
        k4_scales(gp, &s0, &m0);                                                                   \
        k4_scales(gp + (BYTES), &s1, &m1);                                                         \
        *ws = cat8(s0, s1);                                                                        \
        *wm = cat8(m0, m1);                                                                        \
    }
DEFINE_ZS_K4(q4_k, Q4_K_BYTES)
DEFINE_ZS_K4(q5_k, Q5_K_BYTES)

/* d times 16 bytes (signed or not), then from scales_T_v's order (s[2 j + h]) to lane order. */
__attribute__((target(VNNI_TARGET))) INLINE __m512 scale16_lanes(__m128i v, int is_signed, float d) {
    const __m512i i = is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
    return _mm512_permutexvar_ps(_mm512_load_si512(FD_SIDX16), _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(i)));
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_q6_k(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    *ws = scale16_lanes(_mm_loadu_si128((const __m128i *)(gp + 192)), 1, f16v(rd16(gp + 208)));
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_q2_k(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    const __m128i v = _mm_loadu_si128((const __m128i *)gp), low4 = _mm_set1_epi8(0x0F);
    *ws = scale16_lanes(_mm_and_si128(v, low4), 0, f16v(rd16(gp + 80)));
    *wm = scale16_lanes(_mm_and_si128(_mm_srli_epi16(v, 4), low4), 0, f16v(rd16(gp + 82)));
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_q3_k(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[4];
    memcpy(aux, gp + 96, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    const __m128i sc = _mm_sub_epi8(_mm_set_epi32((int)aux[3], (int)aux[2], (int)aux[1], (int)aux[0]), _mm_set1_epi8(32));
    *ws = scale16_lanes(sc, 1, f16v(rd16(gp + 108)));
}

DEFINE_FD(Q4_K, q4_k, 1)
DEFINE_FD(Q5_K, q5_k, 1)
DEFINE_FD(Q6_K, q6_k, 0)
DEFINE_FD(Q2_K, q2_k, 1)
DEFINE_FD(Q3_K, q3_k, 0)

DEFINE_FTD(q4_k)
DEFINE_FTD(q5_k)
DEFINE_FTD(q6_k)
DEFINE_FTD(q2_k)
DEFINE_FTD(q3_k)

DEFINE_FT(Q4_K, q4_k, 1)
DEFINE_FT(Q5_K, q5_k, 1)
DEFINE_FT(Q6_K, q6_k, 0)
DEFINE_FT(Q2_K, q2_k, 1)
DEFINE_FT(Q3_K, q3_k, 0)

#endif
