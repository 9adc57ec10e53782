/* qm_i8.c: the int8 products' machinery every level shares: x rounded to ggml's Q8_0 / Q8_K
 * blocks (ggml's bytes, with AVX-512 forms of both roundings), x laid out in lanes
 * (prepare_x_row), and the driver over a range of output columns (i8_columns), which runs the
 * chosen direct kernel or decodes panels for the level's tiles. The kernels are elsewhere:
 * qm_scalar.c, qm_i8_simd.c, qm_avx2_<family>.c, qm_vnni_<family>.c. */
#include "qm.h"
#include "qm_i8.h"

/* float -> IEEE half, to nearest even (GGML_FP32_TO_FP16 and F16C agree on finite values). */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((ax >> 13) & 0x3FF));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);     /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                      /* a normal half */
        const uint32_t r = ax + 0x0FFFu + ((ax >> 13) & 1u);
        return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
    }
    const int e = (int)(ax >> 23);
    if (e < 102) return (uint16_t)sign;
    const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    const int shift = 126 - e;
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return (uint16_t)(sign | q);
}

/* ggml's nearest_int: to nearest even for |v| < 2^22, by the float magic constant. */
static inline int nearest_int(float v) {
    const float t = v + 12582912.f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007FFFFF) - 0x00400000;
}

#ifdef K3_X86
/* quantize_q8_0_row's variant 1, 16 values a step: the same amax (max is exact in any order) and
 * the same clamp then round to nearest even (cvtps_epi32 in the default rounding mode). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void quantize_q8_0_row_avx512(const float *x, int64_t k,
                                                                                        uint8_t *out) {
    const __m512 lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t b = 0; b < k / 32; b++) {
        const __m512 a0 = _mm512_loadu_ps(x + 32 * b), a1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        uint8_t *yb = out + 34 * b;
        const uint16_t h = f32_to_f16(amax / 127.0f);
        memcpy(yb, &h, 2);
        const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
        const __m512 v0 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a0, id), lo), hi);
        const __m512 v1 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a1, id), lo), hi);
        _mm_storeu_si128((__m128i *)(yb + 2), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v0)));
        _mm_storeu_si128((__m128i *)(yb + 18), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v1)));
    }
}
#endif

void quantize_q8_0_row(const float *x, int64_t k, uint8_t *out, int variant) {
#ifdef K3_X86
    if (variant == 1 && q8_avx512) {
        quantize_q8_0_row_avx512(x, k, out);
        return;
    }
#endif
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        uint8_t *yb = out + 34 * b;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            const float a = fabsf(xb[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f;
        const uint16_t h = f32_to_f16(d);
        memcpy(yb, &h, 2);
        if (variant == 0) {
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            for (int j = 0; j < 32; j++) yb[2 + j] = (uint8_t)(int8_t)roundf(xb[j] * id);
        } else {
            const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
            /* rintf, then clamped to [-128, 127]: clamping first gives the same integers, and
             * nearest_int is rintf's round-to-nearest-even there (without SSE4.1 rintf is a
             * libm call per value: most of a row's preparation) */
            for (int j = 0; j < 32; j++) {
                float v = xb[j] * id;
                v = v > 127.0f ? 127.0f : v < -128.0f ? -128.0f : v;
                yb[2 + j] = (uint8_t)(int8_t)nearest_int(v);
            }
        }
    }
}

static void quantize_q8_k_row(const float *x, int64_t k, uint8_t *out);
#ifdef K3_X86
/* quantize_q8_k_row, 16 values a step: the same first value of the largest magnitude, and
 * nearest_int as cvtps_epi32 (both round to nearest even; |v| <= 127 here). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void quantize_q8_k_row_avx512(const float *x, int64_t k,
                                                                                        uint8_t *out) {
    for (int64_t b = 0; b < k / 256; b++) {
        const float *xb = x + 256 * b;
        uint8_t *yb = out + Q8_K_BYTES * b;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)));
        const float amax = _mm512_reduce_max_ps(m);
        int16_t bs[16];
        float d = 0.0f;
        if (amax == 0.0f || !(amax < INFINITY)) {
            quantize_q8_k_row(xb, 256, yb);   /* zero, infinite or NaN blocks: the scalar loop */
            continue;
        }
        int j = 0;
        while (fabsf(xb[j]) != amax) j++;
        const float iscale = -127.0f / xb[j];
        const __m512 is = _mm512_set1_ps(iscale);
        for (int i = 0; i < 16; i++) {
            const __m512i v = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(is, _mm512_loadu_ps(xb + 16 * i))),
                                               _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(yb + 4 + 16 * i), _mm512_cvtsepi32_epi8(v));
            bs[i] = (int16_t)_mm512_reduce_add_epi32(v);
        }
        d = 1.0f / iscale;
        memcpy(yb, &d, 4);
        memcpy(yb + 260, bs, 32);
    }
}
#endif

static void quantize_q8_k_row(const float *x, int64_t k, uint8_t *out) {
    for (int64_t b = 0; b < k / 256; b++) {
        const float *xb = x + 256 * b;
        uint8_t *yb = out + Q8_K_BYTES * b;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++) {
            const float a = fabsf(xb[j]);
            if (a > amax) {
                amax = a;
                max = xb[j];
            }
        }
        int8_t qs[256];
        int16_t bs[16];
        float d = 0.0f;
        if (amax == 0.0f) {
            memset(qs, 0, sizeof qs);
        } else {
            const float iscale = -127.0f / max;
            for (int j = 0; j < 256; j++) {
                const int v = nearest_int(iscale * xb[j]);
                qs[j] = (int8_t)(v < 127 ? v : 127);
            }
            d = 1.0f / iscale;
        }
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qs[16 * j + i];
            bs[j] = (int16_t)s;
        }
        memcpy(yb, &d, 4);
        memcpy(yb + 4, qs, 256);
        memcpy(yb + 260, bs, 32);
    }
}

void quantize_q8_k_any(const float *x, int64_t k, uint8_t *out) {
#ifdef K3_X86
    if (q8_avx512) {
        quantize_q8_k_row_avx512(x, k, out);
        return;
    }
#endif
    quantize_q8_k_row(x, k, out);
}

/* The natural-order value index (within its group) of lane p's first value. */
static inline int lane_start(int G, int p) { return G == 32 ? 32 * p : 32 * (p & 7) + 16 * (p >> 3); }

/* Where the in-register transpose of a decoded group (the transposed direct path) puts lane p. */
static const int XT_POS32[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
static const int XT_POS16[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

/* Quantize row r of x as the weight type's activation type wants and lay it out. */
void prepare_x_row(const float *x, int64_t k, int act_q8k, int variant, int G, uint8_t *qbuf,
                          const xlane_t *xl, int64_t r) {
    if (act_q8k) quantize_q8_k_any(x, k, qbuf);
    else quantize_q8_0_row(x, k, qbuf, variant);
    const int64_t gv = xl->gv;
    int8_t *q = xl->q != NULL ? xl->q + r * xl->ngroups * gv : NULL, *xn = xl->xn + r * xl->ngroups * gv;
    float *dx = xl->dx + r * xl->ngroups * I8_LANES, *dxs = xl->dxs + r * xl->ngroups * I8_LANES;
    int32_t *corr = xl->corr + r * xl->ngroups * I8_LANES;
    for (int64_t g = 0; g < xl->ngroups; g++)
        for (int p = 0; p < I8_LANES; p++) {
            const int64_t v0 = g * gv + lane_start(G, p);
            int sum = 0;
            float d = 0.0f;
            if (v0 < k) {
                const uint8_t *src;
                if (act_q8k) {
                    memcpy(&d, qbuf + (v0 / 256) * Q8_K_BYTES, 4);
                    src = qbuf + (v0 / 256) * Q8_K_BYTES + 4 + v0 % 256;
                } else {
                    d = f16(rd16(qbuf + (v0 / 32) * 34));
                    src = qbuf + (v0 / 32) * 34 + 2 + v0 % 32;
                }
                memcpy(xn + v0, src, (size_t)G);
                if (q != NULL)
                    for (int c = 0; c < G / 4; c++) memcpy(q + g * gv + 64 * c + 4 * p, src + 4 * c, 4);
                for (int j = 0; j < G; j++) sum += (int8_t)src[j];
            } else {
                if (q != NULL)
                    for (int c = 0; c < G / 4; c++) memset(q + g * gv + 64 * c + 4 * p, 0, 4);
                memset(xn + v0, 0, (size_t)G);
            }
            dx[g * I8_LANES + p] = d;
            dxs[g * I8_LANES + p] = d * (float)sum;
            corr[g * I8_LANES + p] = -128 * sum;
        }
    if (xl->qt != NULL) {
        const int *pos = G == 32 ? XT_POS32 : XT_POS16;
        const int64_t o = r * xl->ngroups * gv, lo = r * xl->ngroups * I8_LANES;
        for (int64_t g = 0; g < xl->ngroups; g++)
            for (int p = 0; p < I8_LANES; p++) {
                const int64_t a = lo + g * I8_LANES + p, b = lo + g * I8_LANES + pos[p];
                xl->dxt[b] = xl->dx[a];
                xl->dxst[b] = xl->dxs[a];
                xl->corrt[b] = xl->corr[a];
                for (int c = 0; c < G / 4; c++)
                    memcpy(xl->qt + o + g * gv + 64 * c + 4 * pos[p], xl->q + o + g * gv + 64 * c + 4 * p, 4);
            }
    }
}


/* Columns [n0, n1) of an int8 product: panels of I8_NP rows x I8_KC values, each decoded once
 * and multiplied by every row of x, I8_MB rows at a time. */
void i8_columns(const i8job_t *jb, int64_t n0, int64_t n1, uint8_t *scratch) {
    if (jb->direct != NULL) {
        const int64_t nb = jb->nchunk > 0 ? jb->nchunk : n1 - n0;
        for (int64_t a = n0; a < n1; a += nb)
            for (int64_t r0 = 0; r0 < jb->m; r0 += I8_DIRECT_ROWS)
                jb->direct(jb, a, n1 - a < nb ? n1 : a + nb, r0,
                           jb->m - r0 < I8_DIRECT_ROWS ? (int)(jb->m - r0) : I8_DIRECT_ROWS);
        return;
    }
    uint8_t *wq = scratch;
    float *ws = (float *)(scratch + (int64_t)I8_NP * I8_KC);
    float *wmn = ws + (int64_t)I8_NP * I8_GMAX * 16;
    float *acc = wmn + (int64_t)I8_NP * I8_GMAX * 16;
    const int64_t rb = jb->k / jb->qk * jb->bytes, gv = jb->xl->gv;
    const int u8 = jb->level == 2;
#ifdef K3_X86
    const i8tiles_fn tiles = jb->level == 2 ? i8tiles_vnni : jb->level == 1 ? i8tiles_avx2 : i8tiles_scalar;
#else
    const i8tiles_fn tiles = i8tiles_scalar;
#endif
    for (int64_t r0 = 0; r0 < jb->m; r0 += I8_MB) {
        const int mb = jb->m - r0 < I8_MB ? (int)(jb->m - r0) : I8_MB;
        for (int64_t p0 = n0; p0 < n1; p0 += I8_NP) {
            const int np = n1 - p0 < I8_NP ? (int)(n1 - p0) : I8_NP;
            for (int64_t c0 = 0; c0 < jb->k; c0 += I8_KC) {
                const int64_t kc = jb->k - c0 < I8_KC ? jb->k - c0 : I8_KC;
                jb->panel(jb->w + p0 * rb, rb, np, c0 / jb->qk, kc, wq, ws, wmn, u8);
                tiles(jb, wq, ws, wmn, np, c0 / gv, (kc + gv - 1) / gv, r0, mb, acc, c0 == 0, c0 + kc == jb->k, p0);
            }
        }
    }
}

