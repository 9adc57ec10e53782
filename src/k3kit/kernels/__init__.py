"""Native products on quantized bytes (C, run-time SIMD dispatch) and their torch fallbacks."""
