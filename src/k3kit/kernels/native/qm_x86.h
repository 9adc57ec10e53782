/* qm_x86.h: the 256-bit decoders (AVX2 + F16C) every x86 vector path builds on: per type a
 * sub-block's 32 int8 values in a register (qv_T: the values q_T unpacks) and the block's scales
 * (scales_T_v), the tiles' horizontal sum and the prefetch of the blocks ahead. A header because
 * they are always_inline into the float tiles and panels, the int8 panels and direct paths,
 * AVX2's own kernels and the VNNI decoders. x86 only. */
#ifndef K3_QM_X86_H
#define K3_QM_X86_H

#include "qm.h"

#ifdef K3_X86

/* f16 -> float with F16C (exact, like f16()). */
__attribute__((target(AVX2_TARGET))) INLINE float f16v(uint16_t h) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

/* The 32 int8 values of sub-block j in a register (the same values as q_T). */
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_q8_0(const uint8_t *b, int j) {
    (void)j;
    return _mm256_loadu_si256((const __m256i *)(b + 2));
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i nibbles(const uint8_t *p, int high) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_q4_k(const uint8_t *b, int j) {
    return nibbles(b + 16 + 32 * (j / 2), j & 1);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_q5_k(const uint8_t *b, int j) {
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
    return _mm256_or_si256(nibbles(b + 48 + 32 * (j / 2), j & 1), _mm256_slli_epi16(hi, 4));
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_q6_k(const uint8_t *b, int j) {
    const int h = j >> 2, g = j & 3;
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), _mm256_set1_epi8(3));
    const __m256i q = _mm256_or_si256(nibbles(b + 64 * h + 32 * (g & 1), g >> 1), _mm256_slli_epi16(hi, 4));
    return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_q2_k(const uint8_t *b, int j) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (j >> 2)));
    return _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j & 3)), _mm256_set1_epi8(3));
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_q3_k(const uint8_t *b, int j) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (j >> 2)));
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j & 3)), _mm256_set1_epi8(3));
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8((char)(1 << j))),
                                            _mm256_setzero_si256());
    return _mm256_sub_epi8(low, _mm256_and_si256(clear, _mm256_set1_epi8(4)));
}
/* IQ types: grid rows and sign masks looked up per 8 values, the signs applied as (g ^ s) - s. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i apply_signs(__m256i g, __m256i s) {
    return _mm256_sub_epi8(_mm256_xor_si256(g, s), s);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_iq2_xxs(const uint8_t *b, int j) {
    const uint8_t *p = b + 2 + 8 * j;
    const uint32_t aux = rd32(p + 4);
    const __m256i g = _mm256_set_epi64x((long long)IQ2XXS_GRID[p[3]], (long long)IQ2XXS_GRID[p[2]],
                                        (long long)IQ2XXS_GRID[p[1]], (long long)IQ2XXS_GRID[p[0]]);
    const __m256i s = _mm256_set_epi64x((long long)SIGN_MASK[(aux >> 21) & 127], (long long)SIGN_MASK[(aux >> 14) & 127],
                                        (long long)SIGN_MASK[(aux >> 7) & 127], (long long)SIGN_MASK[aux & 127]);
    return apply_signs(g, s);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_iq2_xs(const uint8_t *b, int j) {
    const uint8_t *p = b + 2 + 8 * j;
    const uint16_t v0 = rd16(p), v1 = rd16(p + 2), v2 = rd16(p + 4), v3 = rd16(p + 6);
    const __m256i g = _mm256_set_epi64x((long long)IQ2XS_GRID[v3 & 511], (long long)IQ2XS_GRID[v2 & 511],
                                        (long long)IQ2XS_GRID[v1 & 511], (long long)IQ2XS_GRID[v0 & 511]);
    const __m256i s = _mm256_set_epi64x((long long)SIGN_MASK[v3 >> 9], (long long)SIGN_MASK[v2 >> 9],
                                        (long long)SIGN_MASK[v1 >> 9], (long long)SIGN_MASK[v0 >> 9]);
    return apply_signs(g, s);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_iq3_xxs(const uint8_t *b, int j) {
    const uint8_t *q = b + 2 + 8 * j;
    const uint32_t aux = rd32(b + 66 + 4 * j);
    const __m256i g = _mm256_set_epi32((int)IQ3XXS_GRID[q[7]], (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[5]],
                                       (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[2]],
                                       (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[0]]);
    const __m256i s = _mm256_set_epi64x((long long)SIGN_MASK[(aux >> 21) & 127], (long long)SIGN_MASK[(aux >> 14) & 127],
                                        (long long)SIGN_MASK[(aux >> 7) & 127], (long long)SIGN_MASK[aux & 127]);
    return apply_signs(g, s);
}
/* IQ1: grid rows times 8 plus the delta's sign (+-1) in every byte. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_iq1_s(const uint8_t *b, int j) {
    const uint16_t qh = rd16(b + 34 + 2 * j);
    const uint8_t *qs = b + 2 + 4 * j;
    const __m256i g = _mm256_set_epi64x((long long)IQ1S_GRID8[qs[3] | ((qh >> 1) & 0x700)],
                                        (long long)IQ1S_GRID8[qs[2] | ((qh << 2) & 0x700)],
                                        (long long)IQ1S_GRID8[qs[1] | ((qh << 5) & 0x700)],
                                        (long long)IQ1S_GRID8[qs[0] | ((qh << 8) & 0x700)]);
    return _mm256_add_epi8(g, _mm256_set1_epi8(qh & 0x8000 ? -1 : 1));
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_iq1_m(const uint8_t *b, int j) {
    const uint8_t *qs = b + 4 * j;
    const unsigned h0 = b[32 + 2 * j], h1 = b[33 + 2 * j];
    const __m256i g = _mm256_set_epi64x((long long)IQ1S_GRID8[qs[3] | ((h1 << 4) & 0x700)],
                                        (long long)IQ1S_GRID8[qs[2] | ((h1 << 8) & 0x700)],
                                        (long long)IQ1S_GRID8[qs[1] | ((h0 << 4) & 0x700)],
                                        (long long)IQ1S_GRID8[qs[0] | ((h0 << 8) & 0x700)]);
    /* delta sign of group l: bit 3 of its nibble; 0x01 or 0xFF in all its bytes */
    const uint64_t d0 = L8 | (0 - (uint64_t)((h0 >> 3) & 1)), d1 = L8 | (0 - (uint64_t)((h0 >> 7) & 1));
    const uint64_t d2 = L8 | (0 - (uint64_t)((h1 >> 3) & 1)), d3 = L8 | (0 - (uint64_t)((h1 >> 7) & 1));
    return _mm256_add_epi8(g, _mm256_set_epi64x((long long)d3, (long long)d2, (long long)d1, (long long)d0));
}

/* Q8_0 has a scale per 32 values, so its f16 conversion is on the hot path: F16C there. */
__attribute__((target(AVX2_TARGET))) INLINE void scales_q8_0_v(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    s[0] = f16v(rd16(b));
}
/* Q4_K/Q5_K: the 8 six-bit scales and mins unpacked 4 at a time in 32-bit words (ggml's
 * get_scale_min_k4), then d * sc and dmin * m for all 8 in one vector each: in registers, and
 * stored (the generic paths). */
__attribute__((target(AVX2_TARGET))) INLINE void scales_k4_r(const uint8_t *b, __m256 *s, __m256 *mn) {
    const uint32_t a = rd32(b + 4), c = rd32(b + 8), e = rd32(b + 12);
    const uint64_t sc = (a & 0x3F3F3F3Fu) | (uint64_t)((e & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t m = (c & 0x3F3F3F3Fu) | (uint64_t)(((e >> 4) & 0x0F0F0F0Fu) | ((c >> 2) & 0x30303030u)) << 32;
    *s = _mm256_mul_ps(_mm256_set1_ps(f16v(rd16(b))),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc))));
    *mn = _mm256_mul_ps(_mm256_set1_ps(f16v(rd16(b + 2))),
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m))));
}
__attribute__((target(AVX2_TARGET))) INLINE void scales_k4_v(const uint8_t *b, float *s, float *mn) {
    __m256 sv, mv;
    scales_k4_r(b, &sv, &mv);
    _mm256_storeu_ps(s, sv);
    _mm256_storeu_ps(mn, mv);
}
#define scales_q4_k_v scales_k4_v
#define scales_q5_k_v scales_k4_v
/* d times 16 small integers (bytes, signed or not) into s[0..15]: the same products as the
 * scalar loops, 8 at a time. */
__attribute__((target(AVX2_TARGET))) INLINE void scale16(float *s, __m128i v, int is_signed, float d) {
    const __m256 dv = _mm256_set1_ps(d);
    const __m128i hi = _mm_srli_si128(v, 8);
    const __m256i a = is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
    const __m256i b = is_signed ? _mm256_cvtepi8_epi32(hi) : _mm256_cvtepu8_epi32(hi);
    _mm256_storeu_ps(s, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(a)));
    _mm256_storeu_ps(s + 8, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(b)));
}
__attribute__((target(AVX2_TARGET))) INLINE void scales_q6_k_v(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    scale16(s, _mm_loadu_si128((const __m128i *)(b + 192)), 1, f16v(rd16(b + 208)));
}
__attribute__((target(AVX2_TARGET))) INLINE void scales_q2_k_v(const uint8_t *b, float *s, float *mn) {
    const __m128i v = _mm_loadu_si128((const __m128i *)b), low4 = _mm_set1_epi8(0x0F);
    scale16(s, _mm_and_si128(v, low4), 0, f16v(rd16(b + 80)));
    scale16(mn, _mm_and_si128(_mm_srli_epi16(v, 4), low4), 0, f16v(rd16(b + 82)));
}
__attribute__((target(AVX2_TARGET))) INLINE void scales_q3_k_v(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[4];
    memcpy(aux, b + 96, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    const __m128i sc = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)aux), _mm_set1_epi8(32));
    scale16(s, sc, 1, f16v(rd16(b + 108)));
}
#define scales_iq2_xxs_v scales_iq2_xxs
#define scales_iq2_xs_v scales_iq2_xs
#define scales_iq3_xxs_v scales_iq3_xxs
#define scales_iq1_s_v scales_iq1_s
#define scales_iq1_m_v scales_iq1_m

__attribute__((target(AVX2_TARGET))) INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Ask for the blocks PREFETCH_BYTES ahead in each of the NT rows: a block's scales are read
 * first and everything after waits on them, so a miss there stalls more than the hardware
 * prefetcher's stream detection hides (measured: a third of Q6_K's decode time). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 768
#endif
#define PREFETCH_BLOCKS(T, ROW, RB, NT, B, NB)                                                      \
    do {                                                                                           \
        if (((B) + 1) * T##_BYTES / 64 != (B) * T##_BYTES / 64 || (B) == 0)                        \
            for (int i_ = 0; i_ < (NT); i_++)                                                      \
                for (int o_ = 0; o_ < T##_BYTES + 63; o_ += 64)                                    \
                    __builtin_prefetch((ROW) + i_ * (RB) + (B) * T##_BYTES + PREFETCH_BYTES + o_); \
    } while (0)

/* MXFP4: kv of the low nibbles (values 0-15) then of the high nibbles (16-31). */
__attribute__((target(AVX2_TARGET))) INLINE __m256i qv_mxfp4(const uint8_t *b, int j) {
    (void)j;
    const __m128i kv = _mm_loadu_si128((const __m128i *)KV), low4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 1));
    const __m128i lo = _mm_shuffle_epi8(kv, _mm_and_si128(q, low4));
    const __m128i hi = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
    return _mm256_set_m128i(hi, lo);
}
#define scales_mxfp4_v scales_mxfp4

#endif /* K3_X86 */

#endif
