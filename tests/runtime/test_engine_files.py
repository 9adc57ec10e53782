"""Model files under the engine: shards, truncation, files changed while mapped, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_models import prompts, reference_greedy, tiny_gguf

from k3kit.adapters import load_model
from k3kit.errors import FormatError, K3Error
from k3kit.kernels.qmatmul import native_available, native_simd
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import make_sampling
from k3kit.tokenizer.codec import TextCodec


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    path, model = tiny_gguf(d, "Q8_0")
    return d, path, model


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3kit.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_sharded_model_generates_like_the_single_file(tiny, tmp_path):
    d, path, _ = tiny
    out = tmp_path / "split.gguf"
    r = _cli("rewrite", str(path), "-o", str(out), "--split-max-size", "100K")
    assert r.returncode == 0, r.stderr
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) >= 3
    p = prompts(1, 500, seed=3)[0]
    greedy = make_sampling(0.0, seed=0)
    one = load_model(path, LoadOptions(expert_cache_mib=0)).model
    many = load_model(shards[1], LoadOptions(expert_cache_mib=0)).model     # opened from a middle shard
    try:
        a = generate(one, p, max_tokens=24, sampling=greedy)
        b = generate(many, p, max_tokens=24, sampling=greedy)
        assert a.token_ids == b.token_ids
        assert a.stats.payload_bytes == b.stats.payload_bytes > 0
        sources = {str(t.source) for ts in many.store.layers.values() for t in ts}
        assert len(sources) > 1                 # experts spread over several shards
    finally:
        one.close()
        many.close()


def test_q8_trunk_matches_reference_on_q8_rounded_weights(tiny):
    """The Q8_0 file's trunk is the reference trunk rounded to Q8_0: greedy agrees with a torch
    model holding exactly those weights (the engine's GGUF trunk, copied into the reference).
    With `--trunk float`, so that both run the same torch products on the same weights; the
    default quantized trunk (native kernels, other summation order) is held to the float trunk
    in test_engine_quantized_trunk.py. And with `--arith float`: the reference's experts are float
    torch products, which the MXFP4 experts' native kernel matches only in the float arithmetic."""
    _, path, model = tiny
    adapter = load_model(path, LoadOptions(expert_cache_mib=1, trunk="float", arith="float")).model
    try:
        ref_params = dict(model.named_parameters())
        diffs = []
        for name, p in adapter.model.named_parameters():
            diffs.append(float((p - ref_params[name].detach()).abs().max()))
        assert max(diffs) > 0                       # Q8_0 really rounded something
        assert max(diffs) < 0.05                    # ... by at most its half-step
        ref = type(model)(model.cfg).eval()
        trunk = {n: p.detach() for n, p in adapter.model.named_parameters()}
        ref.load_state_dict({**model.state_dict(), **trunk})
        p = prompts(2, 500, seed=9)
        for prompt in p:
            want = reference_greedy(ref, prompt, 32)
            got = generate(adapter, prompt, max_tokens=32, sampling=make_sampling(0.0, seed=0)).token_ids
            assert got == want
    finally:
        adapter.close()


def test_truncated_file_is_a_one_line_cli_error(tiny, tmp_path):
    _, path, _ = tiny
    bad = tmp_path / "cut.gguf"
    data = path.read_bytes()
    bad.write_bytes(data[: len(data) - 4096])
    r = _cli("generate", str(bad), "--prompt", "x", "--max-tokens", "2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"k3kit: error: {bad}") and "end of file" in lines[0]
    with pytest.raises(FormatError, match="past end of file"):
        load_model(bad)


def test_file_changed_while_mapped_is_reported(tiny, tmp_path):
    _, path, _ = tiny
    copy = tmp_path / "m.gguf"
    copy.write_bytes(path.read_bytes())
    adapter = load_model(copy, LoadOptions(expert_cache_mib=0)).model    # every forward reads experts
    try:
        adapter.forward([1, 2, 3])
        with open(copy, "ab") as f:            # e.g. a download or requant rewriting it in place
            f.write(b"\0" * 64)
        with pytest.raises(FormatError, match=f"{copy}: file changed"):
            adapter.forward([4])
        with pytest.raises(FormatError, match="changed"):
            adapter.source.check()
    finally:
        adapter.close()


def test_cli_json_and_streaming(tiny):
    _, path, _ = tiny
    r = _cli("generate", str(path), "--prompt", "def f(x):", "--max-tokens", "12", "--json",
             "--expert-cache-mib", "0.05")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["stats"]
    for key in ("prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "expert_cache_hit_rate",
                "payload_bytes", "payload_bytes_per_token", "peak_rss_bytes"):
        assert key in s
    assert len(out["token_ids"]) == s["generated_tokens"] and 1 <= s["generated_tokens"] <= 12
    assert s["payload_bytes"] > 0 and 0 <= s["expert_cache_hit_rate"] < 1 and s["peak_rss_bytes"] > 0
    assert s["expert_kernel"] == (f"native-{native_simd()}" if native_available() else "torch")
    # the same run streamed: text printed is the JSON text (plus a newline), stats on stderr
    r2 = _cli("generate", str(path), "--prompt", "def f(x):", "--max-tokens", "12", "--stats",
              "--expert-cache-mib", "0.05")
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout == out["text"] + "\n"
    assert "decode" in r2.stderr and "hit rate" in r2.stderr and "peak RSS" in r2.stderr
    # the dequantizing kernel gives the same greedy tokens through the CLI
    r3 = _cli("generate", str(path), "--prompt", "def f(x):", "--max-tokens", "12", "--json",
              "--expert-cache-mib", "0.05", "--expert-kernel", "torch")
    assert r3.returncode == 0, r3.stderr
    torch_out = json.loads(r3.stdout)
    assert torch_out["stats"]["expert_kernel"] == "torch" and torch_out["token_ids"] == out["token_ids"]
    # greedy through the CLI equals greedy through the API on the same prompt
    adapter = load_model(path, LoadOptions(expert_cache_mib=1)).model
    try:
        codec = TextCodec(adapter.source.raw_kv)
        ids = codec.encode("def f(x):")
        api = generate(adapter, ids, max_tokens=12, sampling=make_sampling(0.0, seed=0),
                       stop_ids=codec.stop_ids())
        assert api.token_ids == out["token_ids"]
    finally:
        adapter.close()


def test_cli_bad_arguments(tiny, tmp_path):
    _, path, _ = tiny
    for args, msg in ((["--temperature", "-1"], "--temperature"), (["--top-p", "0"], "--top-p"),
                      (["--max-tokens", "-3"], "--max-tokens"),
                      (["--expert-kernel", "fast"], "--expert-kernel")):
        r = _cli("generate", str(path), "--prompt", "x", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    r = _cli("generate", str(tmp_path / "nope.gguf"), "--prompt", "x")
    assert r.returncode == 2 and "nope.gguf" in r.stderr


def test_text_stream_decodes_utf8_across_tokens(tiny):
    _, path, _ = tiny
    adapter = load_model(path, LoadOptions(expert_cache_mib=0)).model
    try:
        codec = TextCodec(adapter.source.raw_kv)
    finally:
        adapter.close()
    # 'é' is c3 a9: in a byte-level vocab these are two single-byte tokens
    one_byte = {b: i for i, b in enumerate(codec.token_bytes) if len(b) == 1}
    stream = codec.streamer()
    assert stream.push(one_byte[b"\xc3"]) == ""
    assert stream.push(one_byte[b"\xa9"]) == "é"
    ids = codec.encode("naïve — ok ✓")
    s2 = codec.streamer()
    pieces = [s2.push(t) for t in ids] + [s2.flush()]
    assert "".join(pieces) == "naïve — ok ✓"
    assert "\ufffd" not in "".join(pieces)
    with pytest.raises(K3Error):
        codec.decode_bytes([codec.n_vocab])
