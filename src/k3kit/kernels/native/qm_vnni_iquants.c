/* qm_vnni_iquants.c: the AVX512-VNNI direct paths of the IQ types (IQ2_XXS, IQ3_XXS, IQ1_S: two
 * blocks a group; IQ2_XS, IQ1_M: one): their group decoders (grid rows by gathers, the signs
 * applied as masks, the lane scales as vectors) and the folding and transposed paths
 * instantiated for them (qm_vnni.h). One file per type family: a family's decoders are what its
 * kernels differ in. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"
#include "qm_vnni.h"

#ifdef K3_X86

DEFINE_FD_GENERIC(IQ2_XXS, iq2_xxs)
DEFINE_FD_GENERIC(IQ2_XS, iq2_xs)
DEFINE_FD_GENERIC(IQ3_XXS, iq3_xxs)
DEFINE_FD_GENERIC(IQ1_S, iq1_s)
DEFINE_FD_GENERIC(IQ1_M, iq1_m)

/* IQ types: grid rows fetched by gathers, and each 64 values' sign bits (ksigns: the 7 stored
 * bits of each 8-value run plus their parity as the eighth) made in a 64-bit word and applied
 * as a mask; the biased operand is then q + 128. */
__attribute__((target(VNNI_TARGET))) INLINE __mmask64 ksigns8(uint64_t fields) {
    const uint64_t s = _pdep_u64(fields, 0x7F7F7F7F7F7F7F7FULL);
    uint64_t t = s ^ (s >> 4);
    t ^= t >> 2;
    t ^= t >> 1;
    return _cvtu64_mask64(s | ((t & L8) << 7));
}
__attribute__((target(VNNI_TARGET))) INLINE __m512i signed_biased(__m512i g, __mmask64 neg) {
    return _mm512_xor_si512(_mm512_mask_sub_epi8(g, neg, _mm512_setzero_si512(), g), _mm512_set1_epi8((char)0x80));
}
/* IQ2_XXS (two blocks a group): sub-blocks 2t, 2t + 1 are the 16 bytes at 2 + 16 t (4 grid
 * indices and a word of signs and scale, twice). */
__attribute__((target(VNNI_TARGET))) INLINE void zq_iq2_xxs_g(const uint8_t *gp, __m512i *z) {
    const __m128i pick = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *p = gp + s * IQ2_XXS_BYTES + 2 + 16 * t;
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)p), pick));
            const __m512i g = _mm512_i32gather_epi64(idx, (const long long *)IQ2XXS_GRID, 8);
            const uint64_t f = (rd32(p + 4) & 0x0FFFFFFFu) | (uint64_t)(rd32(p + 12) & 0x0FFFFFFFu) << 28;
            z[4 * s + t] = signed_biased(g, ksigns8(f));
        }
}
/* IQ3_XXS: sub-blocks 2t, 2t + 1: 16 grid indices at 2 + 16 t, their sign words at 66 + 8 t. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_iq3_xxs_g(const uint8_t *gp, __m512i *z) {
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *b = gp + s * IQ3_XXS_BYTES;
            const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * t)));
            const __m512i g = _mm512_i32gather_epi32(idx, (const int *)IQ3XXS_GRID, 4);
            const uint64_t f = (rd32(b + 66 + 8 * t) & 0x0FFFFFFFu) | (uint64_t)(rd32(b + 70 + 8 * t) & 0x0FFFFFFFu) << 28;
            z[4 * s + t] = signed_biased(g, ksigns8(f));
        }
}
/* IQ1_S: sub-blocks 2t, 2t + 1: grid indices qs[8 t ..] | 3 bits of the qh words 2t, 2t + 1
 * each, the rows (8 grid values each) plus 1 + 128, minus 2 where the word's delta bit is set. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_iq1_s_g(const uint8_t *gp, __m512i *z) {
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *b = gp + s * IQ1_S_BYTES;
            const uint32_t w = rd32(b + 34 + 4 * t);
            const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * t)));
            /* index bits 8-10 of value l of word h: bits 3 l .. 3 l + 2 of w >> 16 h, moved to 8 */
            const __m256i hw = _mm256_set_m128i(_mm_set1_epi32((int)(w >> 8)), _mm_set1_epi32((int)(w << 8)));
            const __m256i hi = _mm256_and_si256(_mm256_srlv_epi32(hw, _mm256_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9)),
                                                _mm256_set1_epi32(0x700));
            const __m512i g = _mm512_i32gather_epi64(_mm256_or_si256(lo, hi), (const long long *)IQ1S_GRID8, 8);
            const uint64_t neg = (w & 0x8000u ? 0xFFFFFFFFull : 0) | (w & 0x80000000u ? 0xFFFFFFFF00000000ull : 0);
            const __m512i v = _mm512_add_epi8(g, _mm512_set1_epi8((char)129));
            z[4 * s + t] = _mm512_mask_sub_epi8(v, _cvtu64_mask64(neg), v, _mm512_set1_epi8(2));
        }
}
/* IQ2_XS (one block a group): sub-blocks 2t, 2t + 1 are 8 words at 2 + 16 t (9-bit grid index,
 * 7-bit sign index). */
__attribute__((target(VNNI_TARGET))) INLINE void zq_iq2_xs_g(const uint8_t *gp, __m512i *z) {
    for (int t = 0; t < 4; t++) {
        const uint8_t *p = gp + 2 + 16 * t;
        const __m256i idx = _mm256_and_si256(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)),
                                             _mm256_set1_epi32(511));
        const __m512i g = _mm512_i32gather_epi64(idx, (const long long *)IQ2XS_GRID, 8);
        const uint64_t f = _pext_u64(rd64(p), 0xFE00FE00FE00FE00ULL) | _pext_u64(rd64(p + 8), 0xFE00FE00FE00FE00ULL) << 28;
        z[t] = signed_biased(g, ksigns8(f));
    }
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_iq2_xs_g(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    /* lane p: the low (p < 8) or high nibble of scales[p % 8] */
    const uint64_t v = rd64(gp + 66);
    const __m128i n = _mm_set_epi64x((long long)((v >> 4) & 0x0F0F0F0F0F0F0F0FULL), (long long)(v & 0x0F0F0F0F0F0F0F0FULL));
    const __m512 t = _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n)));
    *ws = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(f16v(rd16(gp))), t), _mm512_set1_ps(0.25f));
}
/* IQ1_M (one block a group): sub-blocks 2t, 2t + 1: grid indices qs[8 t ..] | 3 bits of the
 * nibbles of qh[4 t .. 4 t + 3], whose fourth bit is each 8 values' delta sign. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_iq1_m_g(const uint8_t *gp, __m512i *z) {
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for (int t = 0; t < 4; t++) {
        const uint32_t w = rd32(gp + 32 + 4 * t);
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(gp + 8 * t)));
        const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), sh),
                                                              _mm256_set1_epi32(7)), 8);
        const __m512i g = _mm512_i32gather_epi64(_mm256_or_si256(lo, hi), (const long long *)IQ1S_GRID8, 8);
        const __mmask8 neg = (__mmask8)_pext_u32(w, 0x88888888u);
        const __m512i delta = _mm512_mask_blend_epi64(neg, _mm512_set1_epi8((char)129), _mm512_set1_epi8(127));
        z[t] = _mm512_add_epi8(g, delta);
    }
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_iq1_m_g(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    const uint16_t sc[4] = {rd16(gp + 48), rd16(gp + 50), rd16(gp + 52), rd16(gp + 54)};
    const float d = f16((uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000)));
    /* lane p: sub-block j = p % 8, half h = p / 8: bits 6 (j % 2) + 3 h of word j / 2 */
    const __m512i words = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3),
                                                   _mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(gp + 48)))));
    const __m512i s = _mm512_and_si512(_mm512_srlv_epi32(words, _mm512_setr_epi32(0, 6, 0, 6, 0, 6, 0, 6, 3, 9, 3, 9, 3, 9, 3, 9)),
                                       _mm512_set1_epi32(7));
    const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(s, 1), _mm512_set1_epi32(1));
    *ws = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(odd)), _mm512_set1_ps(0.125f));
}
/* IQ2_XXS / IQ3_XXS: d * (0.5 + s) * f with s the top nibble of each sub-block's word. */
__attribute__((target(VNNI_TARGET))) INLINE __m512 iq_scales(__m512i aux, float d0, float d1, float f) {
    const __m512 t = _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_cvtepi32_ps(_mm512_srli_epi32(aux, 28)));
    return _mm512_mul_ps(_mm512_mul_ps(cat8(_mm256_set1_ps(d0), _mm256_set1_ps(d1)), t), _mm512_set1_ps(f));
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_iq2_xxs(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    /* sub-block j's word is dword 2 j + 1 from byte 2 of its block */
    const __m512i idx = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i aux = _mm512_permutex2var_epi32(_mm512_loadu_si512(gp + 2), idx,
                                                  _mm512_loadu_si512(gp + IQ2_XXS_BYTES + 2));
    *ws = iq_scales(aux, f16v(rd16(gp)), f16v(rd16(gp + IQ2_XXS_BYTES)), 0.25f);
}
__attribute__((target(VNNI_TARGET))) INLINE void zs_iq3_xxs(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    const __m512i aux = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(gp + 66))),
                                           _mm256_loadu_si256((const __m256i *)(gp + IQ3_XXS_BYTES + 66)), 1);
    *ws = iq_scales(aux, f16v(rd16(gp)), f16v(rd16(gp + IQ3_XXS_BYTES)), 0.5f);
}
/* IQ1_S: (d * (2 s + 1)) / 8 with s bits 12-14 of each sub-block's qh word. */
__attribute__((target(VNNI_TARGET))) INLINE void zs_iq1_s(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    const __m256i qh = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(gp + IQ1_S_BYTES + 34)),
                                        _mm_loadu_si128((const __m128i *)(gp + 34)));
    const __m512i s = _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu16_epi32(qh), 12), _mm512_set1_epi32(7));
    const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(s, 1), _mm512_set1_epi32(1));
    const __m512 d = cat8(_mm256_set1_ps(f16v(rd16(gp))), _mm256_set1_ps(f16v(rd16(gp + IQ1_S_BYTES))));
    *ws = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(odd)), _mm512_set1_ps(0.125f));
}

DEFINE_FD(IQ2_XXS, iq2_xxs, 0)
DEFINE_FD(IQ2_XS, iq2_xs, 0)
DEFINE_FD(IQ3_XXS, iq3_xxs, 0)
DEFINE_FD(IQ1_S, iq1_s, 0)
DEFINE_FD(IQ1_M, iq1_m, 0)

DEFINE_FTD(iq2_xxs)
DEFINE_FTD(iq2_xs)
DEFINE_FTD(iq3_xxs)
DEFINE_FTD(iq1_s)
DEFINE_FTD(iq1_m)

DEFINE_FT(IQ2_XXS, iq2_xxs, 0)
DEFINE_FT(IQ2_XS, iq2_xs, 0)
DEFINE_FT(IQ3_XXS, iq3_xxs, 0)
DEFINE_FT(IQ1_S, iq1_s, 0)
DEFINE_FT(IQ1_M, iq1_m, 0)

#endif
