"""`--expert-io {auto,page,direct}`: the choice, the same tokens on every path, the ledger against the disk.

The model: `k3kit synth`'s mini geometry with 1024-wide expert latent and FFN (one MXFP4 expert is
1.67 MB: the pages a buffered read rounds a slice out to are under 1.5% of it), top-4 routing, 2 MoE
layers of 24 experts. `auto` is made to
pick each path by saying how much RAM there is (K3KIT_MEM_AVAILABLE), so the test does not depend
on this machine's memory. The ledger test reads expert slices with O_DIRECT (and pread + fadvise)
and compares the store's `io_bytes` with what the kernel says this process read from storage
(/proc/self/io `read_bytes`); it skips where the filesystem refuses O_DIRECT or the kernel keeps no
per-process I/O accounting.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.gguf.reader import GGUFFile
from k3kit.gguf.synth import MINI, synthesize
from k3kit.plan import PlanOptions, make_plan
from k3kit.plan import expert_io as eio
from k3kit.plan.hardware import Hardware
from k3kit.runtime.experts import ExpertStore, ExpertTensor

MIB, GIB = 1 << 20, 1 << 30
TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("eio")
    g = replace(MINI, name="eio", n_ff_exp=1024, expert_latent=1024, top_k=4)
    return Path(synthesize(d, g, 3, 24, vocab=512, progress=False, name="eio").paths[0])


def _generate(capsys, path: Path, *extra: str) -> tuple[dict, str]:
    rc = main(["generate", str(path), "--prompt", "once upon a time", "--max-tokens", str(TOKENS),
               "--threads", "1", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out), err


# -- the choice ------------------------------------------------------------------------------------

def test_auto_reads_direct_only_when_the_experts_do_not_fit():
    fits = eio.choose(asked="auto", routed_bytes=4 * GIB, trunk_bytes=1 * GIB, available=16 * GIB)
    assert fits.mode == "page" and fits.cold is False and not fits.announce
    # RAM left = 16 - 1 - max(2, 1.6) = 13 GiB: the page cache holds 4, the cache gets the rest
    assert fits.ram_left == 13 * GIB and fits.cache_bytes == 4 * GIB

    big = eio.choose(asked="auto", routed_bytes=50 * GIB, trunk_bytes=3 * GIB, available=22 * GIB)
    assert big.mode == "direct" and big.cold == "direct" and big.announce
    assert big.cache_bytes == big.ram_left == 22 * GIB - 3 * GIB - int(0.1 * 22 * GIB)
    assert "do not fit" in big.line() and "O_DIRECT" in big.line()

    # an explicit budget is kept, and counts against what the page cache could hold
    tight = eio.choose(asked="auto", routed_bytes=10 * GIB, trunk_bytes=1 * GIB, available=16 * GIB,
                       cache_mib=4096)
    assert tight.mode == "direct" and tight.cache_bytes == 4 * GIB
    assert tight.cache_from == "--expert-cache-mib"
    assert eio.choose(asked="auto", routed_bytes=10 * GIB, trunk_bytes=1 * GIB, available=16 * GIB,
                      cache_mib=1024).mode == "page"


def test_asked_modes_gpu_and_unknown_ram():
    page = eio.choose(asked="page", routed_bytes=50 * GIB, trunk_bytes=GIB, available=8 * GIB)
    assert page.mode == "page" and not page.announce and page.cache_bytes == eio.MIN_CACHE
    direct = eio.choose(asked="direct", routed_bytes=GIB, trunk_bytes=GIB, available=64 * GIB)
    assert direct.mode == "direct" and not direct.announce
    gpu = eio.choose(asked="auto", routed_bytes=50 * GIB, trunk_bytes=GIB, available=22 * GIB, on_gpu=True)
    assert gpu.mode == "direct" and gpu.cache_bytes == eio.MIN_CACHE      # VRAM is not RAM
    unknown = eio.choose(asked="auto", routed_bytes=50 * GIB, trunk_bytes=GIB, available=0)
    assert unknown.mode == "page" and unknown.cache_bytes == eio.MIN_CACHE
    with pytest.raises(K3Error, match="--expert-io 'cold'"):
        eio.choose(asked="cold", routed_bytes=1, trunk_bytes=1, available=1)


def test_for_model_reads_the_headers(model, monkeypatch):
    f = GGUFFile.open(model)
    routed = sum(t.nbytes for t in f.tensors if "_exps." in t.name)
    trunk = sum(t.nbytes for t in f.tensors) - routed
    assert eio.model_bytes(model) == (routed, trunk)
    monkeypatch.setenv("K3KIT_MEM_AVAILABLE", str(trunk + routed // 2))
    assert eio.for_model(model, "auto", None).mode == "direct"
    monkeypatch.setenv("K3KIT_MEM_AVAILABLE", str(64 * GIB))
    assert eio.for_model(model, "auto", None).mode == "page"
    monkeypatch.setenv("K3KIT_MEM_AVAILABLE", "lots")
    with pytest.raises(K3Error, match="K3KIT_MEM_AVAILABLE"):
        eio.for_model(model, "auto", None)


def test_plan_prints_the_choice_and_its_speed(capsys):
    mini = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
    if not mini.exists():
        pytest.skip("the shipped mini model is not built")
    roomy = make_plan(mini, Hardware(name="roomy", ram=64 * GIB, cores=2), PlanOptions())
    assert roomy["expert_io"]["mode"] == "page" and roomy["expert_io"]["decode_tok_s"] > 0
    # a box whose RAM after the reserve cannot hold the experts: direct reads
    routed, trunk = eio.model_bytes(mini)
    small = PlanOptions(ram_reserve=64 * GIB - trunk - routed // 2)
    tight = make_plan(mini, Hardware(name="tight", ram=64 * GIB, cores=2), small)
    assert tight["expert_io"]["mode"] == "direct"
    assert tight["expert_io"]["decode_tok_s"] == tight["decode_tok_s"]["ar"]
    rc = main(["plan", str(mini), "--ram", "64GiB"])
    out = capsys.readouterr().out
    assert rc == 0 and "expert I/O (k3kit --expert-io auto): page" in out and "predicted decode" in out


# -- the same tokens on every path -------------------------------------------------------------------

def test_every_expert_io_gives_the_same_tokens(model, capsys, monkeypatch):
    monkeypatch.delenv("K3KIT_MEM_AVAILABLE", raising=False)
    small = ["--expert-cache-mib", "4"]     # far less than the experts (80 MB): every path streams
    want, _ = _generate(capsys, model, "--expert-io", "page", *small)
    assert len(want["token_ids"]) == TOKENS and want["stats"]["expert_io"] == "page"
    assert want["stats"]["payload_bytes"] > 4 * MIB
    runs = {"direct": _generate(capsys, model, "--expert-io", "direct", *small),
            "cold": _generate(capsys, model, "--cold", *small),
            "auto": _generate(capsys, model, *small)}
    monkeypatch.setenv("K3KIT_MEM_AVAILABLE", "1")      # no RAM to speak of: auto reads direct
    runs["auto-direct"] = _generate(capsys, model, *small)
    runs["auto-direct-sized"] = _generate(capsys, model)     # and sizes the cache itself
    for name, (got, err) in runs.items():
        assert got["token_ids"] == want["token_ids"], name
        mode = "page" if name == "auto" else "direct"
        assert got["stats"]["expert_io"] == mode, name
        assert ("expert I/O: direct" in err) == name.startswith("auto-direct"), (name, err)   # said once
    assert runs["auto-direct-sized"][0]["stats"]["expert_cache_budget_bytes"] == eio.MIN_CACHE
    assert runs["auto-direct"][0]["stats"]["expert_cache_budget_bytes"] == 4 * MIB


def test_bad_expert_io_is_a_usage_error(model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", str(model), "--prompt", "x", "--expert-io", "cold"])
    assert e.value.code == 2
    assert "--expert-io" in capsys.readouterr().err


# -- the ledger against the disk -------------------------------------------------------------------

def _proc_read_bytes() -> int | None:
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _layers(path: Path) -> dict[int, list[ExpertTensor]]:
    f = GGUFFile.open(path)
    out: dict[int, list[ExpertTensor]] = {}
    for t in f.tensors:
        if "_exps." in t.name:
            layer = int(t.name.split(".")[1])
            out.setdefault(layer, []).append(ExpertTensor(path, t.offset, t.ggml_type, tuple(t.shape[:2]),
                                                          t.shape[2], t.name))
    return out


@pytest.mark.parametrize("cold", ["direct", "fadvise"])
@pytest.mark.parametrize("read_ahead", [False, True])
def test_the_ledger_is_what_the_process_read_from_storage(model, cold, read_ahead):
    if _proc_read_bytes() is None:
        pytest.skip("no /proc/self/io read_bytes here")
    layers = _layers(model)
    with ExpertStore(layers, cache_mib=1, keep="quantized", cold=cold, read_ahead=read_ahead) as store:
        if cold == "direct" and not store.direct_io:
            pytest.skip("this filesystem refuses O_DIRECT")
        fd = os.open(model, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # nothing of it in the page cache
        os.close(fd)
        before = _proc_read_bytes()
        for layer in layers:
            ids = list(range(0, 24, 2))
            store.plan(layer, ids)
            for e in ids:
                store.get(layer, [e])
        store.clear()          # background reads finished and counted
        read = (_proc_read_bytes() or 0) - (before or 0)
        s = store.stats()
    if read == 0:
        pytest.skip("the kernel keeps no per-process I/O accounting here")
    assert s.bytes_read == 2 * 12 * store.expert_nbytes(min(layers))
    assert abs(read - s.io_bytes) <= 0.05 * s.io_bytes, (read, s.io_bytes, s.bytes_read)



@pytest.mark.parametrize("cold", [False, "direct"])
def test_a_512_token_prefill_reads_each_expert_once_per_chunk(model, cold):
    """One chunk of 512 rows: each MoE layer reads every expert its rows route to once, whatever
    the path and however small the cache (a per-row read would be up to 512 x 4 reads a layer)."""
    import torch

    from k3kit.adapters import load_model
    from k3kit.runtime.engine import generate
    from k3kit.runtime.loader import LoadOptions
    from k3kit.runtime.sampling import make_sampling

    torch.set_num_threads(1)
    prompt = [(7 * i + 3) % 500 + 1 for i in range(512)]
    with load_model(model, LoadOptions(expert_cache_mib=0, cold=cold)) as lm:
        generate(lm.model, prompt, max_tokens=1, sampling=make_sampling(0.0, seed=0), prefill_chunk=512)
        s = lm.model.store.stats()
        per = lm.model.store.expert_nbytes(min(s.per_layer))
    assert len(s.per_layer) == 2
    for layer, st in s.per_layer.items():
        assert 4 < st.misses <= 24, (layer, st)         # at most the layer's 24 experts, each once
        assert st.bytes_read == st.misses * per
    assert s.bytes_read == s.misses * per


def test_a_reserve_for_other_caches_comes_off_the_ram_left():
    plain = eio.choose(asked="auto", routed_bytes=50 * GIB, trunk_bytes=3 * GIB, available=22 * GIB)
    kept = eio.choose(asked="auto", routed_bytes=50 * GIB, trunk_bytes=3 * GIB, available=22 * GIB,
                      reserved=4 * GIB)
    assert kept.mode == "direct" and kept.reserved == 4 * GIB
    assert kept.ram_left == plain.ram_left - 4 * GIB and kept.cache_bytes == kept.ram_left
    assert kept.reserved + kept.cache_bytes + 3 * GIB + eio.headroom(22 * GIB) == 22 * GIB   # all fits
    assert "prompt cache 4.29 GB" in kept.line() and "prompt cache" not in plain.line()
    # a model whose experts fit beside the page cache without the reserve, but not with it
    near = dict(asked="auto", routed_bytes=10 * GIB, trunk_bytes=GIB, available=16 * GIB)
    assert eio.choose(**near).mode == "page" and eio.choose(**near, reserved=4 * GIB).mode == "direct"


def test_serve_sets_the_prompt_cache_aside_before_sizing_the_expert_cache(model, monkeypatch):
    from k3kit.cli import build_parser
    from k3kit.commands.serve import memory_budgets
    routed, trunk = eio.model_bytes(model)
    # the experts fit beside the page cache in what is free, not in what the prompt cache leaves
    available = eio.HEADROOM + eio.MIN_CACHE + trunk + routed + 64 * MIB
    monkeypatch.setenv("K3KIT_MEM_AVAILABLE", str(available))
    assert eio.for_model(model, "auto", None).mode == "page"
    args = build_parser().parse_args(["serve", str(model)])
    prompt_mib, io = memory_budgets(model, args)
    assert prompt_mib * MIB == available // 4             # a quarter of what is free
    assert io.mode == "direct" and io.reserved == available // 4
    assert io.ram_left == available - available // 4 - trunk - eio.headroom(available)
    assert io.cache_bytes == max(eio.MIN_CACHE, io.ram_left)
    args = build_parser().parse_args(["serve", str(model), "--prompt-cache-mib", "0"])
    assert memory_budgets(model, args)[1].reserved == 0
