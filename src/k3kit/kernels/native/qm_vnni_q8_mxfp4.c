/* qm_vnni_q8_mxfp4.c: the AVX512-VNNI direct paths of the types with a scale per 32 values, Q8_0
 * and MXFP4 (a group is 16 blocks): their group decoders (the operand bytes, and the scales
 * computed or picked without a gather) and the folding and transposed paths instantiated for them
 * (qm_vnni.h). One file per type family: a family's decoders are what its kernels differ in. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"
#include "qm_vnni.h"

#ifdef K3_X86

DEFINE_FD_GENERIC(Q8_0, q8_0)
DEFINE_FD_GENERIC(MXFP4, mxfp4)

/* MXFP4 (16 blocks a group): blocks 2m, 2m + 1 as [low nibbles | high nibbles] of each, looked
 * up in kv + 128. */
__attribute__((target(VNNI_TARGET))) INLINE void zq_mxfp4_g(const uint8_t *gp, __m512i *z) {
    const __m512i kv = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)KV), _mm_set1_epi8((char)0x80)));
    const __m512i sh = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);   /* 16-bit counts per 128-bit lane */
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i cnt = _mm512_or_si512(sh, _mm512_slli_epi64(sh, 16));
    const __m512i cnt16 = _mm512_or_si512(cnt, _mm512_slli_epi64(cnt, 32));
    for (int m = 0; m < 8; m++) {
        const uint8_t *b = gp + 2 * m * MXFP4_BYTES;
        const __m256i q2 = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b + MXFP4_BYTES + 1)),
                                            _mm_loadu_si128((const __m128i *)(b + 1)));
        const __m512i qq = _mm512_shuffle_i64x2(_mm512_castsi256_si512(q2), _mm512_castsi256_si512(q2), 0x50);
        z[m] = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srlv_epi16(qq, cnt16), m4));
    }
}

/* MXFP4 (16 blocks a group): E8M0_HALF of each block's exponent byte, computed. */
__attribute__((target(VNNI_TARGET))) INLINE void zs_mxfp4(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    const __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(MXFP4_BYTES));
    const __m512i e = _mm512_and_si512(_mm512_i32gather_epi32(off, gp, 1), _mm512_set1_epi32(0xFF));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 lt2 = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    *ws = _mm512_castsi512_ps(_mm512_mask_blend_epi32(lt2, big, small));
}
/* Q8_0 (16 blocks a group): each block's f16 d. */
__attribute__((target(VNNI_TARGET))) INLINE void zs_q8_0(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    (void)wm;
    const __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(Q8_0_BYTES));
    const __m512i h = _mm512_i32gather_epi32(off, gp, 1);
    *ws = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
}
DEFINE_FD(Q8_0, q8_0, 0)
DEFINE_FD(MXFP4, mxfp4, 0)

/* Q8_0's group for this path with fewer loads than zq_q8_0 + zs_q8_0 (16 half loads and a
 * 16-way gather): the group's 544 bytes as 9 vectors; blocks 2m, 2m + 1 (bytes 68 m + 2 .. 33
 * and 36 .. 67, word-aligned) picked from vectors m, m + 1 by one vpermt2w, +128 as the others
 * make it; the 16 f16 d (word 17 i: two in each of vectors 0-7) by 4 vpermt2w and 3 blends.
 * The same operand bytes and scales as zq_q8_0 / zs_q8_0. */
__attribute__((target(VNNI_TARGET))) INLINE void ftd_q8_0(const uint8_t *gp, __m512i *z, __m512 *ws, __m512 *wm) {
    (void)wm;
    __m512i c[9];
    for (int q = 0; q < 8; q++) c[q] = _mm512_loadu_si512(gp + 64 * q);
    c[8] = _mm512_maskz_loadu_epi16(0xFFFF, gp + 512);   /* bytes 512 .. 543: no read past the group */
    const __m512i base = _mm512_setr_epi32(0x00010000, 0x00030002, 0x00050004, 0x00070006, 0x00090008, 0x000B000A,
                                           0x000D000C, 0x000F000E, 0x00120011, 0x00140013, 0x00160015, 0x00180017,
                                           0x001A0019, 0x001C001B, 0x001E001D, 0x0020001F);
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int m = 0; m < 8; m++)
        z[m] = _mm512_xor_si512(_mm512_permutex2var_epi16(c[m], _mm512_add_epi16(base, _mm512_set1_epi16((short)(2 * m + 1))),
                                                          c[m + 1]), bias);
    /* output word 4 h + e = scale 4 h + e = word 4 h + 17 e of vectors 2 h, 2 h + 1 (as one 64-word table) */
    const __m512i si = _mm512_setr_epi32(0x00110000, 0x00330022, 0x00150004, 0x00370026, 0x00190008, 0x003B002A,
                                         0x001D000C, 0x003F002E, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i s = _mm512_permutex2var_epi16(c[0], si, c[1]);
    s = _mm512_mask_mov_epi16(s, 0x00F0, _mm512_permutex2var_epi16(c[2], si, c[3]));
    s = _mm512_mask_mov_epi16(s, 0x0F00, _mm512_permutex2var_epi16(c[4], si, c[5]));
    s = _mm512_mask_mov_epi16(s, 0xF000, _mm512_permutex2var_epi16(c[6], si, c[7]));
    *ws = _mm512_cvtph_ps(_mm512_castsi512_si256(s));
}
/* MXFP4: zq_mxfp4's operand; the 16 exponent bytes (byte 17 i: all in the group's first 256
 * bytes) picked from 4 vectors by 2 vpermt2w and a shift instead of zs_mxfp4's 16-way gather,
 * then zs_mxfp4's arithmetic. */
__attribute__((target(VNNI_TARGET))) INLINE void ftd_mxfp4(const uint8_t *gp, __m512i *z, __m512 *ws, __m512 *wm) {
    (void)wm;
    zq_mxfp4(gp, z);
    /* word of byte 17 i, i = 0..7 in vectors 0 | 1, i = 8..15 in vectors 2 | 3 (at positions 8..15) */
    const __m512i wi = _mm512_setr_epi32(0x00080000, 0x00190011, 0x002A0022, 0x003B0033, 0x000C0004, 0x001D0015,
                                         0x002E0026, 0x003F0037, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i lo = _mm512_permutex2var_epi16(_mm512_loadu_si512(gp), wi, _mm512_loadu_si512(gp + 64));
    const __m512i hi = _mm512_permutex2var_epi16(_mm512_loadu_si512(gp + 128), wi, _mm512_loadu_si512(gp + 192));
    const __m512i w = _mm512_mask_mov_epi16(lo, 0xFF00, hi);
    const __m512i sh = _mm512_srlv_epi16(w, _mm512_set1_epi32(0x00080000));   /* odd i: the high byte */
    const __m512i e = _mm512_and_si512(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(sh)), _mm512_set1_epi32(0xFF));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 lt2 = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    *ws = _mm512_castsi512_ps(_mm512_mask_blend_epi32(lt2, big, small));
}

DEFINE_FT(Q8_0, q8_0, 0)
DEFINE_FT(MXFP4, mxfp4, 0)

#endif
