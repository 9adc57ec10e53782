/* qm_i8.h: what the int8-activation products (ggml's arithmetic, matmul_q8) share across files:
 * the contract, the geometry of panels and direct passes, x's lane layout (xlane_t), the job a
 * range of output columns runs, the per-type table's shape, and the declarations of the int8
 * functions other files call. The float products' counterpart is qm.h. */
#ifndef K3_QM_I8_H
#define K3_QM_I8_H

#include "qm.h"

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

#define I8_DIRECT_ROWS 8    /* x rows per pass over W on the direct path */

#define Q8_K_BYTES 292   /* float d, int8 qs[256], int16 bsums[16] */

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

/* An int8 panel: np rows of W, values c0 .. c0 + kc - 1, as transposed bytes (q, or q + 128
 * with u8 set) at wq (row stride I8_KC), and per lane ws and mn (row stride I8_GMAX * 16). */
typedef void (*i8panel_fn)(const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t kc, uint8_t *wq,
                           float *ws, float *wmn, int u8);

/* Lane of sub-block u's half h within its group (u counted from the group's start). */
static inline int lane_of(int G, int u, int h) { return G == 32 ? u : u + 8 * h; }

#define I8_G(T) (T##_PER16 ? 16 : 32)

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

/* Per type: lane width G, whether the weights have a min, the activation type (ggml's
 * vec_dot_type: Q8_0 for Q8_0 and MXFP4, Q8_K for the rest), the panel decoders. */
typedef struct {
    int ggml_type, G, has_min, act_q8k, direct_below, fast_below, ft_from, ft_below;
    /* fast_below: what path 5 (the folding 512-bit path alone, as before the transposed one) uses */
    i8panel_fn panel[2];   /* scalar, vector */
    i8direct_fn direct[5]; /* -, AVX2, VNNI, VNNI fast (512-bit), VNNI transposed (512-bit) */
} i8type_t;

#ifdef K3_X86
/* AMX-INT8 (qm_amx.c): the job and the scratch the entry points size. */
/* Rows from which matmul_q8's default path takes AMX (measured, see RESULTS.md). */
#define AMX_FROM_Q8_0 12
#define AMX_FROM_MXFP4 12
#define AMX_ACC_BYTES (16 * 8 * 16 * 4)    /* acc[n][pair][(r, h)]: W rows x lane pairs x 16, float */
#define AMX_C_BYTES (2 * 4 * 16 * 64)      /* two sets of four stored C tiles */
/* scratch per thread: acc, the stored C tiles, twice (this W block, the next) ws[n][u] and the
 * decoded W block (16 rows of nsubp sub-blocks) */
#define AMX_SCRATCH_BYTES(nsubp) ((int64_t)AMX_ACC_BYTES + AMX_C_BYTES + 2 * 64 * (int64_t)(nsubp) + 2 * 512 * (int64_t)(nsubp) + 64)

typedef struct {
    const uint8_t *w;
    int qtype;                 /* 8 Q8_0, 39 MXFP4 */
    int64_t n_out, k, m, rb, nsub, nsubp;   /* nsubp: sub-blocks per row with the last group padded */
    const int8_t *xb;          /* per block of 8 x rows, per pair of sub-blocks: a B tile (16 x 64 bytes) */
    const float *dxv;          /* per block of 8 x rows, per pair: dx of (r, h) at 2r + h */
    float *y;
} amxjob_t;

#endif

#pragma GCC visibility push(hidden)
/* qm_dispatch.c: what the CPU runs (set at import), the type table, the own-kernel choice. */
/* 0 scalar, 1 AVX2, 2 AVX512-VNNI (with BW and VL): the best int8 path this CPU runs. */
extern int use_i8;
/* Set at import where AVX512-VBMI runs too (with use_i8 == 2): the one-row MXFP4 kernel. */
extern int use_vbmi;
#ifdef K3_X86
extern int q8_avx512;   /* set at import where AVX512-BW runs */
extern int use_amx;     /* set at import: AMX-INT8 runs, the kernel granted the tile state, no K3KIT_NO_AMX */
#endif
const i8type_t *find_i8type(int ggml_type);
int own_avx2_below(int qtype, int direct_below);
i8direct_fn own_direct_fn(const i8type_t *it, int qtype, i8direct_fn d0, int64_t m);

/* qm_i8.c: x's rows as ggml's activation blocks and in lanes; the column driver. */
void quantize_q8_0_row(const float *x, int64_t k, uint8_t *out, int variant);
void quantize_q8_k_any(const float *x, int64_t k, uint8_t *out);
void prepare_x_row(const float *x, int64_t k, int act_q8k, int variant, int G, uint8_t *qbuf, const xlane_t *xl,
                   int64_t r);
void i8_columns(const i8job_t *jb, int64_t n0, int64_t n1, uint8_t *scratch);

/* The panel tiles per level (qm_scalar.c; qm_i8_simd.c) and the per-type kernels: panel
 * decoders (qm_scalar.c; qm_i8_simd.c), the 256-bit direct paths (qm_i8_simd.c), the 512-bit
 * folding (_fast) and transposed (_ft) direct paths (qm_vnni_<family>.c). */
#define QM_I8_TILES_ARGS                                                                            \
    const i8job_t *jb, const uint8_t *wq, const float *ws, const float *wmn, int np, int64_t g0, int64_t ng, \
        int64_t r0, int mb, float *acc, int first, int last, int64_t p0
#define QM_I8_PANEL_ARGS                                                                            \
    const uint8_t *row, int64_t rb, int np, int64_t b0, int64_t kc, uint8_t *wq, float *ws, float *wmn, int u8
#define QM_I8_DIRECT_ARGS const i8job_t *jb, int64_t n0, int64_t n1, int64_t r0, int m
#define QM_I8_DECLS(T, NAME_LC, HAS_MIN) void i8panel_##NAME_LC##_scalar(QM_I8_PANEL_ARGS);
#define QM_I8_DECLS_X86(T, NAME_LC, HAS_MIN)                                                        \
    void i8panel_##NAME_LC##_avx2(QM_I8_PANEL_ARGS);                                                \
    void i8direct_##NAME_LC##_avx2(QM_I8_DIRECT_ARGS);                                              \
    void i8direct_##NAME_LC##_vnni(QM_I8_DIRECT_ARGS);                                              \
    void i8direct_##NAME_LC##_fast(QM_I8_DIRECT_ARGS);                                              \
    void i8direct_##NAME_LC##_ft(QM_I8_DIRECT_ARGS);
void i8tiles_scalar(QM_I8_TILES_ARGS);
QM_TYPES(QM_I8_DECLS)
#ifdef K3_X86
void i8tiles_avx2(QM_I8_TILES_ARGS);
void i8tiles_vnni(QM_I8_TILES_ARGS);
QM_TYPES(QM_I8_DECLS_X86)
/* AVX2's own direct kernels (qm_avx2_<family>.c; every type but IQ2_XS) and AVX512-VNNI's
 * one-row kernels (qm_vnni_row1.c). */
void i8rows_q4_k_avx2(QM_I8_DIRECT_ARGS);
void i8rows_q5_k_avx2(QM_I8_DIRECT_ARGS);
void i8rows_q6_k_avx2(QM_I8_DIRECT_ARGS);
void i8rows_q2_k_avx2(QM_I8_DIRECT_ARGS);
void i8rows_q3_k_avx2(QM_I8_DIRECT_ARGS);
void i8rows_q8_0_avx2(QM_I8_DIRECT_ARGS);
void i8rows_mxfp4_avx2(QM_I8_DIRECT_ARGS);
void i8rows_iq1_s_avx2(QM_I8_DIRECT_ARGS);
void i8rows_iq1_m_avx2(QM_I8_DIRECT_ARGS);
void i8rows_iq2_xxs_avx2(QM_I8_DIRECT_ARGS);
void i8rows_iq3_xxs_avx2(QM_I8_DIRECT_ARGS);
void i8direct_q4_k_row(QM_I8_DIRECT_ARGS);
void i8direct_mxfp4_vbmi(QM_I8_DIRECT_ARGS);
/* qm_amx.c */
void amx_columns(const amxjob_t *j, int64_t n0, int64_t n1, uint8_t *scratch);
void amx_prepare_x(const xlane_t *xl, int64_t m, int64_t nsubp, int8_t *xb, float *dxv);
#endif
#pragma GCC visibility pop

#endif
