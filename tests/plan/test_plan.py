"""`k3kit plan` on K3's full geometry (sparse synthetic shards): the seed's facts, inspect's bytes, exit codes

The seed counted bytes by hand: K3's trunk is Q8_0 (59.6 GB) and does not fit 2x24 GB; requantized
to Q4_K (34.2 GB) it fits with room for the 2.39 GB Q8_0 DSpark drafter. A sparse synthetic K3
(93 layers, 896 MXFP4 experts, vocab 163840, 32 shards, ~1.5 TB of holes, ~6 MB of disk) must
reproduce that from headers, with inspect's numbers to the byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from k3kit.cli import main
from k3kit.gguf import synth
from k3kit.gguf.inspect import inspect_model, trunk_summary
from k3kit.gguf.shards import Model
from k3kit.plan import PRESETS, PlanOptions, make_plan
from k3kit.plan.facts import read_facts
from k3kit.plan.placement import _best_fill, _fill
from k3kit.plan.profile import make_profile
from k3kit.plan.units import parse_bandwidth, parse_size

GiB = 1 << 30
DRAFT = "2.39GB"   # K3-DSpark-draft-Q8_0.gguf: 2,390,153,888 bytes
TWO_3090 = ["--gpu", "24GiB", "--gpu", "24GiB", "--ram", "128GiB"]
MINI = Path(__file__).resolve().parents[2] / "src/k3kit/mini/assets/mini-k3/mini-k3.gguf"
MINI_DRAFT = MINI.parents[1] / "mini-k3-draft/mini-k3-draft.gguf"


def _k3(tmp_path_factory, trunk: str | None) -> Path:
    out = tmp_path_factory.mktemp(f"k3-{trunk or 'q8'}")
    r = synth.synthesize(out, "k3", 93, 896, shards=32, metadata_shard=True, sparse=True, progress=False,
                         trunk_type=trunk)
    return Path(r.paths[4])  # any shard names the model


@pytest.fixture(scope="module")
def k3_q8(tmp_path_factory) -> Path:
    return _k3(tmp_path_factory, None)


@pytest.fixture(scope="module")
def k3_q4(tmp_path_factory) -> Path:
    return _k3(tmp_path_factory, "Q4_K")


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["plan", *map(str, argv), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_seed_facts_q8_0_trunk_does_not_fit_2x24gib_and_q4_k_does(k3_q8, capsys):
    rc, r = plan_json(capsys, k3_q8, *TWO_3090, "--draft-bytes", DRAFT)
    assert rc == 1 and r["fits"] is False
    with Model.open(k3_q8) as m:
        ins = inspect_model(m)
    trunk, types = trunk_summary(ins)
    assert r["trunk_bytes"] == trunk and r["trunk_by_type"] == types          # inspect's bytes, to the byte
    assert r["routed_expert_bytes"] == ins["by_role"]["routed_experts"]["bytes"]
    assert r["total_bytes"] == ins["total_bytes"]
    assert 59.0e9 < r["trunk_by_type"]["Q8_0"] < 59.7e9                       # seed: 59.6 GB of Q8_0
    assert r["trunk_bytes"] > 2 * 24 * GiB                                    # + F32 router/norms: 61.7 GB
    assert any("does not fit the GPUs" in p for p in r["problems"])
    assert any(p.startswith("fix: requantize the trunk Q8_0 -> Q4_K") for p in r["problems"])

    q4 = next(s for s in r["requant"] if s["to"] == "Q4_K" and not s["include"])
    assert q4["fits_after"] is True
    after = q4["trunk_by_type_after"]
    assert 32e9 < after["Q4_K"] + after["Q8_0"] < 34.5e9                      # seed: 34.2 GB (F32 aside)
    assert after["F32"] == r["trunk_by_type"]["F32"]                          # norms, router: kept F32
    assert q4["saved_bytes"] == r["trunk_bytes"] - q4["trunk_bytes_after"] > 25e9
    assert "k3kit requant" in q4["command"] and "--to Q4_K" in q4["command"]


def test_q4_k_trunk_fits_2x24gib_with_the_drafter_on_a_gpu(k3_q4, k3_q8, capsys):
    rc, r = plan_json(capsys, k3_q4, *TWO_3090, "--draft-bytes", DRAFT)
    assert rc == 0 and r["fits"] is True and r["problems"] == []
    # the synthetic Q4_K trunk is exactly what the requant suggestion predicted for the Q8_0 model
    _, r8 = plan_json(capsys, k3_q8, *TWO_3090, "--draft-bytes", DRAFT)
    q4 = next(s for s in r8["requant"] if s["to"] == "Q4_K" and not s["include"])
    assert r["trunk_bytes"] == q4["trunk_bytes_after"]
    assert r["decode_tok_s"] == q4["decode_tok_s_after"]
    pl = r["placement"]
    assert pl["ngl"] == pl["units"] == 94 and pl["layers_on_gpu"] == 93
    gpu = next(d for d in r["devices"] if d["name"] == pl["draft_device"])
    assert gpu["kind"] == "gpu" and gpu["contents"]["drafter"] == 2_390_000_000
    for d in r["devices"]:
        if d["kind"] == "gpu":
            assert d["used_bytes"] + d["reserve_bytes"] <= d["capacity_bytes"] == 24 * GiB
    assert "-devd CUDA" in r["commands"]["llama_server"] and "-md DRAFT.gguf" in r["commands"]["llama_server"]


def test_kv_state_mla_grows_with_ctx_kda_does_not(k3_q4, capsys):
    _, short = plan_json(capsys, k3_q4, *TWO_3090, "--ctx", "4096")
    _, long = plan_json(capsys, k3_q4, *TWO_3090, "--ctx", "32768")
    a, b = short["kv_state"], long["kv_state"]
    assert b["mla_bytes"] == 8 * a["mla_bytes"] == 8 * 4096 * 24 * (512 + 64) * 2   # 24 MLA layers, f16
    assert a["kda_state_bytes"] == b["kda_state_bytes"] == 69 * (96 * 128 * 128 + 3 * 96 * 128 * 3) * 4
    rc, full = plan_json(capsys, k3_q4, *TWO_3090, "--ctx", "1048576", "--draft-bytes", DRAFT)
    assert rc == 1 and full["kv_state"]["mla_bytes"] > 28e9   # 1M tokens of MLA latents: no longer fits


def test_json_is_consistent(k3_q4, capsys):
    rc, r = plan_json(capsys, k3_q4, "--hardware", "2x3090", "--draft-bytes", DRAFT, "--tau", "4")
    assert rc == 0
    for key in ("fits", "trunk_bytes", "routed_expert_bytes", "devices", "requant", "decode_tok_s",
                "bound_by", "commands"):
        assert key in r
    for d in r["devices"]:
        assert {"name", "capacity_bytes", "used_bytes"} <= set(d)
        assert d["used_bytes"] == sum(d["contents"].values())
    # every unit (93 layers + output) placed exactly once
    units = [x for d in r["devices"] for a, b in d["layers"] for x in range(a, b + 1)]
    assert sorted(units) == list(range(94))
    # speed: t = sum of terms, tok/s = tokens / t, bound_by the largest resource
    for key in ("ar", "speculative"):
        est = r["speed"][key]
        t = sum(term["seconds"] for term in est["terms"])
        assert est["seconds_per_pass"] == pytest.approx(t)
        assert r["decode_tok_s"][key] == pytest.approx(est["tokens_per_pass"] / t)
        by = est["seconds_by_resource"]
        assert r["bound_by"][key] == max(by, key=by.get) == "storage"       # experts streamed from NVMe
        assert est["ceiling_tok_s"] >= est["tok_s"]
    ar, spec = r["speed"]["ar"], r["speed"]["speculative"]
    assert ar["distinct_experts_per_layer"] == pytest.approx(16)
    assert spec["distinct_experts_per_layer"] == pytest.approx(896 * (1 - (1 - 16 / 896) ** 8))
    # uniform routing: hit rate = the resident fraction of the RAM-backed experts
    hit = r["placement"]["experts"]["resident_fraction"]
    per_token = 92 * 16 * r["model"]["expert_bytes"]
    assert ar["storage_bytes_per_token"] == pytest.approx(per_token * (1 - hit), rel=1e-6)
    cmd = r["commands"]["llama_server"]
    split = [int(x) for x in cmd.split("--tensor-split ")[1].split()[0].split(",")]
    assert sum(split) == r["placement"]["ngl"] == 94 and "--n-cpu-moe 93" in cmd
    assert "rpc" not in r["commands"] and r["commands"]["k3kit"].startswith("k3kit serve ")
    # k3kit: the seed's split where its quantized trunk fits the GPUs: experts in RAM, its cache sized
    k3 = r["commands"]["k3kit"]
    assert "--device cuda:0," in k3 and "--cpu-moe" in k3
    assert int(k3.split("--expert-cache-mib ")[1].split()[0]) > 0


def test_presets_toml_and_flags(k3_q8, tmp_path, capsys):
    rc, big = plan_json(capsys, k3_q8, "--hardware", "8x5060ti", "--draft-bytes", DRAFT)
    assert rc == 0 and len([d for d in big["devices"] if d["kind"] == "gpu"]) == 8
    assert any("assumed" in n for n in big["hardware"]["notes"])
    assert big["placement"]["experts"]["gpu_layers"]                          # spare VRAM holds expert layers
    assert "-ot " in big["commands"]["llama_server"]
    toml = tmp_path / "box.toml"
    toml.write_text('name = "box"\nram = "128GiB"\nram_bw = "80GB/s"\ndisk_bw = "7GB/s"\ncores = 16\n'
                    '[[gpu]]\nname = "RTX 3090"\nmemory = "24GiB"\nbandwidth = "936GB/s"\ncount = 2\n')
    _, a = plan_json(capsys, k3_q8, "--hardware", toml)
    _, b = plan_json(capsys, k3_q8, "--hardware", "2x3090")
    assert a["decode_tok_s"] == b["decode_tok_s"] and a["devices"] == b["devices"]
    _, c = plan_json(capsys, k3_q8, "--hardware", "2x3090", "--disk-bw", "14GB/s")    # a flag overrides
    assert c["hardware"]["disk_bw_bytes_s"] == 14e9 and c["decode_tok_s"]["ar"] > b["decode_tok_s"]["ar"]


def test_nodes_split_over_rpc(k3_q8, capsys):
    rc, r = plan_json(capsys, k3_q8, "--hardware", "2x3090", "--nodes", "2", "--draft-bytes", DRAFT)
    assert rc == 0                                                            # Q8_0 fits 2 boxes, no requant
    assert len(r["commands"]["rpc"]) == 1 and r["commands"]["rpc"][0].startswith("rpc-server ")
    cmd = r["commands"]["llama_server"]
    assert "--rpc NODE1:50052" in cmd and len(cmd.split("--tensor-split ")[1].split()[0].split(",")) == 4
    assert r["devices"][0]["node"] == 1                                       # RPC devices come first


def test_profile_changes_hit_rate_and_distinct_experts(k3_q8, tmp_path, capsys):
    with Model.open(k3_q8) as m:
        facts = read_facts(m)
    rng = np.random.default_rng(0)
    tokens = 1000
    counts = {}
    for la in facts.moe_layers:
        p = 1.0 / np.arange(1, 897) ** 1.1                                   # Zipf-like skew
        c = np.minimum(rng.permutation(np.round(p / p.sum() * tokens * 16)), tokens)
        counts[la.index] = c.astype(int).tolist()
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(make_profile(facts, tokens, counts)))
    _, uni = plan_json(capsys, k3_q8, "--hardware", "2x3090", "--draft-bytes", DRAFT)
    rc, skew = plan_json(capsys, k3_q8, "--hardware", "2x3090", "--draft-bytes", DRAFT, "--profile", prof)
    assert rc == 1 and skew["options"]["profile"]["tokens"] == tokens
    assert skew["speed"]["ar"]["storage_bytes_per_token"] < uni["speed"]["ar"]["storage_bytes_per_token"]
    assert (skew["speed"]["speculative"]["distinct_experts_per_layer"]
            < uni["speed"]["speculative"]["distinct_experts_per_layer"])
    good = json.loads(prof.read_text())
    for key, value, what in (("experts", 384, "experts 384"), ("layers", 61, "layers 61"),
                             ("name", "Kimi-K2", "name 'Kimi-K2'")):
        other = json.loads(json.dumps(good))
        other["model"][key] = value
        prof.write_text(json.dumps(other))
        assert main(["plan", str(k3_q8), "--hardware", "2x3090", "--profile", str(prof)]) == 2
        err = capsys.readouterr().err
        assert "profile is for another model" in err and what in err and err.count("\n") == 1, err


BAD = [
    (["--gpu", "24XB", "--ram", "128GiB"], "--gpu '24XB': not a size"),
    (["--gpu", "24G", "--ram", "128GiB"], "not a size"),
    (["--ram", "128GiB", "--disk-bw", "7GB"], "--disk-bw '7GB': not a bandwidth"),
    (["--ram", "128GiB", "--ram-bw", "fast"], "not a bandwidth"),
    (["--ram=-5GiB"], "not a size"),
    (["--gpu", "24GiB"], "--ram is required"),
    (["--hardware", "9x4090"], "--hardware '9x4090'"),
    (["--ram", "128GiB", "--tau", "9"], "--tau 9"),
    (["--ram", "128GiB", "--ctx", "2000000"], "--ctx 2000000"),
    (["--ram", "128GiB", "--draft-bytes", "lots"], "--draft-bytes 'lots'"),
]


@pytest.mark.parametrize("argv,msg", BAD)
def test_bad_input_is_one_line_and_exit_2(k3_q8, capsys, argv, msg):
    assert main(["plan", str(k3_q8), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3kit: error: ") and msg in err and err.count("\n") == 1, err


def test_unreadable_models_and_files(tmp_path, capsys):
    text = tmp_path / "notes.gguf"
    text.write_text("not a gguf")
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("ram = \n")
    typo = tmp_path / "typo.toml"
    typo.write_text('rma = "128GiB"\n')
    cases = [
        ([str(tmp_path / "missing.gguf"), "--ram", "1GiB"], "no such file"),
        ([str(text), "--ram", "1GiB"], str(text)),
        ([str(tmp_path), "--ram", "1GiB"], "is a directory"),
        ([str(MINI_DRAFT), "--ram", "1GiB"], "plan knows 'kimi-k3'"),
        ([str(MINI), "--ram", "1GiB", "--draft", str(MINI)], "is not a 'dflash' draft"),
        ([str(MINI), "--hardware", str(bad_toml)], "not valid TOML"),
        ([str(MINI), "--hardware", str(typo)], "unknown key(s) rma"),
        ([str(MINI), "--ram", "1GiB", "--profile", str(tmp_path / "nope.json")], "no such file"),
    ]
    for argv, msg in cases:
        assert main(["plan", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("k3kit: error: ") and msg in err and err.count("\n") == 1, err


def test_local_preset_runs_on_the_mini_model(capsys):
    t0 = time.perf_counter()
    rc, r = plan_json(capsys, MINI, "--hardware", "local", "--draft", MINI_DRAFT)
    assert time.perf_counter() - t0 < 3.0
    hw = r["hardware"]
    assert rc == 0 and hw["name"] == "local" and hw["ram_bytes"] > 0 and hw["ram_bw_bytes_s"] > 1e8
    assert hw["cores"] >= 1 and any(n.startswith("measured: memory read") for n in hw["notes"])
    assert r["draft"]["kv_bytes_per_token"] == 2 * 4 * (64 + 64) * 2          # 2 layers x 4 kv heads, f16
    assert r["decode_tok_s"]["ar"] > 0 and r["decode_tok_s"]["speculative"] > 0


def test_plan_is_header_only_fast_and_torch_free(k3_q8):
    make_plan(k3_q8, PRESETS["2x3090"], PlanOptions(draft_bytes=2_390_153_888))   # warm imports
    t0 = time.process_time()
    r = make_plan(k3_q8, PRESETS["2x3090"], PlanOptions(draft_bytes=2_390_153_888))
    assert time.process_time() - t0 < 1.0 and r["fits"] is False
    code = ("import sys; from k3kit.cli import main; rc = main(['plan', sys.argv[1], '--hardware', '2x3090', "
            "'--json']); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, str(k3_q8)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert json.loads(out.stdout)["fits"] is False


def test_human_report(k3_q8, capsys):
    assert main(["plan", str(k3_q8), *TWO_3090, "--draft-bytes", DRAFT]) == 1
    out = capsys.readouterr().out
    for text in ("DOES NOT FIT", "fix: requantize the trunk Q8_0 -> Q4_K", "59.29 GB", "bound by storage",
                 "E(1-(1-k/E)^n)", "llama-server", "k3kit serve"):
        assert text in out, text


def test_units():
    assert parse_size("24GiB", "--gpu") == 24 * GiB and parse_size("2.39GB", "x") == 2_390_000_000
    assert parse_size("512", "x") == 512 and parse_size("1.5 TiB", "x") == 3 * (1 << 39)
    assert parse_bandwidth("7GB/s", "x") == 7e9 and parse_bandwidth("80 GiB/s", "x") == 80 * GiB


def test_fill_in_order_and_suffix_monotone():
    assert _fill([5, 5, 5, 2], 0, [10, 10]) == [0, 0, 1, 1]
    assert _fill([5, 5, 5, 2], 0, [9, 9]) is None
    assert _best_fill([5, 5, 5, 2], [9, 9]) == (3, [0, 1, 1])   # llama.cpp offloads the last layers
    assert _best_fill([5], []) == (0, [])
