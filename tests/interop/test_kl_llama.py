"""KL-divergence of k3kit's next-token distribution from llama.cpp's, on the types low-bit K3 files carry.

Issue 12's must-hold: K3-geometry slices with (a) IQ1_S gate/up + IQ3_XXS down experts, (b) Q2_K
experts, (c) a Q4_K trunk run in k3kit and in llama.cpp; over >= 64 positions of a text, mean
KL(llama.cpp || k3kit) <= 0.002 and top-1 agreement >= 85% (random weights give flat
distributions, so top-1 flips at near-ties are frequent); on the shipped mini model <= 0.0002
and >= 93%.

The slices: K3's widths (hidden 7168, KDA head dim 128, MLA q_lora 1536 / kv_lora 512 / nope 128 +
rope 64 / v 128, latent MoE 3584 with expert FFN 3072, vocab cut to 512) with 8 heads, one shared
expert, two layers (KDA + MoE, then MLA + MoE: n_dense_lead 0) and 4 routed experts: fewer
experts than K3's top-k (16), so every expert is routed at every position and no router near-tie
can flip an expert choice (with hundreds of random experts the 16th and 17th scores differ by
~1e-4). ~300-400 MB each, written by `k3kit synth` (k3kit.gguf.synth.synthesize), which writes
the Q4_K trunk directly: `k3kit requant --to Q4_K` of such a slice takes ~2 minutes on 2 cores
(measured once on the Q8_0/MXFP4 slice with 2 shared experts: 0.00074 / 89.1%, 64 positions).

k3kit's logits come from its perplexity machinery (k3kit.runtime.perplexity.evaluate, one chunk
over the text's first N_POS tokens, BOS first as llama.cpp tokenizes, BATCH rows per forward so
the native kernels run): llama.cpp's logits of every position (llama-cpp-python, logits_all) are
saved as the --kl-base .npy. ggml parity is on: ggml-cpu's Q8_0 rounding of the activations of
Q8_0/MXFP4 matmuls is emulated; the Q8_K rounding ggml applies to the activations of K-quant
and i-quant weights is not (k3kit.models.kimi_k3.mxfp4.input_kind), which is most of the Q4_K
trunk's divergence (0.0013 here; ~0.0005 with Q8_K rounding emulated in an experiment).

Measured at 64 positions (-s prints them), float arithmetic: IQ1_S+IQ3_XXS 0.00033 / 98.4% top-1,
Q2_K 0.00041 / 93.8%, Q4_K trunk 0.0013 / 92.2% (float trunk) and 0.0013 / 95.3% (--trunk
quantized); the default arithmetic on the CPU (`--arith auto` = ggml's: activations rounded to
Q8_0 / Q8_K blocks by the kernels, so the Q8_K rounding above is llama.cpp's too), quantized
trunk: IQ1_S+IQ3_XXS 0.00039 / 98.4%, Q2_K 0.00050 / 96.9%, Q4_K trunk 0.00042 / 98.4%, held to
half the KL bound. The IQ1_S / Q2_K means move by ~1e-4 between the arithmetics, in a direction
that depends on the setting (with ggml parity, as here, float's is lower; without it ggml's is:
IQ1_S+IQ3_XXS 0.00042 / 95.3% float, 0.00034 / 98.4% ggml), so only the Q4_K trunk's drop is
clear. The shipped mini at 256 positions: 0.000009 / 99.6% with ggml parity in either
arithmetic; as a user runs it (no parity, quantized trunk) 0.000035 / 99.6% in float and
0.0000078 / 100% in ggml's, held to 0.00003 / 99%. On the mini (32 experts, top-4) positions
where any MoE layer's 4th and 5th selection scores are within NEAR_TIE are counted as router
near-ties and their top-1 flips printed separately (measured: 41-45 such positions, no flip there).
"""

from __future__ import annotations

import json.decoder
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from k3kit.adapters import load_model
from k3kit.gguf.synth import K3, synthesize
from k3kit.models.kimi_k3.moe import Router
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.perplexity import NpyBase, PerplexityResult, evaluate, plan_chunks

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.interop

SLICE = replace(K3, n_dense_lead=0, n_head=8, n_shared=1)
CASES = {
    "iq1_s-iq3_xxs": dict(expert_type="IQ1_S", expert_type_down="IQ3_XXS"),
    "q2_k": dict(expert_type="Q2_K"),
    "q4_k-trunk": dict(trunk_type="Q4_K"),
}
N_POS_SLICE, N_POS_MINI = 64, 256
BATCH = 16               # rows per k3kit forward: native kernels, not dequantize + torch
NEAR_TIE = 1e-3          # router selection-score gap (sigmoid + bias units) counted as a near-tie
TEXT = Path(json.decoder.__file__).read_text()     # any CPython's json/decoder.py: plain code and prose


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """k3kit runs torch on one thread here (tests/conftest.py); llama.cpp gets two."""


class RouterGaps:
    """Per row, the smallest gap between the k-th and (k+1)-th router selection score over all MoE layers."""

    def __init__(self, model) -> None:
        self.gaps: dict[int, list[torch.Tensor]] = {}
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)]

    def _hook(self, router: Router, inputs, output) -> None:
        k = router.cfg.num_experts_per_tok
        if k >= router.cfg.num_experts:
            return
        x = inputs[0].reshape(-1, router.weight.shape[1]).float()
        scores = torch.sigmoid(x @ router.weight.t().float()) + router.bias.float()
        top = torch.topk(scores, k + 1, dim=-1).values
        self.gaps.setdefault(id(router), []).append(top[:, k - 1] - top[:, k])

    def near_ties(self, n: int) -> np.ndarray:
        for h in self.handles:
            h.remove()
        if not self.gaps:
            return np.zeros(n, bool)
        per_layer = [torch.cat(g)[-n:] for g in self.gaps.values()]
        return torch.stack(per_layer).amin(0).numpy() < NEAR_TIE


def kl_vs_llama(path: Path, n_pos: int, tmp: Path, trunk: str = "float", mode: str = "float",
                parity: bool = True) -> tuple[PerplexityResult, np.ndarray, str]:
    """k3kit's perplexity run over the text's first n_pos tokens with llama.cpp's logits as the base:
    (result, router near-tie per position, which kernels ran).

    k3kit runs BATCH rows per forward, so the native kernels (<= NATIVE_MAX_ROWS rows) multiply
    the quantized experts (and a quantized trunk) as they do in decoding and short prefills.
    `mode` is the load's arithmetic (`--arith`) for every quantized matrix, trunk and experts
    ("ggml": int8 activation blocks and integer dot products, as ggml-cpu; "auto": the default).
    `parity`: LoadOptions.ggml_parity (`perplexity --ggml-parity`), off as a user runs k3kit."""
    options = LoadOptions(expert_cache_mib=512, ggml_parity=parity, trunk=trunk, arith=mode)
    mode = options.arith                 # "auto" resolved: the arithmetic that runs
    loaded = load_model(path, options)
    try:
        codec = loaded.codec
        ids = codec.encode(TEXT, add_bos=True)[:n_pos]
        assert len(ids) == n_pos
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_pos + 16, n_batch=n_pos, n_threads=2,
                              logits_all=True, type_k=0, type_v=0, verbose=False)
        try:
            assert llm.tokenize(TEXT.encode(), add_bos=True, special=True)[:n_pos] == ids
            llm.reset()
            llm.eval(ids)
            np.save(tmp / "llama.npy", np.array(llm.scores[:n_pos], dtype=np.float32))
        finally:
            llm.close()
        plan = plan_chunks(n_pos, ctx=n_pos, bos=codec.special.get("bos") if codec.add_bos else None)
        gaps = RouterGaps(loaded.model.model)
        with torch.no_grad():
            result = evaluate(loaded.model, ids, plan, base=NpyBase(tmp / "llama.npy"), batch=BATCH)
        kernels = (f"experts {loaded.expert_kernel}, trunk {loaded.memory().trunk}, {mode} mode"
                   + ("" if parity else ", no parity"))
        return result, gaps.near_ties(n_pos), kernels
    finally:
        loaded.close()


def report(name: str, r: PerplexityResult, ties: np.ndarray, kernels: str) -> str:
    d = r.divergence
    assert d is not None
    flips = ~d["same_top"]
    clear = ~ties
    line = (f"{name} ({kernels}): {r.compared} positions, mean KL {r.kl_mean:.6f} (max {r.kl_max:.5f}), "
            f"top-1 {100 * r.top1_agreement:.2f}%, mean |dp top| {r.mean_abs_dp_top:.5f}, "
            f"ppl {r.perplexity:.3f} vs llama.cpp {r.base_perplexity:.3f}; "
            f"router near-ties {int(ties.sum())}")
    if ties.any():
        line += (f" (flips there {int(flips[ties].sum())}; elsewhere: mean KL {d['kl'][clear].mean():.6f}, "
                 f"top-1 {100 * d['same_top'][clear].mean():.2f}%)")
    print(line)
    return line


@pytest.fixture(scope="module")
def slices(tmp_path_factory):
    """case -> its slice GGUF, synthesized once per module."""
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            d = tmp_path_factory.mktemp(case)
            result = synthesize(d, SLICE, 2, 4, vocab=512, seed=3, progress=False, name=case, **CASES[case])
            made[case] = Path(result.paths[0])
        return made[case]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("case,trunk,mode", [(c, "float", "float") for c in CASES]
                         + [(c, "quantized", m) for c in CASES for m in ("float", "auto")])
def test_k3_slice_kl_from_llama_cpp(case, trunk, mode, slices, tmp_path):
    r, ties, kernels = kl_vs_llama(slices(case), N_POS_SLICE, tmp_path, trunk=trunk, mode=mode)
    line = report(f"{case}, {trunk} trunk, {mode} mode", r, ties, kernels)
    assert not ties.any()          # every expert is routed: nothing to flip
    assert r.compared >= 64
    assert r.kl_mean is not None and r.top1_agreement is not None
    assert r.kl_mean <= 0.002 and r.top1_agreement >= 0.85, line
    if "ggml mode" in kernels:     # llama.cpp's arithmetic: half the KL bound (measured <= 0.0005, >= 96.9%)
        assert r.kl_mean <= 0.001 and r.top1_agreement >= 0.90, line


@pytest.mark.parametrize("mode,parity", [("float", True), ("auto", True), ("auto", False)])
def test_shipped_mini_kl_from_llama_cpp(mode, parity, tmp_path):
    """The must-hold bound in both arithmetics with ggml parity on, and as a user runs it (the
    default load: quantized trunk, `--arith auto`, no parity). In ggml's arithmetic the bound is
    tighter away from router near-ties: measured 0.000020 / 99.6% as a user runs it (0.000006 away
    from the 42 near-ties), 0.000048 / 99.2% with parity (0.000019 away from them; float mode
    0.000039 / 99.2%)."""
    try:
        from k3kit.mini.paths import shipped_gguf
        path = Path(shipped_gguf())
    except Exception as e:      # not built in this checkout
        pytest.skip(str(e))
    r, ties, kernels = kl_vs_llama(path, N_POS_MINI, tmp_path, trunk="quantized", mode=mode, parity=parity)
    line = report("shipped mini", r, ties, kernels)
    assert r.kl_mean is not None and r.top1_agreement is not None
    assert r.kl_mean <= 0.0002 and r.top1_agreement >= 0.93, line
    if "ggml mode" in kernels:     # at router near-ties the two may pick different experts: bound the rest
        d = r.divergence
        assert d is not None
        kl_clear = float(d["kl"][~ties].mean()) if ties.any() else r.kl_mean
        assert kl_clear <= 0.00003 and r.top1_agreement >= 0.99, line
