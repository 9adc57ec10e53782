"""Build the optional native MXFP4 kernel; everything else is in pyproject.toml.

The extension is optional: where no C compiler is available the install still succeeds and
the engine falls back to dequantizing experts with torch (k3kit.runtime.qmatmul says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "k3kit.runtime._mxfp4",
            sources=["src/k3kit/runtime/_mxfp4.c"],
            # OpenMP: the kernel's threads come from the libgomp torch has loaded (see _mxfp4.c)
            extra_compile_args=["-O3", "-std=c11", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        )
    ]
)
