"""The native MXFP4 kernel and QuantizedMatrix: x @ W.T from the blocks equals the product with
the dequantized matrix, to float32 rounding, on every path (AVX2 tiles, scalar, torch).
The other native types: tests/kernels/test_qmatmul_types.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from k3kit.errors import K3Error
from k3kit.kernels import qmatmul
from k3kit.kernels.dequant import dequantize
from k3kit.kernels.qmatmul import NATIVE_MAX_ROWS, QuantizedMatrix
from k3kit.runtime.experts import ExpertStore, ExpertTensor
from k3kit.runtime.loader import expert_keep

native = pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built")


def mxfp4_matmul(*args: object) -> None:
    """The extension's matmul for MXFP4 (the type is its first argument)."""
    qmatmul._qmatmul.matmul(int(T.MXFP4), *args)


def mxfp4_bytes(rng: np.random.Generator, n_out: int, k: int, e_lo: int = 110, e_hi: int = 140) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n_out, k // 32, 17), dtype=np.uint8)
    blocks[:, :, 0] = rng.integers(e_lo, e_hi, size=(n_out, k // 32))
    return blocks.reshape(-1)


def check_close(y: torch.Tensor, x: torch.Tensor, raw: np.ndarray, n_out: int, k: int) -> None:
    """|y - exact| within float32 summation error: k * eps of the absolute product sum."""
    w = dequantize(raw, T.MXFP4, (k, n_out), torch.float32).double()
    exact = x.double() @ w.t()
    bound = (x.double().abs() @ w.abs().t()) * (k + 8) * 2.0 ** -24 + 1e-30
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"


def run_kernel(raw: np.ndarray, x: torch.Tensor, n_out: int, simd: int) -> torch.Tensor:
    y = torch.full((x.shape[0], n_out), float("nan"))
    mxfp4_matmul(raw, x.contiguous().numpy(), y.numpy(), n_out, x.shape[1], x.shape[0], simd)
    return y


# every vector path this CPU has (the kernel caps a level it lacks to the best it has), and scalar
SIMD = [0, 1, 2]


@native
@pytest.mark.parametrize("simd", SIMD)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9])
def test_kernel_matches_dequantized_product(simd: int, m: int) -> None:
    rng = np.random.default_rng(m)
    n_out, k = 37, 320
    raw = mxfp4_bytes(rng, n_out, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    check_close(run_kernel(raw, x, n_out, simd), x, raw, n_out, k)


@native
@pytest.mark.parametrize("simd", SIMD)
def test_kernel_every_scale_and_nibble(simd: int) -> None:
    """All 256 e8m0 bytes (subnormal halves at e = 0, 1 included) against every byte value, with
    one-hot activations so each output is a single weight: the kernel must reproduce ggml's
    dequantized value exactly, element order included."""
    k = 32
    blocks = np.zeros((256, 16, 17), dtype=np.uint8)   # [e, group of 16 bytes, block]
    blocks[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[:, :, 1:] = np.arange(256, dtype=np.uint8).reshape(16, 16)[None]
    raw = blocks.reshape(-1)                            # 4096 rows of one block each
    n_out = 256 * 16
    w = dequantize(raw, T.MXFP4, (k, n_out), torch.float32)
    y = run_kernel(raw, torch.eye(k), n_out, simd)     # y[j, n] = W[n, j]
    assert torch.equal(y, w.t())


@native
@settings(max_examples=40, deadline=None)
@given(n_out=st.integers(1, 40), blocks=st.integers(1, 9), m=st.integers(1, 12),
       seed=st.integers(0, 2**32 - 1), simd=st.sampled_from(SIMD))
def test_kernel_shapes(n_out: int, blocks: int, m: int, seed: int, simd: int) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    raw = mxfp4_bytes(rng, n_out, k, 100, 160)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    check_close(run_kernel(raw, x, n_out, simd), x, raw, n_out, k)


@native
def test_kernel_rejects_wrong_sizes() -> None:
    raw = np.zeros(17 * 4, dtype=np.uint8)   # 4 rows x 32
    x, y = np.zeros((2, 32), np.float32), np.zeros((2, 4), np.float32)
    mxfp4_matmul(raw, x, y, 4, 32, 2)
    with pytest.raises(ValueError, match="weight buffer"):
        mxfp4_matmul(raw[:-1], x, y, 4, 32, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_matmul(raw, x, y, 4, 33, 2)
    with pytest.raises(ValueError, match="wrong size"):
        mxfp4_matmul(raw, x, np.zeros((2, 3), np.float32), 4, 32, 2)
    with pytest.raises(ValueError, match="wrong size"):
        mxfp4_matmul(raw, np.zeros((3, 32), np.float32), y, 4, 32, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, NATIVE_MAX_ROWS[T.MXFP4], NATIVE_MAX_ROWS[T.MXFP4] + 5])
def test_quantized_matrix_both_paths(dtype: torch.dtype, m: int) -> None:
    """Natively up to native_max_rows rows (NATIVE_MAX_ROWS for a 16-bit compute dtype, any number
    for float32), dequantize + torch beyond; same values either way (to the compute dtype's
    rounding), output in x's dtype."""
    rng = np.random.default_rng(m)
    n_out, k = 24, 96
    raw = mxfp4_bytes(rng, n_out, k)
    q = QuantizedMatrix(torch.from_numpy(raw.copy()), T.MXFP4, (k, n_out), dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = q.matmul(x)
    assert y.dtype == dtype and y.shape == (m, n_out)
    w = q.dequantize()
    assert w.shape == (n_out, k) and w.dtype == dtype
    exact = x.double() @ dequantize(raw, T.MXFP4, (k, n_out)).double().t()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())


def test_quantized_matrix_without_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiled kernel: every product dequantizes, and asking for native is a clear error."""
    rng = np.random.default_rng(3)
    raw = mxfp4_bytes(rng, 8, 64)
    q = QuantizedMatrix(torch.from_numpy(raw.copy()), T.MXFP4, (64, 8))
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    with_native = q.matmul(x)
    monkeypatch.setattr(qmatmul, "_qmatmul", None)
    assert not q.native
    without = q.matmul(x)
    check_close(without, x, raw, 8, 64)
    assert torch.allclose(without, with_native, rtol=1e-5, atol=1e-5 * with_native.abs().max().item())
    assert expert_keep("auto", [torch.device("cpu")]) == "dequantized"
    with pytest.raises(K3Error, match="not built"):
        expert_keep("native", [torch.device("cpu")])


def test_quantized_matrix_validates() -> None:
    with pytest.raises(ValueError, match="needs 34 bytes"):
        QuantizedMatrix(torch.zeros(33, dtype=torch.uint8), T.MXFP4, (64, 1))
    q = QuantizedMatrix(torch.zeros(34, dtype=torch.uint8), T.MXFP4, (64, 1))
    with pytest.raises(ValueError, match="does not fit"):
        q.matmul(torch.zeros(1, 32))


def test_expert_keep_modes() -> None:
    cpu = [torch.device("cpu")]
    assert expert_keep("torch", cpu) == "dequantized"
    assert expert_keep("auto", cpu) == ("quantized" if qmatmul.native_available() else "dequantized")
    with pytest.raises(K3Error, match="expected one of"):
        expert_keep("fast", cpu)


def test_store_keeps_quantized_bytes() -> None:
    """keep='quantized': MXFP4 projections come back as QuantizedMatrix holding exactly their
    slice, the cache counts quantized bytes (so it holds 4x more than bf16 in the same MiB),
    and products equal those of the dequantizing store; other types are still dequantized."""
    rng = np.random.default_rng(7)
    n_exp, k, n_out = 6, 64, 16
    mx = mxfp4_bytes(rng, n_exp * n_out, k)
    f32 = rng.standard_normal(n_exp * k * n_out).astype(np.float32).view(np.uint8)
    spec = {0: (ExpertTensor(mx, 0, T.MXFP4, (k, n_out), n_exp, "gate"),
                ExpertTensor(f32, 0, T.F32, (k, n_out), n_exp, "down"))}
    per_expert_mx = n_out * k // 32 * 17
    budget_mib = 3 * (per_expert_mx + n_out * k * 4) / (1 << 20)
    quant = ExpertStore(spec, cache_mib=budget_mib, keep="quantized")
    deq = ExpertStore(spec, cache_mib=budget_mib)
    got = quant.get(0, [1, 4, 5])
    ref = deq.get(0, [1, 4, 5])
    x = torch.randn(2, k)
    for e in (1, 4, 5):
        g, d = got[e]
        assert isinstance(g, QuantizedMatrix) and isinstance(d, torch.Tensor)
        assert bytes(g.raw.numpy()) == bytes(mx[e * per_expert_mx:(e + 1) * per_expert_mx])
        want = x @ ref[e][0].t()
        assert torch.allclose(g.matmul(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert torch.equal(d, ref[e][1])
    s = quant.stats()
    assert s.resident_experts == 3 and s.resident_bytes == 3 * (per_expert_mx + n_out * k * 4)
    assert s.bytes_read == deq.stats().bytes_read
    quant.get(0, [1])
    assert quant.stats().hits == 1
    with pytest.raises(ValueError, match="keep must be"):
        ExpertStore(spec, keep="bytes")


def test_store_reuses_evicted_buffers_only_when_free() -> None:
    """A quantized miss reads into the buffer of an evicted expert (no fresh allocation), but
    never into one a caller still holds."""
    rng = np.random.default_rng(9)
    n_exp, k, n_out = 5, 64, 8
    mx = mxfp4_bytes(rng, n_exp * n_out, k)
    per = n_out * k // 32 * 17
    spec = {0: (ExpertTensor(mx, 0, T.MXFP4, (k, n_out), n_exp, "gate"),)}
    store = ExpertStore(spec, cache_mib=1.5 * per / (1 << 20), keep="quantized")   # one expert fits
    held = store.get(0, [0])[0][0]                    # kept by the caller through two evictions
    second = store.get(0, [1])[1][0]
    ptr_second = second.raw.data_ptr()
    del second                                        # evicted by the next miss, and free
    third = store.get(0, [2])[2][0]                   # expert 0's buffer is held: a fresh one
    assert third.raw.data_ptr() not in (ptr_second, held.raw.data_ptr())
    fourth = store.get(0, [3])[3][0]
    assert fourth.raw.data_ptr() == ptr_second        # reused: no fresh allocation
    for e, q in ((0, held), (2, third), (3, fourth)):
        assert bytes(q.raw.numpy()) == bytes(mx[e * per:(e + 1) * per])
    assert store.stats().evictions == 3


@native
@pytest.mark.parametrize("threads", [2, 3, 64])
def test_kernel_threads_give_the_same_bits(threads: int) -> None:
    """Output columns split over threads: every column is summed by one thread in the same
    order, so any thread count gives bit-identical results (sized to actually split)."""
    rng = np.random.default_rng(threads)
    n_out, k, m = 96, 16384, 3      # 1.5M weights: the kernel splits them over up to 3 threads
    raw = mxfp4_bytes(rng, n_out, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    one = torch.empty(m, n_out)
    many = torch.empty(m, n_out)
    mxfp4_matmul(raw, x.numpy(), one.numpy(), n_out, k, m, -1, 1)
    mxfp4_matmul(raw, x.numpy(), many.numpy(), n_out, k, m, -1, threads)
    assert torch.equal(one, many)
    check_close(many, x, raw, n_out, k)
