"""The K3 engine adapter over a GGUF: config from KVs, trunk tensors, the speculative Target
contract (verify without committing, commit(n) by replay/truncation), taps, cost."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from engine_models import prompts, tiny_gguf  # noqa: E402
from target_contract import check_target_contract  # noqa: E402

from k3kit.adapters import ADAPTERS, adapter_for, load_model  # noqa: E402
from k3kit.adapters.kimi_k3 import K3Adapter, _install_layer_split  # noqa: E402
from k3kit.adapters.session import open_session  # noqa: E402
from k3kit.errors import K3Error  # noqa: E402
from k3kit.layers.quantized_linear import quantized_modules  # noqa: E402
from k3kit.mini.paths import shipped_draft, shipped_gguf  # noqa: E402
from k3kit.models.kimi_k3.mla import LatentHeads  # noqa: E402
from k3kit.runtime.loader import LoadOptions  # noqa: E402
from k3kit.runtime.protocols import AttachableDraft, CausalModel, ExpertBacked, MemoryFigures, Target  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("adapter"), "F32")


def test_registry_finds_the_k3_adapter_and_rejects_others(tiny):
    path, model = tiny
    adapter = load_model(path, LoadOptions(expert_cache_mib=0)).model
    try:
        assert isinstance(adapter, K3Adapter) and isinstance(adapter, Target)
        got, want = adapter.cfg.to_dict(), model.cfg.to_dict()
        assert got.pop("rms_norm_eps") == pytest.approx(want.pop("rms_norm_eps"), rel=1e-6)  # stored as f32
        want["experts_mxfp4"] = True                  # the reference copy rounds experts up front
        assert {k: v for k, v in got.items() if k not in ("bos_token_id", "eos_token_id")} == \
            {k: v for k, v in want.items() if k not in ("bos_token_id", "eos_token_id")}
        ref = dict(model.named_parameters())
        for name, p in adapter.model.named_parameters():   # F32 trunk: bit for bit
            assert torch.equal(p, ref[name]), name
        held = {n: m for n, m in adapter.model.named_modules() if m in quantized_modules(adapter.model)}
        assert held                                         # ... and so are the matrices held as bytes
        for name, m in held.items():
            w = m.dense if hasattr(m, "dense") else m(torch.arange(m.num_embeddings))
            assert torch.equal(w, ref[name + ".weight"]), name
        assert not any("_exps" in n for n, _ in adapter.model.named_parameters())   # experts stay in the file
    finally:
        adapter.close()
    with pytest.raises(Exception, match="no engine adapter"):
        adapter_for("not-a-model", "x.gguf")


def test_target_contract(tiny):
    path, _ = tiny
    made = []

    def make():
        a = load_model(path, LoadOptions(expert_cache_mib=2)).model
        a.set_taps([0, 2, 4])
        made.append(a)
        return a

    p = prompts(1, 500, seed=4, lo=9, hi=9)[0]
    try:
        check_target_contract(make, p, [5, 77, 300, 12, 401], atol=1e-4)   # float32 batch vs row
    finally:
        for a in made:
            a.close()


def test_verify_leaves_state_and_commit_replays(tiny):
    path, model = tiny
    a = load_model(path, LoadOptions(expert_cache_mib=2)).model
    a.set_taps([1, 4])
    try:
        p = prompts(1, 500, seed=6, lo=7, hi=7)[0]
        a.forward(p)
        before = a.state.clone()
        rows = [3, 9, 27, 81]
        v = a.verify(rows)
        assert v.logits.shape == (4, a.vocab_size) and v.taps.shape == (4, 2 * model.cfg.hidden_size)
        for x, y in zip(a.state.layers, before.layers, strict=True):   # KDA untouched, MLA pending only
            if hasattr(x, "S"):
                assert torch.equal(x.S, y.S) and torch.equal(x.conv, y.conv)
        assert a.position == len(p)
        a.commit(2)
        assert a.position == len(p) + 2
        # committed state == having run the 2 rows for real
        b = load_model(path, LoadOptions(expert_cache_mib=2)).model
        try:
            b.forward(p + rows[:2])
            nxt_a, nxt_b = a.forward([rows[2]]), b.forward([rows[2]])
            assert torch.allclose(nxt_a, nxt_b, atol=2e-5, rtol=0)
        finally:
            b.close()
        with pytest.raises(ValueError):
            a.commit(1)                 # nothing pending after a committing forward
    finally:
        a.close()


def test_cost_follows_cache_contents(tiny):
    path, _ = tiny
    a = load_model(path, LoadOptions(expert_cache_mib=64)).model
    try:
        cold1, cold8 = a.cost(1), a.cost(8)
        assert cold8 > cold1 > 0
        a.forward(prompts(1, 500, seed=1, lo=40, hi=40)[0])    # warms the cache with many experts
        assert a.cost(8) < cold8
        assert a.counters()["expert_misses"] > 0
    finally:
        a.close()


def test_layer_split_hooks_leave_results_unchanged(tiny):
    """The multi-device split (hooks moving activations to each layer's device and back) on a
    CPU-only machine: every "device" is the CPU, so only the plumbing is exercised, not CUDA."""
    path, _ = tiny
    a = load_model(path, LoadOptions(expert_cache_mib=2)).model
    try:
        p = prompts(1, 500, seed=8, lo=12, hi=12)[0]
        want = a.forward(p, all_logits=True)
        a.reset()
        _install_layer_split(a.model, [torch.device("cpu")] * a.cfg.num_layers)
        assert torch.equal(a.forward(p, all_logits=True), want)
        assert all(len(layer.attn._forward_pre_hooks) == 1 for layer in a.model.layers)
    finally:
        a.close()


def test_registry_is_an_explicit_table_imported_lazily():
    assert ADAPTERS == {"kimi-k3": "k3kit.adapters.kimi_k3", "dflash": "k3kit.adapters.dflash",
                        # legacy draft architectures, read as dflash
                        "dflash-draft": "k3kit.adapters.dflash",
                        "qwen35-dflash-draft": "k3kit.adapters.dflash"}
    for arch in ADAPTERS:
        assert callable(adapter_for(arch))


def test_loaded_model_carries_codec_ledger_and_memory(tiny):
    """What the CLI reads from a LoadedModel, against the store and the trunk it describes."""
    path, _ = tiny
    with load_model(path, LoadOptions(expert_cache_mib=2, expert_kernel="torch")) as loaded:
        a = loaded.model
        assert loaded.architecture == "kimi-k3" and loaded.path == path
        assert isinstance(a, CausalModel) and isinstance(a, Target) and isinstance(a, ExpertBacked)
        assert loaded.expert_kernel == "torch"
        m = loaded.memory()
        held = [*quantized_modules(a.model),                      # the default trunk: file bytes
                *(h for h in a.model.modules() if isinstance(h, LatentHeads))]
        assert m.trunk == "quantized" and held
        assert m.trunk_bytes == (sum(p.numel() * p.element_size() for p in a.model.parameters())
                                 + sum(q.nbytes for q in held))
        assert m.trunk_file_bytes == m.trunk_bytes > 0             # an F32 trunk is held as stored
        assert (m.expert_cache_bytes, m.expert_cache_budget) == (0, 2 << 20)
        assert m.experts_per_token == a.cfg.num_experts_per_tok
        assert [e.layer for e in m.experts] == sorted(a.store.layers)
        assert all(e.n_experts == 16 and 0 < e.file_bytes < e.cached_bytes for e in m.experts)  # f32 > MXFP4
        assert loaded.codec.n_vocab <= a.vocab_size
        ids = loaded.codec.encode("def f(x):")
        a.forward(ids)
        s = loaded.stats()
        assert s.misses > 0 and s.bytes_read == sum(ls.misses * a.store.expert_nbytes(il)
                                                    for il, ls in s.per_layer.items())
        assert loaded.memory().expert_cache_bytes == s.resident_bytes > 0
        loaded.check()
        loaded.reset_expert_cache(0)
        assert loaded.stats().misses == 0 and loaded.memory().expert_cache_bytes == 0
        assert loaded.memory().expert_cache_budget == 0


def test_session_attaches_the_draft_and_refuses_swapped_roles():
    """open_session: target + draft (block set, attached: the target captures the draft's taps)
    + codec; a draft given as the model or a model given as the draft is a one-line K3Error."""
    with open_session(shipped_gguf(), LoadOptions(expert_cache_mib=16), draft=shipped_draft(),
                      block_size=3) as session:
        draft, target = session.draft_model, session.model
        assert isinstance(draft, AttachableDraft) and draft.block_size == 3
        assert isinstance(target, Target) and target.tap_layers == draft.tap_inputs
        assert session.draft is not None and session.draft.architecture == "dflash"
        assert session.draft.expert_kernel == "none" and session.draft.memory() == MemoryFigures()
        assert session.codec is session.target.codec and session.codec.encode("import os")
    with pytest.raises(K3Error, match="cannot generate on its own"):
        open_session(shipped_draft())
    with pytest.raises(K3Error, match=r"mini-k3\.gguf: architecture 'kimi-k3' is not a draft"):
        open_session(shipped_gguf(), LoadOptions(expert_cache_mib=0), draft=shipped_gguf())


def test_kernels_say_which_path_multiplies_each_type():
    """`generate --stats/--json` shows the kernel per ggml type; it must follow the load options."""
    from k3kit.kernels.qmatmul import native_amx, native_available, native_simd
    if not native_available():
        pytest.skip("the native extension is not built")
    amx = " (AMX from 12 rows)" if native_amx() else ""
    with load_model(shipped_gguf(), LoadOptions(arith="ggml")) as lm:
        k = lm.kernels
    assert k["trunk"]["Q8_0"] == f"native-{native_simd()} ggml{amx}"
    assert k["experts"] == {"MXFP4": f"native-{native_simd()} ggml{amx}"}
    with load_model(shipped_gguf(), LoadOptions(trunk="float", expert_kernel="torch")) as lm:
        k = lm.kernels
    assert list(k["trunk"]) == ["all"] and k["trunk"]["all"].startswith("torch")
    assert k["experts"] == {"MXFP4": "torch (dequantized on a miss)"}
    with pytest.raises(K3Error, match="--arith"):
        load_model(shipped_gguf(), LoadOptions(arith="int4"))
