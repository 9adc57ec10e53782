"""Build the optional native quantized-matmul kernels; everything else is in pyproject.toml.

The extension is optional: where no C compiler is available the install still succeeds and
the engine falls back to dequantizing with torch (k3kit.kernels.qmatmul says which).
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
        )
    ]
)
