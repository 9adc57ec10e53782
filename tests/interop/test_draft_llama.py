"""llama.cpp loads what `k3kit draft convert` / `draft fix` write, as a `dflash` (DSpark) draft.

What is checked, through llama-cpp-python's low-level API in a subprocess (a GGML_ASSERT aborts
the process, and the loader's log goes to the C stderr):
  * `llama_model_load_from_file` (vocab_only = false, so hparams AND tensors load) accepts the
    converted draft standalone: a dflash draft has no token embedding or LM head of its own
    (llama.cpp's dflash.cpp creates them as optional), so the target is not needed to load it;
  * the hparams llama.cpp derived, from its print_info log: n_layer, n_embd, n_head, n_head_kv,
    n_rot, n_embd_head_k, n_ff, f_norm_rms_eps, rope scaling yarn, freq_base_train,
    freq_scale_train (1/factor), n_ctx_orig_yarn; `DFlash extract_layers = [1, 3]` (taps + 1);
    the DSpark Markov head found with its rank;
  * the API: architecture and block_size metadata, n_params equal to the checkpoint's parameter
    count, the vocab (copied from the target) size, and llama_vocab_mask = the config's mask id;
  * a draft context created with ctx_other = a context of the synthetic kimi-k3 target
    (llama.cpp reserves the draft's compute graphs there);
  * a legacy `dflash-draft` file is refused (unknown architecture) and the same file after
    `draft fix` loads with the same parameter count.
Not checked: running the draft (that needs the target's tapped features through llama.cpp's
speculative loop, which llama-cpp-python does not expose).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "convert"))
from draft_fixture import make_legacy, write_draft, write_target  # noqa: E402

from k3kit.convert.draft import convert_draft  # noqa: E402
from k3kit.convert.draft_fix import fix_draft  # noqa: E402

pytestmark = pytest.mark.interop

LOADER = r"""
import ctypes, json, sys
from llama_cpp import llama_cpp as L
L.llama_backend_init()
p = L.llama_model_default_params()
p.use_extra_bufts = False
out = {}
m = L.llama_model_load_from_file(sys.argv[1].encode(), p)
out["loaded"] = bool(m)
if m:
    buf = ctypes.create_string_buffer(512)
    def meta(k):
        return buf.value.decode() if L.llama_model_meta_val_str(m, k.encode(), buf, 512) >= 0 else None
    v = L.llama_model_get_vocab(m)
    out.update(arch=meta("general.architecture"), block_size=meta("dflash.block_size"),
               anchor=meta("dflash.sample_from_anchor"), n_layer=L.llama_model_n_layer(m),
               n_embd=L.llama_model_n_embd(m), n_head=L.llama_model_n_head(m),
               n_params=L.llama_model_n_params(m), n_vocab=L.llama_vocab_n_tokens(v),
               mask=L.llama_vocab_mask(v))
    if len(sys.argv) > 2:
        tm = L.llama_model_load_from_file(sys.argv[2].encode(), p)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 256, 64, 64
        tc = L.llama_init_from_model(tm, cp)
        dp = L.llama_context_default_params()
        dp.n_ctx, dp.n_batch, dp.n_ubatch = 256, 64, 64
        dp.ctx_other = tc
        out["target_ctx"] = bool(tc)
        out["draft_ctx"] = bool(L.llama_init_from_model(m, dp))
print(json.dumps(out))
"""


def _load(tmp_path: Path, draft: Path, target: Path | None = None) -> tuple[dict, str]:
    script = tmp_path / "load_draft.py"
    script.write_text(LOADER)
    args = [sys.executable, str(script), str(draft)] + ([str(target)] if target else [])
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _info(log: str) -> dict[str, str]:
    """The draft's print_info block (the target's, loaded after it, is cut off)."""
    m = re.search(r"print_info: arch\s+= dflash\n", log)
    assert m, "no print_info block for a dflash model"
    block = log[m.end():].split("print_info: arch ", 1)[0]
    return {m[1]: m[2].strip() for m in re.finditer(r"print_info: (\w+)\s+= (.*)", block)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_draft")
    target = write_target(root / "target")
    write_draft(root / "draft")
    rep = convert_draft(root / "draft", target, root / "draft.gguf", progress=False)
    return root, target, root / "draft.gguf", rep


def test_llama_cpp_loads_the_converted_draft(files, tmp_path):
    _, target, draft, rep = files
    out, log = _load(tmp_path, draft, target)
    assert out["loaded"] and out["arch"] == "dflash"
    assert (out["n_layer"], out["n_embd"], out["n_head"]) == (2, 256, 4)
    assert out["n_params"] == rep.mapped_parameters == rep.parameters
    assert (out["n_vocab"], out["mask"]) == (1024, 1000)
    assert (out["block_size"], out["anchor"]) == ("7", "true")
    info = _info(log)
    want = {"n_layer": "2", "n_embd": "256", "n_head": "4", "n_head_kv": "2", "n_rot": "64",
            "n_embd_head_k": "64", "n_ff": "512", "f_norm_rms_eps": "1.0e-05"}
    for k, v in want.items():
        assert info.get(k) == v, (k, info.get(k))
    assert re.search(r"print_info: rope scaling\s+= yarn", log)
    assert info["freq_base_train"] == "50000.0" and info["freq_scale_train"] == "0.0625"
    assert info["n_ctx_orig_yarn"] == "256"
    assert "DFlash extract_layers = [1, 3]" in log
    assert "DSpark markov head (rank = 32)" in log
    assert out["target_ctx"] and out["draft_ctx"]


def test_legacy_is_refused_and_fixed_draft_loads(files, tmp_path):
    root, target, draft, rep = files
    legacy = make_legacy(draft, tmp_path / "legacy.gguf")
    out, log = _load(tmp_path, legacy)
    assert not out["loaded"] and "dflash-draft" in log
    fix_draft(legacy, target, tmp_path / "fixed.gguf")
    out, log = _load(tmp_path, tmp_path / "fixed.gguf")
    assert out["loaded"] and out["n_params"] == rep.parameters and out["mask"] == 1000
    assert "DFlash extract_layers = [1, 3]" in log


def test_llama_cpp_loads_a_bf16_draft(files, tmp_path):
    root, target, _, rep = files
    r = convert_draft(root / "draft", target, tmp_path / "bf16.gguf", out_type="BF16", progress=False)
    out, log = _load(tmp_path, tmp_path / "bf16.gguf")
    assert out["loaded"] and out["n_params"] == r.mapped_parameters == rep.mapped_parameters
    assert "print_info: file type   = BF16" in log
