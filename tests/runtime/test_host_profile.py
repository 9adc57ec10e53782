"""The host side of a decode step stays small: aten ops per layer and host syncs per step are
counted (k3kit.bench.host) on the shipped mini K3 and its drafter, and bounded, so a change that
brings back a per-row host read or a pile of small ops fails here before it costs a GPU stream."""

from __future__ import annotations

import pytest
import torch

from k3kit.adapters.session import open_session
from k3kit.bench.host import counting, host_profile, profile, render
from k3kit.kernels import fused
from k3kit.mini import paths
from k3kit.runtime.loader import LoadOptions

# Ops per layer of a steady decode step (aten ops dispatched, native kernel calls not included) on
# the mini: ~68 (AR), ~82 (verify), ~68 (the 2-layer draft step on its Q8_0 bytes) once every
# expert is cached; a step whose experts are first read takes the per-expert path (~86 AR). The
# bounds leave that room, not a regression. Without the `_fused` extension (no C compiler at install)
# the row-wise steps run as torch ops: ~213 (AR), ~220 (verify), and the draft's norms, rope and
# Markov chain too.
AR_OPS_PER_LAYER = 40 if fused.available() else 275     # the one-row step (models/kimi_k3/row_step.py)
# a server's pass of one decoding sequence (forward_batch, forward_segments' arithmetic): ~13 with
# the router's product and KDA's padded beta on buffers (16.5 when they were made fresh)
SERVE_OPS_PER_LAYER = 15 if fused.available() else 275
VERIFY_OPS_PER_LAYER = 110 if fused.available() else 285
DRAFT_OPS_PER_LAYER = 80 if fused.available() else 235


@pytest.fixture(scope="module")
def session():
    model, draft = paths.shipped_gguf(), paths.shipped_draft()
    if not model.exists() or not draft.exists():
        pytest.skip("the shipped mini K3 / drafter assets are not present")
    with open_session(model, LoadOptions(), draft=draft) as s:
        yield s


def _moe_layers(session) -> int:
    cfg = session.target.model.cfg
    return sum(not cfg.is_dense(il) for il in range(cfg.num_layers))


def test_native_clock_times_every_caller_of_the_kernels():
    """Products called from layers.quantized_linear (fused_products: KDA's q/k/v/gate, a dense
    FFN's gate and up) count as native time, not host time."""
    import numpy as np
    from gguf import GGMLQuantizationType as T

    from k3kit.bench.host import native_clock
    from k3kit.gguf.quants import quantize
    from k3kit.kernels import qmatmul
    from k3kit.layers.quantized_linear import GGMLWeight, QuantizedLinear, fused_products
    if not qmatmul.native_available():
        pytest.skip("the native kernels are not built")

    def linear(seed: int) -> QuantizedLinear:
        raw = quantize(np.random.default_rng(seed).standard_normal((32, 64)).astype(np.float32), T.Q8_0)
        return QuantizedLinear(GGMLWeight(torch.from_numpy(raw.reshape(-1).view(np.uint8).copy()), T.Q8_0,
                                          (64, 32)), arith="ggml")
    a, b = linear(1), linear(2)
    x = torch.randn(2, 64)
    with torch.no_grad():
        a(x), b(x)
        with native_clock() as clk:
            assert fused_products((a, b), x) is not None
            a(x)
    assert clk.calls == 2 and clk.seconds > 0


def test_counter_sees_syncs_and_tolist():
    x = torch.arange(6.0)
    with counting() as c:
        y = x * 2
        float(y.sum())          # one _local_scalar_dense
        y.tolist()              # no aten op on the CPU: counted by the wrapper
        bool(y[0] > 1)          # another
    assert c.syncs == 3
    assert c.ops["mul"] == 1 and c.ops["_local_scalar_dense"] == 2 and c.ops["tolist"] == 1
    assert c.d2h == 0
    with counting() as c:
        x.tolist()
    assert c.ops == {"tolist": 1}          # tolist of a CPU tensor dispatches nothing at all


def test_ar_step_has_one_sync_per_moe_layer_plus_the_token(session):
    model = session.model
    ids = session.codec.encode("def add(a, b):\n    return")
    assert model.store.load_all_if_fits()          # a steady step: every expert cached, no reads
    with torch.no_grad():
        model.reset()
        logits = model.forward(ids)
        tok = [int(torch.argmax(logits[-1]))]

        def step() -> None:
            tok[0] = int(torch.argmax(model.forward(tok)[-1]).item())

        p = profile(step, layers=model.num_layers, calls=4, warmup=1, name="ar")
    # the sampled token, and one copy of each MoE layer's expert ids for the store: no other read
    assert p.syncs <= 1 + _moe_layers(session)
    assert p.d2h == 0
    assert 0 < p.ops_per_layer <= AR_OPS_PER_LAYER
    assert p.native_calls > 0 and p.wall_us > 0
    assert "ar" in render([p])


def test_draft_and_verify_phases_are_bounded(session):
    assert session.model.store.load_all_if_fits()
    with torch.no_grad():
        phases, _ = host_profile(session, session.codec.encode("import os\nimport"), 6)
    by = {p.name: p for p in phases}
    assert set(by) == {"ar", "serve", "draft", "verify"}
    moe = _moe_layers(session)
    assert by["ar"].syncs <= 1 + moe
    assert by["serve"].syncs <= moe                  # the pick is the caller's
    assert by["serve"].ops_per_layer <= SERVE_OPS_PER_LAYER
    assert by["verify"].syncs <= moe                 # the accepted length is read by the caller
    assert by["draft"].syncs <= 1                    # the block's tokens: one read, not one per row
    assert by["ar"].ops_per_layer <= AR_OPS_PER_LAYER
    assert by["verify"].ops_per_layer <= VERIFY_OPS_PER_LAYER
    assert by["draft"].ops_per_layer <= DRAFT_OPS_PER_LAYER
    for p in phases:
        assert p.calls > 0 and p.ops > 0 and p.d2h == 0
        d = p.to_dict()
        assert d["ops_per_layer"] == pytest.approx(p.ops / p.layers, abs=0.1)
