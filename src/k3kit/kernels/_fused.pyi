"""Types of the native extension built from _fused.c (optional: it may not be built).

Buffers are addresses (`Tensor.data_ptr()`) of contiguous float32 memory; k3kit.kernels.fused
checks them before it calls."""

def rms_norm(x: int, w: int, gate: int, y: int, rows: int, n: int, eps: float, l2: int = 0,
             threads: int = 1, /) -> None:
    """y = x * scale(x) * w * gate per row of n (w, gate 0: none); l2: the L2 norm's scale."""

def situ(g: int, u: int, y: int, n: int, beta: float, lb: float, threads: int = 1, /) -> None:
    """K3's situ over n elements."""

def res_mix(bank: tuple[int, ...], cur: int, w: int, y: int, rows: int, n: int, eps: float,
            threads: int = 1, /) -> None:
    """K3's attn-res mix of rows over 1-64 banked checkpoints."""

def short_conv(window: int, x: int, taps: int, out: int, new_window: int, B: int, T: int, C: int, K: int,
               threads: int = 1, rs: int = -1, cs: int = -1, /) -> None:
    """KDA's q/k/v depthwise causal convs + SiLU: out [3, B, T, C], the new window [B, 3, K-1, C];
    x's row (b, t) of conv i at x + (b*T + t)*rs + i*cs floats (defaults 3C and C: [B, T, 3, C])."""

def slot_sum(y: int, order: int, w: int, out: int, N: int, k: int, d: int, /) -> None:
    """out [N, d] = the k weighted expert outputs of each row (y [N*k, d] in grouped order), in slot order."""

def rope_neox(x: int, cos: int, sin: int, y: int, rows: int, heads: int, hd: int, rd: int, /) -> None:
    """NeoX rotary embedding: y [rows, heads, hd] = x * cos + rot(x) * sin on the first rd dims of
    each head (cos, sin [rows, rd]), the rest copied."""

def markov_greedy(base: int, w1: int, w2t: int, anchor: int, rows: int, toks: int, w1s: int, n: int, V: int,
                  r: int, /) -> None:
    """DSpark's greedy Markov chain: rows[k] = base[k] + W2 . W1[prev] (W2 given transposed, [r, V]),
    toks[k] = prev = argmax rows[k], w1s[k] = W1[prev] (prev starts at the anchor)."""

def markov_masked(base: int, w1: int, w2t: int, prev: int, row: int, w1row: int, bits: int, V: int, r: int,
                  W: int, /) -> int:
    """One row of markov_greedy's chain after `prev` whose token is the best one the bitmask bits
    [W] (int32) allows."""

def apply_bitmask(x: int, bits: int, y: int, R: int, V: int, W: int, /) -> None:
    """y [R, V] = x where bit t % 32 of bits[r, t // 32] (int32 [R, W]) is set, else -inf."""

def add(a: int, b: int, y: int, n: int, nb: int = 0, /) -> None:
    """y = a + b over n floats (y may be a or b); nb > 0: b [nb] added to each row of nb floats."""

def mul(a: int, b: int, y: int, n: int, /) -> None:
    """y = a * b over n floats (y may be a or b)."""

def scale(a: int, s: int, y: int, rows: int, n: int, period: int = 0, /) -> None:
    """y [rows, n] = a [rows, n] * s [rows], each row by its own float (y may be a); period > 0:
    row r by s[r % period] (rows of heads, one float a head)."""

def copy_rows(src: int, ss: int, dst: int, ds: int, rows: int, n: int, /) -> None:
    """rows of n floats from src (row stride ss floats) to dst (row stride ds), as they are."""
def route_weights(probs: int, ids: int, out: int, T: int, k: int, E: int, renorm: int, wmin: float,
                  factor: float, /) -> None:
    """route's weights [T, k] of the chosen ids [T, k] (int64) from the scores probs [T, E]."""
