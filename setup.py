"""Build the optional native kernels; everything else is in pyproject.toml.

The extensions are optional: where no C compiler is available the install still succeeds and
the engine falls back to torch (dequantizing, k3kit.kernels.qmatmul says which; the KDA steps,
k3kit.kernels.kda_step).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "k3kit.kernels._qmatmul",
            sources=["src/k3kit/kernels/_qmatmul.c"],
            # OpenMP: the kernel's threads come from the libgomp torch has loaded (see _qmatmul.c).
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
    ]
)
