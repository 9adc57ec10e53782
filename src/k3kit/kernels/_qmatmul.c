/* Quantized ggml matrices times float32 activations, without dequantizing the matrix first.
 *
 * y[r, n] = sum_i W[n, i] * x[r, i]  for a ggml matrix W of n_out rows of k values stored as
 * its blocks (MXFP4, Q8_0, Q2_K..Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ3_XXS), x float32.
 *
 * Why it exists: a matrix that stays in its file bytes (a quantized trunk, or routed experts in
 * a cache of quantized bytes) would otherwise be dequantized whole just to be multiplied by one
 * or a few rows. Reading the blocks directly costs about one pass over the quantized bytes; for
 * many rows (prefill, verify, batches) each block is decoded once into a float32 panel that
 * every row reuses, so the decode is paid once per row block, not per row.
 *
 * The contract (tests/kernels/test_qmatmul*.py): each result agrees with the float64 product of
 * the dequantized matrix to the float32 rounding bound of a k-term dot product, on every path,
 * and a column's result is the same for any thread count and any number of rows. How:
 *
 * - Every type decodes a 32-value sub-block into float32 weights that are exactly ggml's
 *   dequantize_row_* values: the same products and differences in the same order, each rounded
 *   once (the build passes -ffp-contract=off, so `d * q - m` is never fused). A sub-block is
 *   first unpacked to 32 int8 values q (sign-applied grid values for IQ types, the doubled e2m1
 *   values for MXFP4) with a float scale s (and for Q2_K/Q4_K/Q5_K a min) per 16 or 32 values:
 *   w = s * q [- min]. IQ1 values (grid + delta, delta = +-1/8) are kept as the integers
 *   8 * grid +- 1 with the scale dl / 8; dividing by 8 is exact, so the product rounds to ggml's
 *   dl * (grid + delta). Then y is a plain float32 dot product of x with those weights, except
 *   for the FACTORED types (one scale per 32 values, no min, cheap to decode: MXFP4, IQ2_XXS,
 *   IQ3_XXS, IQ1_S), whose products apply the scale to each sub-block's partial sums,
 *   s * sum(q x) (one multiply per 32 values instead of per value; each term s q x is then
 *   rounded at a relative 2^-24 of |w x| more, inside the bound; and an infinite MXFP4 scale
 *   times a zero sum stays 0 where inf * 0 would be NaN). One row of x with a single 1 still
 *   reads each weight back bit for bit, on every type and path.
 * - The arithmetic of one (row of x, row of W) pair does not depend on how many rows of x a
 *   call has, nor on the thread count (threads split the output columns): few rows run per-row
 *   tiles, many rows panels (see "many rows" below), and both give every pair the same
 *   operations in the same order. So a decode step (one row) and a verify pass or a prefill
 *   chunk (many rows) give bit-identical rows.
 *
 * IQ grids and the sign table are not typed here: qmatmul.py passes gguf-py's tables to
 * init_tables() at import (the same data the torch dequantizers gather from). dequantize()
 * writes W's rows as ggml's float32 values (or their bfloat16 rounding), for QuantizedMatrix's
 * dequantize + GEMM path.
 *
 * Paths: AVX-512F, AVX2+FMA+F16C and scalar C, chosen at run time by what the CPU has (the
 * scalar path is the reference and the fallback on other CPUs). These float products do not
 * use AVX-512 VNNI: it multiplies int8 by int8. matmul_q8 ("int8 activations" below) is the
 * other arithmetic, ggml's own: x rounded to int8 blocks first, then VNNI integer products,
 * with its own contract. A call may split its output columns over OpenMP threads (the caller
 * passes torch's thread count).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ggml blocks are little-endian and are read in place"
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define K3_X86 1
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

#define INLINE static inline __attribute__((always_inline))
#define AVX2_TARGET "avx2,fma,f16c"
#define AVX512_TARGET "avx512f,avx2,fma,f16c"

/* y[:, n0:n1] for rows n0 .. n1 - 1 of W; scratch: SCRATCH_FLOATS floats (64-byte aligned) for the
 * many-row drivers, or NULL for the per-row tiles (vector paths, few rows). */
typedef void (*kernel_fn)(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k,
                          const float *x, int64_t m, float *y, float *scratch);

/* ---- little-endian loads and f16 ---------------------------------------------------------- */

INLINE uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INLINE uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* IEEE half -> float, exact (subnormals, infinities and NaN payloads included). */
INLINE float f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exp == 0x1F) bits = sign | 0x7F800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else {
        f = (float)man * 0x1p-24f;   /* subnormal: man * 2^-24, exact */
        return sign ? -f : f;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- bytewise arithmetic on 8 int8 values in a uint64 (no carries between bytes) ---------- */

#define L8 0x0101010101010101ULL
#define H8 0x8080808080808080ULL

INLINE uint64_t add_bytes(uint64_t a, uint64_t b) { return ((a & ~H8) + (b & ~H8)) ^ ((a ^ b) & H8); }
/* Negate the bytes of g where mask has 0xFF: (g ^ 0xFF) + 1 = -g. */
INLINE uint64_t negate_where(uint64_t g, uint64_t mask) { return add_bytes(g ^ mask, mask & L8); }

/* ---- tables filled by init_tables() from gguf-py's data ---------------------------------- */

static uint64_t IQ2XXS_GRID[256];   /* iq2xxs_grid: 8 bytes 0x08/0x19/0x2b per entry */
static uint64_t IQ2XS_GRID[512];    /* iq2xs_grid */
static uint32_t IQ3XXS_GRID[256];   /* iq3xxs_grid: 4 bytes per entry */
static uint64_t IQ1S_GRID8[2048];   /* iq1s_grid (-1, 0, 1) times 8, as int8 bytes */
static uint64_t SIGN_MASK[128];     /* ksigns_iq2xs[i]: byte j = 0xFF where bit j is set */
static int tables_ready = 0;

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
static float E8M0_HALF[256];

static void init_e8m0(void) {
    for (int e = 0; e < 256; e++) {
        uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
        memcpy(&E8M0_HALF[e], &bits, sizeof bits);
    }
}
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
 * partial sums instead of each weight (see the top), and T_BLOCKED_FROM, the row count from
 * which products use panels instead of per-row tiles ("many rows" below). Measured (AVX-512,
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

/* ---- many rows: each block decoded once ----------------------------------------------------
 * The many-row driver takes x in blocks of BLK_MB rows (accumulators for BLK_MB x BLK_NP pairs,
 * and that block of x stays in cache while W streams past), and W in panels of BLK_NP rows and
 * BLK_KC values: a panel is decoded once into float32 (panel_T: each row's values in element
 * order, exactly the weights the per-row tiles below make; for FACTORED types the integer values,
 * each sub-block's scale in a second buffer), then every register tile of (rows of x) x (rows of
 * W) multiplies it, its accumulators kept in a buffer from one panel of values to the next. Each
 * (row of x, row of W) pair goes through the operations of the per-row tiles in the same order
 * (storing an accumulator and loading it back changes no bit), so neither the driver, nor the
 * tile shape, nor the row count changes a result. The scalar path always runs this driver; the
 * vector paths from T_BLOCKED_FROM rows, below which per-row tiles are faster (they decode each
 * block per tile of 4 rows, but into registers: no panel stores and loads). Sizes measured on
 * Zen 4 (AVX-512, 1 MiB L2 per core): 32 x 1024 panels (128 KiB) and 64-row blocks keep 7168 x
 * 2048..16384 products at 80-90 GFLOP/s (non-FACTORED types; ~65 FACTORED: 3 FMA-unit operations
 * per 32 products instead of 2) from 32 to 512 rows; smaller panels or values lost 5-40%. */
#ifndef BLK_NP
#define BLK_NP 32     /* rows of W per panel */
#endif
#ifndef BLK_KC
#define BLK_KC 1024   /* values per panel row: a multiple of every block size */
#endif
#ifndef BLK_MB
#define BLK_MB 64     /* rows of x whose accumulators are kept at once */
#endif
#define BLK_SUB (BLK_KC / 32)
/* Per thread: the panel, its sub-block scales, and 16 floats of accumulator per pair. */
#define SCRATCH_FLOATS (BLK_NP * BLK_KC + BLK_NP * BLK_SUB + BLK_NP * BLK_MB * 16)

/* Decode blocks b0 .. b0 + nbk - 1 of np rows of W (row stride rb bytes) into out (row stride
 * ldw values). PANEL_RAW: float32 as the products use them, so FACTORED types give their integer
 * values, with the sub-block scales in sb (row stride BLK_SUB); PANEL_F32: ggml's weights (q * s
 * for FACTORED types too: what the torch dequantizers make, bit for bit); PANEL_BF16: those
 * rounded to bfloat16 (to nearest even, NaN -> 0x7FC0, as torch's conversion). */
enum { PANEL_RAW, PANEL_F32, PANEL_BF16 };
typedef void (*panel_fn)(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk, void *out, int64_t ldw,
                         float *sb, int mode);

static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* The per-panel loops shared by every path: MK(nt, rt, first, last, wb_i, sb_i, x_t, acc_ti, y_ti)
 * multiplies rows i0 .. i0 + nt of the panel with rows t0 .. t0 + rt of x over the panel's values. */
#define BLOCKED_LOOPS(NT_MAX, RT_MAX, TILES)                                                        \
    do {                                                                                           \
        const int64_t rb = k / qk * bytes;                                                         \
        float *wb = scratch, *sb = scratch + BLK_NP * BLK_KC, *acc = sb + BLK_NP * BLK_SUB;        \
        for (int64_t r0 = 0; r0 < m; r0 += BLK_MB) {                                               \
            const int mb = m - r0 < BLK_MB ? (int)(m - r0) : BLK_MB;                               \
            for (int64_t p0 = n0; p0 < n1; p0 += BLK_NP) {                                         \
                const int np = n1 - p0 < BLK_NP ? (int)(n1 - p0) : BLK_NP;                         \
                for (int64_t c0 = 0; c0 < k; c0 += BLK_KC) {                                       \
                    const int64_t kc = k - c0 < BLK_KC ? k - c0 : BLK_KC;                          \
                    const int first = c0 == 0, last = c0 + kc == k;                                \
                    panel(w + p0 * rb, rb, np, c0 / qk, kc / qk, wb, BLK_KC, sb, PANEL_RAW);       \
                    for (int t0 = 0; t0 < mb; t0 += RT_MAX) {                                      \
                        const int rt = mb - t0 < RT_MAX ? mb - t0 : RT_MAX;                        \
                        const float *xt = x + (r0 + t0) * k + c0;                                  \
                        float *yt = y + (r0 + t0) * n_out + p0;                                    \
                        float *at = acc + (int64_t)t0 * BLK_NP * 16;                               \
                        int i0 = 0;                                                                \
                        for (; i0 + NT_MAX <= np; i0 += NT_MAX) TILES(NT_MAX);                     \
                        for (; i0 < np; i0++) TILES(1);                                            \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* ---- scalar path: the reference -------------------------------------------------------------
 * Per (row of x, row of W): y = sum over sub-blocks, in order, of the sub-block's dot product
 * of weights and x, itself summed in order. Always blocked: one panel per BLK_MB rows of x. */

#define DEFINE_PANEL_SCALAR(T, NAME_LC, HAS_MIN)                                                    \
    static void panel_##NAME_LC##_scalar(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk, \
                                         void *out, int64_t ldw, float *sb, int mode) {             \
        for (int i = 0; i < np; i++)                                                               \
            for (int64_t b = 0; b < nbk; b++) {                                                    \
                const uint8_t *blk = row + i * rb + (b0 + b) * T##_BYTES;                          \
                float s[16], mn[16];                                                               \
                scales_##NAME_LC(blk, s, mn);                                                      \
                for (int j = 0; j < T##_QK / 32; j++) {                                            \
                    const int64_t at = i * ldw + b * T##_QK + 32 * j;                              \
                    uint64_t qw[4];                                                                \
                    int8_t q[32];                                                                  \
                    float v[32];                                                                   \
                    q_##NAME_LC(blk, j, qw);                                                       \
                    memcpy(q, qw, 32);                                                             \
                    for (int e = 0; e < 32; e++) {                                                 \
                        v[e] = (float)q[e];                                                        \
                        if (!T##_FACTORED || mode != PANEL_RAW) v[e] = v[e] * s[SIDX(T, j, e / 16)]; \
                        if (HAS_MIN) v[e] = v[e] - mn[SIDX(T, j, e / 16)];                         \
                    }                                                                              \
                    if (mode == PANEL_BF16)                                                        \
                        for (int e = 0; e < 32; e++) ((uint16_t *)out)[at + e] = bf16_rne(v[e]);   \
                    else                                                                           \
                        memcpy((float *)out + at, v, sizeof v);                                    \
                    if (T##_FACTORED && mode == PANEL_RAW)                                         \
                        sb[i * BLK_SUB + b * (T##_QK / 32) + j] = s[SIDX(T, j, 0)];                \
                }                                                                                  \
            }                                                                                      \
    }

/* One row of W by one row of x over a panel's values (the accumulator in acc between panels);
 * FACTORED types scale each sub-block's sum. */
static inline void mk_scalar(const float *wf, const float *sf, int fact, const float *xr, int64_t kc, float *acc,
                             int first, int last, float *y) {
    float a = first ? 0.0f : *acc;
    for (int64_t j = 0; j < kc; j += 32) {
        float p = 0.0f;
        for (int e = 0; e < 32; e++) p += wf[j + e] * xr[j + e];
        if (fact) a += sf[j / 32] * p;
        else a += p;
    }
    if (last) *y = a;
    else *acc = a;
}

#define SCALAR_TILES(NT)                                                                            \
    for (int t = 0; t < rt; t++)                                                                   \
        for (int i = i0; i < i0 + (NT); i++)                                                       \
            mk_scalar(wb + i * BLK_KC, sb + i * BLK_SUB, fact, xt + t * k, kc, at + (t * BLK_NP + i) * 16, \
                      first, last, yt + t * n_out + i)

static void blocked_scalar(panel_fn panel, int fact, int64_t qk, int64_t bytes, const uint8_t *w, int64_t n0,
                           int64_t n1, int64_t n_out, int64_t k, const float *x, int64_t m, float *y,
                           float *scratch) {
    BLOCKED_LOOPS(BLK_NP, 1, SCALAR_TILES);
}

#define DEFINE_SCALAR(T, NAME_LC, HAS_MIN)                                                          \
    DEFINE_PANEL_SCALAR(T, NAME_LC, HAS_MIN)                                                        \
    static void NAME_LC##_scalar(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k, \
                                 const float *x, int64_t m, float *y, float *scratch) {             \
        blocked_scalar(panel_##NAME_LC##_scalar, T##_FACTORED, T##_QK, T##_BYTES, w, n0, n1, n_out, k, x, \
                       m, y, scratch);                                                             \
    }

/* ---- vector paths --------------------------------------------------------------------------
 * 16 (AVX-512) or 8 (AVX2) lanes: a sub-block's weights are made once for a tile of W rows and
 * used by every row of x in the tile; each (x row, W row) pair has one vector accumulator,
 * summed across its lanes at the end. */

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

/* ---- few rows: per-row tiles ----------------------------------------------------------------
 * Weights of sub-block j for NT rows of W, exactly ggml's values (a product, then a
 * difference), then for each of RT rows of x: acc[i][t] += w[i] . x[t] over the 32 values
 * (lane-wise: products of the first halves, fused with those of the second, then added). */
#define DEFINE_TILE512(T, NAME_LC, HAS_MIN)                                                          \
    __attribute__((target(AVX512_TARGET))) INLINE void tile_##NAME_LC##_avx512(                      \
        const uint8_t *row, int64_t rb, int NT, int64_t nb, const float *x, int64_t k, int RT,       \
        float *out, int64_t ldo) {                                                                  \
        __m512 acc[4][4];                                                                           \
        float s[4][16], mn[4][16];                                                                  \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) acc[i][t] = _mm512_setzero_ps();                           \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            PREFETCH_BLOCKS(T, row, rb, NT, b, nb);                                                 \
            for (int i = 0; i < NT; i++) scales_##NAME_LC##_v(row + i * rb + b * T##_BYTES, s[i], mn[i]); \
            _Pragma("GCC unroll 8") for (int j = 0; j < T##_QK / 32; j++) {                         \
                __m512 w0[4], w1[4], sv[4];                                                         \
                for (int i = 0; i < NT; i++) {                                                      \
                    const __m256i q = qv_##NAME_LC(row + i * rb + b * T##_BYTES, j);                 \
                    w0[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));    \
                    w1[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))); \
                    sv[i] = _mm512_set1_ps(s[i][SIDX(T, j, 0)]);                                    \
                    if (!T##_FACTORED) {                                                            \
                        w0[i] = _mm512_mul_ps(w0[i], sv[i]);                                        \
                        w1[i] = _mm512_mul_ps(w1[i], _mm512_set1_ps(s[i][SIDX(T, j, 1)]));          \
                    }                                                                               \
                    if (HAS_MIN) {                                                                  \
                        w0[i] = _mm512_sub_ps(w0[i], _mm512_set1_ps(mn[i][SIDX(T, j, 0)]));         \
                        w1[i] = _mm512_sub_ps(w1[i], _mm512_set1_ps(mn[i][SIDX(T, j, 1)]));         \
                    }                                                                               \
                }                                                                                   \
                for (int t = 0; t < RT; t++) {                                                      \
                    const float *xb = x + t * k + b * T##_QK + 32 * j;                              \
                    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);           \
                    for (int i = 0; i < NT; i++)                                                    \
                        acc[i][t] = T##_FACTORED                                                    \
                                        ? _mm512_fmadd_ps(_mm512_fmadd_ps(w1[i], x1, _mm512_mul_ps(w0[i], x0)), sv[i], acc[i][t]) \
                                        : _mm512_add_ps(acc[i][t], _mm512_fmadd_ps(w1[i], x1, _mm512_mul_ps(w0[i], x0))); \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) out[t * ldo + i] = _mm512_reduce_add_ps(acc[i][t]);        \
    }

/* The weights of one row's sub-block as four 8-lane vectors (values 0-7, 8-15, 16-23, 24-31):
 * what the AVX2 tiles multiply, and what the panels hold for both vector paths. */
#define DECODE256(T, NAME_LC, HAS_MIN, BLK, J, S, MN, W)                                             \
    do {                                                                                           \
        const __m256i q_ = qv_##NAME_LC(BLK, J);                                                   \
        const __m128i lo_ = _mm256_castsi256_si128(q_), hi_ = _mm256_extracti128_si256(q_, 1);     \
        W[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo_));                                      \
        W[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo_, 8)));                   \
        W[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi_));                                      \
        W[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi_, 8)));                   \
        if (!T##_FACTORED) {                                                                       \
            const __m256 s0_ = _mm256_set1_ps((S)[SIDX(T, J, 0)]), s1_ = _mm256_set1_ps((S)[SIDX(T, J, 1)]); \
            W[0] = _mm256_mul_ps(W[0], s0_);                                                       \
            W[1] = _mm256_mul_ps(W[1], s0_);                                                       \
            W[2] = _mm256_mul_ps(W[2], s1_);                                                       \
            W[3] = _mm256_mul_ps(W[3], s1_);                                                       \
        }                                                                                          \
        if (HAS_MIN) {                                                                             \
            const __m256 m0_ = _mm256_set1_ps((MN)[SIDX(T, J, 0)]), m1_ = _mm256_set1_ps((MN)[SIDX(T, J, 1)]); \
            W[0] = _mm256_sub_ps(W[0], m0_);                                                       \
            W[1] = _mm256_sub_ps(W[1], m0_);                                                       \
            W[2] = _mm256_sub_ps(W[2], m1_);                                                       \
            W[3] = _mm256_sub_ps(W[3], m1_);                                                       \
        }                                                                                          \
    } while (0)

/* The same with 8 lanes: a sub-block is four vectors; per row, (w0 x0 + w1 x1) + (w2 x2 + w3 x3). */
#define DEFINE_TILE256(T, NAME_LC, HAS_MIN)                                                          \
    __attribute__((target(AVX2_TARGET))) INLINE void tile_##NAME_LC##_avx2(                          \
        const uint8_t *row, int64_t rb, int NT, int64_t nb, const float *x, int64_t k, int RT,       \
        float *out, int64_t ldo) {                                                                  \
        __m256 acc[4][4];                                                                           \
        float s[4][16], mn[4][16];                                                                  \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) acc[i][t] = _mm256_setzero_ps();                           \
        for (int64_t b = 0; b < nb; b++) {                                                          \
            PREFETCH_BLOCKS(T, row, rb, NT, b, nb);                                                 \
            for (int i = 0; i < NT; i++) scales_##NAME_LC##_v(row + i * rb + b * T##_BYTES, s[i], mn[i]); \
            _Pragma("GCC unroll 8") for (int j = 0; j < T##_QK / 32; j++) {                         \
                __m256 w[4][4], sv[4];                                                              \
                for (int i = 0; i < NT; i++) {                                                      \
                    DECODE256(T, NAME_LC, HAS_MIN, row + i * rb + b * T##_BYTES, j, s[i], mn[i], w[i]); \
                    sv[i] = _mm256_set1_ps(s[i][SIDX(T, j, 0)]);                                    \
                }                                                                                   \
                for (int t = 0; t < RT; t++) {                                                      \
                    const float *xb = x + t * k + b * T##_QK + 32 * j;                              \
                    for (int i = 0; i < NT; i++) {                                                  \
                        const __m256 p = _mm256_fmadd_ps(w[i][1], _mm256_loadu_ps(xb + 8),          \
                                                         _mm256_mul_ps(w[i][0], _mm256_loadu_ps(xb))); \
                        const __m256 r = _mm256_fmadd_ps(w[i][3], _mm256_loadu_ps(xb + 24),         \
                                                         _mm256_mul_ps(w[i][2], _mm256_loadu_ps(xb + 16))); \
                        acc[i][t] = T##_FACTORED ? _mm256_fmadd_ps(_mm256_add_ps(p, r), sv[i], acc[i][t]) \
                                                 : _mm256_add_ps(acc[i][t], _mm256_add_ps(p, r));   \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < NT; i++)                                                                \
            for (int t = 0; t < RT; t++) out[t * ldo + i] = hsum256(acc[i][t]);                     \
    }

/* The per-row driver over output columns [n0, n1): tiles of NT_MAX rows of W (then single rows)
 * by 4 rows of x (then 2, 1). */
#define ROW_TILES(NAME_LC, LVL, NT)                                                                  \
    do {                                                                                           \
        const uint8_t *row = w + n * rb;                                                           \
        int64_t r = 0;                                                                             \
        for (; r + 4 <= m; r += 4) tile_##NAME_LC##_##LVL(row, rb, NT, nb, x + r * k, k, 4, y + r * n_out + n, n_out); \
        if (r + 2 <= m) {                                                                          \
            tile_##NAME_LC##_##LVL(row, rb, NT, nb, x + r * k, k, 2, y + r * n_out + n, n_out);    \
            r += 2;                                                                                \
        }                                                                                          \
        if (r < m) tile_##NAME_LC##_##LVL(row, rb, NT, nb, x + r * k, k, 1, y + r * n_out + n, n_out); \
    } while (0)

/* ---- many rows on the vector paths: panels (see "many rows" above) -------------------------
 * Both vector paths share one panel decoder per type (8-lane, the AVX2 tiles' DECODE256: the
 * same lane-wise operations as the 16-lane tile, so the same floats). Each panel row's next
 * values are prefetched while it is decoded: they are needed one panel later. */
/* 8 floats to bfloat16, as bf16_rne. */
__attribute__((target(AVX2_TARGET))) INLINE __m128i bf16x8(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

#define DEFINE_PANEL(T, NAME_LC, HAS_MIN)                                                           \
    __attribute__((target(AVX2_TARGET))) static void panel_##NAME_LC##_avx2(                        \
        const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk, void *out, int64_t ldw, float *sb, \
        int mode) {                                                                                \
        for (int i = 0; i < np; i++) {                                                             \
            const uint8_t *ri = row + i * rb + b0 * T##_BYTES;                                     \
            for (int64_t o = 0; o < nbk * T##_BYTES; o += 64) __builtin_prefetch(ri + nbk * T##_BYTES + o); \
            for (int64_t b = 0; b < nbk; b++) {                                                    \
                const uint8_t *blk = ri + b * T##_BYTES;                                           \
                float s[16], mn[16];                                                               \
                scales_##NAME_LC##_v(blk, s, mn);                                                  \
                _Pragma("GCC unroll 8") for (int j = 0; j < T##_QK / 32; j++) {                    \
                    const int64_t at = i * ldw + b * T##_QK + 32 * j;                              \
                    __m256 wv[4];                                                                  \
                    DECODE256(T, NAME_LC, HAS_MIN, blk, j, s, mn, wv);                             \
                    if (T##_FACTORED && mode != PANEL_RAW)                                         \
                        for (int l = 0; l < 4; l++) wv[l] = _mm256_mul_ps(wv[l], _mm256_set1_ps(s[SIDX(T, j, 0)])); \
                    if (mode == PANEL_BF16)                                                        \
                        for (int l = 0; l < 4; l++) _mm_storeu_si128((__m128i *)((uint16_t *)out + at + 8 * l), bf16x8(wv[l])); \
                    else                                                                           \
                        for (int l = 0; l < 4; l++) _mm256_storeu_ps((float *)out + at + 8 * l, wv[l]); \
                    if (T##_FACTORED && mode == PANEL_RAW)                                         \
                        sb[i * BLK_SUB + b * (T##_QK / 32) + j] = s[SIDX(T, j, 0)];                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* NT rows of a panel by RT rows of x: the per-row tiles' operations, the weights loaded from the
 * panel instead of decoded. */
__attribute__((target(AVX512_TARGET))) INLINE void mk512(const float *wb, const float *sb, int NT, const float *x,
                                                         int64_t k, int RT, int64_t nsub, int FACT, float *acc,
                                                         int first, int last, float *y, int64_t n_out) {
    __m512 a[4][4];
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++)
            a[i][t] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (t * BLK_NP + i) * 16);
    for (int64_t j = 0; j < nsub; j++) {
        __m512 w0[4], w1[4];
        for (int i = 0; i < NT; i++) {
            w0[i] = _mm512_load_ps(wb + i * BLK_KC + 32 * j);
            w1[i] = _mm512_load_ps(wb + i * BLK_KC + 32 * j + 16);
        }
        for (int t = 0; t < RT; t++) {
            const __m512 x0 = _mm512_loadu_ps(x + t * k + 32 * j), x1 = _mm512_loadu_ps(x + t * k + 32 * j + 16);
            for (int i = 0; i < NT; i++) {
                const __m512 p = _mm512_fmadd_ps(w1[i], x1, _mm512_mul_ps(w0[i], x0));
                a[i][t] = FACT ? _mm512_fmadd_ps(p, _mm512_set1_ps(sb[i * BLK_SUB + j]), a[i][t])
                               : _mm512_add_ps(a[i][t], p);
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++) {
            if (last) y[t * n_out + i] = _mm512_reduce_add_ps(a[i][t]);
            else _mm512_store_ps(acc + (t * BLK_NP + i) * 16, a[i][t]);
        }
}

__attribute__((target(AVX2_TARGET))) INLINE void mk256(const float *wb, const float *sb, int NT, const float *x,
                                                       int64_t k, int RT, int64_t nsub, int FACT, float *acc,
                                                       int first, int last, float *y, int64_t n_out) {
    __m256 a[2][4];
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++)
            a[i][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + (t * BLK_NP + i) * 16);
    for (int64_t j = 0; j < nsub; j++)
        for (int t = 0; t < RT; t++) {
            const float *xb = x + t * k + 32 * j;
            const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
            const __m256 x2 = _mm256_loadu_ps(xb + 16), x3 = _mm256_loadu_ps(xb + 24);
            for (int i = 0; i < NT; i++) {
                const float *wf = wb + i * BLK_KC + 32 * j;
                const __m256 p = _mm256_fmadd_ps(_mm256_load_ps(wf + 8), x1, _mm256_mul_ps(_mm256_load_ps(wf), x0));
                const __m256 r = _mm256_fmadd_ps(_mm256_load_ps(wf + 24), x3, _mm256_mul_ps(_mm256_load_ps(wf + 16), x2));
                a[i][t] = FACT ? _mm256_fmadd_ps(_mm256_add_ps(p, r), _mm256_set1_ps(sb[i * BLK_SUB + j]), a[i][t])
                               : _mm256_add_ps(a[i][t], _mm256_add_ps(p, r));
            }
        }
    for (int i = 0; i < NT; i++)
        for (int t = 0; t < RT; t++) {
            if (last) y[t * n_out + i] = hsum256(a[i][t]);
            else _mm256_store_ps(acc + (t * BLK_NP + i) * 16, a[i][t]);
        }
}

/* Tile shapes: AVX-512's 32 registers hold 4 x 4 accumulators and 4 rows' weights; AVX2's 16
 * hold 2 x 4 accumulators and one row of x (the weights are memory operands). */
#define MK_CALL(MK, NT, RT, FACT)                                                                   \
    MK(wb + i0 * BLK_KC, sb + i0 * BLK_SUB, NT, xt, k, RT, kc / 32, FACT, at + i0 * 16, first, last, yt + i0, n_out)
#define MK_TILES(MK, NT, FACT)                                                                      \
    switch (rt) {                                                                                  \
    case 4: MK_CALL(MK, NT, 4, FACT); break;                                                       \
    case 3: MK_CALL(MK, NT, 3, FACT); break;                                                       \
    case 2: MK_CALL(MK, NT, 2, FACT); break;                                                       \
    default: MK_CALL(MK, NT, 1, FACT); break;                                                      \
    }
#define TILES512_0(NT) MK_TILES(mk512, NT, 0)
#define TILES512_1(NT) MK_TILES(mk512, NT, 1)
#define TILES256_0(NT) MK_TILES(mk256, NT, 0)
#define TILES256_1(NT) MK_TILES(mk256, NT, 1)

#define DEFINE_BLOCKED(LVL, TARGET, NT_MAX, FACT, TILES)                                            \
    __attribute__((target(TARGET))) static void blocked_##LVL##_##FACT(                             \
        panel_fn panel, int64_t qk, int64_t bytes, const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, \
        int64_t k, const float *x, int64_t m, float *y, float *scratch) {                          \
        BLOCKED_LOOPS(NT_MAX, 4, TILES);                                                           \
    }
DEFINE_BLOCKED(avx512, AVX512_TARGET, 4, 0, TILES512_0)
DEFINE_BLOCKED(avx512, AVX512_TARGET, 4, 1, TILES512_1)
DEFINE_BLOCKED(avx2, AVX2_TARGET, 2, 0, TILES256_0)
DEFINE_BLOCKED(avx2, AVX2_TARGET, 2, 1, TILES256_1)

/* A type's entry point on a vector path: panels for many rows (the caller passes scratch then),
 * per-row tiles for few. */
#define DEFINE_DRIVER(T, NAME_LC, LVL, TARGET, NT_MAX)                                               \
    __attribute__((target(TARGET))) static void NAME_LC##_##LVL(const uint8_t *w, int64_t n0, int64_t n1, \
                                                                int64_t n_out, int64_t k, const float *x, \
                                                                int64_t m, float *y, float *scratch) { \
        const int64_t nb = k / T##_QK, rb = nb * T##_BYTES;                                          \
        if (scratch != NULL) {                                                                       \
            (T##_FACTORED ? blocked_##LVL##_1 : blocked_##LVL##_0)(panel_##NAME_LC##_avx2, T##_QK, T##_BYTES, \
                                                                   w, n0, n1, n_out, k, x, m, y, scratch); \
            return;                                                                                  \
        }                                                                                            \
        int64_t n = n0;                                                                              \
        if (NT_MAX > 1 && m >= 4)                                                                    \
            for (; n + NT_MAX <= n1; n += NT_MAX) ROW_TILES(NAME_LC, LVL, NT_MAX);                   \
        for (; n < n1; n++) ROW_TILES(NAME_LC, LVL, 1);                                              \
    }

/* W rows per per-row tile: AVX-512 has 32 registers, room for 4 x 4 accumulators and 4 rows'
 * weights; AVX2's 16 hold one row's four weight vectors and four accumulators. */
#define DEFINE_TYPE(T, NAME_LC, HAS_MIN)                                                             \
    DEFINE_SCALAR(T, NAME_LC, HAS_MIN)                                                               \
    DEFINE_TILE512(T, NAME_LC, HAS_MIN)                                                              \
    DEFINE_TILE256(T, NAME_LC, HAS_MIN)                                                              \
    DEFINE_PANEL(T, NAME_LC, HAS_MIN)                                                                \
    DEFINE_DRIVER(T, NAME_LC, avx512, AVX512_TARGET, 4)                                              \
    DEFINE_DRIVER(T, NAME_LC, avx2, AVX2_TARGET, 1)
#define KERNELS(NAME_LC) {NAME_LC##_scalar, NAME_LC##_avx2, NAME_LC##_avx512}
#define PANELS(NAME_LC) {panel_##NAME_LC##_scalar, panel_##NAME_LC##_avx2}

#else /* not x86: the scalar path only */
#define DEFINE_TYPE(T, NAME_LC, HAS_MIN) DEFINE_SCALAR(T, NAME_LC, HAS_MIN)
#define KERNELS(NAME_LC) {NAME_LC##_scalar, NAME_LC##_scalar, NAME_LC##_scalar}
#define PANELS(NAME_LC) {panel_##NAME_LC##_scalar, panel_##NAME_LC##_scalar}
#endif

DEFINE_TYPE(Q8_0, q8_0, 0)
DEFINE_TYPE(Q4_K, q4_k, 1)
DEFINE_TYPE(Q5_K, q5_k, 1)
DEFINE_TYPE(Q6_K, q6_k, 0)
DEFINE_TYPE(Q2_K, q2_k, 1)
DEFINE_TYPE(Q3_K, q3_k, 0)
DEFINE_TYPE(IQ2_XXS, iq2_xxs, 0)
DEFINE_TYPE(IQ2_XS, iq2_xs, 0)
DEFINE_TYPE(IQ3_XXS, iq3_xxs, 0)
DEFINE_TYPE(IQ1_S, iq1_s, 0)
DEFINE_TYPE(IQ1_M, iq1_m, 0)
DEFINE_TYPE(MXFP4, mxfp4, 0)

/* ==== int8 activations: ggml's own arithmetic (the "ggml" mode) ================================
 * ggml's CPU backend does not multiply quantized weights by float activations: it first rounds
 * each row of x to 8-bit blocks (Q8_0, 32 values and an f16 scale, for Q8_0 and MXFP4 weights;
 * Q8_K, 256 values and a float scale, for the K-quants and IQ types) and then takes integer dot
 * products of the weights' integer values with those bytes, scaling each block's integer sum.
 * Integer products run ~4x the float32 FMA rate (AVX512-VNNI vpdpbusd: 64 byte products per
 * instruction), which is what makes llama.cpp's prefill fast; and reproducing the rounding of x
 * is what brings k3kit's logits to llama.cpp's. This section does the same, with its own exact
 * contract (tests/kernels/test_qmatmul_int8.py):
 *
 * - quantize_q8_0 / quantize_q8_k give ggml's bytes bit for bit: quantize_row_q8_0_ref (variant
 *   0, round half away from zero, id = 1 / d) or ggml-cpu's x86 quantize_row_q8_0 (variant 1,
 *   what llama.cpp runs on an AVX CPU: id = 127 / amax, round half to even), and
 *   quantize_row_q8_K_ref (which ggml-cpu's x86 build also runs).
 * - A product is laid out in lanes: lane = one scale's run of values (G = 32, or 16 for the
 *   types with a scale per 16 values), 16 lanes a group. Per (row of x, row of W) pair and lane:
 *   S = the exact integer dot product of W's integer values q (as the float decoders unpack them)
 *   with x's bytes; then f = fl(S * ws) with ws the lane's float weight scale (exactly the scale
 *   the float decoders multiply q by), acc = fma(f, dx, acc) with dx the lane's activation scale,
 *   and for the types with a min, acc = fma(-mn, fl(dx * X), acc) with X the lane's byte sum.
 *   Groups in order; at the end the 16 lane accumulators are summed in a fixed tree
 *   (i + 8, then + 4, + 2, + 1). Every path (scalar, AVX2, AVX512-VNNI) does exactly these float
 *   operations, so the paths give the same bits, and a pair's result depends on nothing else:
 *   not the number of rows, not the thread count. It agrees with the float64 product of the
 *   dequantized W and the dequantized q8 activations to the float32 rounding bound.
 * - The vector paths keep W in panels (as the float path's many-row driver) whose bytes are
 *   transposed so that one 64-byte vector holds 4 consecutive values of each of 16 lanes: 8 (or
 *   4) vpdpbusd make a group's 16 integer sums with no horizontal adds, and the float work is 3-4
 *   operations per group per pair. x is laid out the same way once per call. VNNI multiplies
 *   unsigned by signed bytes, so the VNNI panels hold q + 128 and each integer sum starts at
 *   -128 X; AVX2's maddubs would saturate on that, so it multiplies |q| by x carrying q's sign.
 */

#define I8_LANES 16
/* Direct paths, more rows than one pass takes: bytes of W rows that every pass of x rows covers
 * before the next W rows (the later passes read the chunk from L2 instead of from memory). */
#define I8_CHUNK_BYTES (256 << 10)
#define I8_KC 2048                       /* panel values per W row: a multiple of 512 */
#define I8_NP 32                         /* W rows per panel */
#define I8_MB 64                         /* x rows whose accumulators are kept at once */
#define I8_GMAX (I8_KC / 256)            /* groups per panel row at most (G = 16: 256 values) */
#define I8_SCRATCH_BYTES ((int64_t)I8_NP * I8_KC + (int64_t)I8_NP * I8_GMAX * I8_LANES * 8 + \
                          (int64_t)I8_NP * I8_MB * I8_LANES * 4 + 64)

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

#define Q8_K_BYTES 292   /* float d, int8 qs[256], int16 bsums[16] */

#ifdef K3_X86
static int q8_avx512 = 0;   /* set at import where AVX512-BW runs */
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

static void quantize_q8_0_row(const float *x, int64_t k, uint8_t *out, int variant) {
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

static void quantize_q8_k_any(const float *x, int64_t k, uint8_t *out) {
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

/* x laid out for the products: per row, ngroups groups of 16 G bytes (transposed: byte
 * c * 64 + 4 p + e of a group is value 4 c + e of lane p), per lane dx, fl(dx * X) and -128 X. */
typedef struct {
    int8_t *q, *xn;        /* transposed (panels, and the source of qt; else NULL) and natural order
                              (direct paths), same row stride */
    float *dx, *dxs;
    int32_t *corr;
    int64_t ngroups, gv;   /* groups per row, values per group */
    /* The transposed direct path's copy (NULL unless it runs): q, dx, dxs, corr with lane p at
     * XT_POS32[p] (G = 32) or XT_POS16[p] (G = 16), the order its in-register transpose of W's
     * group leaves the lanes in. */
    int8_t *qt;
    float *dxt, *dxst;
    int32_t *corrt;
} xlane_t;

/* Where the in-register transpose of a decoded group (the transposed direct path) puts lane p. */
static const int XT_POS32[16] = {0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15};
static const int XT_POS16[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

/* Quantize row r of x as the weight type's activation type wants and lay it out. */
static void prepare_x_row(const float *x, int64_t k, int act_q8k, int variant, int G, uint8_t *qbuf,
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

/* An int8 panel: np rows of W, values c0 .. c0 + kc - 1, as transposed bytes (q, or q + 128
 * with u8 set) at wq (row stride I8_KC), and per lane ws and mn (row stride I8_GMAX * 16). */
typedef void (*i8panel_fn)(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t kc, uint8_t *wq,
                           float *ws, float *wmn, int u8);

/* Lane of sub-block u's half h within its group (u counted from the group's start). */
static inline int lane_of(int G, int u, int h) { return G == 32 ? u : u + 8 * h; }

#define I8_G(T) (T##_PER16 ? 16 : 32)

#define DEFINE_I8PANEL_SCALAR(T, NAME_LC)                                                           \
    static void i8panel_##NAME_LC##_scalar(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t kc, \
                                           uint8_t *wq, float *ws, float *wmn, int u8) {            \
        const int G = I8_G(T), spg = 16 * G / 32;   /* sub-blocks per group */                      \
        const int64_t nsub = kc / 32, ng = (kc + 16 * G - 1) / (16 * G);                           \
        for (int i = 0; i < np; i++) {                                                             \
            uint8_t *qo = wq + (int64_t)i * I8_KC;                                                 \
            float *so = ws + (int64_t)i * I8_GMAX * 16, *mo = wmn + (int64_t)i * I8_GMAX * 16;     \
            memset(qo, u8 ? 0x80 : 0, (size_t)(ng * 16 * G));                                     \
            memset(so, 0, (size_t)ng * 16 * sizeof(float));                                        \
            memset(mo, 0, (size_t)ng * 16 * sizeof(float));                                        \
            float s[16], mn[16] = {0};                                                                     \
            for (int64_t u = 0; u < nsub; u++) {                                                   \
                const uint8_t *blk = row + i * rb + (b0 + u / (T##_QK / 32)) * T##_BYTES;          \
                const int j = (int)(u % (T##_QK / 32));                                            \
                if (j == 0) scales_##NAME_LC(blk, s, mn);                                          \
                uint64_t qw[4];                                                                    \
                int8_t qv[32];                                                                     \
                q_##NAME_LC(blk, j, qw);                                                           \
                memcpy(qv, qw, 32);                                                                \
                const int64_t g = u / spg;                                                         \
                const int ug = (int)(u % spg);                                                     \
                for (int h = 0; h < 32 / G; h++) {                                                 \
                    const int p = lane_of(G, ug, h);                                               \
                    so[g * 16 + p] = s[SIDX(T, j, h)];                                             \
                    mo[g * 16 + p] = mn[SIDX(T, j, h)];                                            \
                    for (int c = 0; c < G / 4; c++)                                                \
                        for (int e = 0; e < 4; e++)                                                \
                            qo[g * 16 * G + 64 * c + 4 * p + e] = (uint8_t)(qv[G * h + 4 * c + e] ^ (u8 ? 0x80 : 0)); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* The float part of a group for one pair: 16 lanes of S into the accumulators. */
static inline void i8_lanes_scalar(const int32_t *S, const float *ws, const float *wmn, const float *dx,
                                   const float *dxs, int has_min, float *acc) {
    for (int p = 0; p < 16; p++) {
        const float f = (float)S[p] * ws[p];
        acc[p] = fmaf(f, dx[p], acc[p]);
        if (has_min) acc[p] = fmaf(-wmn[p], dxs[p], acc[p]);
    }
}

static inline float i8_reduce_scalar(const float *a) {
    float h8[8], h4[4], h2[2];
    for (int i = 0; i < 8; i++) h8[i] = a[i] + a[i + 8];
    for (int i = 0; i < 4; i++) h4[i] = h8[i] + h8[i + 4];
    for (int i = 0; i < 2; i++) h2[i] = h4[i] + h4[i + 2];
    return h2[0] + h2[1];
}

/* The int8 driver's arguments: everything but the column range. */
typedef struct i8job i8job_t;
typedef void (*i8direct_fn)(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0, int m);
struct i8job {
    const uint8_t *w;
    i8panel_fn panel;
    int64_t qk, bytes, n_out, k, m;
    int G, has_min, level;
    const xlane_t *xl;
    float *y;
    i8direct_fn direct;    /* non-NULL: run the direct path */
    int64_t nchunk;        /* direct path: W rows that every pass of x rows covers before the next */
};

typedef void (*i8tiles_fn)(const i8job_t *j, const uint8_t *wq, const float *ws, const float *wmn, int np,
                           int64_t g0, int64_t ng, int64_t r0, int mb, float *acc, int first, int last,
                           int64_t p0);

/* Scalar tiles: every pair of the panel's rows and the block's x rows. */
static void i8tiles_scalar(const i8job_t *jb, const uint8_t *wq, const float *ws, const float *wmn, int np,
                           int64_t g0, int64_t ng, int64_t r0, int mb, float *acc, int first, int last,
                           int64_t p0) {
    const xlane_t *xl = jb->xl;
    const int64_t gv = xl->gv;
    for (int t = 0; t < mb; t++) {
        const int64_t r = r0 + t;
        for (int i = 0; i < np; i++) {
            float *a = acc + ((int64_t)t * I8_NP + i) * 16;
            if (first) memset(a, 0, 16 * sizeof(float));
            for (int64_t g = 0; g < ng; g++) {
                const int8_t *xq = xl->q + (r * xl->ngroups + g0 + g) * gv;
                const int8_t *wv = (const int8_t *)wq + (int64_t)i * I8_KC + g * gv;
                int32_t S[16];
                for (int p = 0; p < 16; p++) {
                    int s = 0;
                    for (int c = 0; c < jb->G / 4; c++)
                        for (int e = 0; e < 4; e++) s += wv[64 * c + 4 * p + e] * xq[64 * c + 4 * p + e];
                    S[p] = s;
                }
                const int64_t lx = (r * xl->ngroups + g0 + g) * 16;
                i8_lanes_scalar(S, ws + (int64_t)i * I8_GMAX * 16 + g * 16, wmn + (int64_t)i * I8_GMAX * 16 + g * 16,
                                xl->dx + lx, xl->dxs + lx, jb->has_min, a);
            }
            if (last) jb->y[r * jb->n_out + p0 + i] = i8_reduce_scalar(a);
        }
    }
}

#ifdef K3_X86
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,bmi2"

/* 8 x 8 transpose of 32-bit elements. */
__attribute__((target(AVX2_TARGET))) INLINE void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

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
    __attribute__((target(AVX2_TARGET))) static void i8panel_##NAME_LC##_avx2(                     \
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

/* Reduce 16 lanes (two 8-lane halves) as i8_reduce_scalar. */
__attribute__((target(AVX2_TARGET))) INLINE float i8_reduce256(__m256 lo, __m256 hi) {
    const __m256 h8 = _mm256_add_ps(lo, hi);
    const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_movehdup_ps(h2)));
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

__attribute__((target(VNNI_TARGET))) static void i8tiles_vnni(const i8job_t *jb, const uint8_t *wq, const float *ws,
                                                            const float *wmn, int np, int64_t g0, int64_t ng,
                                                            int64_t r0, int mb, float *acc, int first, int last,
                                                            int64_t p0) {
    I8_TILES(i8mk_vnni, 4, 4)
}
__attribute__((target(AVX2_TARGET))) static void i8tiles_avx2(const i8job_t *jb, const uint8_t *wq, const float *ws,
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
 * and the 512-bit one after the type definitions ("fast direct path", what AVX512-VNNI runs),
 * about 1.5-3x faster for one row. */
#define I8_DIRECT_ROWS 8    /* x rows per pass over W on the direct path */
/* How far ahead in W's row the direct path asks for blocks: one row streams at a time, so
 * further than the tiles' PREFETCH_BYTES (measured: 768 -> 2048 bytes took a one-row Q4_K
 * 7168 x 2048 product from 1.29 to 0.88 ms; 4096 no better). */
#ifndef I8_PREFETCH
#define I8_PREFETCH 2048
#endif

/* 16 (G = 32) or 8 (G = 16) vectors of 8 partial sums -> the group's 16 lane sums in lo | hi. */
__attribute__((target(AVX2_TARGET))) INLINE void fold_lanes(const __m256i *p, int G, __m256i *lo, __m256i *hi) {
    if (G == 32) {
        __m256i a[8], b[4];
        for (int i = 0; i < 8; i++) a[i] = _mm256_hadd_epi32(p[2 * i], p[2 * i + 1]);
        for (int i = 0; i < 4; i++) b[i] = _mm256_hadd_epi32(a[2 * i], a[2 * i + 1]);
        /* b[i] = [4i .. 4i+3 first halves | their second halves] of sub-blocks 4i .. 4i + 3 */
        const __m256i s0 = _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20),
                                            _mm256_permute2x128_si256(b[0], b[1], 0x31));
        const __m256i s1 = _mm256_add_epi32(_mm256_permute2x128_si256(b[2], b[3], 0x20),
                                            _mm256_permute2x128_si256(b[2], b[3], 0x31));
        *lo = s0;
        *hi = s1;
    } else {
        __m256i a[4], b[2];
        for (int i = 0; i < 4; i++) a[i] = _mm256_hadd_epi32(p[2 * i], p[2 * i + 1]);
        for (int i = 0; i < 2; i++) b[i] = _mm256_hadd_epi32(a[2 * i], a[2 * i + 1]);
        *lo = _mm256_permute2x128_si256(b[0], b[1], 0x20);   /* first halves of sub-blocks 0-7 */
        *hi = _mm256_permute2x128_si256(b[0], b[1], 0x31);   /* second halves */
    }
}

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
    __attribute__((target(TARGET))) static void i8direct_##NAME_LC##_##LVL(const i8job_t *jb, int64_t n0, int64_t n1, \
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
    DEFINE_I8PANEL_SCALAR(T, NAME_LC) DEFINE_I8PANEL_VEC(T, NAME_LC)                                 \
    DEFINE_I8DIRECT(T, NAME_LC, avx2, AVX2_TARGET, 0) DEFINE_I8DIRECT(T, NAME_LC, vnni, VNNI_TARGET, 1)
#define I8PANELS(NAME_LC) {i8panel_##NAME_LC##_scalar, i8panel_##NAME_LC##_avx2}, \
                          {NULL, i8direct_##NAME_LC##_avx2, i8direct_##NAME_LC##_vnni, i8direct_##NAME_LC##_fast, \
                           i8direct_##NAME_LC##_ft}
#else
#define DEFINE_I8(T, NAME_LC) DEFINE_I8PANEL_SCALAR(T, NAME_LC)
#define I8PANELS(NAME_LC) {i8panel_##NAME_LC##_scalar, i8panel_##NAME_LC##_scalar}, {NULL, NULL, NULL, NULL, NULL}
#endif

/* Columns [n0, n1) of an int8 product: panels of I8_NP rows x I8_KC values, each decoded once
 * and multiplied by every row of x, I8_MB rows at a time. */
static void i8_columns(const i8job_t *jb, int64_t n0, int64_t n1, uint8_t *scratch) {
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

#ifdef K3_X86
/* ---- few rows on AVX2: kernels of their own -------------------------------------------------
 * The 256-bit direct path above is generic: per sub-block |q| . (x with q's sign) (abs, sign,
 * maddubs, madd), the lane sums folded by hadd_epi32, every scale and min stored to memory and
 * reloaded per group. For the types a K3 trunk and its experts are stored in (Q4_K, Q8_0,
 * MXFP4, the IQ1/IQ2/IQ3 expert types, Q2_K and Q3_K, the experts of "Q2" files, and Q5_K and
 * Q6_K, the trunk and LM head of Q4_K_M-style mixes) that is up to 3x the instructions the product needs. These kernels give the same
 * integer sums and the same float steps per lane (so the same bits as every other path) with
 * fewer, for 1 to I8_DIRECT_ROWS rows of x (a block is decoded once for all of them). Q4_K's
 * values are unsigned, so maddubs takes them as they are; MXFP4's table values are looked up as
 * unsigned too (below); the scales and mins stay in registers. For one row (compiled apart, the
 * row count a constant) a block's 8 sub-blocks' 16-bit partial sums fold with 7 hadd_epi16
 * (every partial sum stays below 2^15: at most 16 products of 15 by 127). From 2 rows the 8
 * decoded vectors (8 sub-blocks, or 8 blocks of Q8_0 / MXFP4) are transposed once instead
 * (transpose8: vector c then holds values 4c .. 4c + 3 of each, the panels' lane layout), and
 * each row of x, read from its transposed copy (xl->q), needs one maddubs per vector and adds,
 * no fold: the transpose is paid once for all the rows, the fold was paid per row. */

/* 8 vectors of maddubs results (16 pair sums each, sub-blocks 0-7) -> the 8 sub-blocks' sums. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i fold8_epi16(const __m256i *p) {
    const __m256i a = _mm256_hadd_epi16(p[0], p[1]), b = _mm256_hadd_epi16(p[2], p[3]);
    const __m256i c = _mm256_hadd_epi16(p[4], p[5]), d = _mm256_hadd_epi16(p[6], p[7]);
    /* lane 0: each sub-block's sum over its values 0-15, lane 1: over 16-31 */
    const __m256i e = _mm256_hadd_epi16(_mm256_hadd_epi16(a, b), _mm256_hadd_epi16(c, d));
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(e)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(e, 1)));
}


/* Q4_K and Q5_K (q5: the fifth bit from qh, values 0-31; the scales and mins are Q4_K's): a group
 * (two blocks) is lanes 0-7 (its first block) and 8-15. Q5_K's values are twice as large, so 16
 * products no longer fit 16 bits: one row folds 8 products in 16 bits and widens (madd) before the
 * last step; from 2 rows two vectors' products add in 16 bits before madd. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i fold8_epi16_wide(const __m256i *p) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i a = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])), ones);
    const __m256i b = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7])), ones);
    /* a: sub-blocks 0-3, b: 4-7; lane 0 over values 0-15, lane 1 over 16-31 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}
__attribute__((target(AVX2_TARGET))) INLINE void q4k_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                              int m, int q5) {
    const xlane_t *xl = jb->xl;
    const int bytes = q5 ? Q5_K_BYTES : Q4_K_BYTES, qs0 = q5 ? 48 : 16;
    const int64_t k = jb->k, nb = k / Q4_K_QK, rb = nb * bytes, ng = xl->ngroups, xrow = ng * xl->gv;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * ng * 16, *dxs = xl->dxs + r0 * ng * 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < 2 * ng; b++) {
            const int h = (int)(b & 1);
            const int64_t lx = (b >> 1) * 16 + 8 * h;
            if (b >= nb) {   /* the missing half of a partial last group: zeros, as the other paths */
                for (int t = 0; t < m; t++) {
                    const __m256 a = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(dx + t * ng * 16 + lx), acc[t][h]);
                    acc[t][h] = _mm256_fnmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(dxs + t * ng * 16 + lx), a);
                }
                continue;
            }
            const uint8_t *blk = ri + b * bytes;
            __builtin_prefetch(blk + I8_PREFETCH);
            __builtin_prefetch(blk + I8_PREFETCH + 64);
            if (q5) __builtin_prefetch(blk + I8_PREFETCH + 128);
            __builtin_prefetch(blk + I8_PREFETCH + bytes - 1);
            __m256i v[8];
            for (int i = 0; i < 4; i++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + qs0 + 32 * i));
                v[2 * i] = _mm256_and_si256(q, m4);
                v[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            }
            if (q5) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16)), one8 = _mm256_set1_epi8(1);
                for (int j = 0; j < 8; j++)
                    v[j] = _mm256_or_si256(v[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one8), 4));
            }
            __m256 ws, wm;
            scales_k4_r(blk, &ws, &wm);
            if (m > 1) transpose8(v);   /* v[c]: values 4c .. 4c + 3 of each sub-block, as x's copy in xl->q */
            for (int t = 0; t < m; t++) {
                __m256i s;
                if (m == 1) {
                    const int8_t *xb = xq + t * xrow + b * Q4_K_QK;
                    __m256i p[8];
                    for (int i = 0; i < 8; i++)
                        p[i] = _mm256_maddubs_epi16(v[i], _mm256_loadu_si256((const __m256i *)(xb + 32 * i)));
                    s = q5 ? fold8_epi16_wide(p) : fold8_epi16(p);
                } else if (!q5) {   /* 16 products a 16-bit sum, below 2^15 */
                    const int8_t *xt = xl->q + (r0 + t) * xrow + (b >> 1) * xl->gv + 32 * h;
                    __m256i a16 = _mm256_maddubs_epi16(v[0], _mm256_load_si256((const __m256i *)xt));
                    for (int c = 1; c < 8; c++)
                        a16 = _mm256_add_epi16(a16, _mm256_maddubs_epi16(v[c], _mm256_load_si256((const __m256i *)(xt + 64 * c))));
                    s = _mm256_madd_epi16(a16, ones);
                } else {   /* 4 products of 31 by 128 a 16-bit sum */
                    const int8_t *xt = xl->q + (r0 + t) * xrow + (b >> 1) * xl->gv + 32 * h;
                    s = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2)
                        s = _mm256_add_epi32(s, _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(v[c], _mm256_load_si256((const __m256i *)(xt + 64 * c))),
                                             _mm256_maddubs_epi16(v[c + 1], _mm256_load_si256((const __m256i *)(xt + 64 * c + 64)))),
                            ones));
                }
                const __m256 a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), ws),
                                                 _mm256_loadu_ps(dx + t * ng * 16 + lx), acc[t][h]);
                acc[t][h] = _mm256_fnmadd_ps(wm, _mm256_loadu_ps(dxs + t * ng * 16 + lx), a);
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}

/* Q8_0 and MXFP4 (a scale per 32 values: a group is 16 blocks, lane p block p): one vector of a
 * block's values times x, 8 pair sums of 4 products; fold_lanes makes the group's 16 lane sums.
 * Q8_0's values are signed, so |q| . (x with q's sign) as the generic path; MXFP4's are table
 * values, looked up as KV + 12 (0-24, unsigned: maddubs takes them as they are) and each lane
 * sum corrected by -12 X (X its bytes' sum: from corr = -128 X, exactly). */
#define MX_BIAS 12
/* Block b of a Q8_0 (its 32 values) or MXFP4 (KV + MX_BIAS, values 0-15 | 16-31) row in a
 * vector and its scale in *sc; past the row's nb blocks (a partial last group) zeros, as the other
 * paths. kv: the biased MXFP4 table in both lanes. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i block16_avx2(const uint8_t *ri, int64_t b, int64_t nb, int mx,
                                                               __m256i kv, float *sc) {
    if (b >= nb) {
        *sc = 0.0f;
        return _mm256_setzero_si256();
    }
    const uint8_t *blk = ri + b * (mx ? MXFP4_BYTES : Q8_0_BYTES);
    __builtin_prefetch(blk + I8_PREFETCH);
    if (mx) {
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(blk + 1)));
        const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                             _mm256_set1_epi8(0x0F));
        *sc = E8M0_HALF[blk[0]];
        return _mm256_shuffle_epi8(kv, nib);
    }
    *sc = f16v(rd16(blk));
    return _mm256_loadu_si256((const __m256i *)(blk + 2));
}
__attribute__((target(AVX2_TARGET))) INLINE void row16_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                           int m, int mx) {
    const xlane_t *xl = jb->xl;
    const int64_t bytes = mx ? MXFP4_BYTES : Q8_0_BYTES, nb = jb->k / 32, rb = nb * bytes, ng = xl->ngroups;
    const int64_t xrow = ng * xl->gv;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * ng * 16;
    const int32_t *corr = xl->corr + r0 * ng * 16;
    const __m256i ones = _mm256_set1_epi16(1);
    int8_t kvb[16];
    for (int i = 0; i < 16; i++) kvb[i] = (int8_t)(KV[i] + MX_BIAS);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvb));
    __m256 acc[I8_DIRECT_ROWS][2];
    __m256i p[16];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng && m > 1; g++)
            for (int h = 0; h < 2; h++) {   /* 8 blocks a vector each, transposed: v[c] = values 4c .. 4c + 3 of each */
                __m256i v[8], va[8];
                float sc[8] __attribute__((aligned(32)));
                for (int u = 0; u < 8; u++) v[u] = block16_avx2(ri, 16 * g + 8 * h + u, nb, mx, kv, &sc[u]);
                transpose8(v);
                if (!mx)
                    for (int c = 0; c < 8; c++) va[c] = _mm256_abs_epi8(v[c]);
                const __m256 ws = _mm256_load_ps(sc);
                for (int t = 0; t < m; t++) {
                    const int8_t *xt = xl->q + (r0 + t) * xrow + g * xl->gv + 32 * h;
                    const int64_t lx = t * ng * 16 + g * 16 + 8 * h;
                    __m256i S;
                    if (mx) {   /* 4 chunks a 16-bit sum: 8 products of 24 by 127, below 2^15 */
                        __m256i a0 = _mm256_maddubs_epi16(v[0], _mm256_load_si256((const __m256i *)xt));
                        __m256i a1 = _mm256_maddubs_epi16(v[4], _mm256_load_si256((const __m256i *)(xt + 256)));
                        for (int c = 1; c < 4; c++) {
                            a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(v[c], _mm256_load_si256((const __m256i *)(xt + 64 * c))));
                            a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(v[c + 4], _mm256_load_si256((const __m256i *)(xt + 256 + 64 * c))));
                        }
                        const __m256i c0 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), 5);
                        S = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(a0, ones), _mm256_madd_epi16(a1, ones)),
                                             _mm256_add_epi32(c0, _mm256_add_epi32(c0, c0)));
                    } else {
                        S = _mm256_setzero_si256();
                        for (int c = 0; c < 8; c++) {
                            const __m256i xv = _mm256_load_si256((const __m256i *)(xt + 64 * c));
                            S = _mm256_add_epi32(S, _mm256_madd_epi16(_mm256_maddubs_epi16(va[c], _mm256_sign_epi8(xv, v[c])), ones));
                        }
                    }
                    acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S), ws), _mm256_loadu_ps(dx + lx), acc[t][h]);
                }
            }
        for (int64_t g = 0; g < ng && m == 1; g++) {
            float sc[16] __attribute__((aligned(32)));
            for (int u = 0; u < 16; u++) {
                const int64_t b = 16 * g + u;
                const __m256i v = block16_avx2(ri, b, nb, mx, kv, &sc[u]);
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
                p[u] = _mm256_madd_epi16(mx ? _mm256_maddubs_epi16(v, xv)
                                            : _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xv, v)), ones);
            }
            __m256i lo, hi;
            fold_lanes(p, 32, &lo, &hi);
            const int64_t lx = g * 16;
            if (mx) {   /* corr >> 5 = -4 X */
                const __m256i c0 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), 5);
                const __m256i c1 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx + 8)), 5);
                lo = _mm256_add_epi32(lo, _mm256_add_epi32(c0, _mm256_add_epi32(c0, c0)));
                hi = _mm256_add_epi32(hi, _mm256_add_epi32(c1, _mm256_add_epi32(c1, c1)));
            }
            acc[0][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_load_ps(sc)), _mm256_loadu_ps(dx + lx),
                                        acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_load_ps(sc + 8)),
                                        _mm256_loadu_ps(dx + lx + 8), acc[0][1]);
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}

#define DEFINE_ROWS_AVX2(NAME_LC, CALL)                                                             \
    __attribute__((target(AVX2_TARGET))) static void i8rows_##NAME_LC##_avx2(const i8job_t *jb, int64_t n0, int64_t n1, \
                                                                          int64_t r0, int m) {      \
        if (m == 1) CALL(n0, n1, r0, 1);                                                           \
        else CALL(n0, n1, r0, m);                                                                  \
    }
#define Q4K_CALL(A, B, R, M) q4k_rows_avx2(jb, A, B, R, M, 0)
#define Q5K_CALL(A, B, R, M) q4k_rows_avx2(jb, A, B, R, M, 1)
#define Q80_CALL(A, B, R, M) row16_avx2(jb, A, B, R, M, 0)
#define MX_CALL(A, B, R, M) row16_avx2(jb, A, B, R, M, 1)
DEFINE_ROWS_AVX2(q4_k, Q4K_CALL)
DEFINE_ROWS_AVX2(q5_k, Q5K_CALL)
DEFINE_ROWS_AVX2(q8_0, Q80_CALL)
DEFINE_ROWS_AVX2(mxfp4, MX_CALL)

/* 8 sub-blocks' unsigned vectors times x (sub-block j's 32 values at xb + 32 j; with sg, x with
 * those signs first), a pair of sub-blocks' pair sums added once in 16 bits (4 products, at most
 * 63 by 127: below 2^15) before madd widens them: sub-block j's sum over its values 0-15 in lane j
 * of *lo, over 16-31 in lane j of *hi. */
__attribute__((target(AVX2_TARGET))) INLINE void fold8_pairs(const __m256i *v, const int8_t *xb, const __m256i *sg,
                                                            __m256i *lo, __m256i *hi) {
    __m256i w[4];
    for (int i = 0; i < 4; i++) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xb + 64 * i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb + 64 * i + 32));
        if (sg != NULL) {
            x0 = _mm256_sign_epi8(x0, sg[2 * i]);
            x1 = _mm256_sign_epi8(x1, sg[2 * i + 1]);
        }
        w[i] = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_maddubs_epi16(v[2 * i], x0), _mm256_maddubs_epi16(v[2 * i + 1], x1)),
                                 _mm256_set1_epi16(1));
    }
    const __m256i g0 = _mm256_hadd_epi32(w[0], w[1]), g1 = _mm256_hadd_epi32(w[2], w[3]);
    *lo = _mm256_permute2x128_si256(g0, g1, 0x20);
    *hi = _mm256_permute2x128_si256(g0, g1, 0x31);
}

/* The K-quants with a scale per 16 values: Q6_K, Q2_K, Q3_K (kind K16_Q6, K16_Q2, K16_Q3). A
 * 256-value block is a group of 16 lanes of 16 values: lane j the first 16 values of the block's
 * 32-value vector j, lane 8 + j its last 16. Every value unsigned, so maddubs takes them as they
 * are: Q6_K's as q + 32 (0-63) with each lane corrected by -32 X (corr >> 2, exactly), Q3_K's as
 * q + 4 (0-7: low bits + 4 x the hmask bit) corrected by -4 X (corr >> 5), Q2_K's as they are
 * (0-3) with its min, the generic path's float steps per lane (lanes256: scale, then the min).
 * Scales (and mins) are moved into lane order (the even sub-blocks of 16, then the odd) before
 * or after they become floats, unchanged. One row: a pair of vectors' pair sums add once in 16
 * bits (4 products of at most 63 by 128, below 2^15) before madd widens them, then two
 * hadd_epi32 and two permutes make the 16 lane sums. From 2 rows the 8 vectors are transposed
 * once (vector c < 4: values 4c .. 4c + 3 of each, lanes 0-7; c >= 4: values 16 + 4(c - 4) ..,
 * lanes 8-15), as x's transposed copy lies. */
enum { K16_Q6, K16_Q2, K16_Q3 };
/* 16 floats in sub-block order -> lanes 0-7 (odd = 0: the even ones) or 8-15 (odd = 1), unchanged. */
__attribute__((target(AVX2_TARGET))) INLINE __m256 evens_ps(const float *s, int odd) {
    const __m256 a = _mm256_loadu_ps(s), b = _mm256_loadu_ps(s + 8);
    const __m256 e = odd ? _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)) : _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
}
/* 16 unsigned scale bytes (in lane order) times d -> lanes 0-7 in *lo, 8-15 in *hi. */
__attribute__((target(AVX2_TARGET))) INLINE void scales_lanes(__m128i v, float d, __m256 *lo, __m256 *hi) {
    const __m256 dv = _mm256_set1_ps(d);
    *lo = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)));
    *hi = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))));
}
/* Block blk of a kind's row: its 8 vectors (values as above) and its lanes' scales and mins. */
__attribute__((target(AVX2_TARGET))) INLINE void k16_block(const uint8_t *blk, int kind, __m256i *u, __m256 *ws,
                                                           __m256 *wm) {
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(0x0F);
    const __m128i deint = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    if (kind == K16_Q6) {
        for (int h = 0; h < 2; h++) {   /* sub-block 4h + g: values 128h + 32g + l */
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i lo = _mm256_and_si256(g >> 1 ? _mm256_srli_epi16(g & 1 ? l1 : l0, 4) : (g & 1 ? l1 : l0), m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * g), m3);
                u[4 * h + g] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
            }
        }
        const __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(blk + 192)), deint);
        const __m256 d = _mm256_set1_ps(f16v(rd16(blk + 208)));
        ws[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        ws[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    } else if (kind == K16_Q2) {
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * h));
            for (int g = 0; g < 4; g++) u[4 * h + g] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m3);
        }
        const __m128i sm = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)blk), deint), low4 = _mm_set1_epi8(0x0F);
        scales_lanes(_mm_and_si128(sm, low4), f16v(rd16(blk + 80)), &ws[0], &ws[1]);
        scales_lanes(_mm_and_si128(_mm_srli_epi16(sm, 4), low4), f16v(rd16(blk + 82)), &wm[0], &wm[1]);
    } else {
        const __m256i hm = _mm256_loadu_si256((const __m256i *)blk), one8 = _mm256_set1_epi8(1);
        for (int h = 0; h < 2; h++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 32 + 32 * h));
            for (int g = 0; g < 4; g++) {
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + g), one8);
                u[4 * h + g] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 2 * g), m3), _mm256_slli_epi16(hb, 2));
            }
        }
        float sc[16];
        scales_q3_k_v(blk, sc, NULL);
        ws[0] = evens_ps(sc, 0);
        ws[1] = evens_ps(sc, 1);
    }
}
__attribute__((target(AVX2_TARGET))) INLINE void k16_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                              int m, int kind) {
    const xlane_t *xl = jb->xl;
    const int bytes = kind == K16_Q6 ? Q6_K_BYTES : kind == K16_Q2 ? Q2_K_BYTES : Q3_K_BYTES;
    const int64_t nb = jb->k / 256, rb = nb * bytes, xrow = nb * 256;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * nb * 16, *dxs = xl->dxs + r0 * nb * 16;
    const int32_t *corr = xl->corr + r0 * nb * 16;
    const int shift = kind == K16_Q6 ? 2 : 5;   /* corr >> shift: -32 X (Q6_K), -4 X (Q3_K) */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = ri + b * bytes;
            for (int o = 0; o < bytes; o += 64) __builtin_prefetch(blk + I8_PREFETCH + o);
            __builtin_prefetch(blk + I8_PREFETCH + bytes - 1);
            __m256i u[8];
            __m256 ws[2], wm[2];
            k16_block(blk, kind, u, ws, wm);
            if (m > 1) transpose8(u);
            for (int t = 0; t < m; t++) {
                __m256i lo, hi;
                if (m == 1) {
                    fold8_pairs(u, xq + b * 256, NULL, &lo, &hi);
                } else {   /* 2 chunks a 16-bit sum (4 products) */
                    const int8_t *xt = xl->q + (r0 + t) * xrow + b * 256;
                    __m256i a[4];
                    for (int i = 0; i < 4; i++) {
                        const int c = 2 * (i & 1), o = 32 * (i >> 1);   /* lanes 0-7 from u[c], 8-15 from u[4 + c] */
                        a[i] = _mm256_madd_epi16(
                            _mm256_add_epi16(
                                _mm256_maddubs_epi16(u[4 * (i >> 1) + c], _mm256_load_si256((const __m256i *)(xt + 64 * c + o))),
                                _mm256_maddubs_epi16(u[4 * (i >> 1) + c + 1], _mm256_load_si256((const __m256i *)(xt + 64 * c + 64 + o)))),
                            ones);
                    }
                    lo = _mm256_add_epi32(a[0], a[1]);
                    hi = _mm256_add_epi32(a[2], a[3]);
                }
                const int64_t lx = t * nb * 16 + 16 * b;
                if (kind != K16_Q2) {
                    lo = _mm256_add_epi32(lo, _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), shift));
                    hi = _mm256_add_epi32(hi, _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx + 8)), shift));
                }
                acc[t][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), ws[0]), _mm256_loadu_ps(dx + lx), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), ws[1]), _mm256_loadu_ps(dx + lx + 8), acc[t][1]);
                if (kind == K16_Q2) {
                    acc[t][0] = _mm256_fnmadd_ps(wm[0], _mm256_loadu_ps(dxs + lx), acc[t][0]);
                    acc[t][1] = _mm256_fnmadd_ps(wm[1], _mm256_loadu_ps(dxs + lx + 8), acc[t][1]);
                }
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}
#define Q6K_CALL(A, B, R, M) k16_rows_avx2(jb, A, B, R, M, K16_Q6)
#define Q2K_CALL(A, B, R, M) k16_rows_avx2(jb, A, B, R, M, K16_Q2)
#define Q3K_CALL(A, B, R, M) k16_rows_avx2(jb, A, B, R, M, K16_Q3)
DEFINE_ROWS_AVX2(q6_k, Q6K_CALL)
DEFINE_ROWS_AVX2(q2_k, Q2K_CALL)
DEFINE_ROWS_AVX2(q3_k, Q3K_CALL)

/* IQ1_S, IQ2_XXS and IQ3_XXS (lanes as Q4_K's: a group is two blocks of 8 sub-blocks), 1 to
 * I8_DIRECT_ROWS rows: a block is decoded once, then each row folds its own products (no
 * transpose: these types' decoding, grid lookups, outweighs the fold).
 * IQ1_S: values 8 grid + delta looked up as before (qv_iq1_s), then + 9 (0-18, unsigned: maddubs
 * takes them as they are) and each lane corrected by -9 X (from corr >> 7 = -X, exactly); a
 * block's 8 sub-blocks fold in 16 bits for two rounds (8 products of 18 by 127, below 2^15), then
 * madd widens them.
 * IQ3_XXS and IQ2_XXS: the grid rows are magnitudes (1-62: init_tables holds them to that), so
 * maddubs takes them as they are and the signs go onto x instead (sign_epi8 by the sign mask or 1:
 * the products of the generic |q| . (x with q's sign)); a pair of sub-blocks' pair sums add once in
 * 16 bits (4 products of 62 by 127, below 2^15) before madd widens them, then Q6_K's one-row fold.
 * Scales as scales_iq3_xxs / scales_iq2_xxs compute them, 8 at a time. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i grid_iq3_xxs(const uint8_t *q) {
    return _mm256_set_epi32((int)IQ3XXS_GRID[q[7]], (int)IQ3XXS_GRID[q[6]], (int)IQ3XXS_GRID[q[5]],
                            (int)IQ3XXS_GRID[q[4]], (int)IQ3XXS_GRID[q[3]], (int)IQ3XXS_GRID[q[2]],
                            (int)IQ3XXS_GRID[q[1]], (int)IQ3XXS_GRID[q[0]]);
}
__attribute__((target(AVX2_TARGET))) INLINE __m256i grid_iq2_xxs(const uint8_t *q) {
    return _mm256_set_epi64x((long long)IQ2XXS_GRID[q[3]], (long long)IQ2XXS_GRID[q[2]], (long long)IQ2XXS_GRID[q[1]],
                             (long long)IQ2XXS_GRID[q[0]]);
}
/* IQ2_XXS's and IQ3_XXS's four 7-bit sign indices of a sub-block: 0xFF where negative, else 1. */
__attribute__((target(AVX2_TARGET))) INLINE __m256i signs_xxs(uint32_t aux) {
    return _mm256_or_si256(_mm256_set_epi64x((long long)SIGN_MASK[(aux >> 21) & 127], (long long)SIGN_MASK[(aux >> 14) & 127],
                                             (long long)SIGN_MASK[(aux >> 7) & 127], (long long)SIGN_MASK[aux & 127]),
                           _mm256_set1_epi8(1));
}
__attribute__((target(AVX2_TARGET))) INLINE void iq_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                             int m, int kind) {
    const int mag = kind != 0;   /* IQ3_XXS, IQ2_XXS: grid magnitudes, the signs onto x */
    const xlane_t *xl = jb->xl;
    const int64_t qk = 256, bytes = kind == 2 ? IQ2_XXS_BYTES : kind ? IQ3_XXS_BYTES : IQ1_S_BYTES;   /* all QK 256 */
    const int64_t nb = jb->k / qk, rb = nb * bytes, ng = xl->ngroups, xrow = ng * xl->gv;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * ng * 16;
    const int32_t *corr = xl->corr + r0 * ng * 16;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < 2 * ng; b++) {
            const int h = (int)(b & 1);
            const int64_t lx = (b >> 1) * 16 + 8 * h;
            if (b >= nb) {   /* the missing half of a partial last group: zeros, as the other paths */
                for (int t = 0; t < m; t++)
                    acc[t][h] = _mm256_fmadd_ps(_mm256_setzero_ps(), _mm256_loadu_ps(dx + t * ng * 16 + lx), acc[t][h]);
                continue;
            }
            const uint8_t *blk = ri + b * bytes;
            __builtin_prefetch(blk + I8_PREFETCH);
            __builtin_prefetch(blk + I8_PREFETCH + bytes - 1);
            __m256i v[8], sg[8];
            __m256 ws;
            if (mag) {
                uint32_t a[8];
                for (int j = 0; j < 8; j++) {
                    a[j] = rd32(kind == 2 ? blk + 6 + 8 * j : blk + 66 + 4 * j);
                    v[j] = kind == 2 ? grid_iq2_xxs(blk + 2 + 8 * j) : grid_iq3_xxs(blk + 2 + 8 * j);
                    sg[j] = signs_xxs(a[j]);
                }
                const __m256i aux = _mm256_loadu_si256((const __m256i *)a);
                const __m256 sc = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_cvtepi32_ps(_mm256_srli_epi32(aux, 28)));
                ws = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(f16v(rd16(blk))), sc), _mm256_set1_ps(kind == 2 ? 0.25f : 0.5f));
            } else {
                for (int j = 0; j < 8; j++) v[j] = _mm256_add_epi8(qv_iq1_s(blk, j), _mm256_set1_epi8(9));
                const __m256i qh8 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 34)));
                const __m256i ls = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(qh8, 12),
                                                                                       _mm256_set1_epi32(7)), 1),
                                                    _mm256_set1_epi32(1));
                ws = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(f16v(rd16(blk))), _mm256_cvtepi32_ps(ls)),
                                   _mm256_set1_ps(0.125f));
            }
            for (int t = 0; t < m; t++) {
                const int8_t *xb = xq + t * xrow + b * qk;
                __m256i s;
                if (mag) {
                    __m256i lo, hi;
                    fold8_pairs(v, xb, sg, &lo, &hi);
                    s = _mm256_add_epi32(lo, hi);
                } else {
                    __m256i p[8];
                    for (int j = 0; j < 8; j++)
                        p[j] = _mm256_maddubs_epi16(v[j], _mm256_loadu_si256((const __m256i *)(xb + 32 * j)));
                    /* lane 0: sums over each sub-block's values 0-15, lane 1: 16-31 */
                    const __m256i a0 = _mm256_hadd_epi16(p[0], p[1]), a1 = _mm256_hadd_epi16(p[2], p[3]);
                    const __m256i a2 = _mm256_hadd_epi16(p[4], p[5]), a3 = _mm256_hadd_epi16(p[6], p[7]);
                    const __m256i m0 = _mm256_madd_epi16(_mm256_hadd_epi16(a0, a1), ones);
                    const __m256i m1 = _mm256_madd_epi16(_mm256_hadd_epi16(a2, a3), ones);
                    s = _mm256_add_epi32(_mm256_permute2x128_si256(m0, m1, 0x20), _mm256_permute2x128_si256(m0, m1, 0x31));
                    const __m256i c = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + t * ng * 16 + lx)), 7);   /* -X */
                    s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_slli_epi32(c, 3), c));
                }
                acc[t][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), ws), _mm256_loadu_ps(dx + t * ng * 16 + lx),
                                            acc[t][h]);
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}
/* IQ1_M (lanes as Q6_K's: a group is one block, 16 lanes of 16 values: lanes 0-7 the first halves
 * of its 8 sub-blocks, 8-15 the second halves), 1 to I8_DIRECT_ROWS rows. Values 8 grid + delta
 * (qv_iq1_m) + 9 (0-18, unsigned: maddubs takes them as they are), each lane corrected by -9 X
 * (corr >> 7 = -X, exactly); Q6_K's one-row fold per row; the 16 scales as scales_iq1_m computes
 * them, 8 at a time. */
__attribute__((target(AVX2_TARGET))) INLINE void iq1m_rows_avx2(const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0,
                                                               int m) {
    const xlane_t *xl = jb->xl;
    const int64_t nb = jb->k / IQ1_M_QK, rb = nb * IQ1_M_BYTES, xrow = nb * IQ1_M_QK;
    const int8_t *xq = xl->xn + r0 * xrow;
    const float *dx = xl->dx + r0 * nb * 16;
    const int32_t *corr = xl->corr + r0 * nb * 16;
    __m256 acc[I8_DIRECT_ROWS][2];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *ri = jb->w + n * rb;
        for (int t = 0; t < m; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = ri + b * IQ1_M_BYTES;
            __builtin_prefetch(blk + I8_PREFETCH);
            __builtin_prefetch(blk + I8_PREFETCH + IQ1_M_BYTES - 1);
            __m256i v[8];
            for (int j = 0; j < 8; j++) v[j] = _mm256_add_epi8(qv_iq1_m(blk, j), _mm256_set1_epi8(9));
            const uint16_t sc[4] = {rd16(blk + 48), rd16(blk + 50), rd16(blk + 52), rd16(blk + 54)};
            const float d = f16v((uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                            (sc[3] & 0xf000)));
            int32_t l1[8], l2[8];
            for (int j = 0; j < 8; j++) {
                l1[j] = 2 * ((sc[j / 2] >> (6 * (j % 2))) & 0x7) + 1;
                l2[j] = 2 * ((sc[j / 2] >> (6 * (j % 2) + 3)) & 0x7) + 1;
            }
            const __m256 dv = _mm256_set1_ps(d), eighth = _mm256_set1_ps(0.125f);
            const __m256 ws_lo = _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)l1))), eighth);
            const __m256 ws_hi = _mm256_mul_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)l2))), eighth);
            for (int t = 0; t < m; t++) {
                __m256i lo, hi;
                fold8_pairs(v, xq + t * xrow + b * IQ1_M_QK, NULL, &lo, &hi);
                const int64_t lx = t * nb * 16 + 16 * b;
                const __m256i c0 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx)), 7);       /* -X */
                const __m256i c1 = _mm256_srai_epi32(_mm256_loadu_si256((const __m256i *)(corr + lx + 8)), 7);
                lo = _mm256_add_epi32(lo, _mm256_add_epi32(_mm256_slli_epi32(c0, 3), c0));
                hi = _mm256_add_epi32(hi, _mm256_add_epi32(_mm256_slli_epi32(c1, 3), c1));
                acc[t][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), ws_lo), _mm256_loadu_ps(dx + lx), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), ws_hi), _mm256_loadu_ps(dx + lx + 8), acc[t][1]);
            }
        }
        for (int t = 0; t < m; t++) jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(acc[t][0], acc[t][1]);
    }
}
#define IQ1M_CALL(A, B, R, M) iq1m_rows_avx2(jb, A, B, R, M)
DEFINE_ROWS_AVX2(iq1_m, IQ1M_CALL)
#define IQ1S_CALL(A, B, R, M) iq_rows_avx2(jb, A, B, R, M, 0)
#define IQ3XXS_CALL(A, B, R, M) iq_rows_avx2(jb, A, B, R, M, 1)
#define IQ2XXS_CALL(A, B, R, M) iq_rows_avx2(jb, A, B, R, M, 2)
DEFINE_ROWS_AVX2(iq1_s, IQ1S_CALL)
DEFINE_ROWS_AVX2(iq3_xxs, IQ3XXS_CALL)
DEFINE_ROWS_AVX2(iq2_xxs, IQ2XXS_CALL)
#endif

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

/* One decoded group times RT rows of x: the lanes' float operations of lanes256, 16 at once. */
__attribute__((target(VNNI_TARGET))) INLINE void fd_group(const __m512i *z, const int NZ, __m512 ws, __m512 mn,
                                                         const int has_min, const int bias, const xlane_t *xl,
                                                         const int8_t *xq, int64_t xs, int64_t lx, int64_t ls,
                                                         const int RT, __m512 *acc) {
    const __m512i perm = _mm512_load_si512(NZ == 8 ? FD_PERM8 : FD_PERM4);
    const int shift = bias == 128 ? 0 : bias == 32 ? 2 : 5;
    for (int t = 0; t < RT; t++) {
        __m512i p[8];
        for (int m = 0; m < NZ; m++)
            p[m] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z[m], _mm512_loadu_si512(xq + t * xs + 64 * m));
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

DEFINE_FD_GENERIC(Q8_0, q8_0)
DEFINE_FD_GENERIC(Q4_K, q4_k)
DEFINE_FD_GENERIC(Q5_K, q5_k)
DEFINE_FD_GENERIC(Q6_K, q6_k)
DEFINE_FD_GENERIC(Q2_K, q2_k)
DEFINE_FD_GENERIC(Q3_K, q3_k)
DEFINE_FD_GENERIC(IQ2_XXS, iq2_xxs)
DEFINE_FD_GENERIC(IQ2_XS, iq2_xs)
DEFINE_FD_GENERIC(IQ3_XXS, iq3_xxs)
DEFINE_FD_GENERIC(IQ1_S, iq1_s)
DEFINE_FD_GENERIC(IQ1_M, iq1_m)
DEFINE_FD_GENERIC(MXFP4, mxfp4)

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
                fd_group(z, NZ, ws, wm, HAS_MIN, T##_FDB, xl, xq + g * gv, xs, lx0 + g * 16, ls, RT, acc); \
            }                                                                                      \
            if (g < ng) {                                                                          \
                const uint8_t *gp = ri + g * gbytes;                                               \
                const int nsub = (int)((k - g * gv) / 32);                                         \
                __m512i z[8];                                                                      \
                __m512 ws, wm;                                                                     \
                zqg_##NAME_LC(gp, nsub, z);                                                        \
                zsg_##NAME_LC(gp, nsub, &ws, &wm);                                                 \
                fd_group(z, NZ, ws, wm, HAS_MIN, T##_FDB, xl, xq + g * gv, xs, lx0 + g * 16, ls, RT, acc); \
            }                                                                                      \
            for (int t = 0; t < RT; t++)                                                           \
                jb->y[(r0 + t) * jb->n_out + n] = i8_reduce256(_mm512_castps512_ps256(acc[t]),     \
                                                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1))); \
        }                                                                                          \
    }                                                                                              \
    __attribute__((target(VNNI_TARGET))) static void i8direct_##NAME_LC##_fast(const i8job_t *jb, int64_t n0, \
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

DEFINE_FD(Q8_0, q8_0, 0)
DEFINE_FD(Q4_K, q4_k, 1)
DEFINE_FD(Q5_K, q5_k, 1)
DEFINE_FD(Q6_K, q6_k, 0)
DEFINE_FD(Q2_K, q2_k, 1)
DEFINE_FD(Q3_K, q3_k, 0)
DEFINE_FD(IQ2_XXS, iq2_xxs, 0)
DEFINE_FD(IQ2_XS, iq2_xs, 0)
DEFINE_FD(IQ3_XXS, iq3_xxs, 0)
DEFINE_FD(IQ1_S, iq1_s, 0)
DEFINE_FD(IQ1_M, iq1_m, 0)
DEFINE_FD(MXFP4, mxfp4, 0)

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
__attribute__((target(VNNI_TARGET))) static void i8direct_q4_k_row(const i8job_t *jb, int64_t n0, int64_t n1,
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
            fd_group(z, 8, ws, wm, 1, Q4_K_FDB, xl, xq + nfull * gv, ng * gv, lx0 + nfull * 16, ng * 16, 1, &acc);
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
__attribute__((target(VBMI_TARGET))) static void i8direct_mxfp4_vbmi(const i8job_t *jb, int64_t n0, int64_t n1,
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
            __m512i z[8];
            __m512 ws, wm;
            zqg_mxfp4(gp, (int)((k - nfull * gv) / 32), z);
            zsg_mxfp4(gp, (int)((k - nfull * gv) / 32), &ws, &wm);
            fd_group(z, 8, ws, wm, 0, MXFP4_FDB, xl, xq + nfull * gv, ng * gv, lx0 + nfull * 16, ng * 16, 1, &acc);
        }
        jb->y[r0 * jb->n_out + n] = i8_reduce256(_mm512_castps512_ps256(acc),
                                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    }
    free(xo);
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
/* The other types: their one-row decoders. */
#define DEFINE_FTD(NAME_LC)                                                                          \
    __attribute__((target(VNNI_TARGET))) INLINE void ftd_##NAME_LC(const uint8_t *gp, __m512i *z, __m512 *ws, \
                                                                  __m512 *wm) {                     \
        zq_##NAME_LC(gp, z);                                                                       \
        zs_##NAME_LC(gp, ws, wm);                                                                  \
    }
DEFINE_FTD(q4_k)
DEFINE_FTD(q5_k)
DEFINE_FTD(q6_k)
DEFINE_FTD(q2_k)
DEFINE_FTD(q3_k)
DEFINE_FTD(iq2_xxs)
DEFINE_FTD(iq2_xs)
DEFINE_FTD(iq3_xxs)
DEFINE_FTD(iq1_s)
DEFINE_FTD(iq1_m)
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
            zsg_##NAME_LC(gp, nsub, &ws, &wm);                                                     \
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
    __attribute__((target(VNNI_TARGET))) static void i8direct_##NAME_LC##_ft(const i8job_t *jb, int64_t n0, \
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

DEFINE_FT(Q8_0, q8_0, 0)
DEFINE_FT(Q4_K, q4_k, 1)
DEFINE_FT(Q5_K, q5_k, 1)
DEFINE_FT(Q6_K, q6_k, 0)
DEFINE_FT(Q2_K, q2_k, 1)
DEFINE_FT(Q3_K, q3_k, 0)
DEFINE_FT(IQ2_XXS, iq2_xxs, 0)
DEFINE_FT(IQ2_XS, iq2_xs, 0)
DEFINE_FT(IQ3_XXS, iq3_xxs, 0)
DEFINE_FT(IQ1_S, iq1_s, 0)
DEFINE_FT(IQ1_M, iq1_m, 0)
DEFINE_FT(MXFP4, mxfp4, 0)
#endif


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
/* Rows from which matmul_q8's default path takes AMX (measured, see RESULTS.md). */
#define AMX_FROM_Q8_0 12
#define AMX_FROM_MXFP4 12
#define AMX_TARGET "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"
#define AMX_ACC_BYTES (16 * 8 * 16 * 4)    /* acc[n][pair][(r, h)]: W rows x lane pairs x 16, float */
#define AMX_C_BYTES (2 * 4 * 16 * 64)      /* two sets of four stored C tiles */
/* scratch per thread: acc, the stored C tiles, twice (this W block, the next) ws[n][u] and the
 * decoded W block (16 rows of nsubp sub-blocks) */
#define AMX_SCRATCH_BYTES(nsubp) ((int64_t)AMX_ACC_BYTES + AMX_C_BYTES + 2 * 64 * (int64_t)(nsubp) + 2 * 512 * (int64_t)(nsubp) + 64)

static int use_amx = 0;       /* set at import: AMX-INT8 runs, the kernel granted the tile state, no K3KIT_NO_AMX */
static long amx_calls = 0;    /* products that ran the AMX path (tests read it) */

typedef struct {
    const uint8_t *w;
    int qtype;                 /* 8 Q8_0, 39 MXFP4 */
    int64_t n_out, k, m, rb, nsub, nsubp;   /* nsubp: sub-blocks per row with the last group padded */
    const int8_t *xb;          /* per block of 8 x rows, per pair of sub-blocks: a B tile (16 x 64 bytes) */
    const float *dxv;          /* per block of 8 x rows, per pair: dx of (r, h) at 2r + h */
    float *y;
} amxjob_t;

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

__attribute__((target(AMX_TARGET))) static void amx_columns(const amxjob_t *j, int64_t n0, int64_t n1, uint8_t *scratch) {
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
static void amx_prepare_x(const xlane_t *xl, int64_t m, int64_t nsubp, int8_t *xb, float *dxv) {
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

/* AMX-INT8 in cpuid (leaf 7: EDX bit 24 AMX-TILE, bit 25 AMX-INT8), and Linux's permission to use
 * the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
static int amx_init(void) {
    unsigned int a, b, c, d;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(0), "c"(0));
    if (a < 7) return 0;
    __asm__ volatile("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return 0;
#ifdef __linux__
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#endif

/* Per type: lane width G, whether the weights have a min, the activation type (ggml's
 * vec_dot_type: Q8_0 for Q8_0 and MXFP4, Q8_K for the rest), the panel decoders. */
typedef struct {
    int ggml_type, G, has_min, act_q8k, direct_below, fast_below, ft_from, ft_below;
    /* fast_below: what path 5 (the folding 512-bit path alone, as before the transposed one) uses */
    i8panel_fn panel[2];   /* scalar, vector */
    i8direct_fn direct[5]; /* -, AVX2, VNNI, VNNI fast (512-bit), VNNI transposed (512-bit) */
} i8type_t;

/* ft_from, ft_below: on AVX512-VNNI (the default path), rows from which the transposed direct
 * path runs instead of the folding one, and rows from which the panels run instead. Measured
 * (benchmarks/bench_qmatmul.py --int8-paths, 7168 x 2048, 1 thread, 1-64 rows, 2026-12-02): the
 * transposed path is 1.1-1.5x the folding one from 2-4 rows (Q8_0: from ~8; one row stays on
 * the folding path, slightly faster there) and beats the panels through 64 rows for Q8_0, Q4_K,
 * Q6_K, Q2_K, MXFP4 (Q3_K, Q5_K by analogy, not measured); the IQ types' panels, which decode
 * each grid row once for 64 rows, win from 16 rows (IQ2_XS, IQ1_M by analogy).
 * direct_below: rows below which the direct path runs on AVX2 (panels from there; the same
 * bits). Measured (AVX512-VNNI, 7168 x 2048, 1 thread, 2-8 rows): Q6_K's panels (16-value lanes:
 * half the integer work per float step) lose to the direct path up to 8+ rows, Q4_K's and Q8_0's
 * up to ~6-8, MXFP4's and IQ2_XXS's from 4; the other types take their lane width's figure.
 * fast_below: the same for the 512-bit direct path on AVX512-VNNI. Measured (7168 x 2048, 1
 * thread, 1-32 rows, benchmarks/bench_qmatmul.py --int8-paths): it beats the panels up to 8
 * rows for every type, to 16 for MXFP4, Q4_K, IQ1_M, to ~20 for Q2_K, Q3_K, Q5_K and past 32
 * for Q6_K; the IQ types with costly grid gathers (IQ1_S, IQ2_XXS, IQ3_XXS) and Q8_0 cross over
 * between 8 and 16. */
static const i8type_t I8TYPES[] = {
    {39, I8_G(MXFP4), 0, 0, 4, 16, 2, 65, I8PANELS(mxfp4)},    {8, I8_G(Q8_0), 0, 0, 8, 12, 8, 65, I8PANELS(q8_0)},
    {10, I8_G(Q2_K), 1, 1, 12, 24, 2, 65, I8PANELS(q2_k)},     {11, I8_G(Q3_K), 0, 1, 12, 24, 2, 65, I8PANELS(q3_k)},
    {12, I8_G(Q4_K), 1, 1, 8, 20, 2, 65, I8PANELS(q4_k)},      {13, I8_G(Q5_K), 1, 1, 8, 24, 2, 65, I8PANELS(q5_k)},
    {14, I8_G(Q6_K), 0, 1, 12, 40, 2, 65, I8PANELS(q6_k)},     {16, I8_G(IQ2_XXS), 0, 1, 4, 12, 4, 16, I8PANELS(iq2_xxs)},
    {17, I8_G(IQ2_XS), 0, 1, 12, 16, 4, 16, I8PANELS(iq2_xs)}, {18, I8_G(IQ3_XXS), 0, 1, 4, 12, 2, 16, I8PANELS(iq3_xxs)},
    {19, I8_G(IQ1_S), 0, 1, 4, 12, 4, 16, I8PANELS(iq1_s)},    {29, I8_G(IQ1_M), 0, 1, 12, 16, 4, 16, I8PANELS(iq1_m)},
};

static const i8type_t *find_i8type(int ggml_type) {
    for (size_t i = 0; i < sizeof I8TYPES / sizeof I8TYPES[0]; i++)
        if (I8TYPES[i].ggml_type == ggml_type) return &I8TYPES[i];
    return NULL;
}

/* ---- the type table ------------------------------------------------------------------------ */

typedef struct {
    int ggml_type;        /* GGMLQuantizationType value (the file format's type id) */
    const char *name;
    int64_t qk, bytes;    /* values and bytes per block */
    int needs_tables;     /* IQ types: init_tables() must have run */
    int factored;         /* T_FACTORED */
    int blocked_from;     /* rows from which the vector paths use panels (T_BLOCKED_FROM) */
    kernel_fn fn[3];      /* scalar, AVX2, AVX-512 */
    panel_fn panel[2];    /* scalar, vector: the decoders dequantize() runs */
} qtype_t;

static const qtype_t QTYPES[] = {
    {39, "MXFP4", MXFP4_QK, MXFP4_BYTES, 0, MXFP4_FACTORED, MXFP4_BLOCKED_FROM, KERNELS(mxfp4), PANELS(mxfp4)},
    {8, "Q8_0", Q8_0_QK, Q8_0_BYTES, 0, Q8_0_FACTORED, Q8_0_BLOCKED_FROM, KERNELS(q8_0), PANELS(q8_0)},
    {10, "Q2_K", Q2_K_QK, Q2_K_BYTES, 0, Q2_K_FACTORED, Q2_K_BLOCKED_FROM, KERNELS(q2_k), PANELS(q2_k)},
    {11, "Q3_K", Q3_K_QK, Q3_K_BYTES, 0, Q3_K_FACTORED, Q3_K_BLOCKED_FROM, KERNELS(q3_k), PANELS(q3_k)},
    {12, "Q4_K", Q4_K_QK, Q4_K_BYTES, 0, Q4_K_FACTORED, Q4_K_BLOCKED_FROM, KERNELS(q4_k), PANELS(q4_k)},
    {13, "Q5_K", Q5_K_QK, Q5_K_BYTES, 0, Q5_K_FACTORED, Q5_K_BLOCKED_FROM, KERNELS(q5_k), PANELS(q5_k)},
    {14, "Q6_K", Q6_K_QK, Q6_K_BYTES, 0, Q6_K_FACTORED, Q6_K_BLOCKED_FROM, KERNELS(q6_k), PANELS(q6_k)},
    {16, "IQ2_XXS", IQ2_XXS_QK, IQ2_XXS_BYTES, 1, IQ2_XXS_FACTORED, IQ2_XXS_BLOCKED_FROM, KERNELS(iq2_xxs), PANELS(iq2_xxs)},
    {17, "IQ2_XS", IQ2_XS_QK, IQ2_XS_BYTES, 1, IQ2_XS_FACTORED, IQ2_XS_BLOCKED_FROM, KERNELS(iq2_xs), PANELS(iq2_xs)},
    {18, "IQ3_XXS", IQ3_XXS_QK, IQ3_XXS_BYTES, 1, IQ3_XXS_FACTORED, IQ3_XXS_BLOCKED_FROM, KERNELS(iq3_xxs), PANELS(iq3_xxs)},
    {19, "IQ1_S", IQ1_S_QK, IQ1_S_BYTES, 1, IQ1_S_FACTORED, IQ1_S_BLOCKED_FROM, KERNELS(iq1_s), PANELS(iq1_s)},
    {29, "IQ1_M", IQ1_M_QK, IQ1_M_BYTES, 1, IQ1_M_FACTORED, IQ1_M_BLOCKED_FROM, KERNELS(iq1_m), PANELS(iq1_m)},
};
#define N_QTYPES ((int)(sizeof QTYPES / sizeof QTYPES[0]))

static const qtype_t *find_qtype(int ggml_type) {
    for (int i = 0; i < N_QTYPES; i++)
        if (QTYPES[i].ggml_type == ggml_type) return &QTYPES[i];
    return NULL;
}

/* 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512F: the best this CPU runs, set at import. */
static int use_simd = 0;

typedef struct {
    kernel_fn fn;
    const uint8_t *w;
    const float *x;
    float *y;
    float *scratch;       /* SCRATCH_FLOATS per thread, or NULL */
    int64_t n0, n1, n_out, k, m;
} job_t;

#define MAX_THREADS 256
/* Below this many weights per thread a call is over before threads would have started. */
#define MIN_WEIGHTS_PER_THREAD (1 << 19)

/* How many threads a product of n_out x k weights is split over, asked for `threads`. */
static int split_threads(int64_t n_out, int64_t k, int threads) {
    const int64_t work = n_out * k;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && work / threads < MIN_WEIGHTS_PER_THREAD) threads = (int)(work / MIN_WEIGHTS_PER_THREAD);
    if (threads > n_out) threads = (int)n_out;
    return threads < 1 ? 1 : threads;
}

/* Split the output columns over `threads` OpenMP threads (split_threads' count). Built against
 * libgomp, this resolves to the libgomp torch has already loaded (same soname), so the split runs
 * on torch's own worker threads: no second pool competing for the cores with torch's spinning
 * one. Each column is computed by one thread with the same arithmetic, so the split does not
 * change results. */
static void run_split(job_t base, int threads) {
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) {
            const int64_t n0 = base.n_out * t / threads, n1 = base.n_out * (t + 1) / threads;
            base.fn(base.w, n0, n1, base.n_out, base.k, base.x, base.m, base.y,
                    base.scratch ? base.scratch + (int64_t)t * SCRATCH_FLOATS : NULL);
        }
        return;
    }
#endif
    (void)threads;
    base.fn(base.w, 0, base.n_out, base.n_out, base.k, base.x, base.m, base.y, base.scratch);
}

/* matmul(qtype, w, x, y, n_out, k, m, simd=-1, threads=1, path=-1): y[m, n_out] = x[m, k] @ W.T
 * for a ggml matrix W[n_out, k] of type qtype (a GGMLQuantizationType value). w, x and y are
 * contiguous buffers (uint8, float32, float32); sizes are checked here. simd: -1 the best path,
 * else 0 scalar, 1 AVX2, 2 AVX-512 (capped at what the CPU has). threads: split the output
 * columns over this many threads (small products use fewer). path: -1 per-row tiles below the
 * type's blocked_from rows and panels from there, 0 tiles, 1 panels (the same bits either way;
 * for tests and benchmarks). Panels get SCRATCH_FLOATS floats of scratch per thread. */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    Py_ssize_t n_out, k, m;
    int qtype, simd = -1, threads = 1, path = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*w*nnn|iii", &qtype, &w, &x, &y, &n_out, &k, &m, &simd, &threads, &path))
        return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    if (qt == NULL) {
        PyErr_Format(PyExc_ValueError, "matmul: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "matmul: %s needs the IQ grids (init_tables was not called)", qt->name);
    } else if (n_out < 0 || k < 0 || m < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "matmul: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w.len != n_out * (k / qt->qk) * qt->bytes) {
        PyErr_Format(PyExc_ValueError, "matmul: %s weight buffer is %zd bytes, expected %zd", qt->name, w.len,
                     (Py_ssize_t)(n_out * (k / qt->qk) * qt->bytes));
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || y.len != m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul: activation or output buffer has the wrong size");
    } else {
        const int level = simd < 0 || simd > use_simd ? use_simd : simd;
        const int nthreads = split_threads(n_out, k, threads);
        /* the scalar path always uses panels; the vector paths from the type's blocked_from rows
         * (path: -1 so, 0 per-row tiles, 1 panels) */
        const int blocked = level == 0 || (path < 0 ? m >= qt->blocked_from : path > 0);
        float *scratch = NULL;
        if (blocked && m > 0 && n_out > 0 && k > 0)
            scratch = aligned_alloc(64, (size_t)nthreads * SCRATCH_FLOATS * sizeof(float));
        if (blocked && m > 0 && n_out > 0 && k > 0 && scratch == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        const job_t job = {qt->fn[level], w.buf, x.buf, y.buf, scratch, 0, n_out, n_out, k, m};
        Py_BEGIN_ALLOW_THREADS
        if (k == 0) memset(y.buf, 0, (size_t)y.len);   /* empty sums (the drivers walk k) */
        else run_split(job, nthreads);
        Py_END_ALLOW_THREADS
        free(scratch);
        ret = Py_NewRef(Py_None);
    }
done:
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

/* 0 scalar, 1 AVX2, 2 AVX512-VNNI (with BW and VL): the best int8 path this CPU runs. */
static int use_i8 = 0;
/* Set at import where AVX512-VBMI runs too (with use_i8 == 2): the one-row MXFP4 kernel. */
static int use_vbmi = 0;
#ifdef K3_X86
#define MX1_FN (use_vbmi ? i8direct_mxfp4_vbmi : NULL)
#define Q4K1_FN i8direct_q4_k_row
#else
#define MX1_FN NULL
#define Q4K1_FN NULL
#endif

/* Rows below which AVX2's default path runs a type's own direct kernel (few rows on AVX2 above)
 * instead of the panels. Measured (AVX2-only EPYC, 7168 x 2048, 1 thread, benchmarks/
 * bench_rows.py against a build with every threshold at 65, 2026-12-03): the kernels take
 * 0.76-0.91x the panels' time for Q4_K at 12-32 rows, 0.80-0.82x for MXFP4 at 8-16 rows (even
 * at 32), 0.81-0.93x for Q8_0 at 8-16 rows (1.03x at 32), 0.67-0.72x for IQ1_S and IQ3_XXS at 4
 * rows, 0.81x at 8 (1.05-1.31x from 10: a second pass over W; IQ2_XXS and IQ1_M, the same
 * kind of kernel, by analogy), 0.52-0.82x for Q6_K at 12-64 rows (not measured beyond); Q2_K's and
 * Q3_K's (Q6_K's lanes) 0.68-0.72x and 0.73-0.91x at 16-64 rows, Q5_K's (Q4_K's) 0.83x at 16 rows
 * and 1.02x at 32 (2026-12-03, session 15). */
static int own_avx2_below(int qtype, int direct_below) {
    return qtype == 12 ? 33 : qtype == 13 ? 25 : qtype == 39 ? 32 : qtype == 8 ? 24 : qtype == 18 || qtype == 19 || qtype == 16 || qtype == 29 ? 9
           : qtype == 14 || qtype == 10 || qtype == 11 ? 65 : direct_below;
}

/* The default path's direct kernel: the type's own where it has one for the direct kernel d0
 * that the row count chose (AVX512-VNNI's 512-bit folding one, for one row; AVX2's). */
static i8direct_fn own_direct_fn(const i8type_t *it, int qtype, i8direct_fn d0, int64_t m) {
#ifdef K3_X86
    if (d0 != NULL && d0 == it->direct[3] && m == 1)
        return qtype == 39 && MX1_FN != NULL ? MX1_FN : qtype == 12 ? Q4K1_FN : d0;
    if (d0 != NULL && d0 == it->direct[1])
        return qtype == 12 ? i8rows_q4_k_avx2 : qtype == 8 ? i8rows_q8_0_avx2 : qtype == 39 ? i8rows_mxfp4_avx2
               : qtype == 14 ? i8rows_q6_k_avx2 : qtype == 19 ? i8rows_iq1_s_avx2
               : qtype == 18 ? i8rows_iq3_xxs_avx2 : qtype == 16 ? i8rows_iq2_xxs_avx2
               : qtype == 29 ? i8rows_iq1_m_avx2 : qtype == 10 ? i8rows_q2_k_avx2
               : qtype == 11 ? i8rows_q3_k_avx2 : qtype == 13 ? i8rows_q5_k_avx2 : d0;
#else
    (void)it;
    (void)qtype;
    (void)m;
#endif
    return d0;
}

/* quantize_q8(x, out, act_type, m, k, variant=1): rows of x (float32 [m, k]) as ggml blocks of
 * act_type (8 = Q8_0: 34 bytes per 32 values; 15 = Q8_K: 292 bytes per 256). variant (Q8_0
 * only): 0 quantize_row_q8_0_ref, 1 ggml-cpu's x86 quantize_row_q8_0. */
static PyObject *py_quantize_q8(PyObject *self, PyObject *args) {
    Py_buffer x, out;
    Py_ssize_t m, k;
    int act, variant = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*w*inn|i", &x, &out, &act, &m, &k, &variant)) return NULL;
    PyObject *ret = NULL;
    const int qk = act == 15 ? 256 : 32, bytes = act == 15 ? Q8_K_BYTES : 34;
    if (act != 8 && act != 15) {
        PyErr_Format(PyExc_ValueError, "quantize_q8: activation type %d is neither Q8_0 (8) nor Q8_K (15)", act);
    } else if (m < 0 || k < 0 || k % qk) {
        PyErr_Format(PyExc_ValueError, "quantize_q8: bad dimensions (k must be a multiple of %d)", qk);
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || out.len != m * (k / qk) * bytes) {
        PyErr_SetString(PyExc_ValueError, "quantize_q8: input or output buffer has the wrong size");
    } else {
        for (Py_ssize_t r = 0; r < m; r++) {
            const float *xr = (const float *)x.buf + r * k;
            uint8_t *o = (uint8_t *)out.buf + r * (k / qk) * bytes;
            if (act == 15) quantize_q8_k_any(xr, k, o);
            else quantize_q8_0_row(xr, k, o, variant);
        }
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return ret;
}

/* matmul_q8(qtype, w, x, y, n_out, k, m, simd=-1, threads=1, variant=1): y[m, n_out] = x @ W.T
 * in ggml's arithmetic: each row of x rounded to the type's activation blocks (Q8_0 with
 * `variant` as quantize_q8, or Q8_K), then integer dot products (see "int8 activations").
 * simd: -1 best, 0 scalar, 1 AVX2, 2 AVX512-VNNI (capped at what the CPU runs); every level gives
 * the same bits. Output columns split over `threads`. path: -1 by the row count (direct below
 * the type's direct_below rows, panels from there; on AVX512-VNNI the folding 512-bit direct path
 * below ft_from rows, the transposed one below ft_below, panels from there), 0 the direct path's
 * 256-bit form, 1 panels, 2 the folding 512-bit direct path (on AVX512-VNNI, else as 0), 3 as -1
 * but with the 256-bit direct path and its thresholds (the kernels before the 512-bit path, for
 * benchmarks), 4 the transposed 512-bit direct path (AVX512-VNNI, else as 0), 5 as -1 without the
 * transposed path, the folding one below fast_below rows (the kernels before it, for
 * benchmarks): the same bits on every path and level. */
static PyObject *py_matmul_q8(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    Py_ssize_t n_out, k, m;
    int qtype, simd = -1, threads = 1, variant = 1, path = -1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*w*nnn|iiii", &qtype, &w, &x, &y, &n_out, &k, &m, &simd, &threads, &variant,
                          &path))
        return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    const i8type_t *it = find_i8type(qtype);
    if (qt == NULL || it == NULL) {
        PyErr_Format(PyExc_ValueError, "matmul_q8: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "matmul_q8: %s needs the IQ grids (init_tables was not called)", qt->name);
    } else if (n_out < 0 || k < 0 || m < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "matmul_q8: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w.len != n_out * (k / qt->qk) * qt->bytes) {
        PyErr_Format(PyExc_ValueError, "matmul_q8: %s weight buffer is %zd bytes, expected %zd", qt->name, w.len,
                     (Py_ssize_t)(n_out * (k / qt->qk) * qt->bytes));
    } else if (x.len != m * k * (Py_ssize_t)sizeof(float) || y.len != m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul_q8: activation or output buffer has the wrong size");
    } else if (m == 0 || n_out == 0 || k == 0) {
        if (y.len) memset(y.buf, 0, (size_t)y.len);
        ret = Py_NewRef(Py_None);
    } else {
        const int level = simd < 0 || simd > use_i8 ? use_i8 : simd;
        const int nthreads = split_threads(n_out, k, threads);
        const int64_t gv = 16 * (int64_t)it->G, ngroups = (k + gv - 1) / gv;
        const int64_t qbytes = it->act_q8k ? k / 256 * Q8_K_BYTES : k / 32 * 34;
        const int64_t rb = k / qt->qk * qt->bytes;
        xlane_t xl = {NULL, NULL, NULL, NULL, NULL, ngroups, gv, NULL, NULL, NULL, NULL};
        xl.xn = aligned_alloc(64, (size_t)(m * ngroups * gv + 64));
        xl.dx = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        xl.dxs = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        xl.corr = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        uint8_t *qbuf = malloc((size_t)qbytes + 64);
#ifdef K3_X86
        const int amx_from = qtype == 8 ? AMX_FROM_Q8_0 : qtype == 39 ? AMX_FROM_MXFP4 : 0;
        const int amx = use_amx && level == 2 && amx_from > 0 && (path == 6 || (path < 0 && m >= amx_from));
#else
        const int amx = 0;
#endif
        if (path == 6) path = -1;
        const int auto_path = path < 0 || path == 3 || path == 5, d256 = path == 0 || path == 3;
        const int below = level == 2 && path < 0 ? it->ft_below : level == 2 && path == 5 ? it->fast_below
                          : level == 1 && path < 0 ? own_avx2_below(qtype, it->direct_below) : it->direct_below;
        const int direct = !amx && level > 0 && (auto_path ? m < below : path == 0 || path == 2 || path == 4);
        const int transposed = direct && level == 2 && !d256 && (path == 4 || (path < 0 && m >= it->ft_from));
        const i8direct_fn dfn0 = !direct ? NULL : transposed ? it->direct[4] : level == 2 && !d256 ? it->direct[3]
                                                                                                : it->direct[level];
        /* on the default path: the type's own direct kernel where it has one */
        const i8direct_fn dfn = path >= 0 ? dfn0 : own_direct_fn(it, qtype, dfn0, m);
        const int64_t nsubp = ngroups * 16, nxb = (m + 7) / 8;
#ifdef K3_X86
        const int64_t scratch_bytes = amx ? (AMX_SCRATCH_BYTES(nsubp) + 63) / 64 * 64 : I8_SCRATCH_BYTES;
#else
        const int64_t scratch_bytes = I8_SCRATCH_BYTES;
#endif
        uint8_t *scratch = direct ? NULL : aligned_alloc(64, (size_t)(nthreads * scratch_bytes));
        int8_t *amx_xb = amx ? aligned_alloc(64, (size_t)(nxb * nsubp * 512)) : NULL;   /* (nsubp / 2) * 1024 */
        float *amx_dxv = amx ? aligned_alloc(64, (size_t)(nxb * nsubp * 16) * sizeof(float)) : NULL;
        /* the transposed bytes: for the panels and as the source of the transposed path's copy; the
         * other direct paths read xn (a decode row's layout work: ~halved) */
        const int own_t = level == 1 && m > 1 && dfn != dfn0;   /* AVX2's own kernels: x's transposed copy */
        if ((!direct && !amx) || transposed || own_t) xl.q = aligned_alloc(64, (size_t)(m * ngroups * gv + 64));
        if (transposed) {
            xl.qt = aligned_alloc(64, (size_t)(m * ngroups * gv + 64));
            xl.dxt = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
            xl.dxst = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
            xl.corrt = aligned_alloc(64, (size_t)(m * ngroups * 16 * 4 + 64));
        }
        if ((((!direct && !amx) || transposed || own_t) && !xl.q) || (amx && (!amx_xb || !amx_dxv)) || !xl.xn || !xl.dx || !xl.dxs || !xl.corr || !qbuf
            || (!direct && !scratch) || (transposed && (!xl.qt || !xl.dxt || !xl.dxst || !xl.corrt))) {
            PyErr_NoMemory();
        } else {
            const i8job_t jb = {w.buf, it->panel[level > 0], qt->qk, qt->bytes, n_out, k, m,
                                it->G, it->has_min, level, &xl, y.buf, dfn,
                                m > 8 ? (I8_CHUNK_BYTES + rb - 1) / rb : 0};
            Py_BEGIN_ALLOW_THREADS
            for (int64_t r = 0; r < m; r++)
                prepare_x_row((const float *)x.buf + r * k, k, it->act_q8k, variant, it->G, qbuf, &xl, r);
#ifdef K3_X86
            if (amx) {
                amx_prepare_x(&xl, m, nsubp, amx_xb, amx_dxv);
                const amxjob_t aj = {w.buf, qtype, n_out, k, m, rb, k / 32, nsubp, amx_xb, amx_dxv, y.buf};
#ifdef _OPENMP
                if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
                    for (int t = 0; t < nthreads; t++)
                        amx_columns(&aj, n_out * t / nthreads, n_out * (t + 1) / nthreads, scratch + (int64_t)t * scratch_bytes);
                } else
#endif
                    amx_columns(&aj, 0, n_out, scratch);
            } else
#endif
#ifdef _OPENMP
            if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
                for (int t = 0; t < nthreads; t++)
                    i8_columns(&jb, n_out * t / nthreads, n_out * (t + 1) / nthreads,
                               scratch + (int64_t)t * I8_SCRATCH_BYTES);
            } else
#endif
                i8_columns(&jb, 0, n_out, scratch);
            Py_END_ALLOW_THREADS
#ifdef K3_X86
            amx_calls += amx;
#endif
            ret = Py_NewRef(Py_None);
        }
        free(xl.q);
        free(xl.xn);
        free(xl.dx);
        free(xl.dxs);
        free(xl.corr);
        free(xl.qt);
        free(xl.dxt);
        free(xl.dxst);
        free(xl.corrt);
        free(qbuf);
        free(scratch);
        free(amx_xb);
        free(amx_dxv);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

/* amx() -> (in use, products run on it so far): whether matmul_q8 takes AMX-INT8 for Q8_0 and
 * MXFP4 products of many rows (the CPU has it, Linux granted the tile state, K3KIT_NO_AMX unset). */
static PyObject *py_amx(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
#ifdef K3_X86
    return Py_BuildValue("(Ol)", use_amx ? Py_True : Py_False, amx_calls);
#else
    return Py_BuildValue("(Ol)", Py_False, 0L);
#endif
}

static PyObject *py_simd_i8(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    static const char *names[] = {"scalar", "avx2", "avx512vnni"};
    return PyUnicode_FromString(names[use_i8]);
}

/* ---- dequantize: rows of W as float32 or bfloat16 ------------------------------------------
 * The panel decoders' PANEL_F32 / PANEL_BF16 modes over whole rows. QuantizedMatrix uses this
 * for products with many rows and a 16-bit compute dtype: a chunk of W's rows dequantized into a
 * bounded buffer, multiplied by torch's GEMM, the next chunk into the same buffer. */
static void dequant_rows(const qtype_t *qt, int level, const uint8_t *w, int64_t n0, int64_t n1, int64_t k,
                         void *out, int bf16) {
    const panel_fn panel = qt->panel[level > 0];
    const int64_t nb = k / qt->qk, rb = nb * qt->bytes;
    for (int64_t p0 = n0; p0 < n1; p0 += BLK_NP) {
        const int np = n1 - p0 < BLK_NP ? (int)(n1 - p0) : BLK_NP;
        void *dst = bf16 ? (void *)((uint16_t *)out + p0 * k) : (void *)((float *)out + p0 * k);
        panel(w + p0 * rb, rb, np, 0, nb, dst, k, NULL, bf16 ? PANEL_BF16 : PANEL_F32);
    }
}

/* dequantize(qtype, w, out, n_rows, k, bf16=0, simd=-1, threads=1): the n_rows x k matrix W held
 * as its bytes in w into out (contiguous float32, or bfloat16 bits as 2-byte items with bf16=1),
 * rows split over threads. */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    Py_buffer w, out;
    Py_ssize_t n_rows, k;
    int qtype, bf16 = 0, simd = -1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*w*nn|iii", &qtype, &w, &out, &n_rows, &k, &bf16, &simd, &threads)) return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    const Py_ssize_t item = bf16 ? 2 : 4;
    if (qt == NULL) {
        PyErr_Format(PyExc_ValueError, "dequantize: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "dequantize: %s needs the IQ grids (init_tables was not called)",
                     qt->name);
    } else if (n_rows < 0 || k < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "dequantize: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w.len != n_rows * (k / qt->qk) * qt->bytes) {
        PyErr_Format(PyExc_ValueError, "dequantize: %s weight buffer is %zd bytes, expected %zd", qt->name, w.len,
                     (Py_ssize_t)(n_rows * (k / qt->qk) * qt->bytes));
    } else if (out.len != n_rows * k * item) {
        PyErr_SetString(PyExc_ValueError, "dequantize: output buffer has the wrong size");
    } else {
        const int level = simd < 0 || simd > use_simd ? use_simd : simd;
        const int nthreads = split_threads(n_rows, k, threads);
        (void)nthreads;
        Py_BEGIN_ALLOW_THREADS
#ifdef _OPENMP
        if (nthreads > 1) {
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
            for (int t = 0; t < nthreads; t++)
                dequant_rows(qt, level, w.buf, n_rows * t / nthreads, n_rows * (t + 1) / nthreads, k, out.buf, bf16);
        } else
#endif
            dequant_rows(qt, level, w.buf, 0, n_rows, k, out.buf, bf16);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return ret;
}

/* Check one table argument, `entries` rows of `width` int8 values each in [lo, hi], and pack
 * it (times `mul`) into 64- or 32-bit words at dst. */
static int load_table(const char *name, Py_buffer *buf, Py_ssize_t entries, int width, int lo, int hi, int mul,
                      void *dst) {
    if (buf->len != entries * width) {
        PyErr_Format(PyExc_ValueError, "init_tables: %s has %zd bytes, expected %zd", name, buf->len,
                     entries * width);
        return -1;
    }
    const int8_t *src = buf->buf;
    for (Py_ssize_t e = 0; e < entries; e++) {
        uint64_t word = 0;
        for (int j = 0; j < width; j++) {
            const int v = src[e * width + j];
            if (v < lo || v > hi) {
                PyErr_Format(PyExc_ValueError, "init_tables: %s entry %zd has value %d outside [%d, %d]", name,
                             e, v, lo, hi);
                return -1;
            }
            word |= (uint64_t)(uint8_t)(int8_t)(v * mul) << (8 * j);
        }
        if (width == 8) ((uint64_t *)dst)[e] = word;
        else ((uint32_t *)dst)[e] = (uint32_t)word;
    }
    return 0;
}

/* init_tables(iq2xxs, iq2xs, iq3xxs, iq1s, ksigns): ggml's iq2xxs_grid [256 x 8], iq2xs_grid
 * [512 x 8], iq3xxs_grid [256 x 4] (uint8 values), iq1s_grid [2048 x 8] (int8 -1/0/1) and
 * ksigns_iq2xs [128] as contiguous byte buffers. The grid values must stay int8 after a sign
 * (and, for IQ1, after the factor 8), which the checks enforce. Everything is checked before
 * anything is replaced: a rejected call leaves the tables as they were. */
static PyObject *py_init_tables(PyObject *self, PyObject *args) {
    static uint64_t g2xxs[256], g2xs[512], g1[2048], signs[128];
    static uint32_t g3xxs[256];
    Py_buffer b[5];
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*", &b[0], &b[1], &b[2], &b[3], &b[4])) return NULL;
    int ok = load_table("iq2xxs", &b[0], 256, 8, 1, 62, 1, g2xxs) == 0 &&
             load_table("iq2xs", &b[1], 512, 8, 1, 127, 1, g2xs) == 0 &&
             load_table("iq3xxs", &b[2], 256, 4, 1, 62, 1, g3xxs) == 0 &&
             load_table("iq1s", &b[3], 2048, 8, -1, 1, 8, g1) == 0;
    if (ok && b[4].len != 128) {
        PyErr_Format(PyExc_ValueError, "init_tables: ksigns has %zd bytes, expected 128", b[4].len);
        ok = 0;
    }
    if (ok) {
        const uint8_t *ks = b[4].buf;
        for (int i = 0; i < 128; i++) {
            uint64_t mask = 0;
            for (int j = 0; j < 8; j++)
                if (ks[i] >> j & 1) mask |= 0xFFULL << (8 * j);
            signs[i] = mask;
        }
        memcpy(IQ2XXS_GRID, g2xxs, sizeof g2xxs);
        memcpy(IQ2XS_GRID, g2xs, sizeof g2xs);
        memcpy(IQ3XXS_GRID, g3xxs, sizeof g3xxs);
        memcpy(IQ1S_GRID8, g1, sizeof g1);
        memcpy(SIGN_MASK, signs, sizeof signs);
        tables_ready = 1;
    }
    for (int i = 0; i < 5; i++) PyBuffer_Release(&b[i]);
    return ok ? Py_NewRef(Py_None) : NULL;
}

static PyObject *py_simd(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    static const char *names[] = {"scalar", "avx2", "avx512"};
    return PyUnicode_FromString(names[use_simd]);
}

static PyObject *py_types(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *t = PyTuple_New(N_QTYPES);
    if (t == NULL) return NULL;
    for (int i = 0; i < N_QTYPES; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(QTYPES[i].ggml_type));
    return t;
}

/* tiling(qtype): the many-row drivers' geometry, so tests and benchmarks can size products that
 * cross every edge. */
static PyObject *py_tiling(PyObject *self, PyObject *args) {
    int qtype;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &qtype)) return NULL;
    const qtype_t *qt = find_qtype(qtype);
    if (qt == NULL) return PyErr_Format(PyExc_ValueError, "tiling: no native kernel for ggml type %d", qtype);
    return Py_BuildValue("{sisisisisi}", "blocked_from", qt->blocked_from, "panel_rows", BLK_NP, "panel_values",
                         BLK_KC, "row_block", BLK_MB, "factored", qt->factored);
}

/* ---- stacks of per-head matrices (MLA's attn_k_b / attn_v_b) ----------------------------------
 * A 3-D ggml tensor [k, n_out, heads] is `heads` matrices, each multiplying its own rows of x.
 * One call runs every head, so a decode step pays one call per stack instead of one per head. */

/* One thread's int8 buffers for m rows of x (prepare_x_row's layout), its q8 row and panels. */
typedef struct {
    xlane_t xl;
    uint8_t *qbuf, *scratch;
} heads_buf_t;

static void heads_buf_free(heads_buf_t *b) {
    free(b->xl.q);
    free(b->xl.xn);
    free(b->xl.dx);
    free(b->xl.dxs);
    free(b->xl.corr);
    free(b->xl.qt);
    free(b->xl.dxt);
    free(b->xl.dxst);
    free(b->xl.corrt);
    free(b->qbuf);
    free(b->scratch);
    memset(b, 0, sizeof *b);
}

/* Sizes as matmul_q8 allocates them; 0 when out of memory. */
static int heads_buf_alloc(heads_buf_t *b, int64_t m, int64_t ngroups, int64_t gv, int64_t qbytes,
                           int transposed, int panels) {
    memset(b, 0, sizeof *b);
    b->xl.ngroups = ngroups;
    b->xl.gv = gv;
    const size_t vals = (size_t)(m * ngroups * gv + 64), lanes = (size_t)(m * ngroups * 16 * 4 + 64);
    b->xl.q = aligned_alloc(64, vals);
    b->xl.xn = aligned_alloc(64, vals);
    b->xl.dx = aligned_alloc(64, lanes);
    b->xl.dxs = aligned_alloc(64, lanes);
    b->xl.corr = aligned_alloc(64, lanes);
    b->qbuf = malloc((size_t)qbytes + 64);
    int ok = b->xl.q && b->xl.xn && b->xl.dx && b->xl.dxs && b->xl.corr && b->qbuf;
    if (transposed) {
        b->xl.qt = aligned_alloc(64, vals);
        b->xl.dxt = aligned_alloc(64, lanes);
        b->xl.dxst = aligned_alloc(64, lanes);
        b->xl.corrt = aligned_alloc(64, lanes);
        ok = ok && b->xl.qt && b->xl.dxt && b->xl.dxst && b->xl.corrt;
    }
    if (panels) {
        b->scratch = aligned_alloc(64, (size_t)I8_SCRATCH_BYTES);
        ok = ok && b->scratch;
    }
    return ok;
}

/* What every head of one call shares. */
typedef struct {
    const uint8_t *w;
    const float *x;
    float *y;
    int64_t heads, n_out, k, m, w_stride;
    const qtype_t *qt;
    const i8type_t *it;
    int level, i8;
    i8direct_fn dfn;       /* int8: the direct path's kernel, NULL for panels */
    int64_t nchunk;        /* int8: as matmul_q8's */
} heads_job_t;

/* Head h's x rows into b (int8 only). */
static void heads_prepare(const heads_job_t *hj, int64_t h, heads_buf_t *b) {
    for (int64_t r = 0; r < hj->m; r++)
        prepare_x_row(hj->x + (h * hj->m + r) * hj->k, hj->k, hj->it->act_q8k, 1, hj->it->G, b->qbuf, &b->xl, r);
}

/* Columns [n0, n1) of head h: int8 from b's prepared rows, or the float kernel (fscratch:
 * SCRATCH_FLOATS floats, or NULL for the per-row tiles). */
static void heads_columns(const heads_job_t *hj, int64_t h, const heads_buf_t *b, float *fscratch, int64_t n0,
                          int64_t n1) {
    const uint8_t *w = hj->w + h * hj->w_stride;
    float *y = hj->y + h * hj->m * hj->n_out;
    if (hj->i8) {
        const i8job_t jb = {w, hj->it->panel[hj->level > 0], hj->qt->qk, hj->qt->bytes, hj->n_out, hj->k, hj->m,
                            hj->it->G, hj->it->has_min, hj->level, &b->xl, y, hj->dfn, hj->nchunk};
        i8_columns(&jb, n0, n1, b->scratch);
    } else {
        hj->qt->fn[hj->level](w, n0, n1, hj->n_out, hj->k, hj->x + h * hj->m * hj->k, hj->m, y, fscratch);
    }
}

/* matmul_heads(qtype, w, x, y, heads, n_out, k, m, w_stride, i8=1, simd=-1, threads=1): for every
 * h < heads, y[h] = x[h] @ W_h.T with W_h the ggml matrix [n_out, k] of type qtype starting at byte
 * h * w_stride of w; x float32 [heads, m, k], y float32 [heads, m, n_out], contiguous. i8 = 1:
 * ggml's int8 arithmetic, each head's result bit for bit matmul_q8(qtype, W_h, x[h], y[h], n_out,
 * k, m, simd) (variant 1, path -1); i8 = 0: the float kernels, bit for bit matmul(...) (path -1).
 * simd as the matching single-matrix entry. Threads: whole heads per thread when the heads are
 * at least as many as the threads (each thread quantizes the x rows it multiplies), else head by
 * head with W_h's output columns split; a result never depends on the split. */
static PyObject *py_matmul_heads(PyObject *self, PyObject *args) {
    Py_buffer w, x, y;
    Py_ssize_t heads, n_out, k, m, w_stride;
    int qtype, i8 = 1, simd = -1, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*w*nnnnn|iii", &qtype, &w, &x, &y, &heads, &n_out, &k, &m, &w_stride, &i8,
                          &simd, &threads))
        return NULL;
    PyObject *ret = NULL;
    const qtype_t *qt = find_qtype(qtype);
    const i8type_t *it = find_i8type(qtype);
    const Py_ssize_t rb = qt != NULL && k >= 0 ? k / qt->qk * qt->bytes : 0;
    if (qt == NULL || (i8 && it == NULL)) {
        PyErr_Format(PyExc_ValueError, "matmul_heads: no native kernel for ggml type %d", qtype);
    } else if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "matmul_heads: %s needs the IQ grids (init_tables was not called)",
                     qt->name);
    } else if (heads < 0 || n_out < 0 || k < 0 || m < 0 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "matmul_heads: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
    } else if (w_stride < n_out * rb || (heads > 0 && w.len < (heads - 1) * w_stride + n_out * rb)) {
        PyErr_Format(PyExc_ValueError, "matmul_heads: %s weight buffer of %zd bytes does not hold %zd heads of "
                     "%zd bytes at a stride of %zd", qt->name, w.len, heads, n_out * rb, w_stride);
    } else if (x.len != heads * m * k * (Py_ssize_t)sizeof(float)
               || y.len != heads * m * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "matmul_heads: activation or output buffer has the wrong size");
    } else if (heads == 0 || m == 0 || n_out == 0 || k == 0) {
        if (y.len) memset(y.buf, 0, (size_t)y.len);
        ret = Py_NewRef(Py_None);
    } else {
        heads_job_t hj = {w.buf, x.buf, y.buf, heads, n_out, k, m, w_stride, qt, it, 0, i8 != 0, NULL, 0};
        int nthreads = split_threads(heads * n_out, k, threads);
        const int by_head = heads >= nthreads, nbuf = by_head ? nthreads : 1;
        int panels, transposed = 0;
        int64_t ngroups = 0, gv = 0, qbytes = 0;
        if (hj.i8) {   /* matmul_q8's choice of path, for path -1 */
            hj.level = simd < 0 || simd > use_i8 ? use_i8 : simd;
            gv = 16 * (int64_t)it->G;
            ngroups = (k + gv - 1) / gv;
            qbytes = it->act_q8k ? k / 256 * Q8_K_BYTES : k / 32 * 34;
            const int direct = hj.level > 0 && m < (hj.level == 2 ? it->ft_below : it->direct_below);
            transposed = direct && hj.level == 2 && m >= it->ft_from;
            hj.dfn = !direct ? NULL : transposed ? it->direct[4] : hj.level == 2 ? it->direct[3]
                                                                                 : it->direct[hj.level];
            hj.nchunk = m > 8 ? (I8_CHUNK_BYTES + rb - 1) / rb : 0;
            panels = !direct;
        } else {
            hj.level = simd < 0 || simd > use_simd ? use_simd : simd;
            panels = hj.level == 0 || m >= qt->blocked_from;
        }
        heads_buf_t bufs[MAX_THREADS];
        float *fscratch = NULL;
        int ok = 1;
        memset(bufs, 0, sizeof bufs);
        if (hj.i8) {
            for (int t = 0; t < nbuf; t++)
                ok = ok && heads_buf_alloc(&bufs[t], m, ngroups, gv, qbytes, transposed, 0);
            for (int t = 0; t < nthreads && panels; t++)     /* column splits need one panel each */
                ok = ok && (bufs[t].scratch = aligned_alloc(64, (size_t)I8_SCRATCH_BYTES)) != NULL;
        } else if (panels) {
            fscratch = aligned_alloc(64, (size_t)nthreads * SCRATCH_FLOATS * sizeof(float));
            ok = fscratch != NULL;
        }
        if (!ok) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            if (by_head) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
#endif
                for (int t = 0; t < nthreads; t++) {
                    float *fs = fscratch ? fscratch + (int64_t)t * SCRATCH_FLOATS : NULL;
                    for (int64_t h = heads * t / nthreads; h < heads * (t + 1) / nthreads; h++) {
                        if (hj.i8) heads_prepare(&hj, h, &bufs[t]);
                        heads_columns(&hj, h, &bufs[t], fs, 0, n_out);
                    }
                }
            } else {
                for (int64_t h = 0; h < heads; h++) {
                    if (hj.i8) heads_prepare(&hj, h, &bufs[0]);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
#endif
                    for (int t = 0; t < nthreads; t++) {
                        heads_buf_t b = bufs[0];
                        b.scratch = bufs[t].scratch;
                        heads_columns(&hj, h, &b, fscratch ? fscratch + (int64_t)t * SCRATCH_FLOATS : NULL,
                                      n_out * t / nthreads, n_out * (t + 1) / nthreads);
                    }
                }
            }
            Py_END_ALLOW_THREADS
            ret = Py_NewRef(Py_None);
        }
        for (int t = 0; t < MAX_THREADS; t++) heads_buf_free(&bufs[t]);
        free(fscratch);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

/* ---- a layer's routed experts in one call per projection ---------------------------------------
 * A decode step runs each routed expert on one row: per expert and projection, matmul_q8 would
 * quantize that row again and fork and join the threads again. experts_q8 runs every expert's
 * product of one projection (or gate and up together) in one parallel region, each segment of
 * x quantized once for all the matrices that multiply it. */

/* experts_q8(qtype, ws, x, y, counts, n_out, k, per, threads=1): x float32 [P, k] is segments
 * of counts[s] rows (P = sum(counts), segment s from row sum(counts[:s])), ws a sequence of
 * len(counts) * per weight buffers, each a ggml matrix [n_out, k] of type qtype; matrix j < per
 * of segment s (ws[s * per + j]) multiplies that segment's rows into y[j] (float32 [per, P,
 * n_out]) at the same rows. Each segment's result is bit for bit matmul_q8(qtype, ws[s * per +
 * j], x_s, y_s, n_out, k, counts[s]) (variant 1, path -1: the same kernels for the same row
 * count), the output columns of every product split over the threads inside one parallel
 * region; a result never depends on the split. */
static PyObject *py_experts_q8(PyObject *self, PyObject *args) {
    PyObject *ws_obj, *counts_obj;
    Py_buffer x, y;
    Py_ssize_t n_out, k;
    int qtype, per, threads = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "iOy*w*Onni|i", &qtype, &ws_obj, &x, &y, &counts_obj, &n_out, &k, &per, &threads))
        return NULL;
    PyObject *ret = NULL, *ws_seq = NULL, *counts_seq = NULL;
    Py_buffer *wb = NULL;
    int64_t *cnt = NULL;
    heads_buf_t *bufs = NULL;
    uint8_t *scratch = NULL;
    Py_ssize_t nw = 0, got = 0, E = 0, P = 0;
    const qtype_t *qt = find_qtype(qtype);
    const i8type_t *it = find_i8type(qtype);
    if (qt == NULL || it == NULL) {
        PyErr_Format(PyExc_ValueError, "experts_q8: no native kernel for ggml type %d", qtype);
        goto done;
    }
    if (qt->needs_tables && !tables_ready) {
        PyErr_Format(PyExc_RuntimeError, "experts_q8: %s needs the IQ grids (init_tables was not called)", qt->name);
        goto done;
    }
    if (n_out < 0 || k < 0 || per < 1 || k % qt->qk) {
        PyErr_Format(PyExc_ValueError, "experts_q8: bad dimensions (k must be a multiple of %d for %s)",
                     (int)qt->qk, qt->name);
        goto done;
    }
    ws_seq = PySequence_Fast(ws_obj, "experts_q8: ws must be a sequence of buffers");
    counts_seq = ws_seq ? PySequence_Fast(counts_obj, "experts_q8: counts must be a sequence of ints") : NULL;
    if (counts_seq == NULL) goto done;
    E = PySequence_Fast_GET_SIZE(counts_seq);
    nw = PySequence_Fast_GET_SIZE(ws_seq);
    if (nw != E * per) {
        PyErr_Format(PyExc_ValueError, "experts_q8: %zd weights for %zd segments of %d matrices", nw, E, per);
        goto done;
    }
    const int64_t rb = k / qt->qk * qt->bytes;
    cnt = malloc(sizeof *cnt * (size_t)(E + 1));
    wb = calloc((size_t)(nw + 1), sizeof *wb);
    bufs = calloc((size_t)(E + 1), sizeof *bufs);
    if (!cnt || !wb || !bufs) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t s = 0; s < E; s++) {
        cnt[s] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(counts_seq, s));
        if (cnt[s] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "experts_q8: negative row count");
            goto done;
        }
        P += cnt[s];
    }
    for (; got < nw; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(ws_seq, got), &wb[got], PyBUF_SIMPLE) < 0) goto done;
        if (wb[got].len != n_out * rb) {
            PyErr_Format(PyExc_ValueError, "experts_q8: %s weight %zd is %zd bytes, expected %zd", qt->name, got,
                         wb[got].len, (Py_ssize_t)(n_out * rb));
            got++;
            goto done;
        }
    }
    if (x.len != P * k * (Py_ssize_t)sizeof(float) || y.len != per * P * n_out * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "experts_q8: activation or output buffer has the wrong size");
        goto done;
    }
    if (P == 0 || n_out == 0 || k == 0) {
        if (y.len) memset(y.buf, 0, (size_t)y.len);
        ret = Py_NewRef(Py_None);
        goto done;
    }
    {
        const int level = use_i8;
        const int nthreads = split_threads(n_out, k * (int64_t)nw, threads);
        const int64_t gv = 16 * (int64_t)it->G, ngroups = (k + gv - 1) / gv;
        const int64_t qbytes = it->act_q8k ? k / 256 * Q8_K_BYTES : k / 32 * 34;
        /* per segment, matmul_q8's path -1 for its row count */
        i8direct_fn *dfn = calloc((size_t)(E + 1), sizeof *dfn);
        int ok = dfn != NULL, any_panels = 0;
        for (Py_ssize_t s = 0; s < E && ok; s++) {
            const int64_t m = cnt[s];
            if (m == 0) continue;
            const int direct = level > 0 && m < (level == 2 ? it->ft_below : own_avx2_below(qtype, it->direct_below));
            const int transposed = direct && level == 2 && m >= it->ft_from;
            const i8direct_fn d0 = !direct ? NULL : transposed ? it->direct[4] : level == 2 ? it->direct[3]
                                                                                            : it->direct[level];
            dfn[s] = own_direct_fn(it, qtype, d0, m);
            any_panels |= !direct;
            ok = heads_buf_alloc(&bufs[s], m, ngroups, gv, qbytes, transposed, 0);
        }
        if (ok && any_panels) {
            scratch = aligned_alloc(64, (size_t)nthreads * I8_SCRATCH_BYTES);
            ok = scratch != NULL;
        }
        if (!ok) {
            free(dfn);
            PyErr_NoMemory();
            goto done;
        }
        const float *xs = x.buf;
        float *ys = y.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t s = 0, off = 0; s < E; off += cnt[s], s++)
            for (int64_t r = 0; r < cnt[s]; r++)
                prepare_x_row(xs + (off + r) * k, k, it->act_q8k, 1, it->G, bufs[s].qbuf, &bufs[s].xl, r);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nthreads) schedule(static, 1) if (nthreads > 1)
#endif
        for (int t = 0; t < nthreads; t++) {
            const int64_t n0 = n_out * t / nthreads, n1 = n_out * (t + 1) / nthreads;
            uint8_t *sc = scratch ? scratch + (int64_t)t * I8_SCRATCH_BYTES : NULL;
            for (Py_ssize_t s = 0, off = 0; s < E; off += cnt[s], s++) {
                const int64_t m = cnt[s];
                if (m == 0) continue;
                for (int j = 0; j < per; j++) {
                    const i8job_t jb = {wb[s * per + j].buf, it->panel[level > 0], qt->qk, qt->bytes, n_out, k, m,
                                        it->G, it->has_min, level, &bufs[s].xl, ys + ((int64_t)j * P + off) * n_out,
                                        dfn[s], m > 8 ? (I8_CHUNK_BYTES + rb - 1) / rb : 0};
                    i8_columns(&jb, n0, n1, sc);
                }
            }
        }
        Py_END_ALLOW_THREADS
        free(dfn);
        ret = Py_NewRef(Py_None);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&wb[i]);
    if (bufs != NULL)
        for (Py_ssize_t s = 0; s < E; s++) heads_buf_free(&bufs[s]);
    free(bufs);
    free(wb);
    free(cnt);
    free(scratch);
    Py_XDECREF(ws_seq);
    Py_XDECREF(counts_seq);
    PyBuffer_Release(&x);
    PyBuffer_Release(&y);
    return ret;
}

static PyMethodDef methods[] = {
    {"matmul", py_matmul, METH_VARARGS, "y = x @ W.T for a quantized ggml W (see the module source)."},
    {"dequantize", py_dequantize, METH_VARARGS, "W's rows as float32 or bfloat16 (see the module source)."},
    {"init_tables", py_init_tables, METH_VARARGS, "Load the IQ grids and ksigns (gguf-py's data)."},
    {"simd", py_simd, METH_NOARGS, "The best path the CPU runs: 'avx512', 'avx2' or 'scalar'."},
    {"types", py_types, METH_NOARGS, "The ggml type ids with a native kernel."},
    {"tiling", py_tiling, METH_VARARGS, "The many-row drivers' geometry (rows, panel sizes)."},
    {"quantize_q8", py_quantize_q8, METH_VARARGS, "Rows of x as ggml Q8_0 / Q8_K blocks (ggml's bytes)."},
    {"matmul_q8", py_matmul_q8, METH_VARARGS, "y = x @ W.T in ggml's int8-activation arithmetic."},
    {"simd_i8", py_simd_i8, METH_NOARGS, "The best int8 path: 'avx512vnni', 'avx2' or 'scalar'."},
    {"amx", py_amx, METH_NOARGS, "(AMX-INT8 in use, products run on it): see the module source."},
    {"matmul_heads", py_matmul_heads, METH_VARARGS, "y[h] = x[h] @ W_h.T for a stack of per-head ggml matrices."},
    {"experts_q8", py_experts_q8, METH_VARARGS, "Every routed expert's product of one projection, int8 arithmetic."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qmatmul", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__qmatmul(void) {
    init_e8m0();
#ifdef K3_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        use_simd = 1;
    if (use_simd && __builtin_cpu_supports("avx512f")) use_simd = 2;
    use_i8 = use_simd >= 1;
    if (use_simd == 2 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("bmi2"))
        use_i8 = 2;
    use_vbmi = use_i8 == 2 && __builtin_cpu_supports("avx512vbmi");
    q8_avx512 = use_simd == 2 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    if (use_i8 == 2) {
        const char *no_amx = getenv("K3KIT_NO_AMX");
        use_amx = (no_amx == NULL || no_amx[0] == '\0' || strcmp(no_amx, "0") == 0) && amx_init();
    }
#endif
    return PyModule_Create(&module);
}
