/* qm_amx.c: the int8 products of many rows on AMX-INT8 (Q8_0 and MXFP4): the tile
 * configuration, the decode of W blocks into int8 rows, the tile multiplies with the other
 * paths' float steps per lane, and x laid out as B tiles. Its own file: its own instruction set,
 * its own OS permission (requested in qm_dispatch.c) and its own driver. x86 only. */
#include "qm.h"
#include "qm_i8.h"

#ifdef K3_X86
/* ---- many rows on AMX-INT8 -------------------------------------------------------------------
 * The int8 products' arithmetic, bit for bit, with the integer sums from AMX's tile multiply
 * (TDPBSSD: a 16 x 16 tile of int32 dot products of 64 signed bytes per instruction). Per block of
 * 16 W rows, decoded once into int8 rows (Q8_0: the blocks' bytes; MXFP4: the doubled e2m1 values)
 * with the scales beside them, and per block of up to 8 x rows, per pair of sub-blocks (u, u + 1;
 * 32 values each, lanes u % 16 and u % 16 + 1 of group u / 16): A = the 16 W rows' 64 values, B =
 * the x rows' values laid out once per call so that column 2r + h holds x row r's values of
 * sub-block u + h against A's half h and zeros against the other half: C[n][2r + h] is then the
 * exact sum S of (W row n, x row r, sub-block u + h). Per W row n, vectorized over (r, h): f =
 * fl(S * ws), acc = fma(f, dx, acc), ws W's scales of u, u + 1 (a broadcast pair), dx x's: every
 * element gets the other paths' operations in their order (sub-blocks past k, in a partial last
 * group: zero operands and zero scales, as elsewhere), and the final tree over the 16 lanes
 * (lane p = 2 (pair) + h) is elementwise theirs. Q8_0 and MXFP4: the types without a min whose
 * lanes are 32 values and whose activations are Q8_0. The tile work of the next 4 pairs is issued
 * before the float work of the current ones. Linux hands out the tile state only after
 * arch_prctl(ARCH_REQ_XCOMP_PERM); each thread loads its tile configuration per call and releases
 * it at the end. */
#define AMX_TARGET "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
/* two adjacent floats (ws of a pair) as one 64-bit broadcast */
INLINE double ld_f64(const float *p) { double d; memcpy(&d, p, 8); return d; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amxcfg_t;

/* tmm0-3: C; tmm4, tmm5: A; tmm6, tmm7: B; all 16 rows of 64 bytes. */
__attribute__((target(AMX_TARGET))) static void amx_config(void) {
    amxcfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* One pair's sums into C tile T (A in tile TA, B in tile TB; literal numbers). */
#define AMX_DP(T, TA, TB, a, as, b)                                                                 \
    do {                                                                                           \
        _tile_zero(T);                                                                             \
        _tile_loadd(TA, (a), (as));                                                                \
        _tile_loadd(TB, (b), 64);                                                                  \
        _tile_dpbssd(T, TA, TB);                                                                   \
    } while (0)
/* Pairs v .. v + 3 against x block xb into the C set at cb: the four multiplies first, then the
 * stores (a store straight after its multiply holds the next one back by the multiply's latency). */
#define AMX_BATCH(v, cb)                                                                            \
    do {                                                                                           \
        AMX_DP(0, 4, 6, wbuf + 64 * (v), kp, xb + 1024 * (v));                                     \
        AMX_DP(1, 5, 7, wbuf + 64 * ((v) + 1), kp, xb + 1024 * ((v) + 1));                         \
        AMX_DP(2, 4, 6, wbuf + 64 * ((v) + 2), kp, xb + 1024 * ((v) + 2));                         \
        AMX_DP(3, 5, 7, wbuf + 64 * ((v) + 3), kp, xb + 1024 * ((v) + 3));                         \
        _tile_stored(0, (cb), 64);                                                                 \
        _tile_stored(1, (cb) + 256, 64);                                                           \
        _tile_stored(2, (cb) + 512, 64);                                                           \
        _tile_stored(3, (cb) + 768, 64);                                                           \
    } while (0)

/* Decode units [e0, e1) of W rows nb .. n1 - 1 (unit e: row e / upr, sub-blocks 16 (e % upr) ..
 * + 15) into wbuf (row stride kp) and wsb (row stride nsubp). */
__attribute__((target(AMX_TARGET))) static void amx_decode(const amxjob_t *j, int64_t nb, int64_t n1, int64_t e0,
                                                           int64_t e1, int8_t *wbuf, float *wsb) {
    const int64_t nsub = j->nsub, upr = (nsub + 15) / 16;
    const __m256i nib = _mm256_set1_epi8(0x0F), kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KV));
    for (int64_t e = e0; e < e1; e++) {
        const int64_t n = e / upr, u0 = 16 * (e % upr), u1 = u0 + 16 < nsub ? u0 + 16 : nsub;
        if (nb + n >= n1) break;
        const uint8_t *row = j->w + (nb + n) * j->rb;
        int8_t *wo = wbuf + n * 32 * j->nsubp;
        float *wso = wsb + n * j->nsubp;
        if (j->qtype == 8) {
            /* (no vpgatherdd for the scales: slow on this generation with its mitigations) */
            for (int64_t u = u0; u < u1; u++) {
                wso[u] = _cvtsh_ss(rd16(row + 34 * u));
                _mm256_storeu_si256((__m256i *)(wo + 32 * u), _mm256_loadu_si256((const __m256i *)(row + 34 * u + 2)));
            }
        } else {
            for (int64_t u = u0; u < u1; u++) {
                const uint8_t *blk = row + 17 * u;
                wso[u] = E8M0_HALF[blk[0]];
                const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 1));
                const __m256i qq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), nib);
                _mm256_storeu_si256((__m256i *)(wo + 32 * u), _mm256_shuffle_epi8(kv, qq));
            }
        }
    }
}

__attribute__((target(AMX_TARGET))) void amx_columns(const amxjob_t *j, int64_t n0, int64_t n1, uint8_t *scratch) {
    float *acc = (float *)scratch;
    int32_t *cb = (int32_t *)(scratch + AMX_ACC_BYTES);
    const int64_t nsubp = j->nsubp, kp = 32 * nsubp, npair = nsubp / 2, nbatch = npair / 4;
    float *wsbs[2] = {(float *)(scratch + AMX_ACC_BYTES + AMX_C_BYTES), (float *)(scratch + AMX_ACC_BYTES + AMX_C_BYTES) + 16 * nsubp};
    int8_t *wbufs[2] = {(int8_t *)(wsbs[1] + 16 * nsubp), (int8_t *)(wsbs[1] + 16 * nsubp) + 16 * kp};
    const int64_t units = 16 * ((j->nsub + 15) / 16), per_batch = (units + nbatch - 1) / nbatch;
    /* rows past n1 and sub-blocks past k: zeros (a partial W block's extra rows are not stored) */
    memset(wsbs[0], 0, (size_t)(2 * 16 * nsubp * sizeof(float) + 2 * 16 * kp));
    amx_config();
    amx_decode(j, n0, n1, 0, units, wbufs[0], wsbs[0]);
    for (int64_t nb = n0, blk = 0; nb < n1; nb += 16, blk++) {
        const int nr = n1 - nb < 16 ? (int)(n1 - nb) : 16;
        const int8_t *wbuf = wbufs[blk & 1];
        const float *wsb = wsbs[blk & 1];
        /* the next W block is decoded a slice per batch of the first x rows: its loads from memory
         * overlap the tile and float work */
        int8_t *wnext = wbufs[(blk + 1) & 1];
        float *snext = wsbs[(blk + 1) & 1];
        for (int64_t r0 = 0; r0 < j->m; r0 += 8) {
            const int mr = j->m - r0 < 8 ? (int)(j->m - r0) : 8;
            const int8_t *xb = j->xb + (r0 / 8) * npair * 1024;
            const float *dxv = j->dxv + (r0 / 8) * npair * 16;
            AMX_BATCH(0, cb);
            for (int64_t v = 0; v < npair; v += 4) {
                const int32_t *cur = cb + 1024 * ((v / 4) & 1);
                if (v + 4 < npair) AMX_BATCH(v + 4, cb + 1024 * (((v / 4) + 1) & 1));
                if (r0 == 0 && nb + 16 < n1)
                    amx_decode(j, nb + 16, n1, (v / 4) * per_batch, (v / 4 + 1) * per_batch, wnext, snext);
                for (int q = 0; q < 4; q++) {
                    const int pp = (int)((v + q) % 8);
                    float *accp = acc + pp * 16;
                    const __m512 dx = _mm512_loadu_ps(dxv + (v + q) * 16);
                    const float *wsp = wsb + 2 * (v + q);
                    const int32_t *cq = cur + 256 * q;
                    if (v + q < 8) /* the first group: the accumulators start at +0 */
                        for (int n = 0; n < 16; n++) _mm512_store_ps(accp + n * 128, _mm512_setzero_ps());
                    for (int n = 0; n < 16; n++) {
                        float *ap = accp + n * 128;
                        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cq + 16 * n)),
                                                       _mm512_castpd_ps(_mm512_set1_pd(ld_f64(wsp + n * nsubp))));
                        _mm512_store_ps(ap, _mm512_fmadd_ps(f, dx, _mm512_load_ps(ap)));
                    }
                }
            }
            /* lanes 2 pp + h: the tree's pairs (p, p + 8), (p, p + 4), (p, p + 2) are pp's, then h's */
            for (int n = 0; n < nr; n++) {
                const float *a = acc + n * 128;
                __m512 h[4];
                for (int i = 0; i < 4; i++) h[i] = _mm512_add_ps(_mm512_load_ps(a + 16 * i), _mm512_load_ps(a + 16 * (i + 4)));
                for (int i = 0; i < 2; i++) h[i] = _mm512_add_ps(h[i], h[i + 2]);
                const __m512 h2 = _mm512_add_ps(h[0], h[1]);
                float out[16] __attribute__((aligned(64)));
                _mm512_store_ps(out, _mm512_add_ps(h2, _mm512_permute_ps(h2, 0xB1)));
                for (int r = 0; r < mr; r++) j->y[(r0 + r) * j->n_out + nb + n] = out[2 * r];
            }
        }
    }
    _tile_release();
}

/* x's B tiles and scales for the AMX path, from prepare_x_row's natural-order bytes and dx. */
void amx_prepare_x(const xlane_t *xl, int64_t m, int64_t nsubp, int8_t *xb, float *dxv) {
    const int64_t nxb = (m + 7) / 8, xrow = xl->ngroups * xl->gv, npair = nsubp / 2;
    memset(xb, 0, (size_t)(nxb * npair * 1024));
    memset(dxv, 0, (size_t)(nxb * npair * 16) * sizeof(float));
    for (int64_t r = 0; r < m; r++)
        for (int64_t u = 0; u < nsubp; u++) {
            const int h = (int)(u & 1), col = 2 * (int)(r % 8) + h;
            int8_t *xo = xb + ((r / 8) * npair + u / 2) * 1024 + 4 * col;
            const int8_t *src = xl->xn + r * xrow + 32 * u;
            for (int c = 0; c < 8; c++) memcpy(xo + 64 * (8 * h + c), src + 4 * c, 4);
            dxv[((r / 8) * npair + u / 2) * 16 + col] = xl->dx[r * xl->ngroups * 16 + u];
        }
}

#endif
