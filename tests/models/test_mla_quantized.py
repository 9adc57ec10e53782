"""MLA's kv_b kept as the file stores it (attn_k_b / attn_v_b bytes, LatentHeads).

The per-head products run in one native call over all heads (QuantizedHeads / matmul_heads): each
head's result is bit for bit the single-matrix kernel's on that head (matmul_q8 in ggml's
arithmetic, matmul in the float one), at every SIMD level and thread count, and agrees with the
float64 product of the dequantized operands to the float32 rounding bound. A loaded quantized
trunk holds no float kv_b (its trunk is the file's bytes, to the byte), its logits follow the
float kv_b's, and a batched decode row gets the floats it gets alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from k3kit.gguf.quants import random_blocks
from k3kit.kernels import qmatmul
from k3kit.kernels.qmatmul import QuantizedHeads
from k3kit.layers.quantized_linear import GGMLWeight
from k3kit.models.kimi_k3 import mla as mla_mod
from k3kit.models.kimi_k3.mla import MLA, LatentHeads

pytestmark = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")

# (type, n_in, n_out, heads): K3's k_b shape class (128-value rows), v_b's (512-value rows, a K-quant),
# a Q6_K (16-value lanes) and one head big enough for two threads to split its columns
CASES = [(T.Q8_0, 128, 256, 12), (T.Q4_K, 512, 64, 12), (T.Q6_K, 256, 48, 5), (T.Q4_K, 1024, 1024, 1)]
ROWS = [1, 3, 9, 40]
Q8_K_BYTES = 292


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread unless it sets its own (tests/conftest.py)."""


def stack(qtype: T, n_in: int, n_out: int, heads: int, seed: int = 0) -> torch.Tensor:
    n_blocks = n_in * n_out * heads // (32 if qtype == T.Q8_0 else 256)
    return torch.from_numpy(random_blocks(qtype, n_blocks, np.random.default_rng(seed)).reshape(-1).copy())


def activations(heads: int, m: int, k: int, seed: int = 1) -> torch.Tensor:
    """Rows of mixed magnitude, one of them zero."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1.0, 50.0])[torch.arange(m) % 3]
    x = torch.randn(heads, m, k, generator=g) * scale[None, :, None]
    x[:, m // 2] = 0.0
    return x


def heads_call(qtype: T, raw: torch.Tensor, x: torch.Tensor, n_out: int, i8: int, simd: int,
               threads: int) -> np.ndarray:
    heads, m, k = x.shape
    y = np.full((heads, m, n_out), np.nan, dtype=np.float32)
    qmatmul._qmatmul.matmul_heads(int(qtype), raw.numpy(), x.numpy(), y, heads, n_out, k, m,
                                  raw.numel() // heads, i8, simd, threads)
    return y


def single_call(qtype: T, raw: torch.Tensor, x: torch.Tensor, n_out: int, i8: int, simd: int) -> np.ndarray:
    m, k = x.shape
    y = np.full((m, n_out), np.nan, dtype=np.float32)
    xc = np.ascontiguousarray(x.numpy())
    if i8:
        qmatmul._qmatmul.matmul_q8(int(qtype), raw.numpy(), xc, y, n_out, k, m, simd, 1, 1, -1)
    else:
        qmatmul._qmatmul.matmul(int(qtype), raw.numpy(), xc, y, n_out, k, m, simd, 1, -1)
    return y


@pytest.mark.parametrize("i8", [1, 0], ids=["ggml", "float"])
@pytest.mark.parametrize("simd", [0, 1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].name}-{c[1]}x{c[2]}x{c[3]}")
def test_each_head_is_the_single_matrix_kernel_bit_for_bit(case, simd: int, i8: int) -> None:
    qtype, n_in, n_out, heads = case
    raw = stack(qtype, n_in, n_out, heads)
    per = raw.numel() // heads
    for m in ROWS:
        x = activations(heads, m, n_in, seed=m)
        want = [single_call(qtype, raw[h * per:(h + 1) * per], x[h], n_out, i8, simd) for h in range(heads)]
        for threads in (1, 2):
            got = heads_call(qtype, raw, x, n_out, i8, simd, threads)
            for h in range(heads):
                np.testing.assert_array_equal(got[h], want[h], err_msg=f"m={m} threads={threads} head {h}")


def q8_values(x: np.ndarray, act: T) -> np.ndarray:
    """The values ggml's activation blocks hold for rows of x (float64)."""
    m, k = x.shape
    qk, nbytes = (256, Q8_K_BYTES) if act == T.Q8_K else (32, 34)
    raw = np.empty((m, k // qk * nbytes), np.uint8)
    qmatmul._qmatmul.quantize_q8(np.ascontiguousarray(x), raw, int(act), m, k, 1)
    b = raw.reshape(m, k // qk, nbytes)
    if act == T.Q8_K:
        d, q = b[:, :, :4].copy().view(np.float32), b[:, :, 4:260].view(np.int8)
    else:
        d, q = b[:, :, :2].copy().view(np.float16), b[:, :, 2:].view(np.int8)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(m, k)


@pytest.mark.parametrize("arith", ["ggml", "float"])
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c[0].name)
def test_heads_agree_with_the_float64_product(case, arith: str) -> None:
    """|y - x W^T| <= (k + 8) 2^-24 |x| |W|^T per head, x the operand the arithmetic multiplies
    (ggml: the activation blocks' values), W the dequantized head."""
    qtype, n_in, n_out, heads = case
    qh = QuantizedHeads(stack(qtype, n_in, n_out, heads), qtype, (n_in, n_out, heads), arith=arith)
    w = qh.dequantize().double().numpy()                          # [heads, n_out, n_in]
    x = activations(heads, 7, n_in)
    y = qh.matmul(x).double().numpy()
    for h in range(heads):
        xh = x[h].numpy()
        xd = q8_values(xh, qmatmul.ACT_TYPE[qtype]) if arith == "ggml" else xh.astype(np.float64)
        exact = xd @ w[h].T
        bound = np.abs(xd) @ np.abs(w[h]).T * (n_in + 8) * 2.0**-24 + 1e-300
        assert np.isfinite(y[h]).all()
        err = np.abs(y[h] - exact)
        assert (err <= bound).all(), f"head {h}: max err/bound {(err / bound).max():.3g}"


def test_quantized_heads_check_their_bytes() -> None:
    raw = stack(T.Q8_0, 64, 8, 3)
    with pytest.raises(ValueError, match="need"):
        QuantizedHeads(raw[:-1].clone(), T.Q8_0, (64, 8, 3))
    with pytest.raises(ValueError, match="3-D"):
        QuantizedHeads(raw, T.Q8_0, (64, 24))                       # type: ignore[arg-type]
    qh = QuantizedHeads(raw, T.Q8_0, (64, 8, 3))
    with pytest.raises(ValueError, match="does not fit"):
        qh.matmul(torch.zeros(2, 1, 64))
    with pytest.raises(ValueError, match="no native kernel"):
        heads_call(T.Q5_0, raw, torch.zeros(3, 1, 64), 8, 1, -1, 1)


# -- the model -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mini_loads():
    """The shipped mini K3 (Q8_0 attn_k_b / attn_v_b), quantized trunk in each arithmetic."""
    from k3kit.adapters import load_model
    from k3kit.mini.paths import shipped_gguf
    from k3kit.runtime.loader import LoadOptions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loads = {a: load_model(shipped_gguf(), LoadOptions(arith=a)) for a in ("ggml", "float")}
    yield {a: ld.model for a, ld in loads.items()}
    for ld in loads.values():
        ld.close()
    torch.set_num_threads(threads)


def _mlas(adapter) -> list[MLA]:
    return [layer.attn for layer in adapter.model.layers if isinstance(layer.attn, MLA)]


def test_quantized_trunk_holds_no_float_kv_b(mini_loads) -> None:
    from k3kit.gguf.reader import GGUFFile
    from k3kit.mini.paths import shipped_gguf

    a = mini_loads["ggml"]
    mlas = _mlas(a)
    assert mlas and all(m.kv_b_proj is None and m.kv_b_heads is not None for m in mlas)
    assert not any("kv_b" in name for name, _ in a.model.named_parameters())
    sizes = {t.name: t.nbytes for t in GGUFFile.open(shipped_gguf()).tensors}
    for il, layer in enumerate(a.model.layers):
        if isinstance(layer.attn, MLA):
            heads = layer.attn.kv_b_heads
            assert heads is not None and heads.native and heads.ggml_exact
            assert heads.nbytes == sizes[f"blk.{il}.attn_k_b.weight"] + sizes[f"blk.{il}.attn_v_b.weight"]
    m = a.memory()
    # a float32 kv_b held (nope + v) * L * H * 4 bytes per MLA layer on top of the file's bytes
    assert m.trunk_bytes == m.trunk_file_bytes


@torch.no_grad()
@pytest.mark.parametrize("arith", ["ggml", "float"])
def test_logits_follow_the_float_kv_b(mini_loads, arith: str, monkeypatch) -> None:
    """The same model with its kv_b halves dequantized to float and multiplied as before (the
    float path every non-native product takes): float arithmetic agrees to float32 noise, ggml's
    (int8 activations) closely, with the same top-1 nearly everywhere."""
    a = mini_loads[arith]
    ids = torch.arange(3, 3 + 96)[None] % a.vocab_size
    step = mla_mod.HEADS_NATIVE_MAX_ROWS          # chunks the native products take

    def logits() -> torch.Tensor:
        state = a.model.new_state()
        return torch.cat([a.model(ids[:, i:i + step], state, experts=a.experts).logits[0]
                          for i in range(0, ids.shape[1], step)])

    got = logits()
    monkeypatch.setattr(LatentHeads, "native", property(lambda self: False))
    want = logits()
    diff = (got - want).abs()
    same_top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{arith}: max |diff| {diff.max():.3g} median {diff.median():.3g}, top-1 agreement {same_top1:.3f}")
    if arith == "float":
        assert diff.max() < 1e-4
        assert same_top1 == 1.0
    else:
        assert 0 < diff.max() < 0.1                   # int8 activations: not the float products
        assert same_top1 >= 0.97


@torch.no_grad()
@pytest.mark.parametrize("arith", ["ggml", "float"])
def test_rows_batched_get_their_own_products(mini_loads, arith: str) -> None:
    mla = _mlas(mini_loads[arith])[0]
    cfg = mla.cfg
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, cfg.num_heads, cfg.qk_nope_head_dim, generator=g)
    lat = torch.randn(5, cfg.num_heads, cfg.kv_lora_rank, generator=g)
    q_abs, out = mla_mod.absorb_q_rows(mla, q), mla_mod.value_rows(mla, lat)
    assert q_abs.shape == (5, cfg.num_heads, cfg.kv_lora_rank)
    assert out.shape == (5, cfg.num_heads * cfg.v_head_dim)
    for i in range(5):
        assert torch.equal(mla_mod.absorb_q_rows(mla, q[i:i + 1])[0], q_abs[i])
        assert torch.equal(mla_mod.value_rows(mla, lat[i:i + 1])[0], out[i])
        assert torch.equal(mla_mod.absorb_q(mla, q[None, i:i + 1])[0, 0], q_abs[i])   # a decode row alone


@torch.no_grad()
def test_bytes_without_a_kernel_take_the_float_path() -> None:
    """F32 halves (no native kernel: the CUDA route, dequantize per use) give the products of a
    float kv_b_proj holding the same values."""
    from k3kit.models.kimi_k3 import K3Model, init_random, tiny_config

    model = init_random(K3Model(tiny_config()), 2).eval()
    mla = next(layer.attn for layer in model.layers if isinstance(layer.attn, MLA))
    cfg = mla.cfg
    H, nope, v, L = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    assert mla.kv_b_proj is not None
    kv_b = mla.kv_b_proj.weight.detach().view(H, nope + v, L)
    k_b = kv_b[:, :nope].transpose(1, 2).contiguous()                  # [H, L, nope]: ggml [nope, L, H]
    v_b = kv_b[:, nope:].contiguous()                                  # [H, v, L]: ggml [L, v, H]
    heads = LatentHeads(GGMLWeight(k_b.view(-1).view(torch.uint8), T.F32, (nope, L, H)),
                        GGMLWeight(v_b.view(-1).view(torch.uint8), T.F32, (L, v, H)))
    assert not heads.native
    x = torch.randn(1, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    want = mla(x)
    mla.kv_b_proj, mla.kv_b_heads = None, heads
    torch.testing.assert_close(mla(x), want, rtol=1e-6, atol=1e-6)
