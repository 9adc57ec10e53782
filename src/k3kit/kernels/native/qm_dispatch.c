/* qm_dispatch.c: which kernel runs. What the CPU runs (qm_detect_cpu, at import: the float
 * level, the int8 level, VBMI, AVX512-BW for the activations, AMX with Linux's permission), the
 * type tables that name each type's kernels per level with their row thresholds, the thread
 * split, and the choice of a type's own direct kernel on the default int8 path. The kernel files
 * only compute; the choices live here and in the entry points that apply them (qm_module*.c). */
#define _GNU_SOURCE   /* syscall() under -std=c11 */
#include "qm.h"
#include "qm_i8.h"
#if defined(K3_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* 0 scalar, 1 AVX2+FMA+F16C, 2 AVX-512F: the best this CPU runs, set at import. */
int use_simd = 0;

/* 0 scalar, 1 AVX2, 2 AVX512-VNNI (with BW and VL): the best int8 path this CPU runs. */
int use_i8 = 0;
/* Set at import where AVX512-VBMI runs too (with use_i8 == 2): the one-row MXFP4 kernel. */
int use_vbmi = 0;
#ifdef K3_X86
int q8_avx512 = 0;   /* set at import where AVX512-BW runs */
int use_amx = 0;     /* set at import: AMX-INT8 runs, the kernel granted the tile state, no K3KIT_NO_AMX */
#endif

/* Each type's kernels per level, for the tables below. */
#ifdef K3_X86
#define KERNELS(NAME_LC) {NAME_LC##_scalar, NAME_LC##_avx2, NAME_LC##_avx512}
#define PANELS(NAME_LC) {panel_##NAME_LC##_scalar, panel_##NAME_LC##_avx2}
#define I8PANELS(NAME_LC) {i8panel_##NAME_LC##_scalar, i8panel_##NAME_LC##_avx2}, \
                          {NULL, i8direct_##NAME_LC##_avx2, i8direct_##NAME_LC##_vnni, i8direct_##NAME_LC##_fast, \
                           i8direct_##NAME_LC##_ft}
#else /* not x86: the scalar path only */
#define KERNELS(NAME_LC) {NAME_LC##_scalar, NAME_LC##_scalar, NAME_LC##_scalar}
#define PANELS(NAME_LC) {panel_##NAME_LC##_scalar, panel_##NAME_LC##_scalar}
#define I8PANELS(NAME_LC) {i8panel_##NAME_LC##_scalar, i8panel_##NAME_LC##_scalar}, {NULL, NULL, NULL, NULL, NULL}
#endif

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

const i8type_t *find_i8type(int ggml_type) {
    for (size_t i = 0; i < sizeof I8TYPES / sizeof I8TYPES[0]; i++)
        if (I8TYPES[i].ggml_type == ggml_type) return &I8TYPES[i];
    return NULL;
}

const qtype_t QTYPES[] = {
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
const int n_qtypes = (int)(sizeof QTYPES / sizeof QTYPES[0]);


const qtype_t *find_qtype(int ggml_type) {
    for (int i = 0; i < N_QTYPES; i++)
        if (QTYPES[i].ggml_type == ggml_type) return &QTYPES[i];
    return NULL;
}

/* Below this many weights per thread a call is over before threads would have started. k3kit's
 * OpenMP threads sleep between regions (OMP_WAIT_POLICY=PASSIVE), and waking one costs about what
 * a thread's share of a 1M-weight Q8_0 row product saves: the shipped mini's 4096 x 256 head
 * took longer on 2 threads than on 1 at 1 << 19 (AMD EPYC Zen 4, 2 vCPU, 2026-12-06). */
#define MIN_WEIGHTS_PER_THREAD (1 << 21)

/* How many threads a product of n_out x k weights is split over, asked for `threads`. */
int split_threads(int64_t n_out, int64_t k, int threads) {
    const int64_t work = n_out * k;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > 1 && work / threads < MIN_WEIGHTS_PER_THREAD) threads = (int)(work / MIN_WEIGHTS_PER_THREAD);
    if (threads > n_out) threads = (int)n_out;
    return threads < 1 ? 1 : threads;
}

#ifdef K3_X86
#define MX1_FN (use_vbmi ? i8direct_mxfp4_vbmi : NULL)
#define Q4K1_FN i8direct_q4_k_row
#else
#define MX1_FN NULL
#define Q4K1_FN NULL
#endif

/* Rows below which AVX2's default path runs a type's own direct kernel ("few rows on AVX2", qm_i8_x86.h)
 * instead of the panels. Measured (AVX2-only EPYC, 7168 x 2048, 1 thread, benchmarks/
 * bench_rows.py against a build with every threshold at 65, 2026-12-03): the kernels take
 * 0.76-0.91x the panels' time for Q4_K at 12-32 rows, 0.80-0.82x for MXFP4 at 8-16 rows (even
 * at 32), 0.81-0.93x for Q8_0 at 8-16 rows (1.03x at 32), 0.67-0.72x for IQ1_S and IQ3_XXS at 4
 * rows, 0.81x at 8 (1.05-1.31x from 10: a second pass over W; IQ2_XXS and IQ1_M, the same
 * kind of kernel, by analogy), 0.52-0.82x for Q6_K at 12-64 rows (not measured beyond); Q2_K's and
 * Q3_K's (Q6_K's lanes) 0.68-0.72x and 0.73-0.91x at 16-64 rows, Q5_K's (Q4_K's) 0.83x at 16 rows
 * and 1.02x at 32 (2026-12-03). */
int own_avx2_below(int qtype, int direct_below) {
    return qtype == 12 ? 33 : qtype == 13 ? 25 : qtype == 39 ? 32 : qtype == 8 ? 24 : qtype == 18 || qtype == 19 || qtype == 16 || qtype == 29 ? 9
           : qtype == 14 || qtype == 10 || qtype == 11 ? 65 : direct_below;
}

/* The default path's direct kernel: the type's own where it has one for the direct kernel d0
 * that the row count chose (AVX512-VNNI's 512-bit folding one, for one row; AVX2's). */
i8direct_fn own_direct_fn(const i8type_t *it, int qtype, i8direct_fn d0, int64_t m) {
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

#ifdef K3_X86
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

/* Sets the levels above from what this CPU runs (at import: PyInit__qmatmul). */
void qm_detect_cpu(void) {
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
}
