"""Models for the engine tests: a random tiny K3 checkpoint converted to GGUF, or the shipped mini.

`tiny_gguf(dir, trunk)` writes a random tiny Kimi-K3 (tests/convert/k3_checkpoint.py geometry
with 16 experts top-4, so cache sizes between "one expert" and "all" make a difference) as a
Hugging Face checkpoint, converts it with `k3kit convert target`, and returns the GGUF path and
the torch reference model (experts MXFP4-rounded in forward, exactly what the GGUF stores).
Also imported by tests/models/test_adapter*.py and tests/interop/test_engine_vs_llama.py.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from k3_checkpoint import write_checkpoint  # noqa: E402

from k3kit.convert.target import convert_target  # noqa: E402
from k3kit.models.kimi_k3 import K3Model, mxfp4_fake_quant  # noqa: E402

TINY = dict(num_experts=16, num_experts_per_tok=4)
SHIPPED = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"


def tiny_gguf(out_dir: Path, trunk: str = "F32", seed: int = 1) -> tuple[Path, K3Model]:
    out_dir.mkdir(parents=True, exist_ok=True)
    model = write_checkpoint(out_dir / "hf", seed=seed, **TINY)
    path = out_dir / f"tiny-{trunk.lower()}.gguf"
    convert_target(out_dir / "hf", path, trunk)
    return path, rounded_once(model.eval())


@torch.no_grad()
def rounded_once(model: K3Model) -> K3Model:
    """A copy whose expert parameters hold their MXFP4-rounded values, so the forward need not
    round them again on every call (rounding is idempotent: same outputs, much faster)."""
    ref = copy.deepcopy(model)
    if ref.cfg.experts_mxfp4:
        for layer in ref.layers:
            if getattr(layer.ffn, "has_experts", False):
                for name in ("gate_exps", "up_exps", "down_exps"):
                    p = getattr(layer.ffn, name)
                    p.copy_(torch.stack([mxfp4_fake_quant(w) for w in p]))
        ref.cfg = copy.deepcopy(ref.cfg)
        ref.cfg.experts_mxfp4 = False
        for m in ref.modules():
            if hasattr(m, "cfg"):
                m.cfg = ref.cfg
    return ref


def prompts(n: int, vocab: int, seed: int = 0, lo: int = 1, hi: int = 24) -> list[list[int]]:
    """n random prompts of varied length (token ids below the special tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out


@torch.no_grad()
def reference_greedy(model: K3Model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by the torch model alone: whole prompt in one pass, then one token
    at a time through its own K3State, experts from its module parameters (no GGUF, no store)."""
    state = model.new_state()
    logits = model(torch.tensor(prompt)[None], state, logits="last").logits[0, -1]
    out = []
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = model(torch.tensor([out[-1]])[None], state, logits="last").logits[0, -1]
    return out
