"""Build the optional native kernels; everything else is in pyproject.toml.

The extensions are optional: where no C compiler is available the install still succeeds and
the engine falls back to torch (dequantizing, k3kit.kernels.qmatmul says which; the KDA steps,
k3kit.kernels.kda_step).
"""

from setuptools import Extension, setup

NATIVE = "src/k3kit/kernels/native"
QMATMUL_SOURCES = [
    "qm_module", "qm_module_multi", "qm_dispatch", "qm_tables", "qm_scalar", "qm_i8",
    "qm_float_simd", "qm_i8_simd", "qm_avx2_q8_mxfp4", "qm_avx2_kquants", "qm_avx2_iquants",
    "qm_vnni_q8_mxfp4", "qm_vnni_kquants", "qm_vnni_iquants", "qm_vnni_row1", "qm_amx",
]
# listed so that editing a header rebuilds the extension (sdist: MANIFEST.in ships them)
QMATMUL_HEADERS = ["qm", "qm_blocks", "qm_i8", "qm_x86", "qm_i8_x86", "qm_vnni", "qm_module"]

setup(
    ext_modules=[
        Extension(
            "k3kit.kernels._qmatmul",
            # one extension from the files of kernels/native (README.md there is the map)
            sources=[f"{NATIVE}/{name}.c" for name in QMATMUL_SOURCES],
            depends=[f"{NATIVE}/{name}.h" for name in QMATMUL_HEADERS],
            # OpenMP: the kernel's threads come from the libgomp torch has loaded (see run_split in
            # native/qm_module.c).
            # -ffp-contract=off: weights are ggml's `d * q - m` rounded twice, never one fused op.
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "k3kit.kernels._kda",
            sources=["src/k3kit/kernels/_kda.c"],
            # the KDA recurrence step (kernels/kda_step.py; without it the torch steps run).
            # -ffp-contract=off: the same products and sums, each rounded, on every SIMD path.
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "k3kit.kernels._attn",
            sources=["src/k3kit/kernels/_attn.c"],
            # MLA attention's two float32 products over a prompt chunk with AVX-512 (kernels/attn.py;
            # without it, or on a CPU without AVX-512F, torch's products run). Explicit FMAs only.
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "k3kit.kernels._fused",
            sources=["src/k3kit/kernels/_fused.c"],
            # row-wise norms, the attn-res mix and situ in one call each (kernels/fused.py;
            # without it the torch ops run). -ffp-contract=off: each product and sum rounded.
            # -Wno-psabi: its 8-float vectors are passed between inlined helpers, never across an ABI.
            extra_compile_args=["-O3", "-std=c11", "-fopenmp", "-ffp-contract=off", "-Wno-psabi"],
            extra_link_args=["-fopenmp", "-lm"],
            optional=True,
        ),
    ]
)
