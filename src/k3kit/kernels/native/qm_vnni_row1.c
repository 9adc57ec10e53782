/* qm_vnni_row1.c: AVX512-VNNI's one-row kernels of their own, what a decode step runs for the two
 * types a K3 file stores most of its bytes in: Q4_K (the trunk) and MXFP4 (the experts, with
 * AVX512-VBMI). Both arrange a group's bytes so that 4 vectors of partial sums fold with fold4,
 * and both copy x once per call into the matching order (x_quads): one file for the two, beside
 * the per-family decoders they fall back on (qm_vnni.h's generic ones for a partial group). */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"
#include "qm_vnni.h"

#ifdef K3_X86

DEFINE_FD_GENERIC(Q4_K, q4_k)
DEFINE_FD_GENERIC(MXFP4, mxfp4)

/* x's full groups for the one-row kernels below: per 4 sub-blocks of 32 values, their values
 * 0-15, then their values 16-31 (qwords 0, 1, 4, 5, 8, 9, 12, 13, then the others); NULL when
 * out of memory (the caller then takes the folding path). */
__attribute__((target(VNNI_TARGET))) static int8_t *x_quads(const int8_t *xq, int64_t n) {
    int8_t *xo = aligned_alloc(64, (size_t)(n > 0 ? n : 64));
    if (xo == NULL) return NULL;
    const __m512i xlo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), xhi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t c = 0; c < n; c += 128) {
        const __m512i a = _mm512_loadu_si512(xq + c), b = _mm512_loadu_si512(xq + c + 64);
        _mm512_store_si512(xo + c, _mm512_permutex2var_epi64(a, xlo, b));
        _mm512_store_si512(xo + c + 64, _mm512_permutex2var_epi64(a, xhi, b));
    }
    return xo;
}
/* Sub-block c of the 16 after fold4 is at 4 (c % 4) + c / 4. */
static const int32_t MX1_PERM[16] __attribute__((aligned(64))) = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* Q4_K's lane scales and mins for a group (two blocks), as zs_q4_k makes them (the same
 * products d * sc, dmin * m) but unpacked with byte shuffles, both blocks at once. */
__attribute__((target(VNNI_TARGET))) INLINE void zs_q4_k_row(const uint8_t *gp, __m512 *ws, __m512 *wm) {
    /* per block: bytes 0-7 sc[0..7], 8-15 m[0..7]; sc[j < 4] = B[4 + j] & 63, sc[j >= 4] =
     * (B[8 + j] & 15) | ((B[j] >> 2) & 0x30), m[j < 4] = B[8 + j] & 63, m[j >= 4] =
     * (B[8 + j] >> 4) | ((B[4 + j] >> 2) & 0x30) */
    const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)gp)),
                                              _mm_loadu_si128((const __m128i *)(gp + Q4_K_BYTES)), 1);
    const __m256i i1 = _mm256_broadcastsi128_si256(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m256i i2 = _mm256_broadcastsi128_si256(_mm_setr_epi8(-128, -128, -128, -128, 4, 5, 6, 7, -128, -128, -128, -128,
                                                                 8, 9, 10, 11));
    const __m256i m1 = _mm256_broadcastsi128_si256(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
    __m256i p = _mm256_shuffle_epi8(h, i1);
    p = _mm256_mask_blend_epi8(0xF000F000u, p, _mm256_srli_epi16(p, 4));
    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(_mm256_shuffle_epi8(h, i2), 2), _mm256_set1_epi8(0x30));
    const __m256i r = _mm256_permute4x64_epi64(_mm256_or_si256(_mm256_and_si256(p, m1), q), 0xD8);
    const __m128 dm = _mm_cvtph_ps(_mm_setr_epi32((int)rd32(gp), (int)rd32(gp + Q4_K_BYTES), 0, 0));
    const __m512 d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), _mm512_castps128_ps512(dm));
    const __m512 dmin = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), _mm512_castps128_ps512(dm));
    *ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(r))));
    *wm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(r, 1))));
}

/* One row of Q4_K (the default one-row path on AVX512-VNNI): the folding path's integer sums
 * and float steps with the sub-blocks arranged as in the MXFP4 kernel below. 64 bytes of qs are
 * sub-blocks 4h .. 4h + 3 (low, high, low, high nibbles of 32 bytes each); their nibbles are
 * masked once and two vpermt2q make [values 0-15 of each of the 4] and [values 16-31], both
 * multiplied into one vector of 4 lanes per sub-block; the group's 4 such vectors fold with
 * fold4 instead of fold8's 21 operations. x is copied once per call to the matching order. */
__attribute__((target(VNNI_TARGET))) void i8direct_q4_k_row(const i8job_t *jb, int64_t n0, int64_t n1,
                                                                 int64_t r0, int m) {
    const xlane_t *xl = jb->xl;
    const int64_t k = jb->k, rb = k / Q4_K_QK * Q4_K_BYTES, gv = xl->gv, ng = xl->ngroups, nfull = k / gv;
    const int64_t gbytes = gv / Q4_K_QK * Q4_K_BYTES;
    const int8_t *xq = xl->xn + r0 * ng * gv;
    int8_t *xo = m == 1 ? x_quads(xq, nfull * gv) : NULL;
    if (xo == NULL) {   /* (one row only; out of memory: the folding path) */
        i8direct_q4_k_fast(jb, n0, n1, r0, m);
        return;
    }
    const int64_t lx0 = r0 * ng * 16;
    const __m512i perm = _mm512_load_si512(MX1_PERM), m4 = _mm512_set1_epi8(0x0F);
    const __m512i plo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), phi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < nfull; g++) {
            const uint8_t *gp = ri + g * gbytes;
            for (int64_t o = 0; o < gbytes; o += 64) __builtin_prefetch(gp + I8_PREFETCH + o);
            const int8_t *xg = xo + g * gv;
            __m512i p[4];
            for (int j = 0; j < 4; j++) {
                const __m512i q = _mm512_loadu_si512(gp + (j >> 1) * Q4_K_BYTES + 16 + 64 * (j & 1));
                const __m512i a = _mm512_and_si512(q, m4), b = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
                p[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_permutex2var_epi64(a, plo, b),
                                                               _mm512_load_si512(xg + 128 * j)),
                                           _mm512_permutex2var_epi64(a, phi, b), _mm512_load_si512(xg + 128 * j + 64));
            }
            __m512 ws, wm;
            zs_q4_k_row(gp, &ws, &wm);
            const int64_t lx = lx0 + g * 16;
            const __m512i s = _mm512_permutexvar_epi32(perm, fold4(p));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), ws), _mm512_loadu_ps(xl->dx + lx), acc);
            acc = _mm512_fnmadd_ps(wm, _mm512_loadu_ps(xl->dxs + lx), acc);
        }
        if (nfull < ng) {
            const uint8_t *gp = ri + nfull * gbytes;
            __m512i z[8];
            __m512 ws, wm;
            zqg_q4_k(gp, (int)((k - nfull * gv) / 32), z);
            zsg_q4_k(gp, (int)((k - nfull * gv) / 32), &ws, &wm);
            fd_group(z, 8, (int)((k - nfull * gv) / 32 + 1) / 2, ws, wm, 1, Q4_K_FDB, xl,
                     xq + nfull * gv, ng * gv, lx0 + nfull * 16, ng * 16, 1, &acc);
        }
        jb->y[r0 * jb->n_out + n] = i8_reduce256(_mm512_castps512_ps256(acc),
                                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    }
    free(xo);
}

/* One row of MXFP4 on AVX512-VBMI (the default one-row path where the CPU has it): the folding
 * path's integer sums and float steps, with a group's W bytes arranged for fewer instructions.
 * The folding path makes 8 vectors of two blocks each (~7 shuffles apiece) and folds 8 vectors
 * of partial sums (21 adds and shuffles); here 4 blocks' 64 nibble bytes are picked with one
 * vpermt2b, their low and high nibbles looked up with one vpermb each (a 64-entry table: the
 * bits above the nibble need no mask), and both vpdpbusd accumulate into the same vector, which
 * holds 4 lanes of each of its 4 blocks: 4 such vectors fold with fold4 (7 operations). x is
 * copied once per call to the matching order (per 4 blocks: their values 0-15, then 16-31).
 * The exponent bytes are picked from the same loads (no gather). Each block's integer sum is
 * exact and the float operations per lane are fd_group's, so the bits are the other paths'. A
 * partial last group takes the folding path's decoder on x's natural order. */
#define VBMI_TARGET VNNI_TARGET ",avx512vbmi"
/* The partial last group of the kernel below: the folding path's decoder on x's natural order
 * (always inlined: a literal nsub folds the sub-blocks past it away). */
__attribute__((target(VBMI_TARGET))) INLINE void mx1_part(const uint8_t *gp, const int nsub, const xlane_t *xl,
                                                         const int8_t *xq, int64_t nfull, int64_t gv, int64_t ng,
                                                         int64_t lx0, __m512 *acc) {
    __m512i z[8];
    __m512 ws, wm;
    zqg_mxfp4(gp, nsub, z);
    zsp_mxfp4(gp, nsub, &ws, &wm);
    fd_group(z, 8, (nsub + 1) / 2, ws, wm, 0, MXFP4_FDB, xl, xq + nfull * gv, ng * gv, lx0 + nfull * 16, ng * 16, 1,
             acc);
}
__attribute__((target(VBMI_TARGET))) void i8direct_mxfp4_vbmi(const i8job_t *jb, int64_t n0, int64_t n1,
                                                                   int64_t r0, int m) {
    const xlane_t *xl = jb->xl;
    const int64_t k = jb->k, rb = k / MXFP4_QK * MXFP4_BYTES, gv = xl->gv, ng = xl->ngroups, nfull = k / gv;
    const int64_t gbytes = gv / MXFP4_QK * MXFP4_BYTES;
    const int8_t *xq = xl->xn + r0 * ng * gv;
    int8_t *xo = m == 1 ? x_quads(xq, nfull * gv) : NULL;
    if (xo == NULL) {   /* (one row only; out of memory: the folding path) */
        i8direct_mxfp4_fast(jb, n0, n1, r0, m);
        return;
    }
    const int64_t lx0 = r0 * ng * 16;
    /* nibble byte t of block b (of 4, from byte 68 j of the group) is byte 17 b + 1 + t: from the
     * load at 68 j below 64, else from the load at 68 j + 4; exponent of block 4 h + i (i < 4) is
     * byte 17 i of the load at 68 h */
    uint8_t pick[64] __attribute__((aligned(64))), epick[64] __attribute__((aligned(64))) = {0};
    int8_t table[64] __attribute__((aligned(64)));
    for (int i = 0; i < 64; i++) {
        const int o = 17 * (i / 16) + 1 + i % 16;
        pick[i] = (uint8_t)(o < 64 ? o : 64 + o - 4);
        table[i] = (int8_t)(KV[i % 16] ^ 0x80);
    }
    for (int i = 0; i < 8; i++) epick[i] = (uint8_t)(17 * (i % 4) + 64 * (i / 4));
    const __m512i vpick = _mm512_load_si512(pick), vepick = _mm512_load_si512(epick), kv = _mm512_load_si512(table);
    const __m512i perm = _mm512_load_si512(MX1_PERM);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t g = 0; g < nfull; g++) {
            const uint8_t *gp = ri + g * gbytes;
            for (int64_t o = 0; o < gbytes; o += 64) __builtin_prefetch(gp + I8_PREFETCH + o);
            const int8_t *xg = xo + g * gv;
            __m512i a[4], p[4];
            for (int j = 0; j < 4; j++) {
                a[j] = _mm512_loadu_si512(gp + 68 * j);
                const __m512i q = _mm512_permutex2var_epi8(a[j], vpick, _mm512_loadu_si512(gp + 68 * j + 4));
                const __m512i lo = _mm512_permutexvar_epi8(q, kv), hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(q, 4), kv);
                p[j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(xg + 128 * j)),
                                           hi, _mm512_load_si512(xg + 128 * j + 64));
            }
            const __m512i e8 = _mm512_unpacklo_epi64(_mm512_permutex2var_epi8(a[0], vepick, a[1]),
                                                     _mm512_permutex2var_epi8(a[2], vepick, a[3]));
            const __m512i e = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(e8));
            const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
            const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
            const __m512 ws = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2)),
                                                                          big, small));
            const int64_t lx = lx0 + g * 16;
            const __m512i s = _mm512_add_epi32(_mm512_permutexvar_epi32(perm, fold4(p)), _mm512_loadu_si512(xl->corr + lx));
            acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), ws), _mm512_loadu_ps(xl->dx + lx), acc);
        }
        if (nfull < ng) {
            const uint8_t *gp = ri + nfull * gbytes;
            const int nsub = (int)((k - nfull * gv) / 32);
            switch (nsub) {   /* rows of 64, 128 and 256 values (a small model's): the count constant */
            case 2: mx1_part(gp, 2, xl, xq, nfull, gv, ng, lx0, &acc); break;
            case 4: mx1_part(gp, 4, xl, xq, nfull, gv, ng, lx0, &acc); break;
            case 8: mx1_part(gp, 8, xl, xq, nfull, gv, ng, lx0, &acc); break;
            default: mx1_part(gp, nsub, xl, xq, nfull, gv, ng, lx0, &acc); break;
            }
        }
        jb->y[r0 * jb->n_out + n] = i8_reduce256(_mm512_castps512_ps256(acc),
                                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    }
    free(xo);
}

#endif
