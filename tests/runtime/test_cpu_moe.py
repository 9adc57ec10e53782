"""`--cpu-moe` / `--n-cpu-moe N` (llama.cpp's flags): with a GPU trunk, the routed experts of the
named layers stay in RAM and multiply on the CPU through the native kernels.

What a CPU-only machine can check: which layers are named, the cache sized against RAM when every
expert is there, and the store holding some layers' experts quantized for the CPU while the
others are cached dequantized (the GPU layers' way), end to end on the shipped mini: the same
greedy tokens as with every layer either way, the kernel labels saying both. The rows crossing
from a GPU to the CPU and back run where a GPU is (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from k3kit.adapters import load_model
from k3kit.adapters.store_experts import StoreExperts
from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.kernels.qmatmul import QuantizedMatrix, native_available, native_simd
from k3kit.mini.paths import shipped_gguf
from k3kit.models.kimi_k3.gguf_load import expert_tensor_names
from k3kit.plan import expert_io as eio
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions, cpu_moe_layers
from k3kit.runtime.sampling import make_sampling

GPU, CPU = [torch.device("cuda")], [torch.device("cpu")]
GIB = 1 << 30


def test_which_layers_keep_their_experts_on_the_cpu():
    layers = [1, 2, 3, 5]
    assert cpu_moe_layers(-1, layers, GPU) == {1, 2, 3, 5}          # --cpu-moe
    assert cpu_moe_layers(3, layers, GPU) == {1, 2}                   # --n-cpu-moe 3: blk.0-2
    assert cpu_moe_layers(0, layers, GPU) == frozenset()
    assert cpu_moe_layers(-1, layers, CPU) == frozenset()             # already there
    with pytest.raises(K3Error, match="--n-cpu-moe -2"):
        cpu_moe_layers(-2, layers, GPU)


def test_cpu_moe_sizes_the_expert_cache_against_ram():
    on_gpu = eio.for_model(shipped_gguf(), "auto", None, device="cuda", available=16 * GIB)
    assert on_gpu.cache_from == "GPU default"
    in_ram = eio.for_model(shipped_gguf(), "auto", None, device="cuda", available=16 * GIB, cpu_moe=-1)
    assert in_ram.cache_from.startswith("RAM left") and in_ram.trunk_bytes == 0
    assert in_ram.cache_bytes >= on_gpu.cache_bytes


def test_expert_arith_follows_the_cpu_under_cpu_moe():
    assert LoadOptions(device="cuda", cpu_moe=-1).expert_arith == LoadOptions().arith
    assert LoadOptions(device="cuda").expert_arith == LoadOptions(device="cuda").arith == "float"
    assert LoadOptions(device="cuda", cpu_moe=-1, arith="float").expert_arith == "float"


def _tokens(lm, n: int = 24) -> list[int]:
    ids = lm.codec.encode("def parse(argv):\n")
    return generate(lm.model, ids, max_tokens=n, sampling=make_sampling(0.0)).token_ids


@pytest.mark.skipif(not native_available(), reason="the native extension is not built")
def test_some_layers_in_ram_quantized_the_rest_dequantized():
    with load_model(shipped_gguf(), LoadOptions()) as lm:
        native = _tokens(lm)
    with load_model(shipped_gguf(), LoadOptions(expert_kernel="torch")) as lm:
        torch_only = _tokens(lm)
        adapter = lm.model
        names = expert_tensor_names(adapter.cfg)
        first = min(names)
        store = adapter.source.expert_store(names, cache_mib=64, dtype=torch.float32, device="cpu",
                                            cold=False, keep="dequantized", arith=adapter.options.arith,
                                            cpu_layers={first}, cpu_keep="quantized")
        adapter.store.close()
        adapter.store, adapter.experts = store, StoreExperts(store, adapter.layer_dev)
        assert store.keep_of(first) == "quantized" and store.keep_of(first + 1) == "dequantized"
        assert all(isinstance(w, QuantizedMatrix) for w in store.get(first, [0])[0])
        assert all(isinstance(w, torch.Tensor) for w in store.get(first + 1, [0])[0])
        assert store.cached_expert_nbytes(first) < store.cached_expert_nbytes(first + 1)
        assert adapter.experts.device(first) == torch.device("cpu")
        mixed = _tokens(lm)
        assert adapter.expert_kernel == f"native-{native_simd()} + torch"
        label = lm.kernels["experts"]["MXFP4"]
        assert label.startswith(f"native-{native_simd()}") and "torch (dequantized on a miss)" in label
        adapter._invariant_rows = None
        assert adapter.batch_invariant_rows == 0          # float experts: torch's GEMM, no guarantee
    # the mini's greedy text is far from float near-ties for these tokens: every layout agrees
    assert mixed == native == torch_only


def test_cpu_moe_flags_on_a_cpu_only_run(capsys, tmp_path):
    """Without a GPU the flags change nothing (the experts are in RAM already); a bad N is one line."""
    base = ["generate", "--prompt", "import os", "--max-tokens", "6", "--threads", "1", "--json"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--cpu-moe"]) == 0
    assert capsys.readouterr().out.split('"stats"')[0] == plain.split('"stats"')[0]
    assert main([*base, "--n-cpu-moe", "-3"]) != 0
    err = capsys.readouterr().err
    assert "--n-cpu-moe -3: must be >= 0" in err and "Traceback" not in err
