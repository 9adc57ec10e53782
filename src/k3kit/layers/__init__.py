"""Torch blocks shared by architectures (imports only kernels and errors, never runtime).

    norm.py   RMSNorm
    rope.py   RoPE / YaRN
    moe.py    RoutedMoE: route -> group rows per expert -> plan the misses -> run each distinct
              expert once for all its rows -> scatter; the ExpertProvider protocol
    quantized_linear.py   QuantizedLinear / QuantizedEmbedding: weights kept as ggml bytes
"""
