/* qm_vnni.h: the AVX512-VNNI direct paths' shared machinery, for the per-family files
 * qm_vnni_<family>.c: the folding path ("fast": one group's 16 lane sums folded per row) and the
 * transposed path ("ft": the group transposed once for all rows), each a macro a family file
 * instantiates for its types over its own group decoders (zq_T: the biased operands, zs_T: the
 * lane scales), plus the generic decoders built on qm_x86.h's qv_T for partial groups. A header
 * because all of it is always_inline into the per-type kernels. x86 only. */
#ifndef K3_QM_VNNI_H
#define K3_QM_VNNI_H

#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"


/* ---- few rows on AVX512-VNNI: the fast direct path ---------------------------------------------
 * The direct path's arithmetic, bit for bit, arranged for 512-bit registers. A group's W values
 * are decoded straight into 8 (G = 32) or 4 (G = 16) vectors of 64 bytes, vector m holding
 * sub-blocks 2m and 2m + 1 in natural order, already as vpdpbusd's unsigned operand q + B with a
 * per-type bias B (T_FDB: 0 for the K-quants whose values are unsigned, 32 for Q6_K, 4 for Q3_K,
 * 128 otherwise; each integer sum is then corrected by -B X), so x's bytes multiply as they lie.
 * One vpdpbusd per 64 values; a fixed tree of in-lane unpacks and adds folds the partial sums to
 * the group's 16 lane sums (one vpermd puts them in lane order); the lanes' float operations run
 * on one 16-lane vector whose accumulator stays in a register for the whole W row. Scales are made
 * as vectors in lane order where that is cheap. RT rows of x (1-4) share each decoded group. The
 * integer sums are exact and the float operations per lane are the other paths', so the bits are
 * theirs. A partial last group (k not a multiple of 16 G) decodes its present sub-blocks one by one
 * and gives the missing ones a zero operand and zero scales, as the other paths do. */
#ifdef K3_X86
#define FD_ROWS 8   /* rows of x per pass over W (passes of 8, 4, then 1-3) */

#define Q8_0_FDB 128
#define Q4_K_FDB 0
#define Q5_K_FDB 0
#define Q6_K_FDB 32
#define Q2_K_FDB 0
#define Q3_K_FDB 4
#define IQ2_XXS_FDB 128
#define IQ2_XS_FDB 128
#define IQ3_XXS_FDB 128
#define IQ1_S_FDB 128
#define IQ1_M_FDB 128
#define MXFP4_FDB 128

/* Where fold8 / fold4 leave lane p's sum, and (G = 16) where scales_T_v leaves lane p's scale. */
static const int32_t FD_PERM8[16] __attribute__((aligned(64))) = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
static const int32_t FD_PERM4[16] __attribute__((aligned(64))) = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
static const int32_t FD_SIDX16[16] __attribute__((aligned(64))) = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

__attribute__((target(VNNI_TARGET))) INLINE __m512 cat8(__m256 a, __m256 b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(a)), _mm256_castps_pd(b), 1));
}
__attribute__((target(VNNI_TARGET))) INLINE __m512i bcast32(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
/* 16-bit shift counts: a in the low 256 bits, b in the high. */
__attribute__((target(VNNI_TARGET))) INLINE __m512i counts(int a, int b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((short)a)), _mm256_set1_epi16((short)b), 1);
}

/* 8 vectors of (sub-block 2i | 2i + 1) partial sums -> 16 sums, sub-block u at FD_PERM8[u]. */
__attribute__((target(VNNI_TARGET))) INLINE __m512i fold8(const __m512i *p) {
    __m512i t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
}
/* 4 vectors of 16-value chunks 4i .. 4i + 3 (one per 128-bit lane) -> 16 sums, chunk c at 4 (c % 4) + c / 4. */
__attribute__((target(VNNI_TARGET))) INLINE __m512i fold4(const __m512i *p) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* One decoded group times RT rows of x: the lanes' float operations of lanes256, 16 at once. Only
 * the first `live` of the NZ vectors of z may be non-zero (a partial last group: the others hold
 * no sub-block), so the others' products are the zero they would be, without loading x. */
__attribute__((target(VNNI_TARGET))) INLINE void fd_group(const __m512i *z, const int NZ, const int live,
                                                         __m512 ws, __m512 mn,
                                                         const int has_min, const int bias, const xlane_t *xl,
                                                         const int8_t *xq, int64_t xs, int64_t lx, int64_t ls,
                                                         const int RT, __m512 *acc) {
    const __m512i perm = _mm512_load_si512(NZ == 8 ? FD_PERM8 : FD_PERM4);
    const int shift = bias == 128 ? 0 : bias == 32 ? 2 : 5;
    for (int t = 0; t < RT; t++) {
        __m512i p[8];
        for (int m = 0; m < NZ; m++)
            p[m] = m < live ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[m], _mm512_loadu_si512(xq + t * xs + 64 * m))
                            : _mm512_setzero_si512();
        __m512i s = _mm512_permutexvar_epi32(perm, NZ == 8 ? fold8(p) : fold4(p));
        if (bias) s = _mm512_add_epi32(s, _mm512_srai_epi32(_mm512_loadu_si512(xl->corr + lx + t * ls), shift));
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s), ws);
        acc[t] = _mm512_fmadd_ps(f, _mm512_loadu_ps(xl->dx + lx + t * ls), acc[t]);
        if (has_min) acc[t] = _mm512_fnmadd_ps(mn, _mm512_loadu_ps(xl->dxs + lx + t * ls), acc[t]);
    }
}

/* Per type: fdq_T, sub-block u of a group as the biased operand (from qv_T); zqg_T, the group's
 * vectors with sub-blocks from nsub on zero; zsg_T, its lane scales through scales_T_v (the
 * direct path's way; sub-blocks from nsub on zero). */
#define DEFINE_FD_GENERIC(T, NAME_LC)                                                              \
    __attribute__((target(VNNI_TARGET))) INLINE __m256i fdq_##NAME_LC(const uint8_t *gp, int u) {  \
        const __m256i q = qv_##NAME_LC(gp + (u / (T##_QK / 32)) * T##_BYTES, u % (T##_QK / 32));   \
        return T##_FDB ? _mm256_add_epi8(q, _mm256_set1_epi8((char)T##_FDB)) : q;                  \
    }                                                                                              \
    __attribute__((target(VNNI_TARGET))) INLINE void zqg_##NAME_LC(const uint8_t *gp, int nsub, __m512i *z) { \
        for (int m = 0; m < I8_G(T) / 4; m++) {                                                    \
            const __m256i a = 2 * m < nsub ? fdq_##NAME_LC(gp, 2 * m) : _mm256_setzero_si256();    \
            const __m256i b = 2 * m + 1 < nsub ? fdq_##NAME_LC(gp, 2 * m + 1) : _mm256_setzero_si256(); \
            z[m] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);                            \
        }                                                                                          \
    }                                                                                              \
    __attribute__((target(VNNI_TARGET))) INLINE void zsg_##NAME_LC(const uint8_t *gp, int nsub, __m512 *ws, \
                                                                  __m512 *wm) {                    \
        const int G = I8_G(T), spg = 16 * G / 32, spb = T##_QK / 32;                               \
        float s[16], mn[16] = {0}, so[16] __attribute__((aligned(64))), mo[16] __attribute__((aligned(64))); \
        for (int u = 0; u < spg; u++)                                                              \
            for (int h = 0; h < 32 / G; h++) {                                                     \
                const uint8_t *blk = gp + (u / spb) * T##_BYTES;                                   \
                if (u < nsub && u % spb == 0 && h == 0) scales_##NAME_LC##_v(blk, s, mn);          \
                so[lane_of(G, u, h)] = u < nsub ? s[SIDX(T, u % spb, h)] : 0.0f;                   \
                mo[lane_of(G, u, h)] = u < nsub ? mn[SIDX(T, u % spb, h)] : 0.0f;                  \
            }                                                                                      \
        *ws = _mm512_load_ps(so);                                                                  \
        *wm = _mm512_load_ps(mo);                                                                  \
    }


/* Whole groups: zq_T / zs_T. The types without a vector form of their own use the generic ones. */
#define FD_NSUB(T) (16 * I8_G(T) / 32)
#define zq_q8_0(gp, z) zqg_q8_0(gp, FD_NSUB(Q8_0), z)
#define zq_q3_k(gp, z) zqg_q3_k(gp, FD_NSUB(Q3_K), z)
#define zq_iq2_xxs zq_iq2_xxs_g
#define zq_iq2_xs zq_iq2_xs_g
#define zq_iq3_xxs zq_iq3_xxs_g
#define zq_iq1_s zq_iq1_s_g
#define zq_iq1_m zq_iq1_m_g
#define zq_mxfp4 zq_mxfp4_g
#define zs_iq2_xs zs_iq2_xs_g
#define zs_iq1_m zs_iq1_m_g

/* Partial last groups' lane scales: zsp_T. zsg_T builds them a value at a time (with a store and a
 * reload of 16 floats: ~15 ns a row, most of a small product's cost); for Q8_0 and MXFP4, whose
 * lane u is block u's scale, one gather masked to the group's nsub blocks gives the same values
 * (0.0 from nsub on) without touching memory past them. */
#define FD_LIVE(nsub) ((__mmask16)((1u << (nsub)) - 1u))
__attribute__((target(VNNI_TARGET))) INLINE void zsp_q8_0(const uint8_t *gp, int nsub, __m512 *ws, __m512 *wm) {
    const __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(Q8_0_BYTES));
    const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), FD_LIVE(nsub), off, gp, 1);
    *ws = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
    *wm = _mm512_setzero_ps();
}
__attribute__((target(VNNI_TARGET))) INLINE void zsp_mxfp4(const uint8_t *gp, int nsub, __m512 *ws, __m512 *wm) {
    const __mmask16 live = FD_LIVE(nsub);
    const __m512i off = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(MXFP4_BYTES));
    const __m512i e = _mm512_and_si512(_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, off, gp, 1),
                                       _mm512_set1_epi32(0xFF));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    const __mmask16 lt2 = _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(2));
    *ws = _mm512_maskz_mov_ps(live, _mm512_castsi512_ps(_mm512_mask_blend_epi32(lt2, big, small)));
    *wm = _mm512_setzero_ps();
}
#define zsp_q4_k zsg_q4_k
#define zsp_q5_k zsg_q5_k
#define zsp_q6_k zsg_q6_k
#define zsp_q2_k zsg_q2_k
#define zsp_q3_k zsg_q3_k
#define zsp_iq2_xxs zsg_iq2_xxs
#define zsp_iq2_xs zsg_iq2_xs
#define zsp_iq3_xxs zsg_iq3_xxs
#define zsp_iq1_s zsg_iq1_s
#define zsp_iq1_m zsg_iq1_m


/* A partial last group of NSUB sub-blocks (fdrows' locals): decode, scales, fd_group. Called with a
 * literal NSUB for the common counts, so the sub-blocks past it and their products fold away in
 * the compiled copy; the same operations on the same values as the runtime count's. */
#define FD_PART(T, NAME_LC, HAS_MIN, NSUB)                                                         \
    do {                                                                                           \
        __m512i z[8];                                                                              \
        __m512 ws, wm;                                                                             \
        zqg_##NAME_LC(gp, (NSUB), z);                                                              \
        zsp_##NAME_LC(gp, (NSUB), &ws, &wm);                                                       \
        fd_group(z, NZ, ((NSUB) + 1) / 2, ws, wm, HAS_MIN, T##_FDB, xl, xg, xs, lxg, ls, RT, acc); \
    } while (0)

/* Rows n0 .. n1 - 1 of W times rows r0 .. r0 + RT - 1 of x. */
#define DEFINE_FD(T, NAME_LC, HAS_MIN)                                                              \
    __attribute__((target(VNNI_TARGET))) INLINE void fdrows_##NAME_LC(const i8job_t *jb, int64_t n0, int64_t n1, \
                                                                     int64_t r0, const int RT) {    \
        const xlane_t *xl = jb->xl;                                                                \
        const int NZ = I8_G(T) / 4;                                                                \
        const int64_t k = jb->k, rb = k / T##_QK * T##_BYTES, gv = xl->gv, ng = xl->ngroups;       \
        const int64_t nfull = k / gv, gbytes = gv / T##_QK * T##_BYTES, xs = ng * gv, ls = ng * 16; \
        const int8_t *xq = xl->xn + r0 * xs;                                                       \
        const int64_t lx0 = r0 * ls;                                                               \
        for (int64_t n = n0; n < n1; n++) {                                                        \
            const uint8_t *ri = jb->w + n * rb;                                                    \
            __m512 acc[FD_ROWS];                                                                   \
            for (int t = 0; t < RT; t++) acc[t] = _mm512_setzero_ps();                             \
            int64_t g = 0;                                                                         \
            for (; g < nfull; g++) {                                                               \
                const uint8_t *gp = ri + g * gbytes;                                               \
                for (int64_t o = 0; o < gbytes; o += 64) __builtin_prefetch(gp + I8_PREFETCH + o);  \
                __m512i z[8];                                                                      \
                __m512 ws, wm = _mm512_setzero_ps();                                               \
                zq_##NAME_LC(gp, z);                                                               \
                zs_##NAME_LC(gp, &ws, &wm);                                                        \
                fd_group(z, NZ, NZ, ws, wm, HAS_MIN, T##_FDB, xl, xq + g * gv, xs, lx0 + g * 16, ls, RT, acc); \
            }                                                                                      \
            if (g < ng) {                                                                          \
                const uint8_t *gp = ri + g * gbytes;                                               \
                const int nsub = (int)((k - g * gv) / 32);                                         \
                const int8_t *xg = xq + g * gv;                                                    \
                const int64_t lxg = lx0 + g * 16;                                                  \
                switch (nsub) { /* rows of 64, 128, 256 values: the counts constant, zeros folded away */ \
                case 2: FD_PART(T, NAME_LC, HAS_MIN, 2); break;                                    \
                case 4: FD_PART(T, NAME_LC, HAS_MIN, 4); break;                                    \
                case 8: FD_PART(T, NAME_LC, HAS_MIN, 8); break;                                    \
                default: FD_PART(T, NAME_LC, HAS_MIN, nsub); break;                                \
                }                                                                                  \
            }                                                                                      \
            for (int t = 0; t < RT; t++)                                                           \
                jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(_mm512_castps512_ps256(acc[t]),     \
                                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))); \
        }                                                                                          \
    }                                                                                              \
    __attribute__((target(VNNI_TARGET))) void i8direct_##NAME_LC##_fast(const i8job_t *jb, int64_t n0,        \
                                                                              int64_t n1, int64_t r0, int m) { \
        for (int r = 0; r < m;) {                                                                  \
            const int rt = m - r >= 8 ? 8 : m - r >= 4 ? 4 : m - r;                                \
            switch (rt) {                                                                          \
            case 1: fdrows_##NAME_LC(jb, n0, n1, r0 + r, 1); break;                                \
            case 2: fdrows_##NAME_LC(jb, n0, n1, r0 + r, 2); break;                                \
            case 3: fdrows_##NAME_LC(jb, n0, n1, r0 + r, 3); break;                                \
            case 4: fdrows_##NAME_LC(jb, n0, n1, r0 + r, 4); break;                                \
            default: fdrows_##NAME_LC(jb, n0, n1, r0 + r, 8); break;                               \
            }                                                                                      \
            r += rt;                                                                               \
        }                                                                                          \
    }


/* ---- several rows on AVX512-VNNI: the transposed direct path --------------------------------
 * fd_group folds each row's NZ vectors of partial sums into the group's 16 lane sums (~14 shuffles
 * and adds a row), so from 2 rows on the folding, not W's bytes, bounds the 512-bit direct path
 * (8 rows cost 2.7-5x one). Here the decoded group is transposed once in registers instead, to
 * the panels' lane layout (vector c holds 4 values of every lane), and every row of x, prepared
 * in the same layout, needs just NZ vpdpbusd into one vector of its 16 lane sums: the transpose
 * (16 or 24 shuffles a group) is shared by all RT rows. The transpose leaves lane p at
 * XT_POS32[p] / XT_POS16[p] (what fold8 / fold4 leave too), so x's copy (xlane_t.qt ...), the
 * group's scales (one permute a group) and the accumulators are kept in that order, and each
 * accumulator is put back in lane order (one permute) before the 16 lanes are reduced. The
 * integer sums are exact and each lane's float operations are the other paths', in the same
 * order, so the bits are theirs. From 4 rows W's rows go two at a time (ft_group2: each vector of
 * x loaded once for both), and Q8_0 and MXFP4 decode their groups with fewer loads than the
 * one-row decoders (ftd_q8_0, ftd_mxfp4: no gathers). */
#define FT_ROWS 8   /* rows of x per pass over a W row (passes of 8, 4, then 1-3) */
#define FT_NB 16    /* W rows walked together, chunk by chunk */
#define FT_XBYTES (16 << 10)   /* bytes of x rows (RT of them) per chunk: well inside L1 */

static const int32_t FT_PI8[16] __attribute__((aligned(64))) = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

/* z[m] = sub-blocks 2m | 2m + 1 in natural order -> z[c] = 4 values of each lane (lane p at XT_POS). */
__attribute__((target(VNNI_TARGET))) INLINE void ft_transpose(__m512i *z, const int NZ) {
    __m512i o[8];
    for (int h = 0; h < NZ / 4; h++) {
        const __m512i *a = z + 4 * h;
        const __m512i t0 = _mm512_unpacklo_epi32(a[0], a[1]), t1 = _mm512_unpackhi_epi32(a[0], a[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(a[2], a[3]), t3 = _mm512_unpackhi_epi32(a[2], a[3]);
        o[4 * h] = _mm512_unpacklo_epi64(t0, t2);
        o[4 * h + 1] = _mm512_unpackhi_epi64(t0, t2);
        o[4 * h + 2] = _mm512_unpacklo_epi64(t1, t3);
        o[4 * h + 3] = _mm512_unpackhi_epi64(t1, t3);
    }
    if (NZ == 8)
        for (int c = 0; c < 4; c++) {
            z[c] = _mm512_shuffle_i32x4(o[c], o[4 + c], 0x88);
            z[4 + c] = _mm512_shuffle_i32x4(o[c], o[4 + c], 0xDD);
        }
    else
        for (int c = 0; c < 4; c++) z[c] = o[c];
}

/* One transposed group times RT rows of x (x, dx, dxs, corr in the transposed lane order). */
__attribute__((target(VNNI_TARGET))) INLINE void ft_group(const __m512i *z, const int NZ, __m512 ws, __m512 mn,
                                                         const int has_min, const int bias, const xlane_t *xl,
                                                         const int8_t *xq, int64_t xs, int64_t lx, int64_t ls,
                                                         const int RT, __m512 *acc) {
    const int shift = bias == 128 ? 0 : bias == 32 ? 2 : 5;
    for (int t = 0; t < RT; t++) {
        const int8_t *xt = xq + t * xs;
        __m512i s0 = bias ? _mm512_srai_epi32(_mm512_loadu_si512(xl->corrt + lx + t * ls), shift)
                          : _mm512_setzero_si512();
        __m512i s1 = _mm512_setzero_si512();
        for (int m = 0; m < NZ; m += 2) {
            s0 = _mm512_dpbusd_epi32(s0, z[m], _mm512_loadu_si512(xt + 64 * m));
            s1 = _mm512_dpbusd_epi32(s1, z[m + 1], _mm512_loadu_si512(xt + 64 * m + 64));
        }
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), ws);
        acc[t] = _mm512_fmadd_ps(f, _mm512_loadu_ps(xl->dxt + lx + t * ls), acc[t]);
        if (has_min) acc[t] = _mm512_fnmadd_ps(mn, _mm512_loadu_ps(xl->dxst + lx + t * ls), acc[t]);
    }
}

/* Two W rows' transposed groups (za, zb) times RT rows of x: each vector of x is loaded once for
 * both (loads, not dot products, bound this loop: a vpdpbusd with a memory operand runs at a
 * third of the register form's rate here). The accumulators live in memory (acc[t] for za,
 * acc[FT_ROWS + t] for zb: 16 of them do not fit in the registers beside 16 decoded vectors).
 * Each lane's float operations are ft_group's, in its order. */
__attribute__((target(VNNI_TARGET))) INLINE void ft_group2(const __m512i *za, const __m512i *zb, const int NZ,
                                                          __m512 wsa, __m512 mna, __m512 wsb, __m512 mnb,
                                                          const int has_min, const int bias, const xlane_t *xl,
                                                          const int8_t *xq, int64_t xs, int64_t lx, int64_t ls,
                                                          const int RT, float *acc) {
    const int shift = bias == 128 ? 0 : bias == 32 ? 2 : 5;
    for (int t = 0; t < RT; t++) {
        const int8_t *xt = xq + t * xs;
        const __m512i c = bias ? _mm512_srai_epi32(_mm512_loadu_si512(xl->corrt + lx + t * ls), shift)
                               : _mm512_setzero_si512();
        __m512i a0 = c, b0 = c, a1 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
        for (int m = 0; m < NZ; m += 2) {
            __m512i x0 = _mm512_loadu_si512(xt + 64 * m), x1 = _mm512_loadu_si512(xt + 64 * m + 64);
            __asm__("" : "+v"(x0), "+v"(x1));   /* in registers: else GCC folds each load into both uses */
            a0 = _mm512_dpbusd_epi32(a0, za[m], x0);
            b0 = _mm512_dpbusd_epi32(b0, zb[m], x0);
            a1 = _mm512_dpbusd_epi32(a1, za[m + 1], x1);
            b1 = _mm512_dpbusd_epi32(b1, zb[m + 1], x1);
        }
        const __m512 dx = _mm512_loadu_ps(xl->dxt + lx + t * ls);
        float *pa = acc + 16 * t, *pb = acc + 16 * (FT_ROWS + t);
        const __m512 fa = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1)), wsa);
        const __m512 fb = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(b0, b1)), wsb);
        __m512 va = _mm512_fmadd_ps(fa, dx, _mm512_load_ps(pa));
        __m512 vb = _mm512_fmadd_ps(fb, dx, _mm512_load_ps(pb));
        if (has_min) {
            const __m512 dxs = _mm512_loadu_ps(xl->dxst + lx + t * ls);
            va = _mm512_fnmadd_ps(mna, dxs, va);
            vb = _mm512_fnmadd_ps(mnb, dxs, vb);
        }
        _mm512_store_ps(pa, va);
        _mm512_store_ps(pb, vb);
    }
}

/* The other types: their one-row decoders. */
#define DEFINE_FTD(NAME_LC)                                                                          \
    __attribute__((target(VNNI_TARGET))) INLINE void ftd_##NAME_LC(const uint8_t *gp, __m512i *z, __m512 *ws, \
                                                                  __m512 *wm) {                     \
        zq_##NAME_LC(gp, z);                                                                       \
        zs_##NAME_LC(gp, ws, wm);                                                                  \
    }


/* W row n's group g decoded and transposed, its scales (and mins) permuted to the same lanes. */
#define FT_DECODE(T, NAME_LC, HAS_MIN, ri, z, ws, wm)                                               \
    do {                                                                                           \
        const uint8_t *gp = (ri) + g * gbytes;                                                     \
        wm = _mm512_setzero_ps();                                                                  \
        if (g < nfull) {                                                                           \
            for (int64_t o = 0; o < gbytes; o += 64)                                               \
                __builtin_prefetch(gc < ng ? gp + 2 * rb + o : gp + I8_PREFETCH + o);              \
            ftd_##NAME_LC(gp, z, &ws, &wm);                                                        \
        } else {                                                                                   \
            const int nsub = (int)((k - g * gv) / 32);                                             \
            zqg_##NAME_LC(gp, nsub, z);                                                            \
            zsp_##NAME_LC(gp, nsub, &ws, &wm);                                                     \
        }                                                                                          \
        ft_transpose(z, NZ);                                                                       \
        ws = _mm512_permutexvar_ps(pi, ws);                                                        \
        if (HAS_MIN || g >= nfull) wm = _mm512_permutexvar_ps(pi, wm);                             \
    } while (0)

/* Rows n0 .. n1 - 1 of W times rows r0 .. r0 + RT - 1 of x, transposed, W's rows two at a time
 * (ft_group2). 8 rows of a 7168-value x are 57 KB, more than L1, so W's rows are taken FT_NB at
 * a time and walked in chunks of gc groups (RT gc groups of x fit in FT_XBYTES), the accumulators
 * of each W row kept in accb between chunks: every lane's float operations still run over the
 * groups in order, so the bits do not change. (Measured against no chunks: 1.0-1.2x at 8 rows,
 * within this machine's noise.) */
#define DEFINE_FT(T, NAME_LC, HAS_MIN)                                                              \
    __attribute__((target(VNNI_TARGET))) INLINE void ftrows_##NAME_LC(const i8job_t *jb, int64_t n0, int64_t n1, \
                                                                     int64_t r0, const int RT) {    \
        const xlane_t *xl = jb->xl;                                                                \
        const int NZ = I8_G(T) / 4;                                                                \
        const __m512i pi = _mm512_load_si512(NZ == 8 ? FT_PI8 : FD_SIDX16);                        \
        const __m512i back = _mm512_load_si512(NZ == 8 ? FD_PERM8 : FD_PERM4);                     \
        const int64_t k = jb->k, rb = k / T##_QK * T##_BYTES, gv = xl->gv, ng = xl->ngroups;       \
        const int64_t nfull = k / gv, gbytes = gv / T##_QK * T##_BYTES, xs = ng * gv, ls = ng * 16; \
        const int64_t gc = FT_XBYTES / (RT * gv) > 0 ? FT_XBYTES / (RT * gv) : 1;                 \
        const int8_t *xq = xl->qt + r0 * xs;                                                       \
        const int64_t lx0 = r0 * ls;                                                               \
        __m512 accb[FT_NB][FT_ROWS];                                                               \
        for (int64_t a = n0; a < n1; a += FT_NB) {                                                 \
            const int64_t b = n1 - a < FT_NB ? n1 : a + FT_NB;                                     \
            for (int64_t g0 = 0; g0 < ng; g0 += gc) {                                              \
                const int64_t g1 = ng - g0 < gc ? ng : g0 + gc;                                    \
                if (g0 == 0)                                                                       \
                    for (int64_t n = a; n < b; n++)                                                \
                        for (int t = 0; t < RT; t++) accb[n - a][t] = _mm512_setzero_ps();         \
                int64_t n = a;                                                                     \
                for (; RT >= 4 && n + 1 < b; n += 2) {                                             \
                    const uint8_t *ra = jb->w + n * rb, *rbw = ra + rb;                            \
                    for (int64_t g = g0; g < g1; g++) {                                            \
                        __m512i za[8], zb[8];                                                      \
                        __m512 wsa, wma, wsb, wmb;                                                 \
                        FT_DECODE(T, NAME_LC, HAS_MIN, ra, za, wsa, wma);                          \
                        FT_DECODE(T, NAME_LC, HAS_MIN, rbw, zb, wsb, wmb);                         \
                        ft_group2(za, zb, NZ, wsa, wma, wsb, wmb, HAS_MIN, T##_FDB, xl, xq + g * gv, xs, \
                                  lx0 + g * 16, ls, RT, (float *)accb[n - a]);                     \
                    }                                                                              \
                }                                                                                  \
                for (; n < b; n++) {                                                               \
                    const uint8_t *ri = jb->w + n * rb;                                            \
                    __m512 acc[FT_ROWS];                                                           \
                    for (int t = 0; t < RT; t++) acc[t] = accb[n - a][t];                          \
                    for (int64_t g = g0; g < g1; g++) {                                            \
                        __m512i z[8];                                                              \
                        __m512 ws, wm;                                                             \
                        FT_DECODE(T, NAME_LC, HAS_MIN, ri, z, ws, wm);                             \
                        ft_group(z, NZ, ws, wm, HAS_MIN, T##_FDB, xl, xq + g * gv, xs, lx0 + g * 16, ls, RT, acc); \
                    }                                                                              \
                    for (int t = 0; t < RT; t++) accb[n - a][t] = acc[t];                          \
                }                                                                                  \
                if (g1 < ng) continue;                                                             \
                for (n = a; n < b; n++)                                                            \
                    for (int t = 0; t < RT; t++) {                                                 \
                        const __m512 v = _mm512_permutexvar_ps(back, accb[n - a][t]);              \
                        jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(_mm512_castps512_ps256(v),  \
                                                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))); \
                    }                                                                              \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    __attribute__((target(VNNI_TARGET))) void i8direct_##NAME_LC##_ft(const i8job_t *jb, int64_t n0,        \
                                                                            int64_t n1, int64_t r0, int m) { \
        for (int r = 0; r < m;) {                                                                  \
            const int rt = m - r >= 8 ? 8 : m - r >= 4 ? 4 : m - r;                                \
            switch (rt) {                                                                          \
            case 1: ftrows_##NAME_LC(jb, n0, n1, r0 + r, 1); break;                                \
            case 2: ftrows_##NAME_LC(jb, n0, n1, r0 + r, 2); break;                                \
            case 3: ftrows_##NAME_LC(jb, n0, n1, r0 + r, 3); break;                                \
            case 4: ftrows_##NAME_LC(jb, n0, n1, r0 + r, 4); break;                                \
            default: ftrows_##NAME_LC(jb, n0, n1, r0 + r, 8); break;                               \
            }                                                                                      \
            r += rt;                                                                               \
        }                                                                                          \
    }

#endif /* K3_X86 */

#endif
