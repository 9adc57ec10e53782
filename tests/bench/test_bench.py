"""`k3kit bench` on the shipped mini K3: every field of results.json, the files, sweeps, profiles, pins.

Runs are tiny (-p 16, -n 4, one thread) so the file stays quick on two shared cores; nothing here
asserts a speed, only what the numbers must satisfy whatever the machine does (llama-bench's
avg = mean of the samples, sample = tokens / seconds, one phase's payload = its bytes / tokens...).
"""

from __future__ import annotations

import json
import statistics
import struct
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch

from k3kit.adapters import load_model
from k3kit.bench.config import Config, expand, parse_concurrency, parse_sweep
from k3kit.bench.workloads import Workload, fit, resolve, stdlib_texts
from k3kit.cli import main
from k3kit.errors import K3Error
from k3kit.gguf.shards import Model
from k3kit.plan.facts import read_facts
from k3kit.plan.profile import load_profile
from k3kit.runtime.experts.pinning import plan_pins
from k3kit.runtime.loader import LoadOptions

MINI = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
P, N = 16, 4
FAST = ["-p", str(P), "-n", str(N), "--threads", "1", "--no-progress", "--workload", "gsm8k"]
PNG = b"\x89PNG\r\n\x1a\n"

LLAMA_BENCH_FIELDS = {
    "build_commit": str, "cpu_info": str, "gpu_info": str, "backends": str, "model_filename": str,
    "model_type": str, "model_size": int, "model_n_params": int, "n_batch": int, "n_threads": int,
    "use_mmap": bool, "n_prompt": int, "n_gen": int, "n_depth": int, "test_time": str, "avg_ns": int,
    "stddev_ns": int, "avg_ts": float, "stddev_ts": float, "samples_ns": list, "samples_ts": list,
}
K3KIT_FIELDS = {
    "engine": str, "test": str, "config": str, "settings": dict, "workload": str, "expert_kernel": str,
    "trunk": str, "expert_cache_mib": float, "draft": (str, type(None)), "pinned_experts": int,
    "peak_rss_bytes": int, "expert_hit_rate": float, "payload_bytes": int, "payload_bytes_per_token": float,
}
SPEC_FIELDS = {"target_passes": int, "draft_steps": int, "verify_rows": int, "verify_rows_per_pass": float,
               "committed_per_pass": float, "mean_accepted": float, "acceptance_histogram": list}


def bench(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["bench", str(MINI), *argv])
    # bench runs inside its caller's process: it must leave torch's global state as it found it
    assert torch.is_grad_enabled(), "bench left autograd disabled"
    out = capsys.readouterr()
    return rc, out.out, out.err


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR", path
    w, h = struct.unpack(">II", data[16:24])
    assert 50 < w < 5000 and 50 < h < 5000


def check_row_types(row: dict, fields: dict) -> None:
    for key, typ in fields.items():
        assert key in row, key
        assert isinstance(row[key], typ), (key, row[key])


def check_timing(row: dict, tokens_per_sample: int, reps: int) -> None:
    ns, ts = row["samples_ns"], row["samples_ts"]
    assert len(ns) == len(ts) == reps and all(isinstance(x, int) and x > 0 for x in ns)
    for a, b in zip(ns, ts, strict=True):
        assert b == pytest.approx(tokens_per_sample * 1e9 / a, rel=1e-6)
    assert row["avg_ts"] == pytest.approx(statistics.fmean(ts))
    assert row["avg_ns"] == pytest.approx(statistics.fmean(ns), abs=1)
    assert row["stddev_ts"] == pytest.approx(statistics.stdev(ts) if reps > 1 else 0.0)
    assert row["stddev_ns"] == pytest.approx(statistics.stdev(ns) if reps > 1 else 0.0, abs=1)


def test_bench_r1_writes_complete_results(tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, err = bench(capsys, *FAST, "-r", "1", "--out", str(out), "-o", "json")
    assert rc == 0, err
    printed = json.loads(stdout)
    res = json.loads((out / "results.json").read_text())
    assert printed["rows"] == res["rows"]
    assert res["format"] == "k3kit-bench" and res["n_prompt"] == P and res["n_gen"] == N and res["reps"] == 1
    assert res["workload"]["name"] == "gsm8k" and res["workload"]["prompt_tokens"] == [P]
    with Model.open(MINI) as m:
        size = sum(t.nbytes for t in m.tensors.values())
        params = sum(t.n_elements for t in m.tensors.values())
        facts = read_facts(m)
    assert res["model"]["model_size"] == size and res["model"]["model_n_params"] == params
    assert res["model"]["n_experts"] == facts.n_experts and res["model"]["experts_used"] == facts.experts_used
    rows = res["rows"]
    assert [r["test"] for r in rows] == [f"pp{P}", f"tg{N}"]
    pp, tg = rows
    for r in rows:
        check_row_types(r, LLAMA_BENCH_FIELDS | K3KIT_FIELDS)
        assert r["engine"] == "k3kit" and r["config"] == "default" and r["n_threads"] == 1
        assert r["model_size"] == size and r["model_filename"] == str(MINI)
        assert 0.0 <= r["expert_hit_rate"] <= 1.0 and r["payload_bytes"] >= 0
        assert r["peak_rss_bytes"] > 10 << 20
        datetime.fromisoformat(r["test_time"].replace("Z", "+00:00"))
        assert "committed_per_pass" not in r       # no draft: no speculative figures
    assert (pp["n_prompt"], pp["n_gen"], pp["n_depth"]) == (P, 0, 0)
    assert (tg["n_prompt"], tg["n_gen"], tg["n_depth"]) == (0, N, P)
    check_timing(pp, P, 1)
    check_timing(tg, N, 1)
    assert pp["payload_bytes_per_token"] == pytest.approx(pp["payload_bytes"] / P)
    assert tg["payload_bytes_per_token"] == pytest.approx(tg["payload_bytes"] / N)
    # what a decoded token reads: the trunk but the embedding table, and each routed expert fetched
    with load_model(MINI, LoadOptions(expert_cache_mib=0)) as lm:
        mem = lm.model.memory()
    weights = mem.trunk_bytes - mem.input_bytes
    top_k = facts.experts_used * len(mem.experts)
    assert 0 < mem.input_bytes < mem.trunk_bytes
    unit = sum(e.cached_bytes for e in mem.experts) / len(mem.experts)
    assert weights < tg["read_bytes_per_token"] <= weights + top_k * unit * (1 + 1e-9)
    assert tg["read_gbps"] == pytest.approx(tg["read_bytes_per_token"] * tg["avg_ts"] / 1e9)
    assert res["machine"]["copy_gbps"] > 0.1 and tg["read_of_copy_bw"] == pytest.approx(
        tg["read_gbps"] / res["machine"]["copy_gbps"])
    assert "read_bytes_per_token" not in pp
    probe = res["probes"][0]
    assert probe["prompt_tokens"] == P and probe["verify_rows"] == N and probe["draft_steps"] == 0
    assert probe["avg_commit_per_step"] == 1.0
    assert probe["storage_payload_bytes"] == pp["payload_bytes"] + tg["payload_bytes"]
    assert probe["decode_tok_s"] == pytest.approx(tg["avg_ts"])
    assert [len(t) for t in res["outputs"]["token_ids"][0]] == [N + 1]
    md = (out / "report.md").read_text()
    assert f"| pp{P} |" in md and f"| tg{N} |" in md and "![tok_s](tok_s.png)" in md
    assert res["plots"] == ["tok_s.png"]      # no draft, no sweep: only the plot with data
    check_png(out / "tok_s.png")
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json", "tok_s.png"]


def test_bench_with_draft_and_sweep(tmp_path, capsys):
    out = tmp_path / "out"
    rc, stdout, err = bench(capsys, *FAST, "-r", "2", "--draft", "default", "--sweep", "block_size=2,7",
                            "--sweep", "expert_cache_mib=0.25,64", "--out", str(out), "-o", "jsonl")
    assert rc == 0, err
    rows = [json.loads(line) for line in stdout.splitlines()]
    res = json.loads((out / "results.json").read_text())
    assert rows == res["rows"] and len(rows) == 8
    assert [c["label"] for c in res["configs"]] == [
        "block_size=2 expert_cache_mib=0.25", "block_size=2 expert_cache_mib=64.0",
        "block_size=7 expert_cache_mib=0.25", "block_size=7 expert_cache_mib=64.0"]
    tg = [r for r in rows if r["test"] == f"tg{N}"]
    for r in tg:
        check_row_types(r, LLAMA_BENCH_FIELDS | K3KIT_FIELDS | SPEC_FIELDS)
        check_timing(r, N, 2)
        hist = r["acceptance_histogram"]
        assert sum(hist) == r["target_passes"] and len(hist) == r["settings"]["block_size"] + 1
        assert r["mean_accepted"] == pytest.approx(sum(m * h for m, h in enumerate(hist)) / sum(hist))
        assert 1.0 <= r["committed_per_pass"] <= r["mean_accepted"] + 1 + 1e-9
        width = r["settings"]["block_size"] + 1
        assert r["target_passes"] <= r["verify_rows"] <= r["target_passes"] * width
        assert r["draft_steps"] <= r["target_passes"]
    small = [r for r in tg if r["expert_cache_mib"] == 0.25]
    big = [r for r in tg if r["expert_cache_mib"] == 64.0]
    for s, b in zip(small, big, strict=True):
        assert s["payload_bytes_per_token"] > b["payload_bytes_per_token"]
    # greedy speculative decoding emits the same tokens whatever the block or the cache
    outs = res["outputs"]["token_ids"]
    assert all(o == outs[0] for o in outs)
    assert res["plots"] == ["tok_s.png", "committed_per_pass.png", "payload_vs_cache.png",
                            "acceptance_vs_block.png"]
    for name in res["plots"]:
        check_png(out / name)


def test_profile_experts_counts_every_routed_row(tmp_path, capsys):
    prof = tmp_path / "profile.json"
    r = 2
    rc, _, err = bench(capsys, *FAST, "-r", str(r), "--profile-experts", str(prof))
    assert rc == 0, err
    data = json.loads(prof.read_text())
    with Model.open(MINI) as m:
        facts = read_facts(m)
    p = load_profile(prof, facts)
    # AR: every prompt row and every decoded row goes through every MoE layer once
    assert data["tokens"] == p.tokens == r * (P + N)
    assert sorted(int(k) for k in data["layers"]) == [la.index for la in facts.moe_layers]
    for counts in data["layers"].values():
        assert sum(counts) == data["tokens"] * facts.experts_used
    assert data["model"]["name"] == facts.name


def test_pin_experts_raises_hit_rate_and_keeps_tokens(tmp_path, capsys):
    prompt = "Question: A farmer has 45 chickens and 3 times as many ducks. How many birds does he have?"
    wl = tmp_path / "one.jsonl"
    wl.write_text(json.dumps({"prompt": prompt}) + "\n")
    prof = tmp_path / "profile.json"
    rc, _, err = bench(capsys, "-p", "0", "-n", "12", "-r", "1", "--threads", "1", "--no-progress",
                       "--workload", str(wl), "--profile-experts", str(prof))
    assert rc == 0, err
    runs = {}
    for pinned in (False, True):
        argv = ["generate", str(MINI), "--prompt", prompt, "--max-tokens", "12", "--json", "--threads", "1",
                "--expert-cache-mib", "0.5"] + (["--pin-experts", str(prof)] if pinned else [])
        assert main(argv) == 0
        runs[pinned] = json.loads(capsys.readouterr().out)
    assert runs[True]["token_ids"] == runs[False]["token_ids"]
    hit = {k: v["stats"]["expert_cache_hit_rate"] for k, v in runs.items()}
    assert hit[True] > hit[False] + 0.1, hit


class FakeStore:
    """What plan_pins reads of an ExpertStore: layers, expert counts, cached bytes per expert."""

    def __init__(self, layers: dict[int, int], nbytes: int):
        self.layers = {k: [None] for k in layers}
        self._n, self._b = layers, nbytes

    def n_experts(self, layer: int) -> int:
        return self._n[layer]

    def cached_expert_nbytes(self, layer: int) -> int:
        return self._b


def test_plan_pins_takes_the_hottest_within_the_budget():
    store = FakeStore({1: 4, 2: 4}, 100)
    probs = {1: np.array([0.1, 0.9, 0.0, 0.5]), 2: np.array([0.7, 0.2, 0.3, 0.0])}
    plan = plan_pins(store, probs, 350)         # room for 3 experts
    assert plan.experts == {1: [1, 3], 2: [0]} and plan.nbytes == 300
    assert plan.expected_hit_rate == pytest.approx((0.9 + 0.7 + 0.5) / 2.7)
    assert plan_pins(store, probs, 10_000).count == 6      # never an expert the profile never saw
    with pytest.raises(K3Error, match="layer 2 has 4 experts in the profile, 8 in the model"):
        plan_pins(FakeStore({1: 4, 2: 8}, 100), probs, 1000, "p.json")
    with pytest.raises(K3Error, match="layer 3 has no routed experts"):
        plan_pins(store, {3: np.ones(4)}, 1000, "p.json")


def test_sweep_parsing_and_product():
    assert parse_sweep("block-size=2,4,7") == ("block_size", [2, 4, 7])
    assert parse_sweep("verify_budget=auto,8") == ("verify_budget", ["auto", "8"])
    assert parse_sweep("expert_cache_mib=0.5,64") == ("expert_cache_mib", [0.5, 64.0])
    configs, keys = expand(Config(), ["threads=1,2", "expert_kernel=native,torch"], draft=False)
    assert keys == ["threads", "expert_kernel"]
    assert [(c.threads, c.expert_kernel) for c in configs] == [(1, "native"), (1, "torch"), (2, "native"),
                                                              (2, "torch")]
    assert configs[1].label(keys) == "threads=1 expert_kernel=torch"
    assert expand(Config(), [], draft=False)[0] == [Config()]
    assert parse_concurrency("1,4,16") == [1, 4, 16] and parse_concurrency(None) == []


@pytest.mark.parametrize("sweep,msg", [
    ("colour=1,2", "unknown key 'colour'"),
    ("threads", "expected KEY=V1,V2"),
    ("threads=0", "threads='0': must be >= 1"),
    ("threads=1,x", "threads='x'"),
    ("threads=1,,2", "empty value"),
    ("threads=2,2", "listed twice"),
    ("expert_cache_mib=-1", "must be a number of MiB >= 0"),
    ("expert_kernel=cuda", "must be one of auto, native, torch"),
    ("confidence_threshold=1.5", "must be in [0, 1]"),
    ("verify_budget=0", "verify_budget='0'"),
])
def test_bad_sweeps_are_one_line_errors(capsys, sweep, msg):
    rc, _, err = bench(capsys, *FAST, "--sweep", sweep)
    assert rc == 2 and err.startswith("k3kit: error: ") and msg in err and err.count("\n") == 1, err


def test_bad_input_is_one_line(tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF but not really" * 10)
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "ok"}\n{"prompt": \n')
    no_prompt = tmp_path / "noprompt.jsonl"
    no_prompt.write_text('{"text": "x"}\n')
    other = tmp_path / "other.json"
    with Model.open(MINI) as m:
        facts = read_facts(m)
        n_ctx = int(m.kv["kimi-k3.context_length"].value)
    other.write_text(json.dumps({"format": "k3kit-expert-profile", "version": 1,
                                 "model": {"arch": "kimi-k3", "layers": facts.n_layer, "experts": 64,
                                           "experts_used": facts.experts_used},
                                 "tokens": 1, "layers": {}}))
    cases = [
        ([str(tmp_path / "missing.gguf")], "no such file"),
        ([str(junk)], str(junk)),
        ([str(tmp_path)], "is a directory"),
        ([str(MINI), *FAST, "--sweep", "block_size=2,3"], "needs --draft"),
        ([str(MINI), *FAST, "--workload", str(bad_jsonl)], f"{bad_jsonl}:2: not valid JSON"),
        ([str(MINI), *FAST, "--workload", str(no_prompt)], f"{no_prompt}:1: expected an object"),
        ([str(MINI), *FAST, "--workload", "poems"], "not a workload"),
        ([str(MINI), *FAST, "--pin-experts", str(other)], "profile is for another model (experts 64"),
        ([str(MINI), *FAST, "--concurrency", "0"], "must be 1..256"),
        ([str(MINI), "-p", str(n_ctx - 50), "-n", "100", "--no-progress"],
         f"do not fit its context of {n_ctx}"),
        ([str(MINI), *FAST, "-r", "0"], "-r 0: must be >= 1"),
    ]
    for argv, msg in cases:
        assert main(["bench", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("k3kit: error: ") and msg in err and err.count("\n") == 1, err
    # generate reads --pin-experts too, before loading anything
    assert main(["generate", str(MINI), "--prompt", "x", "--pin-experts", str(other)]) == 2
    err = capsys.readouterr().err
    assert "profile is for another model" in err and err.count("\n") == 1


def test_workloads():
    with Model.open(MINI) as m:
        from k3kit.tokenizer.codec import TextCodec
        codec = TextCodec(m.kv, str(MINI))
    for name in ("gsm8k", "chat", "humaneval"):
        w = resolve(name, lambda: ())
        assert len(w.texts) >= 12
        prompts = fit(codec, w, 64, 3, 1000)
        assert [len(p) for p in prompts] == [64, 64, 64] and prompts[0] != prompts[1]
    chat = resolve("chat", lambda: ())
    assert chat.chat and codec.chat_prompt(chat.texts[0]) != chat.texts[0]
    whole = codec.encode(codec.chat_prompt(chat.texts[0]))
    cut = fit(codec, chat, 16, 1, 1000)[0]          # the template's preamble is cut, the request kept
    assert len(whole) > 16 and cut == whole[:1] + whole[-15:]
    natural = fit(codec, resolve("gsm8k", lambda: ()), 0, 2, 1000)
    assert natural[0] == codec.encode(resolve("gsm8k", lambda: ()).texts[0])
    docs = ["import os\n" * 400, "x = 1\n"]
    texts = stdlib_texts(docs)
    assert texts[0].endswith("\n") and len(texts[0]) <= 2000 and texts[1] == "x = 1\n"
    w = Workload("w", ("a",))
    with pytest.raises(K3Error, match="shorter than -p 5000"):
        fit(codec, w, 5000, 1, 10_000)


def test_concurrency_rows_through_the_http_api(tmp_path, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    out = tmp_path / "out"
    rc, _, err = bench(capsys, *FAST, "-r", "1", "--concurrency", "1,2", "--out", str(out))
    assert rc == 0, err
    res = json.loads((out / "results.json").read_text())
    conc = [r for r in res["rows"] if r["engine"] == "k3kit serve"]
    assert [(r["n_clients"], r["test"]) for r in conc] == [(1, f"tg{N} x1"), (2, f"tg{N} x2")]
    for r in conc:
        # greedy requests of N tokens, no stop before N on these prompts is not guaranteed: <= N each
        assert 0 < r["completion_tokens"] <= N * r["n_clients"]
        assert r["avg_ts"] == pytest.approx(r["samples_ts"][0])
        tokens, ns = r["completion_tokens"], r["samples_ns"][0]
        assert r["samples_ts"][0] == pytest.approx(tokens * 1e9 / ns, rel=1e-3)
        assert 0 < r["ttft_ms_avg"] <= r["ttft_ms_max"] <= r["samples_ns"][0] / 1e6
    assert "concurrency.png" in res["plots"]
    check_png(out / "concurrency.png")


@pytest.mark.interop
def test_llama_cpp_rows_side_by_side(capsys):
    pytest.importorskip("llama_cpp")
    rc, stdout, err = bench(capsys, *FAST, "-r", "2", "--llama-cpp", "-o", "json")
    assert rc == 0, err
    res = json.loads(stdout)
    ours = {r["test"]: r for r in res["rows"] if r["engine"] == "k3kit"}
    peer = {r["test"]: r for r in res["rows"] if r["engine"] == "llama.cpp"}
    assert set(ours) == set(peer) == {f"pp{P}", f"tg{N}"}
    for test, r in ours.items():
        check_timing(peer[test], P if test.startswith("pp") else N, 2)
        assert r["ratio_vs_llama_cpp"] == pytest.approx(r["avg_ts"] / peer[test]["avg_ts"])
        assert peer[test]["n_threads"] == r["n_threads"] == 1
    # the same greedy continuation on both engines (the interop suite holds them to it)
    k3 = res["outputs"]["token_ids"][0]
    assert [t[:3] for t in k3] == [t[:3] for t in res["outputs"]["llama_cpp_token_ids"][0]]


@pytest.mark.interop
def test_concurrency_rounds_against_llama_server(tmp_path, capsys, monkeypatch):
    """--concurrency with --llama-cpp drives llama-server (here a fake one: building the real one
    takes half an hour) with the same clients and prompts, one slot per client of the largest round."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    from test_serve_bench import _fake_llama_server
    exe, flags = _fake_llama_server(tmp_path, fail=False)
    monkeypatch.setenv("K3KIT_LLAMA_SERVER", str(exe))
    out = tmp_path / "out"
    rc, _, err = bench(capsys, *FAST, "-r", "1", "--concurrency", "1,2", "--llama-cpp", "--out", str(out))
    assert rc == 0, err
    argv = json.loads(flags.read_text())
    assert argv[argv.index("-np") + 1] == "2" and argv[argv.index("-t") + 1] == "1"
    res = json.loads((out / "results.json").read_text())
    peer = [r for r in res["rows"] if r["engine"] == "llama-server"]
    ours = [r for r in res["rows"] if r["engine"] == "k3kit serve"]
    assert [r["n_clients"] for r in peer] == [r["n_clients"] for r in ours] == [1, 2]
    assert [r["completion_tokens"] for r in peer] == [N, 2 * N]      # the fake always gives max_tokens
    report_md = (out / "report.md").read_text()
    for r in ours:
        ratio = r["avg_ts"] / next(p["avg_ts"] for p in peer if p["n_clients"] == r["n_clients"])
        assert f"| k3kit serve | {r['n_clients']} |" in report_md and f"{ratio:.2f}x" in report_md
