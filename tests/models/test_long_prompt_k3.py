"""The shipped mini K3 after a prompt longer than its old 1,024-token context: `k3kit generate`
takes the context from the file, and greedy DSpark (`--draft default`) gives the plain run's
tokens. K3's MLA is NoPE and KDA recurrent, so nothing in the target depends on the position; the
drafter ropes its rows (theta 10000, no YaRN) at any position, trained on short windows, so its
acceptance may fall this far in, but verification keeps the output the target's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from k3kit.gguf.shards import Model
from k3kit.mini.corpus import build_corpus
from k3kit.mini.paths import shipped_gguf
from k3kit.tokenizer.codec import TextCodec

N_PROMPT, N_TOKENS = 2000, 6


def _cli(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "k3kit.cli", *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_long_prompt_draft_equals_plain(tmp_path):
    with Model.open(shipped_gguf()) as m:
        codec = TextCodec(m.kv, str(shipped_gguf()))
    ids = codec.encode("".join(build_corpus().heldout_docs[:6]))
    assert len(ids) > N_PROMPT
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(codec.decode_bytes(ids[:N_PROMPT]))
    args = ["generate", "--prompt-file", str(prompt), "--max-tokens", str(N_TOKENS), "--threads", "1",
            "--json"]
    plain = _cli(*args)
    spec = _cli(*args, "--draft", "default")
    assert plain["stats"]["prompt_tokens"] > 1900
    assert plain["stats"]["generated_tokens"] == len(plain["token_ids"]) >= 1
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    s = spec["stats"]
    assert s["target_passes"] >= 1 and s["replay_full_replays"] == 0
