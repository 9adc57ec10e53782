import math

import pytest
import torch
from toy_target import (
    ToyTarget,
    bigram_dspark,
    draft_config,
    one_thread,  # noqa: F401  (autouse fixture)
)

from k3kit.adapters.dflash import DSparkDrafter
from k3kit.convert.draft_config import YarnScaling
from k3kit.errors import ConvertError
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.names import gguf_tensor_name
from k3kit.models.dflash.network import DSparkDraft, rope_inv_freq
from k3kit.runtime.protocols import DraftBlock
from k3kit.runtime.speculative import FeatureRing, Sampling, propose, speculative_generate
from k3kit.runtime.speculative.sampling import probs

V, H = 32, 16


def _draft(cfg=None, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    emb = torch.randn(V, H, generator=g, dtype=torch.float64)
    head = torch.randn(V, H, generator=g, dtype=torch.float64)
    d = DSparkDraft(cfg or draft_config(), embed=emb, lm_head=head).double()
    for p in d.parameters():                      # non-trivial norms too
        if p.dim() == 1:
            p.data = 1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
    return d


def _ctx(d, n=6, start=0, seed=3):
    g = torch.Generator().manual_seed(seed)
    taps = torch.randn(n, 2 * H, generator=g, dtype=torch.float64)
    return taps, d.context_kv(taps, torch.arange(start, start + n))


def test_every_hidden_row_is_a_proposal():
    d = _draft()
    ring = FeatureRing(2 * H, storage="f32")
    ring.append(_ctx(d)[0])
    drafter = DSparkDrafter(d)
    drafter.sync(ring)
    prop = propose(drafter, 4, ring.length, Sampling())
    assert len(prop.tokens) == 5 == d.cfg.block_size and prop.confidence.shape == (5,)
    # push row k's final hidden state towards a token: proposal k must follow, for every k
    for k in range(5):
        tok = next(t for t in (11, 12, 13) if t != prop.tokens[k])
        direction = d._head[tok] / d._head[tok].norm()

        def bump(module, inp, out, k=k, direction=direction):
            out = out.clone()
            out[k] += 50 * direction
            return out

        h = d.norm.register_forward_hook(bump)
        try:
            bumped = propose(drafter, 4, ring.length, Sampling())
        finally:
            h.remove()
        assert bumped.tokens[k] == tok and bumped.tokens[:k] == prop.tokens[:k]
        assert len(bumped.tokens) == 5
    # DFlash layout (row 0 only re-reads the anchor) gives block_size - 1 proposals
    d2 = _draft(draft_config(sample_from_anchor=False, markov_rank=0, has_confidence=False))
    dr2 = DSparkDrafter(d2)
    dr2.sync(ring)
    assert len(propose(dr2, 4, ring.length, Sampling()).tokens) == 4


def test_markov_chain_and_confidence_by_hand():
    d = _draft()
    ring = FeatureRing(2 * H, storage="f32")
    ring.append(_ctx(d)[0])
    drafter = DSparkDrafter(d)
    drafter.sync(ring)
    anchor, pos = 7, ring.length
    block = drafter.draft_block(anchor, pos)
    prop = propose(drafter, anchor, pos, Sampling())
    w1 = d.markov_head.markov_w1.weight.detach().numpy()
    w2 = d.markov_head.markov_w2.weight.detach().numpy()
    cw = d.confidence_head.proj.weight.detach().numpy()[0]
    cb = d.confidence_head.proj.bias.detach().numpy()[0]
    base, hid = block.logits.numpy(), block.hidden.numpy()
    prev = anchor
    for k in range(5):
        logits = base[k] + w2 @ w1[prev]
        conf = 1 / (1 + math.exp(-(cw[:H] @ hid[k] + cw[H:] @ w1[prev] + cb)))
        assert torch.allclose(prop.logits[k], torch.from_numpy(logits), atol=1e-12)
        assert abs(prop.confidence[k].item() - conf) < 1e-12
        assert prop.tokens[k] == int(logits.argmax())
        prev = prop.tokens[k]
    assert not torch.allclose(prop.logits, block.logits)


def test_hidden_only_confidence_head():
    d = _draft(draft_config(markov_rank=0, has_confidence=True, confidence_with_markov=False))
    assert d.confidence_head.proj.weight.shape == (1, H)
    dr = DSparkDrafter(d)
    dr.sync(FeatureRing(2 * H))
    block = dr.draft_block(3, 0)
    prop = propose(dr, 3, 0, Sampling())
    w, b = d.confidence_head.proj.weight[0], d.confidence_head.proj.bias[0]
    assert torch.allclose(prop.confidence, torch.sigmoid(block.hidden @ w + b).detach())
    assert prop.tokens == block.logits.argmax(-1).tolist()      # no Markov head: base logits
    with pytest.raises(ConvertError):
        draft_config(markov_rank=0, has_confidence=True).validate()


def test_context_injection_and_bidirectional_block():
    d = _draft()
    taps, kv = _ctx(d)
    ids = torch.tensor([3, V - 1, V - 1, V - 1, V - 1])
    pos = torch.arange(6, 11)
    with torch.no_grad():
        h = d(ids, pos, kv)
        # context rows matter
        taps2 = taps.clone()
        taps2[2] += 1.0
        assert not torch.allclose(h, d(ids, pos, d.context_kv(taps2, torch.arange(6))))
        # attention is bidirectional: a later block token changes row 0
        ids2 = ids.clone()
        ids2[4] = 5
        assert not torch.allclose(h[0], d(ids2, pos, kv)[0])
        # rope is applied to context K and block Q/K alike: a global shift changes nothing
        kv_s = d.context_kv(taps, torch.arange(100, 106))
        assert torch.allclose(h, d(ids, pos + 100, kv_s), atol=1e-9)
        # but moving the block away from its context does
        assert not torch.allclose(h, d(ids, pos + 3, kv), atol=1e-6)
        # context K/V depend only on the features: no attn_norm, k_norm + rope on K, raw V
        layer = d.layers[0].self_attn
        g = d.hidden_norm(d.fc(taps))
        v_ref = layer.v_proj(g).view(6, 2, 8)
        assert torch.allclose(kv[0][1], v_ref)


def test_drafter_incremental_context_equals_full_recompute():
    d = _draft()
    taps, _ = _ctx(d, n=12)
    taps = taps.float().double()          # what an f32 ring holds
    ring = FeatureRing(2 * H, storage="f32", capacity=64)
    inc = DSparkDrafter(d, max_context=8, chunk=2)
    for a, b in ((0, 3), (3, 4), (4, 9), (9, 12)):
        ring.append(taps[a:b])
        inc.sync(ring)
    assert inc.context_span == (4, 12)
    full = d.context_kv(taps[4:12], torch.arange(4, 12))
    for (k, v), (fk, fv) in zip(inc.context(), full, strict=True):
        assert torch.allclose(k, fk, atol=1e-12) and torch.allclose(v, fv, atol=1e-12)
    ring.truncate(10)
    ring.append(taps[:2] * 3)
    inc.sync(ring)
    full = d.context_kv(torch.cat([taps[4:10], taps[:2] * 3]), torch.arange(4, 12))
    for (k, _), (fk, _) in zip(inc.context(), full, strict=True):
        assert torch.allclose(k, fk, atol=1e-12)


def test_yarn_frequencies_by_hand():
    cfg = draft_config(head_dim=64, rope_theta=50000.0,
               rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=4096))
    inv, mag = rope_inv_freq(cfg)
    base = 50000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    assert mag == pytest.approx(0.1 * math.log(16) + 1)

    def corr(r):
        return 64 * math.log(4096 / (r * 2 * math.pi)) / (2 * math.log(50000.0))

    low, high = math.floor(corr(32)), math.ceil(corr(1))
    assert torch.allclose(inv[: low + 1], base[: low + 1])           # fast dims: as trained
    assert torch.allclose(inv[high:], base[high:] / 16)                # slow dims: interpolated
    mid = (low + high) // 2
    t = (mid - low) / (high - low)
    assert inv[mid].item() == pytest.approx(base[mid].item() * (1 - t) + base[mid].item() / 16 * t)
    plain, one = rope_inv_freq(draft_config(head_dim=64, rope_theta=50000.0))
    assert one == 1.0 and torch.allclose(plain, base)


def test_parameter_names_map_to_gguf():
    d = _draft()
    names = {n: gguf_tensor_name(n) for n, _ in d.named_parameters()}
    assert len(set(names.values())) == len(names)
    assert names["fc.weight"] == "fc.weight"
    assert names["hidden_norm.weight"] == "enc.output_norm.weight"
    assert names["layers.1.self_attn.k_norm.weight"] == "blk.1.attn_k_norm.weight"
    assert names["layers.0.mlp.down_proj.weight"] == "blk.0.ffn_down.weight"
    assert names["markov_head.markov_w1.weight"] == "markov_w1.weight"
    assert names["confidence_head.proj.bias"] == "conf_proj.bias"
    sd = d.state_dict()
    # the target's embedding and head are borrowed, not saved
    assert not any("embed" in k or "lm_head" in k for k in sd)
    # ggml shapes (reversed torch) are what llama.cpp's dflash loader asks for
    assert tuple(reversed(sd["fc.weight"].shape)) == (2 * H, H)
    assert tuple(reversed(sd["markov_head.markov_w1.weight"].shape)) == (4, V)
    assert tuple(reversed(sd["markov_head.markov_w2.weight"].shape)) == (4, V)
    assert tuple(reversed(sd["confidence_head.proj.weight"].shape)) == (H + 4, 1)
    with pytest.raises(KeyError):
        gguf_tensor_name("layers.0.bogus.weight")


def test_embedding_and_logit_scales():
    d = _draft()
    ds = _draft(draft_config(embedding_scale=2.0, logit_scale=0.5, final_logit_softcapping=3.0))
    ids = torch.tensor([1, 2])
    assert torch.allclose(ds.embed(ids), 2 * d.embed(ids))
    h = torch.randn(2, H, dtype=torch.float64)
    assert torch.allclose(ds.logits(h), torch.tanh(0.5 * d.logits(h) / 3.0) * 3.0)


def test_config_validation_and_hf():
    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "rms_norm_eps": 1e-5,
          "rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 16.0,
                                              "original_max_position_embeddings": 4096},
          "dflash_config": {"block_size": 7, "target_layer_ids": [1, 3], "mask_token_id": 99}}
    cfg = DraftConfig.from_hf(hf)
    assert cfg.block_size == 7 and cfg.rope_scaling.factor == 16.0 and cfg.target_layer_ids == (1, 3)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 1e6
    for bad in ({"vocab_size": -1}, {"num_key_value_heads": 3}, {"dflash_config": {"block_size": 7}},
                {"hidden_size": "x"}, {"num_hidden_layers": 10**9}):
        with pytest.raises(ConvertError, match="config.json"):
            DraftConfig.from_hf({**hf, **bad})


def test_bigram_markov_draft_gets_accepted():
    """Only a correctly seeded left-to-right Markov chain is accepted often."""
    from k3kit.runtime.speculative import ar_generate

    ref = ar_generate(ToyTarget(state_weight=0.0), [3, 17, 5], 30, Sampling()).tokens
    t = ToyTarget(state_weight=0.0)
    res = speculative_generate(t, bigram_dspark(t, 6), [3, 17, 5], 30, Sampling())
    assert res.tokens == ref
    assert res.stats.tau > 1.5
    # seeding the chain with the wrong token (a broken anchor) destroys acceptance
    t2 = ToyTarget(state_weight=0.0)
    bad = bigram_dspark(t2, 6)
    orig = bad.markov_embed
    bad.markov_embed = lambda prev: orig((prev + 1) % t2.vocab_size)
    res_bad = speculative_generate(t2, bad, [3, 17, 5], 30, Sampling())
    assert res_bad.tokens == ref and res_bad.stats.tau < res.stats.tau


def test_sampled_proposals_chain_on_the_sampled_token():
    d = _draft()
    dr = DSparkDrafter(d)
    dr.sync(FeatureRing(2 * H))
    s = Sampling(temperature=2.0, top_k=20)
    block = dr.draft_block(7, 0)
    w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    seen = set()
    for seed in range(6):
        prop = propose(dr, 7, 0, s, torch.Generator().manual_seed(seed))
        prev = 7
        for k in range(5):
            expect = block.logits[k] + w2 @ w1[prev]
            assert torch.allclose(prop.logits[k], expect.detach(), atol=1e-12)
            assert torch.allclose(prop.q[k], probs(expect.detach(), s))
            assert prop.q[k, prop.tokens[k]] > 0
            prev = prop.tokens[k]
        seen.add(tuple(prop.tokens))
    assert len(seen) > 1                      # it really samples


def test_block_protocol_shapes():
    d = _draft()
    dr = DSparkDrafter(d)
    dr.sync(FeatureRing(2 * H))
    blk = dr.draft_block(2, 0)       # empty context is allowed
    assert isinstance(blk, DraftBlock) and blk.logits.shape == (5, V) and blk.hidden.shape == (5, H)


def test_gguf_metadata_round_trip():
    yarn = YarnScaling(factor=16.0, original_max_position_embeddings=4096, beta_fast=24.0)
    cfg = draft_config(rope_scaling=yarn, target_layer_ids=(7, 23, 51), block_size=7)
    kv = cfg.to_gguf_kv()
    assert kv["dflash.target_layers"] == [8, 24, 52]          # llama.cpp reads layer inputs
    assert kv["dflash.block_size"] == 7 and kv["tokenizer.ggml.mask_token_id"] == V - 1
    back = DraftConfig.from_gguf_kv(kv, vocab_size=V, markov_rank=4)
    assert back == cfg
    scaled = draft_config(embedding_scale=2.0, logit_scale=0.5, final_logit_softcapping=30.0)
    assert DraftConfig.from_gguf_kv(scaled.to_gguf_kv(), vocab_size=V, markov_rank=4) == scaled
    del kv["dflash.block_count"]
    with pytest.raises(ConvertError, match="dflash.block_count"):
        DraftConfig.from_gguf_kv(kv, vocab_size=V, markov_rank=4)


def test_context_rows_buffer_matches_a_list():
    from k3kit.adapters.dflash import _Rows

    g = torch.Generator().manual_seed(0)
    rows, ref, counter = _Rows(), [], 0
    for _ in range(400):
        if torch.rand((), generator=g) < 0.6:
            m = int(torch.randint(1, 40, (), generator=g))
            x = torch.arange(counter, counter + m, dtype=torch.float64)[:, None].repeat(1, 3)
            counter += m
            rows.append(x)
            ref.extend(x.unbind(0))
        else:
            k = int(torch.randint(0, 30, (), generator=g))
            rows.drop_front(k)
            ref = ref[k:]
        assert torch.equal(rows.view(), torch.stack(ref) if ref else rows.view()[:0])
        assert rows.buf.shape[0] <= max(64, 4 * (len(ref) + 40))   # storage stays proportional


def test_load_gguf_tensors_round_trip_and_errors():
    d = _draft()
    tensors = {gguf_tensor_name(n): p.detach().numpy().copy() for n, p in d.state_dict().items()}
    tensors["token_embd.weight"] = d._embed.numpy()          # borrowed: accepted and ignored
    fresh = DSparkDraft(d.cfg, embed=d._embed, lm_head=d._head).double()
    fresh.load_gguf_tensors(tensors)
    ids, pos = torch.tensor([3, V - 1, V - 1]), torch.arange(3)
    with torch.no_grad():
        assert torch.equal(fresh(ids, pos), d(ids, pos))
    broken = dict(tensors)
    del broken["blk.1.attn_v.weight"]
    with pytest.raises(ConvertError, match="missing tensor 'blk.1.attn_v.weight'"):
        fresh.load_gguf_tensors(broken)
    broken = dict(tensors, **{"fc.weight": tensors["fc.weight"].T.copy()})
    with pytest.raises(ConvertError, match="fc.weight"):
        fresh.load_gguf_tensors(broken)
    with pytest.raises(ConvertError, match="blk.9.attn_q.weight"):
        fresh.load_gguf_tensors(dict(tensors, **{"blk.9.attn_q.weight": tensors["fc.weight"]}))
