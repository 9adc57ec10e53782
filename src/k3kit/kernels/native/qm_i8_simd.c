/* qm_i8_simd.c: the int8 products' generic vector paths, every type through the same macros: the
 * panel decoder (AVX2, into the transposed lane layout; both levels' panels), the panel tiles of
 * AVX2 (maddubs) and AVX512-VNNI (vpdpbusd), and the 256-bit direct path of both (few rows). The
 * kernels of a type family that beat these are apart: qm_avx2_<family>.c, qm_vnni_<family>.c.
 * x86 only; the scalar reference is qm_scalar.c. */
#include "qm.h"
#include "qm_i8.h"
#include "qm_x86.h"
#include "qm_i8_x86.h"

#ifdef K3_X86

/* A group's sub-blocks (16 for G = 32, 8 for G = 16; 32 values each, natural order) stored as
 * the transposed lanes: G = 32: chunk c = (column c of sub-blocks 0-7 | of 8-15); G = 16: chunk c
 * = (column c | column c + 4) of sub-blocks 0-7, i.e. their first halves then their second. */
__attribute__((target(AVX2_TARGET))) INLINE void store_group(__m256i *v, int G, uint8_t *out, int u8) {
    const __m256i flip = _mm256_set1_epi8(u8 ? (char)0x80 : 0);
    if (G == 32) {
        transpose8(v);
        transpose8(v + 8);
        for (int c = 0; c < 8; c++) {
            _mm256_storeu_si256((__m256i *)(out + 64 * c), _mm256_xor_si256(v[c], flip));
            _mm256_storeu_si256((__m256i *)(out + 64 * c + 32), _mm256_xor_si256(v[8 + c], flip));
        }
    } else {
        transpose8(v);
        for (int c = 0; c < 4; c++) {
            _mm256_storeu_si256((__m256i *)(out + 64 * c), _mm256_xor_si256(v[c], flip));
            _mm256_storeu_si256((__m256i *)(out + 64 * c + 32), _mm256_xor_si256(v[4 + c], flip));
        }
    }
}

#define DEFINE_I8PANEL_VEC(T, NAME_LC)                                                              \
    __attribute__((target(AVX2_TARGET))) void i8panel_##NAME_LC##_avx2(                            \
        const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t kc, uint8_t *wq, float *ws, float *wmn, \
        int u8) {                                                                                  \
        const int G = I8_G(T), spg = 16 * G / 32;                                                  \
        const int64_t nsub = kc / 32, ng = (kc + 16 * G - 1) / (16 * G);                           \
        for (int i = 0; i < np; i++) {                                                             \
            uint8_t *qo = wq + (int64_t)i * I8_KC;                                                 \
            float *so = ws + (int64_t)i * I8_GMAX * 16, *mo = wmn + (int64_t)i * I8_GMAX * 16;     \
            const uint8_t *ri = row + i * rb + b0 * T##_BYTES;                                     \
            for (int64_t o = 0; o < kc / T##_QK * T##_BYTES; o += 64)                              \
                __builtin_prefetch(ri + kc / T##_QK * T##_BYTES + o);                              \
            float s[16], mn[16] = {0};                                                                     \
            __m256i v[16];                                                                         \
            for (int64_t g = 0; g < ng; g++) {                                                     \
                for (int ug = 0; ug < spg; ug++) {                                                 \
                    const int64_t u = g * spg + ug;                                                \
                    if (u >= nsub) {                                                               \
                        v[ug] = _mm256_setzero_si256();                                            \
                        for (int h = 0; h < 32 / G; h++) so[g * 16 + lane_of(G, ug, h)] = mo[g * 16 + lane_of(G, ug, h)] = 0.0f; \
                        continue;                                                                  \
                    }                                                                              \
                    const uint8_t *blk = ri + (u / (T##_QK / 32)) * T##_BYTES;                     \
                    const int j = (int)(u % (T##_QK / 32));                                        \
                    if (j == 0) scales_##NAME_LC##_v(blk, s, mn);                                  \
                    v[ug] = qv_##NAME_LC(blk, j);                                                  \
                    for (int h = 0; h < 32 / G; h++) {                                             \
                        so[g * 16 + lane_of(G, ug, h)] = s[SIDX(T, j, h)];                         \
                        mo[g * 16 + lane_of(G, ug, h)] = mn[SIDX(T, j, h)];                        \
                    }                                                                              \
                }                                                                                  \
                store_group(v, G, qo + g * 16 * G, u8);                                            \
            }                                                                                      \
        }                                                                                          \
    }

/* AVX512-VNNI tiles: NT rows of the panel by RT rows of x; per group 16 integer sums per pair
 * from G / 4 vpdpbusd, then the lanes' float operations with the accumulators in acc. */
__attribute__((target(VNNI_TARGET))) INLINE void i8mk_vnni(const i8job_t *jb, const uint8_t *wq, const float *ws,
                                                         const float *wmn, int NT, int64_t g0, int64_t ng,
                                                         int64_t r, int RT, float *acc, int first, int last,
                                                         float *y) {
    const xlane_t *xl = jb->xl;
    const int64_t gv = xl->gv, xrow = xl->ngroups * gv;
    const int nc = jb->G / 4, has_min = jb->has_min;
    for (int64_t g = 0; g < ng; g++) {
        __m512i s[4][4];
        const int8_t *xq = xl->q + r * xrow + (g0 + g) * gv;
        const int64_t lx = (r * xl->ngroups + g0 + g) * 16;
        for (int t = 0; t < RT; t++) {
            const __m512i c0 = _mm512_loadu_si512(xl->corr + lx + t * xl->ngroups * 16);
            for (int i = 0; i < NT; i++) s[i][t] = c0;
        }
        const uint8_t *wg = wq + g * gv;
        for (int c = 0; c < nc; c++) {
            __m512i wv[4];
            for (int i = 0; i < NT; i++) wv[i] = _mm512_loadu_si512(wg + (int64_t)i * I8_KC + 64 * c);
            for (int t = 0; t < RT; t++) {
                const __m512i xv = _mm512_loadu_si512(xq + t * xrow + 64 * c);
                for (int i = 0; i < NT; i++) s[i][t] = _mm512_dpbusd_epi32(s[i][t], wv[i], xv);
            }
        }
        for (int i = 0; i < NT; i++) {
            const __m512 wsv = _mm512_loadu_ps(ws + (int64_t)i * I8_GMAX * 16 + g * 16);
            const __m512 mnv = has_min ? _mm512_loadu_ps(wmn + (int64_t)i * I8_GMAX * 16 + g * 16) : _mm512_setzero_ps();
            for (int t = 0; t < RT; t++) {
                float *ap = acc + ((int64_t)t * I8_NP + i) * 16;
                __m512 a = first && g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(ap);
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s[i][t]), wsv);
                a = _mm512_fmadd_ps(f, _mm512_loadu_ps(xl->dx + lx + t * xl->ngroups * 16), a);
                if (has_min) a = _mm512_fnmadd_ps(mnv, _mm512_loadu_ps(xl->dxs + lx + t * xl->ngroups * 16), a);
                _mm512_store_ps(ap, a);
            }
        }
    }
    if (ng == 0 && first)
        for (int i = 0; i < NT; i++)
            for (int t = 0; t < RT; t++) _mm512_store_ps(acc + ((int64_t)t * I8_NP + i) * 16, _mm512_setzero_ps());
    if (last)
        for (int i = 0; i < NT; i++)
            for (int t = 0; t < RT; t++) {
                const float *ap = acc + ((int64_t)t * I8_NP + i) * 16;
                y[t * jb->n_out + i] = i8_reduce256(_mm256_load_ps(ap), _mm256_load_ps(ap + 8));
            }
}

/* AVX2 tiles' float steps for lane half hh of group g: NT x RT pairs' integer sums s into the
 * accumulators (the scalar path's operations, 8 lanes at a time). */
__attribute__((target(AVX2_TARGET))) INLINE void i8half_avx2(const xlane_t *xl, __m256i s[2][2], const float *ws,
                                                           const float *wmn, int has_min, int NT, int RT, int64_t g,
                                                           int hh, int64_t lx, float *acc, int first) {
    for (int i = 0; i < NT; i++) {
        const __m256 wsv = _mm256_loadu_ps(ws + (int64_t)i * I8_GMAX * 16 + g * 16 + 8 * hh);
        const __m256 mnv = has_min ? _mm256_loadu_ps(wmn + (int64_t)i * I8_GMAX * 16 + g * 16 + 8 * hh)
                                   : _mm256_setzero_ps();
        for (int t = 0; t < RT; t++) {
            float *ap = acc + ((int64_t)t * I8_NP + i) * 16 + 8 * hh;
            __m256 a = first && g == 0 ? _mm256_setzero_ps() : _mm256_load_ps(ap);
            const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s[i][t]), wsv);
            a = _mm256_fmadd_ps(f, _mm256_loadu_ps(xl->dx + lx + t * xl->ngroups * 16 + 8 * hh), a);
            if (has_min) a = _mm256_fnmadd_ps(mnv, _mm256_loadu_ps(xl->dxs + lx + t * xl->ngroups * 16 + 8 * hh), a);
            _mm256_store_ps(ap, a);
        }
    }
}

/* AVX2 tiles' end: zero accumulators where a tile had no group; the pairs' results on the last. */
__attribute__((target(AVX2_TARGET))) INLINE void i8end_avx2(const i8job_t *jb, int NT, int RT, int64_t ng,
                                                          float *acc, int first, int last, float *y) {
    if (ng == 0 && first)
        for (int i = 0; i < NT; i++)
            for (int t = 0; t < RT; t++) memset(acc + ((int64_t)t * I8_NP + i) * 16, 0, 16 * sizeof(float));
    if (last)
        for (int i = 0; i < NT; i++)
            for (int t = 0; t < RT; t++) {
                const float *ap = acc + ((int64_t)t * I8_NP + i) * 16;
                y[t * jb->n_out + i] = i8_reduce256(_mm256_load_ps(ap), _mm256_load_ps(ap + 8));
            }
}

/* AVX2 tiles: a lane half (8 lanes) per register; |q| (maddubs' unsigned operand, <= 128) times
 * x with q's sign (|x| <= 127), so no 16-bit pair sum saturates. */
__attribute__((target(AVX2_TARGET))) INLINE void i8mk_avx2(const i8job_t *jb, const uint8_t *wq, const float *ws,
                                                         const float *wmn, int NT, int64_t g0, int64_t ng,
                                                         int64_t r, int RT, float *acc, int first, int last,
                                                         float *y) {
    const xlane_t *xl = jb->xl;
    const int64_t gv = xl->gv, xrow = xl->ngroups * gv;
    const int nc = jb->G / 4, has_min = jb->has_min;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ng; g++) {
        __m256i s[2][2][2];
        const int8_t *xq = xl->q + r * xrow + (g0 + g) * gv;
        const int64_t lx = (r * xl->ngroups + g0 + g) * 16;
        for (int i = 0; i < NT; i++)
            for (int t = 0; t < RT; t++) s[i][t][0] = s[i][t][1] = _mm256_setzero_si256();
        const uint8_t *wg = wq + g * gv;
        for (int c = 0; c < nc; c++)
            for (int hh = 0; hh < 2; hh++) {
                __m256i wv[2], wa[2];
                for (int i = 0; i < NT; i++) {
                    wv[i] = _mm256_loadu_si256((const __m256i *)(wg + (int64_t)i * I8_KC + 64 * c + 32 * hh));
                    wa[i] = _mm256_abs_epi8(wv[i]);
                }
                for (int t = 0; t < RT; t++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + t * xrow + 64 * c + 32 * hh));
                    for (int i = 0; i < NT; i++) {
                        const __m256i p = _mm256_maddubs_epi16(wa[i], _mm256_sign_epi8(xv, wv[i]));
                        s[i][t][hh] = _mm256_add_epi32(s[i][t][hh], _mm256_madd_epi16(p, ones));
                    }
                }
            }
        for (int hh = 0; hh < 2; hh++) {
            __m256i sh[2][2];
            for (int i = 0; i < NT; i++)
                for (int t = 0; t < RT; t++) sh[i][t] = s[i][t][hh];
            i8half_avx2(xl, sh, ws, wmn, has_min, NT, RT, g, hh, lx, acc, first);
        }
    }
    i8end_avx2(jb, NT, RT, ng, acc, first, last, y);
}

/* AVX2 tiles for the types with a min (Q2_K, Q4_K, Q5_K), whose values are unsigned (at most
 * 31): maddubs takes them as they are, and 4 chunks' 16-bit pair sums add up before one madd
 * (at most 8 products of 31 by 127: below 2^15), about half the operations of i8mk_avx2. */
__attribute__((target(AVX2_TARGET))) INLINE void i8mk_avx2u(const i8job_t *jb, const uint8_t *wq, const float *ws,
                                                          const float *wmn, int NT, int64_t g0, int64_t ng,
                                                          int64_t r, int RT, float *acc, int first, int last,
                                                          float *y) {
    const xlane_t *xl = jb->xl;
    const int64_t gv = xl->gv, xrow = xl->ngroups * gv;
    const int nc = jb->G / 4;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < ng; g++) {
        const int8_t *xq = xl->q + r * xrow + (g0 + g) * gv;
        const int64_t lx = (r * xl->ngroups + g0 + g) * 16;
        const uint8_t *wg = wq + g * gv;
        for (int hh = 0; hh < 2; hh++) {
            __m256i s[2][2];
            for (int i = 0; i < NT; i++)
                for (int t = 0; t < RT; t++) s[i][t] = _mm256_setzero_si256();
            for (int c0 = 0; c0 < nc; c0 += 4) {
                __m256i a[2][2];
                for (int i = 0; i < NT; i++)
                    for (int t = 0; t < RT; t++) a[i][t] = _mm256_setzero_si256();
                for (int c = c0; c < c0 + 4; c++) {
                    __m256i wv[2];
                    for (int i = 0; i < NT; i++)
                        wv[i] = _mm256_loadu_si256((const __m256i *)(wg + (int64_t)i * I8_KC + 64 * c + 32 * hh));
                    for (int t = 0; t < RT; t++) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + t * xrow + 64 * c + 32 * hh));
                        for (int i = 0; i < NT; i++) a[i][t] = _mm256_add_epi16(a[i][t], _mm256_maddubs_epi16(wv[i], xv));
                    }
                }
                for (int i = 0; i < NT; i++)
                    for (int t = 0; t < RT; t++) s[i][t] = _mm256_add_epi32(s[i][t], _mm256_madd_epi16(a[i][t], ones));
            }
            i8half_avx2(xl, s, ws, wmn, 1, NT, RT, g, hh, lx, acc, first);
        }
    }
    i8end_avx2(jb, NT, RT, ng, acc, first, last, y);
}

/* Tiles of NTMAX rows of W by RTMAX rows of x (then fewer); every shape a compile-time constant,
 * so the accumulators stay in registers. */
#define I8_CALL(MK, NT, RT)                                                                         \
    MK(jb, wq + (int64_t)i0 * I8_KC, ws + (int64_t)i0 * I8_GMAX * 16, wmn + (int64_t)i0 * I8_GMAX * 16, NT, g0, \
       ng, r0 + t0, RT, at + i0 * 16, first, last, yt + i0)
#define I8_RT(MK, NT, RTMAX)                                                                        \
    switch (rt) {                                                                                  \
    case 4: if (RTMAX >= 4) { I8_CALL(MK, NT, 4); break; } /* fall through */                      \
    case 3: if (RTMAX >= 3) { I8_CALL(MK, NT, 3); break; } /* fall through */                      \
    case 2: I8_CALL(MK, NT, 2); break;                                                             \
    default: I8_CALL(MK, NT, 1); break;                                                            \
    }
#define I8_TILES(MK, NTMAX, RTMAX)                                                                  \
    for (int t0 = 0; t0 < mb; t0 += RTMAX) {                                                       \
        const int rt = mb - t0 < RTMAX ? mb - t0 : RTMAX;                                          \
        float *at = acc + (int64_t)t0 * I8_NP * 16;                                                \
        float *yt = jb->y + (r0 + t0) * jb->n_out + p0;                                            \
        int i0 = 0;                                                                                \
        for (; i0 + NTMAX <= np; i0 += NTMAX) I8_RT(MK, NTMAX, RTMAX)                              \
        for (; i0 < np; i0++) I8_RT(MK, 1, RTMAX)                                                  \
    }

__attribute__((target(VNNI_TARGET))) void i8tiles_vnni(const i8job_t *jb, const uint8_t *wq, const float *ws,
                                                            const float *wmn, int np, int64_t g0, int64_t ng,
                                                            int64_t r0, int mb, float *acc, int first, int last,
                                                            int64_t p0) {
    I8_TILES(i8mk_vnni, 4, 4)
}
__attribute__((target(AVX2_TARGET))) void i8tiles_avx2(const i8job_t *jb, const uint8_t *wq, const float *ws,
                                                            const float *wmn, int np, int64_t g0, int64_t ng,
                                                            int64_t r0, int mb, float *acc, int first, int last,
                                                            int64_t p0) {
    if (jb->has_min) {
        I8_TILES(i8mk_avx2u, 2, 2)
    } else {
        I8_TILES(i8mk_avx2, 2, 2)
    }
}

/* ---- few rows: the direct path ----------------------------------------------------------------
 * Below the type's direct_below rows (4-12; fast_below, 12-40, on AVX512-VNNI) a panel costs more
 * than it saves (the transposed store and reload of every value, for a few rows of x): each W
 * row's sub-blocks are decoded into registers and multiplied with x's bytes in natural order, and
 * the partial sums folded into the group's 16 lane sums by a fixed tree. The integer sums are
 * exact either way, and the float operations per lane are the panel path's, so the paths give the
 * same bits. Two forms: the 256-bit one below (AVX2, and VNNI when forced: path 0), one 8-lane
 * integer dot product per sub-block, the lanes' float work on two 8-lane halves through memory;
 * and the 512-bit one of qm_vnni.h ("fast direct path", what AVX512-VNNI runs),
 * about 1.5-3x faster for one row. */

/* One pair's float operations for a group, on two 8-lane halves (the panel path's, lane for lane). */
__attribute__((target(AVX2_TARGET))) INLINE void lanes256(__m256i S, const float *ws, const float *wmn, const float *dx,
                                                         const float *dxs, int has_min, float *acc, int first) {
    __m256 a = first ? _mm256_setzero_ps() : _mm256_load_ps(acc);
    const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(S), _mm256_loadu_ps(ws));
    a = _mm256_fmadd_ps(f, _mm256_loadu_ps(dx), a);
    if (has_min) a = _mm256_fnmadd_ps(_mm256_loadu_ps(wmn), _mm256_loadu_ps(dxs), a);
    _mm256_store_ps(acc, a);
}

/* VNNI: (q ^ 0x80) . x with the -128 X correction; AVX2: |q| . (x with q's sign). */
__attribute__((target(VNNI_TARGET))) INLINE __m256i dot_vnni(__m256i q, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)), x);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i dot_avx2(__m256i q, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1));
}

#define DEFINE_I8DIRECT(T, NAME_LC, LVL, TARGET, CORR)                                              \
    __attribute__((target(TARGET))) void i8direct_##NAME_LC##_##LVL(const i8job_t *jb, int64_t n0, int64_t n1,        \
                                                                       int64_t r0, int m) {        \
        const int G = I8_G(T), spg = 16 * G / 32;                                                  \
        const xlane_t *xl = jb->xl;                                                                \
        const int64_t k = jb->k, nsub = k / 32, rb = k / T##_QK * T##_BYTES;                       \
        float acc[I8_DIRECT_ROWS][16] __attribute__((aligned(64)));                               \
        for (int64_t n = n0; n < n1; n++) {                                                        \
            const uint8_t *ri = jb->w + n * rb;                                                    \
            float s[16], mn[16] = {0};                                                             \
            for (int64_t g = 0; g < xl->ngroups; g++) {                                            \
                __m256i v[16];                                                                     \
                float ws[16], wm[16];                                                              \
                _Pragma("GCC unroll 16") for (int ug = 0; ug < spg; ug++) {                        \
                    const int64_t u = g * spg + ug;                                                \
                    if (u >= nsub) {                                                               \
                        v[ug] = _mm256_setzero_si256();                                            \
                        for (int h = 0; h < 32 / G; h++) ws[lane_of(G, ug, h)] = wm[lane_of(G, ug, h)] = 0.0f; \
                        continue;                                                                  \
                    }                                                                              \
                    const uint8_t *blk = ri + (u / (T##_QK / 32)) * T##_BYTES;                     \
                    const int j = (int)(u % (T##_QK / 32));                                        \
                    if (j == 0) {                                                                  \
                        __builtin_prefetch(blk + I8_PREFETCH);                                     \
                        __builtin_prefetch(blk + I8_PREFETCH + 64);                                \
                        __builtin_prefetch(blk + I8_PREFETCH + T##_BYTES - 1);                     \
                        scales_##NAME_LC##_v(blk, s, mn);                                          \
                    }                                                                              \
                    v[ug] = qv_##NAME_LC(blk, j);                                                  \
                    for (int h = 0; h < 32 / G; h++) {                                             \
                        ws[lane_of(G, ug, h)] = s[SIDX(T, j, h)];                                  \
                        wm[lane_of(G, ug, h)] = mn[SIDX(T, j, h)];                                 \
                    }                                                                              \
                }                                                                                  \
                for (int t = 0; t < m; t++) {                                                      \
                    const int8_t *xn = xl->xn + (r0 + t) * xl->ngroups * xl->gv + g * xl->gv;    \
                    __m256i p[16], lo, hi;                                                         \
                    _Pragma("GCC unroll 16") for (int ug = 0; ug < spg; ug++)                                               \
                        p[ug] = dot_##LVL(v[ug], _mm256_loadu_si256((const __m256i *)(xn + 32 * ug))); \
                    fold_lanes(p, G, &lo, &hi);                                                    \
                    const int64_t lx = ((r0 + t) * xl->ngroups + g) * 16;                        \
                    if (CORR) {                                                                    \
                        lo = _mm256_add_epi32(lo, _mm256_loadu_si256((const __m256i *)(xl->corr + lx))); \
                        hi = _mm256_add_epi32(hi, _mm256_loadu_si256((const __m256i *)(xl->corr + lx + 8))); \
                    }                                                                              \
                    lanes256(lo, ws, wm, xl->dx + lx, xl->dxs + lx, jb->has_min, acc[t], g == 0);  \
                    lanes256(hi, ws + 8, wm + 8, xl->dx + lx + 8, xl->dxs + lx + 8, jb->has_min, acc[t] + 8, g == 0); \
                }                                                                                  \
            }                                                                                      \
            for (int t = 0; t < m; t++)                                                            \
                jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(_mm256_load_ps(acc[t]), _mm256_load_ps(acc[t] + 8)); \
        }                                                                                          \
    }
#define DEFINE_I8(T, NAME_LC)                                                                       \
    DEFINE_I8PANEL_VEC(T, NAME_LC)                                                                  \
    DEFINE_I8DIRECT(T, NAME_LC, avx2, AVX2_TARGET, 0) DEFINE_I8DIRECT(T, NAME_LC, vnni, VNNI_TARGET, 1)

DEFINE_I8(Q8_0, q8_0)
DEFINE_I8(Q4_K, q4_k)
DEFINE_I8(Q5_K, q5_k)
DEFINE_I8(Q6_K, q6_k)
DEFINE_I8(Q2_K, q2_k)
DEFINE_I8(Q3_K, q3_k)
DEFINE_I8(IQ2_XXS, iq2_xxs)
DEFINE_I8(IQ2_XS, iq2_xs)
DEFINE_I8(IQ3_XXS, iq3_xxs)
DEFINE_I8(IQ1_S, iq1_s)
DEFINE_I8(IQ1_M, iq1_m)
DEFINE_I8(MXFP4, mxfp4)

#endif
