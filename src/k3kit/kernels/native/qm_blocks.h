/* qm_blocks.h: the ggml block layouts every path reads. Per type: its values and bytes per block,
 * its scales (and mins) and its 32-value sub-blocks as int8 values, unpacked as the scalar
 * reference does (the vector decoders, qm_x86.h and qm_vnni_*.c, give the same values), and the
 * float products' per-type tuning. One header for all types: every path needs some of it, and
 * the decoders inline into each. Included by qm.h after the loads and the tables. */
#ifndef K3_QM_BLOCKS_H
#define K3_QM_BLOCKS_H

/* ---- per type: the scales of a block, and sub-block j as 32 int8 values -------------------
 * scales_T(blk, s, mn): the scales (and mins) of the block's 32-value sub-blocks as ggml
 * computes them: s[SIDX(T, j, h)] is the scale of half h (values 16 h .. 16 h + 15) of
 * sub-block j; T_PER16 types have one per 16 values (s[2 j + h]), the others one per 32 (s[j]).
 * q_T(blk, j, q): the 32 int8 values of sub-block j in four little-endian words (the scalar
 * path's unpacking, also the reference for the vector paths' qv_T, which return the 32 bytes
 * in a register; scales_T_v are the vector paths' versions where they differ). */
#define SIDX(T, j, h) (T##_PER16 ? 2 * (j) + (h) : (j))

/* Q8_0: f16 d, int8 qs[32]: w = q * d. */
#define Q8_0_QK 32
#define Q8_0_BYTES 34
#define Q8_0_PER16 0
INLINE void scales_q8_0(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    s[0] = f16(rd16(b));
}
INLINE void q_q8_0(const uint8_t *b, int j, uint64_t *q) {
    (void)j;
    for (int i = 0; i < 4; i++) q[i] = rd64(b + 2 + 8 * i);
}

/* Q4_K: f16 d, f16 dmin, scales[12] (8 six-bit scale/min pairs), qs[128]: sub-block j is the
 * low (j even) or high nibbles of qs[32 (j / 2) ...]; w = (d * sc) * q - dmin * m. */
#define Q4_K_QK 256
#define Q4_K_BYTES 144
#define Q4_K_PER16 0
INLINE void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
INLINE void scales_k4(const uint8_t *b, float *s, float *mn) {
    const float d = f16(rd16(b)), dmin = f16(rd16(b + 2));
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        scale_min_k4(j, b + 4, &sc, &m);
        s[j] = d * sc;
        mn[j] = dmin * m;
    }
}
#define scales_q4_k scales_k4
INLINE void q_q4_k(const uint8_t *b, int j, uint64_t *q) {
    const uint8_t *qs = b + 16 + 32 * (j / 2);
    for (int i = 0; i < 4; i++) q[i] = (rd64(qs + 8 * i) >> (4 * (j & 1))) & 0x0F0F0F0F0F0F0F0FULL;
}

/* Q5_K: as Q4_K plus qh[32] at 16 (bit j of qh[l] is the fifth bit), qs[128] at 48. */
#define Q5_K_QK 256
#define Q5_K_BYTES 176
#define Q5_K_PER16 0
#define scales_q5_k scales_k4
INLINE void q_q5_k(const uint8_t *b, int j, uint64_t *q) {
    const uint8_t *qs = b + 48 + 32 * (j / 2);
    for (int i = 0; i < 4; i++)
        q[i] = ((rd64(qs + 8 * i) >> (4 * (j & 1))) & 0x0F0F0F0F0F0F0F0FULL) |
               (((rd64(b + 16 + 8 * i) >> j) & L8) << 4);
}

/* Q6_K: ql[128], qh[64], int8 scales[16], f16 d at 208. Sub-block j = 4 h + g: low 4 bits from
 * ql[64 h + 32 (g & 1) ...] (high nibble if g >= 2), top 2 bits from qh[32 h ...] >> 2 g, minus
 * 32; scale 2 j + l / 16. w = (d * sc) * q. */
#define Q6_K_QK 256
#define Q6_K_BYTES 210
#define Q6_K_PER16 1
INLINE void scales_q6_k(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const float d = f16(rd16(b + 208));
    for (int i = 0; i < 16; i++) s[i] = d * (int8_t)b[192 + i];
}
INLINE void q_q6_k(const uint8_t *b, int j, uint64_t *q) {
    const int h = j >> 2, g = j & 3;
    const uint8_t *ql = b + 64 * h + 32 * (g & 1), *qh = b + 128 + 32 * h;
    for (int i = 0; i < 4; i++) {
        const uint64_t lo = (rd64(ql + 8 * i) >> (4 * (g >> 1))) & 0x0F0F0F0F0F0F0F0FULL;
        const uint64_t hi = ((rd64(qh + 8 * i) >> (2 * g)) & 0x0303030303030303ULL) << 4;
        q[i] = add_bytes(lo | hi, 0xE0E0E0E0E0E0E0E0ULL);   /* - 32 */
    }
}

/* Q2_K: scales[16] (low nibble scale, high nibble min), qs[64], f16 d, f16 dmin. Sub-block j:
 * bits 2 (j % 4) of qs[32 (j / 4) ...]; w = (d * sc) * q - dmin * m per 16 values. */
#define Q2_K_QK 256
#define Q2_K_BYTES 84
#define Q2_K_PER16 1
INLINE void scales_q2_k(const uint8_t *b, float *s, float *mn) {
    const float d = f16(rd16(b + 80)), dmin = f16(rd16(b + 82));
    for (int i = 0; i < 16; i++) {
        s[i] = d * (b[i] & 0xF);
        mn[i] = dmin * (b[i] >> 4);
    }
}
INLINE void q_q2_k(const uint8_t *b, int j, uint64_t *q) {
    const uint8_t *qs = b + 16 + 32 * (j >> 2);
    for (int i = 0; i < 4; i++) q[i] = (rd64(qs + 8 * i) >> (2 * (j & 3))) & 0x0303030303030303ULL;
}

/* Q3_K: hmask[32], qs[64], scales[12] (16 six-bit, minus 32), f16 d at 108. Sub-block j: bits
 * 2 (j % 4) of qs[32 (j / 4) ...], minus 4 where bit j of hmask[l] is clear; w = (d * sc) * q. */
#define Q3_K_QK 256
#define Q3_K_BYTES 110
#define Q3_K_PER16 1
INLINE void scales_q3_k(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f;
    uint32_t aux[4];
    int8_t sc[16];
    memcpy(aux, b + 96, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    memcpy(sc, aux, 16);
    const float d = f16(rd16(b + 108));
    for (int i = 0; i < 16; i++) s[i] = d * (sc[i] - 32);
}
INLINE void q_q3_k(const uint8_t *b, int j, uint64_t *q) {
    const uint8_t *qs = b + 32 + 32 * (j >> 2);
    for (int i = 0; i < 4; i++) {
        const uint64_t low = (rd64(qs + 8 * i) >> (2 * (j & 3))) & 0x0303030303030303ULL;
        const uint64_t clear = ((rd64(b + 8 * i) >> j) & L8) ^ L8;
        q[i] = low | (clear * 0xFC);   /* low - 4: the bits of 0xFC and of low (<= 3) are disjoint */
    }
}

/* IQ2_XXS: f16 d, then per sub-block 8 bytes: 4 grid indices and a uint32 of four 7-bit sign
 * indices plus a 4-bit scale; w = (d * (0.5 + s) * 0.25) * (+-grid). */
#define IQ2_XXS_QK 256
#define IQ2_XXS_BYTES 66
#define IQ2_XXS_PER16 0
INLINE void scales_iq2_xxs(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const float d = f16(rd16(b));
    for (int j = 0; j < 8; j++) s[j] = d * (0.5f + (rd32(b + 2 + 8 * j + 4) >> 28)) * 0.25f;
}
INLINE void q_iq2_xxs(const uint8_t *b, int j, uint64_t *q) {
    const uint8_t *p = b + 2 + 8 * j;
    const uint32_t aux = rd32(p + 4);
    for (int l = 0; l < 4; l++) q[l] = negate_where(IQ2XXS_GRID[p[l]], SIGN_MASK[(aux >> (7 * l)) & 127]);
}

/* IQ2_XS: f16 d, uint16 qs[32] (9-bit grid index | 7-bit sign index), scales[8] (a nibble per
 * 16 values); w = (d * (0.5 + s) * 0.25) * (+-grid). */
#define IQ2_XS_QK 256
#define IQ2_XS_BYTES 74
#define IQ2_XS_PER16 1
INLINE void scales_iq2_xs(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const float d = f16(rd16(b));
    for (int j = 0; j < 8; j++) {
        s[2 * j] = d * (0.5f + (b[66 + j] & 0xf)) * 0.25f;
        s[2 * j + 1] = d * (0.5f + (b[66 + j] >> 4)) * 0.25f;
    }
}
INLINE void q_iq2_xs(const uint8_t *b, int j, uint64_t *q) {
    for (int l = 0; l < 4; l++) {
        const uint16_t v = rd16(b + 2 + 2 * (4 * j + l));
        q[l] = negate_where(IQ2XS_GRID[v & 511], SIGN_MASK[v >> 9]);
    }
}

/* IQ3_XXS: f16 d, qs[64] (grid indices of 4 values), then per sub-block a uint32 of four 7-bit
 * sign indices plus a 4-bit scale; w = (d * (0.5 + s) * 0.5) * (+-grid). */
#define IQ3_XXS_QK 256
#define IQ3_XXS_BYTES 98
#define IQ3_XXS_PER16 0
INLINE void scales_iq3_xxs(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const float d = f16(rd16(b));
    for (int j = 0; j < 8; j++) s[j] = d * (0.5f + (rd32(b + 66 + 4 * j) >> 28)) * 0.5f;
}
INLINE void q_iq3_xxs(const uint8_t *b, int j, uint64_t *q) {
    const uint8_t *qs = b + 2 + 8 * j;
    const uint32_t aux = rd32(b + 66 + 4 * j);
    for (int l = 0; l < 4; l++) {
        const uint64_t g = IQ3XXS_GRID[qs[2 * l]] | ((uint64_t)IQ3XXS_GRID[qs[2 * l + 1]] << 32);
        q[l] = negate_where(g, SIGN_MASK[(aux >> (7 * l)) & 127]);
    }
}

/* IQ1_S: f16 d, qs[32], uint16 qh[8] (4 x 3 high index bits, a 3-bit scale, the delta sign);
 * w = (d * (2 s + 1)) * (grid + delta), computed as ((d * (2 s + 1)) / 8) * (8 grid +- 1). */
#define IQ1_S_QK 256
#define IQ1_S_BYTES 50
#define IQ1_S_PER16 0
INLINE void scales_iq1_s(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const float d = f16(rd16(b));
    for (int j = 0; j < 8; j++) {
        const float dl = d * (2 * ((rd16(b + 34 + 2 * j) >> 12) & 7) + 1);
        s[j] = dl * 0.125f;
    }
}
INLINE void q_iq1_s(const uint8_t *b, int j, uint64_t *q) {
    const uint16_t qh = rd16(b + 34 + 2 * j);
    const uint64_t delta = qh & 0x8000 ? ~0ULL : L8;   /* -1 or +1 in every byte */
    for (int l = 0; l < 4; l++)
        q[l] = add_bytes(IQ1S_GRID8[b[2 + 4 * j + l] | (((qh >> (3 * l)) & 7) << 8)], delta);
}

/* IQ1_M: qs[32], qh[16] (a nibble per 8 values: 3 index bits and the delta sign), 4 x uint16
 * scales (3 bits per 16 values; their top nibbles together are the f16 d). */
#define IQ1_M_QK 256
#define IQ1_M_BYTES 56
#define IQ1_M_PER16 1
INLINE void scales_iq1_m(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    const uint16_t sc[4] = {rd16(b + 48), rd16(b + 50), rd16(b + 52), rd16(b + 54)};
    const float d = f16((uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                   (sc[3] & 0xf000)));
    for (int j = 0; j < 8; j++) {
        const float dl1 = d * (2 * ((sc[j / 2] >> (6 * (j % 2) + 0)) & 0x7) + 1);
        const float dl2 = d * (2 * ((sc[j / 2] >> (6 * (j % 2) + 3)) & 0x7) + 1);
        s[2 * j] = dl1 * 0.125f;
        s[2 * j + 1] = dl2 * 0.125f;
    }
}
INLINE void q_iq1_m(const uint8_t *b, int j, uint64_t *q) {
    for (int l = 0; l < 4; l++) {
        const int nib = (b[32 + 2 * j + l / 2] >> (4 * (l & 1))) & 0xF;
        q[l] = add_bytes(IQ1S_GRID8[b[4 * j + l] | ((nib & 7) << 8)], nib & 8 ? ~0ULL : L8);
    }
}

/* MXFP4: e8m0 exponent e, then 16 bytes; value j is the low nibble of byte j, value j + 16 its
 * high nibble. w = kv * d with kv the doubled e2m1 values (ggml's kvalues_mxfp4) and d = 2^(e - 128)
 * the halved scale (ggml_e8m0_to_fp32_half): the product is exact, ggml's value. */
#define MXFP4_QK 32
#define MXFP4_BYTES 17
#define MXFP4_PER16 0

static const int8_t KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
INLINE void scales_mxfp4(const uint8_t *b, float *s, float *mn) {
    (void)mn;
    s[0] = E8M0_HALF[b[0]];
}
INLINE void q_mxfp4(const uint8_t *b, int j, uint64_t *q) {
    (void)j;
    int8_t v[32];
    for (int i = 0; i < 16; i++) {
        v[i] = KV[b[1 + i] & 0x0F];
        v[i + 16] = KV[b[1 + i] >> 4];
    }
    memcpy(q, v, 32);
}

/* Per type, for the vector paths: T_FACTORED, whether a sub-block's scale multiplies its
 * partial sums instead of each weight (see qm.h's top), and T_BLOCKED_FROM, the row count from
 * which products use panels instead of per-row tiles ("many rows" in qm.h). Measured (AVX-512,
 * 7168 x 2048, 1 thread, benchmarks/bench_qmatmul.py --paths): panels win from 6-8 rows for
 * types with costly decodes; FACTORED types and Q8_0, whose per-row tiles decode in a few
 * instructions, only from 12-48. Q8_0 is not FACTORED: its panels then run at the 2-operation
 * rate (trunk prefill), while one row, bound by memory, costs the same either way. */
#define Q8_0_FACTORED 0
#define Q4_K_FACTORED 0
#define Q5_K_FACTORED 0
#define Q6_K_FACTORED 0
#define Q2_K_FACTORED 0
#define Q3_K_FACTORED 0
#define IQ2_XXS_FACTORED 1
#define IQ2_XS_FACTORED 0
#define IQ3_XXS_FACTORED 1
#define IQ1_S_FACTORED 1
#define IQ1_M_FACTORED 0
#define MXFP4_FACTORED 1

#define Q8_0_BLOCKED_FROM 32
#define Q4_K_BLOCKED_FROM 6
#define Q5_K_BLOCKED_FROM 6
#define Q6_K_BLOCKED_FROM 8
#define Q2_K_BLOCKED_FROM 6
#define Q3_K_BLOCKED_FROM 6
#define IQ2_XXS_BLOCKED_FROM 32
#define IQ2_XS_BLOCKED_FROM 6
#define IQ3_XXS_BLOCKED_FROM 12
#define IQ1_S_BLOCKED_FROM 24
#define IQ1_M_BLOCKED_FROM 6
#define MXFP4_BLOCKED_FROM 48

#endif
