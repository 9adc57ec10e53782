/* qm.h: what every file of the _qmatmul extension shares. The map is README.md in this folder.
 *
 * The extension is split by instruction set first (the scalar reference, the float products'
 * vector paths, the int8 products' generic vector paths, AVX2's and AVX512-VNNI's kernels of
 * their own, AMX), then by type family where the code differs per family; the block layouts
 * every path reads are in qm_blocks.h. Here: the contract below, the loads and f16 helpers, the
 * tables init_tables() fills, the panel geometry, and the declarations of the float kernels and
 * the type table. Functions one file defines and another calls are declared once, in this
 * header or qm_i8.h, with hidden visibility: only PyInit__qmatmul leaves the shared object. */
#ifndef K3_QM_H
#define K3_QM_H

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
 * use AVX-512 VNNI: it multiplies int8 by int8. matmul_q8 ("int8 activations" in qm_i8.h) is the
 * other arithmetic, ggml's own: x rounded to int8 blocks first, then VNNI integer products,
 * with its own contract. A call may split its output columns over OpenMP threads (the caller
 * passes torch's thread count).
 */
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
#endif

#define INLINE static inline __attribute__((always_inline))
#define AVX2_TARGET "avx2,fma,f16c"
#define AVX512_TARGET "avx512f,avx2,fma,f16c"
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,bmi2"

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

#pragma GCC visibility push(hidden)
extern uint64_t IQ2XXS_GRID[256];   /* iq2xxs_grid: 8 bytes 0x08/0x19/0x2b per entry */
extern uint64_t IQ2XS_GRID[512];    /* iq2xs_grid */
extern uint32_t IQ3XXS_GRID[256];   /* iq3xxs_grid: 4 bytes per entry */
extern uint64_t IQ1S_GRID8[2048];   /* iq1s_grid (-1, 0, 1) times 8, as int8 bytes */
extern uint64_t SIGN_MASK[128];     /* ksigns_iq2xs[i]: byte j = 0xFF where bit j is set */
extern int tables_ready;
/* MXFP4's halved scales per exponent byte (ggml_e8m0_to_fp32_half), filled at import. */
extern float E8M0_HALF[256];
void init_e8m0(void);
#pragma GCC visibility pop

#include "qm_blocks.h"

/* ---- many rows: each block decoded once ----------------------------------------------------
 * The many-row driver takes x in blocks of BLK_MB rows (accumulators for BLK_MB x BLK_NP pairs,
 * and that block of x stays in cache while W streams past), and W in panels of BLK_NP rows and
 * BLK_KC values: a panel is decoded once into float32 (panel_T: each row's values in element
 * order, exactly the weights the per-row tiles (qm_float_simd.c) make; for FACTORED types the integer values,
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
/* ---- the float kernels (qm_scalar.c; on x86 qm_float_simd.c) and the type table ------------
 * QM_TYPES(X): X(T, name_lc, HAS_MIN) for every type with a native kernel. */
#define QM_TYPES(X)                                                                                 \
    X(Q8_0, q8_0, 0) X(Q4_K, q4_k, 1) X(Q5_K, q5_k, 1) X(Q6_K, q6_k, 0) X(Q2_K, q2_k, 1) X(Q3_K, q3_k, 0) \
    X(IQ2_XXS, iq2_xxs, 0) X(IQ2_XS, iq2_xs, 0) X(IQ3_XXS, iq3_xxs, 0) X(IQ1_S, iq1_s, 0)           \
    X(IQ1_M, iq1_m, 0) X(MXFP4, mxfp4, 0)
/* A type's kernel_fn and panel_fn per path (the definitions carry their target attributes). */
#define QM_FLOAT_DECLS(T, NAME_LC, HAS_MIN)                                                         \
    void NAME_LC##_scalar(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k, const float *x, \
                          int64_t m, float *y, float *scratch);                                     \
    void panel_##NAME_LC##_scalar(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk, void *out, \
                                  int64_t ldw, float *sb, int mode);
#define QM_FLOAT_DECLS_X86(T, NAME_LC, HAS_MIN)                                                     \
    void NAME_LC##_avx2(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k, const float *x, \
                        int64_t m, float *y, float *scratch);                                       \
    void NAME_LC##_avx512(const uint8_t *w, int64_t n0, int64_t n1, int64_t n_out, int64_t k, const float *x, \
                          int64_t m, float *y, float *scratch);                                     \
    void panel_##NAME_LC##_avx2(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t nbk, void *out, \
                                int64_t ldw, float *sb, int mode);
#pragma GCC visibility push(hidden)
QM_TYPES(QM_FLOAT_DECLS)
#ifdef K3_X86
QM_TYPES(QM_FLOAT_DECLS_X86)
#endif
#pragma GCC visibility pop

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

#define MAX_THREADS 256

#pragma GCC visibility push(hidden)
/* qm_dispatch.c: the type table (N_QTYPES entries), what the CPU runs, the thread split. */
extern const qtype_t QTYPES[];
extern const int n_qtypes;
#define N_QTYPES n_qtypes
const qtype_t *find_qtype(int ggml_type);
/* 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512F: the best this CPU runs, set at import. */
extern int use_simd;
int split_threads(int64_t n_out, int64_t k, int threads);
void qm_detect_cpu(void);
#pragma GCC visibility pop

#endif
