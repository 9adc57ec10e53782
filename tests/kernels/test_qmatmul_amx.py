"""matmul_q8 on AMX-INT8 (Sapphire Rapids and later): Q8_0 and MXFP4 products of many rows.

The AMX path takes the exact integer sums of every (W row, x row, 32-value sub-block) from tile
multiplies and then does the other paths' float operations per lane in their order, so its
contract is theirs: the same bits as the AVX512-VNNI paths and the scalar path for any row count,
k (a partial last group of lanes included), W row count (blocks of 16 and a partial last one) and
thread split. path=6 forces it at any row count (the default takes it from 12 rows); the module's
amx() counter proves a call really ran it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from test_qmatmul_int8 import activations, product, setup

from k3kit.kernels import qmatmul

pytestmark = [
    pytest.mark.skipif(not qmatmul.native_available(), reason="native kernel not built"),
    pytest.mark.skipif(not qmatmul.native_amx(),
                       reason="no AMX-INT8 (CPU without it, tile state refused, or K3KIT_NO_AMX set)"),
]

AMX = 6          # matmul_q8's path: AMX where it runs
ROWS = [*range(1, 21), 31, 64, 65, 130]


def amx_calls() -> int:
    return qmatmul._qmatmul.amx()[1]


def forced(qtype: T, raw: np.ndarray, x: np.ndarray, n_out: int, threads: int = 1) -> np.ndarray:
    """The AMX product, failing unless the call really ran on AMX."""
    before = amx_calls()
    y = product(qtype, raw, x, n_out, threads=threads, path=AMX)
    assert amx_calls() == before + 1
    return y


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [2048, 2048 + 96], ids=["whole", "partial"])
def test_same_bits_as_vnni_and_scalar(qtype: T, k: int) -> None:
    """n_out = 37: two blocks of 16 W rows and a partial one; k + 96: the last group of 16 lanes
    holds 3 sub-blocks (the rest zero operands and scales, and an odd sub-block in a pair)."""
    n_out = 37
    rng, raw = setup(qtype, n_out, k, 90)
    x = activations(rng, max(ROWS), k)
    for m in ROWS:
        y = forced(qtype, raw, x[:m], n_out)
        assert not np.isnan(y).any()
        bits = y.view(np.uint32)
        np.testing.assert_array_equal(bits, product(qtype, raw, x[:m], n_out, path=1).view(np.uint32))
        np.testing.assert_array_equal(bits, product(qtype, raw, x[:m], n_out, simd=0, path=1).view(np.uint32))
        if m <= 64:
            np.testing.assert_array_equal(bits, product(qtype, raw, x[:m], n_out, path=4).view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4], ids=lambda t: t.name)
def test_rows_alone_and_among_others_on_thread_splits(qtype: T) -> None:
    """Batch invariance on K3's hidden width with 2 threads: each thread's columns start inside a
    block of 16 W rows (n_out = 161). The default path takes AMX from 12 rows."""
    n_out, k = 161, 7168
    rng, raw = setup(qtype, n_out, k, 91)
    x = activations(rng, 20, k)
    alone = np.concatenate([product(qtype, raw, x[r:r + 1], n_out) for r in range(20)])
    for m in (2, 8, 12, 20):
        for threads in (1, 2):
            before = amx_calls()
            np.testing.assert_array_equal(product(qtype, raw, x[:m], n_out, threads=threads), alone[:m])
            assert amx_calls() == before + (m >= 12)
            np.testing.assert_array_equal(forced(qtype, raw, x[:m], n_out, threads), alone[:m])


def test_k3kit_no_amx_turns_it_off() -> None:
    """K3KIT_NO_AMX=1 at import: native_amx() is False and no product runs on AMX."""
    code = ("import numpy as np; from k3kit.kernels import qmatmul as q; "
            "w = np.zeros(64 * 34, np.uint8); y = np.empty((16, 64), np.float32); "
            "q._qmatmul.matmul_q8(8, w, np.ones((16, 32), np.float32), y, 64, 32, 16, -1, 1, 1, 6); "
            "print(q.native_amx(), q._qmatmul.amx()[1])")
    env = {**os.environ, "K3KIT_NO_AMX": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "0"]


def test_kernel_label_names_amx_where_it_runs() -> None:
    """--stats names AMX for Q8_0 / MXFP4 in the ggml arithmetic while it is in use, else not."""
    from k3kit.kernels.qmatmul import kernel_label, native_simd
    base = f"native-{native_simd()}"
    assert kernel_label(T.Q8_0, "ggml") == f"{base} ggml (AMX from 12 rows)"
    assert kernel_label(T.MXFP4, "ggml") == f"{base} ggml (AMX from 12 rows)"
    assert kernel_label(T.Q4_K, "ggml") == f"{base} ggml"
    assert kernel_label(T.Q8_0, "float") == f"{base} float"
    code = ("from gguf import GGMLQuantizationType as T; from k3kit.kernels import qmatmul as q; "
            "print(q.kernel_label(T.Q8_0, 'ggml'))")
    env = {**os.environ, "K3KIT_NO_AMX": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"{base} ggml"


def test_other_types_keep_their_paths() -> None:
    """Q4_K (a min, Q8_K activations) is not covered: path=6 runs its usual kernels."""
    qtype, n_out = T.Q4_K, 20
    k = 2 * GGML_QUANT_SIZES[qtype][0]
    rng, raw = setup(qtype, n_out, k, 92)
    x = activations(rng, 16, k)
    before = amx_calls()
    np.testing.assert_array_equal(product(qtype, raw, x, n_out, path=AMX),
                                  product(qtype, raw, x, n_out, path=1))
    assert amx_calls() == before
