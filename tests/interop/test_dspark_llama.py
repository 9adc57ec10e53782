"""The DSpark/DFlash draft network against llama.cpp's `dflash` graph.

A small random draft is written as a self-contained dflash GGUF (it carries token_embd and output
so llama.cpp needs no target context), the same context features are injected through an embd
batch at positions 0..L-1, and the block [anchor, MASK x (B-1)] is decoded at L..L+B-1 with
non-causal attention. llama.cpp's logits include the DSpark Markov chain (argmax-seeded from the
anchor) and its "nextn" embeddings carry the confidence head: both must match k3kit's draft.
F32 KV cache and no flash attention, so the two sides differ only by float32 rounding.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch

from k3kit.adapters.dflash import DSparkDrafter
from k3kit.convert.draft_config import YarnScaling
from k3kit.layers.quantized_linear import QuantizedLinear
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.names import gguf_tensor_name
from k3kit.models.dflash.network import DSparkDraft
from k3kit.runtime.speculative import FeatureRing, Sampling, propose

llama_cpp = pytest.importorskip("llama_cpp")
gguf = pytest.importorskip("gguf")

V, H, B = 64, 64, 4
YARN = YarnScaling(factor=4.0, original_max_position_embeddings=16)


def _draft(cfg: DraftConfig) -> tuple[DSparkDraft, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(V, cfg.hidden_size, generator=g)
    head = torch.randn(V, cfg.hidden_size, generator=g) * 0.2
    d = DSparkDraft(cfg, embed=emb, lm_head=head)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.dim() == 1 and not n.endswith("bias"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return d, emb, head


def _write_gguf(path, d: DSparkDraft, emb, head, q8: bool = False) -> None:
    """`q8`: every matrix whose rows are whole Q8_0 blocks stored as Q8_0 (the rest F32)."""
    w = gguf.GGUFWriter(str(path), "dflash")
    for key, val in d.cfg.to_gguf_kv().items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            w.add_array(key, list(val))
    w.add_uint32("dflash.context_length", 256)
    w.add_uint32("dflash.vocab_size", V)
    w.add_string("tokenizer.ggml.model", "none")
    for name, p in d.state_dict().items():
        a = p.detach().float().numpy().copy()
        if q8 and a.ndim == 2 and a.shape[1] % 32 == 0:
            w.add_tensor(gguf_tensor_name(name), gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gguf_tensor_name(name), a)
    w.add_tensor("token_embd.weight", emb.numpy().copy())
    w.add_tensor("output.weight", head.numpy().copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _cpp(name: str, argtypes, restype):
    """llama-ext.h entry points are exported with C++ linkage in this build."""
    fn = getattr(llama_cpp.llama_cpp._lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _run_llama(path, taps: np.ndarray, block: list[int], want_conf: bool):
    L = llama_cpp
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False         # the package's top-level binding: conftest patches the submodule's
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model, "llama.cpp could not load the draft"
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
    cp.type_k = cp.type_v = 0          # GGML_TYPE_F32
    cp.flash_attn_type = 0             # disabled: it would round K/V to f16
    ctx = L.llama_init_from_model(model, cp)
    batch = None
    try:
        L.llama_set_causal_attn(ctx, False)
        if want_conf:
            _cpp("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                 [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None)(ctx, True, True)
        batch = L.llama_batch_ext_init(ctx)
        rows = np.ascontiguousarray(taps, dtype=np.float32)
        for i in range(rows.shape[0]):
            e = L.llama_embd(rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1])
            idx = L.llama_batch_ext_add_embd(batch, 0, e)
            L.llama_batch_ext_set_pos(batch, idx, (ctypes.c_int32 * 4)(i, i, i, 0))
        assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        L.llama_batch_ext_clear(batch)
        n = rows.shape[0]
        for i, tok in enumerate(block):
            idx = L.llama_batch_ext_add_token(batch, 0, tok)
            L.llama_batch_ext_set_pos(batch, idx, (ctypes.c_int32 * 4)(n + i, n + i, n + i, 0))
            L.llama_batch_ext_set_output_logits(batch, idx, True)
        assert L.llama_process(ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) == 0
        logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).copy()
                           for i in range(len(block))])
        conf = None
        if want_conf:
            get = _cpp("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                       [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float))
            conf = np.array([get(ctx, i)[0] for i in range(len(block))])
        return logits, conf
    finally:
        if batch is not None:
            L.llama_batch_ext_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)


@pytest.mark.interop
@pytest.mark.parametrize("variant", ["dspark", "dspark-yarn", "dflash"])
def test_draft_matches_llama_dflash_graph(tmp_path, variant):
    dspark = variant.startswith("dspark")
    cfg = DraftConfig(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=V, block_size=B, target_layer_ids=(0, 1),
                      mask_token_id=V - 1, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=YARN if variant == "dspark-yarn" else None,
                      markov_rank=8 if dspark else 0, has_confidence=dspark, sample_from_anchor=dspark)
    d, emb, head = _draft(cfg)
    path = tmp_path / "draft.gguf"
    _write_gguf(path, d, emb, head)
    n_ctx = 40 if variant == "dspark-yarn" else 9        # past the original context for YaRN
    taps = torch.randn(n_ctx, 2 * H, generator=torch.Generator().manual_seed(2))
    anchor = 5
    ll, conf = _run_llama(path, taps.numpy(), [anchor] + [V - 1] * (B - 1), want_conf=dspark)

    ring = FeatureRing(2 * H, storage="f32")
    ring.append(taps)
    drafter = DSparkDrafter(d)
    drafter.sync(ring)
    prop = propose(drafter, anchor, n_ctx, Sampling())
    mine = prop.logits.float().numpy()
    ref = ll if dspark else ll[1:]          # DFlash: row 0 re-reads the anchor, not a proposal
    assert len(prop.tokens) == (B if dspark else B - 1)
    scale = np.abs(mine).max()
    assert np.abs(ref - mine).max() < 1e-4 * scale
    assert prop.tokens == ref.argmax(-1).tolist()
    if dspark:
        assert np.abs(conf - prop.confidence.numpy()).max() < 1e-5
    # the comparison has teeth: the other rope setting is far off
    other = dataclasses.replace(cfg, rope_scaling=None if cfg.rope_scaling else YARN)
    d2 = DSparkDraft(other, embed=emb, lm_head=head)
    d2.load_state_dict(d.state_dict())
    dr2 = DSparkDrafter(d2)
    dr2.sync(ring)
    assert np.abs(ref - propose(dr2, anchor, n_ctx, Sampling()).logits.float().numpy()).max() > 0.1 * scale


@pytest.mark.interop
def test_quantized_draft_file_matches_llama_dflash_graph(tmp_path):
    """A Q8_0 draft file loaded as `k3kit generate --draft` loads it (matrices kept as their bytes,
    products in ggml's int8 arithmetic, ggml's norms) against llama.cpp's CPU graph on the same file."""
    from k3kit.adapters.dflash import load
    from k3kit.runtime.loader import GGUFSource, LoadOptions

    h = 96              # rows of 3 blocks: wider than adapters.dflash.SHORT_ROWS, so kept quantized
    cfg = DraftConfig(hidden_size=h, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
                      intermediate_size=128, vocab_size=V, block_size=B, target_layer_ids=(0, 1),
                      mask_token_id=V - 1, rms_norm_eps=1e-5, rope_theta=10000.0, markov_rank=8,
                      has_confidence=True, sample_from_anchor=True)
    d, emb, head = _draft(cfg)
    path = tmp_path / "draft-q8.gguf"
    _write_gguf(path, d, emb, head, q8=True)
    taps = torch.randn(9, 2 * h, generator=torch.Generator().manual_seed(2))
    anchor = 5
    ll, conf = _run_llama(path, taps.numpy(), [anchor] + [V - 1] * (B - 1), want_conf=True)

    source = GGUFSource(path)
    try:
        drafter = load(source, LoadOptions())
        q8 = [m for m in drafter.draft.modules() if isinstance(m, QuantizedLinear) and m.qtype.name == "Q8_0"]
        assert len(q8) == 15
        drafter.draft.set_target(emb, head)
        ring = FeatureRing(2 * h, storage="f32")
        ring.append(taps)
        drafter.sync(ring)
        prop = propose(drafter, anchor, 9, Sampling())
    finally:
        source.close()
    mine = prop.logits.float().numpy()
    scale = np.abs(mine).max()
    err = np.abs(ll - mine).max() / scale
    assert err < 1e-5, err
    assert prop.tokens == ll.argmax(-1).tolist()
    assert np.abs(conf - prop.confidence.numpy()).max() < 1e-5
    # the float draft of the same weights is far from llama.cpp's Q8_0 graph: the comparison has teeth
    ring2 = FeatureRing(2 * h, storage="f32")
    ring2.append(taps)
    flt = DSparkDrafter(d)
    flt.sync(ring2)
    assert np.abs(ll - propose(flt, anchor, 9, Sampling()).logits.float().numpy()).max() / scale > 100 * err
