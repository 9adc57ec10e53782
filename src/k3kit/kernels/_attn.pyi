"""Types of the native extension built from _attn.c (optional: it may not be built).

Buffers are addresses (`Tensor.data_ptr()`) of float32 rows with unit stride; k3kit.kernels.attn
checks them before it calls. Both raise ValueError on a CPU without AVX-512F (see `available`)."""

def pack_keys(b: int, ldb: int, n: int, k: int, p: int, threads: int = 1, /) -> None:
    """b [n, k] (row stride ldb) packed for scores_nt into p (ceil(n / 32) * 32 * k floats)."""

def scores_nt(a: int, lda: int, p: int, y: int, ldy: int, m: int, n: int, k: int, scale: float,
              threads: int = 1, /) -> None:
    """y [m, n] = scale * a [m, k] · bᵀ, b [n, k] as pack_keys packed it (row strides lda, ldy)."""

def probs_v(a: int, lda: int, b: int, ldb: int, y: int, ldy: int, m: int, n: int, k: int,
            threads: int = 1, /) -> None:
    """y [m, n] = a [m, k] · b [k, n] (row strides lda, ldb, ldy in floats)."""

def softmax(x: int, ld: int, rows: int, n: int, heads: int, first: int, threads: int = 1, /) -> None:
    """In place, the causal softmax of rows of n (row r sees min(n, first + r // heads) columns)."""

def available() -> bool:
    """Whether this CPU runs the kernels (AVX-512F)."""
