"""Ship a trained drafter: convert it against the shipped target GGUF, measure the converted
file's acceptance (the artifact, not the float32 weights it came from), and write the asset
directory (GGUF, bfloat16 HF copy, card, summary, converter report) as one atomic rename.
Run by `k3kit mini ship-draft RUN_DIR --target-hf HF_DIR --target-gguf T.gguf --dest DIR`.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from k3kit._io import read_json, write_json
from k3kit.convert.draft import convert_draft, write_report
from k3kit.mini import data
from k3kit.mini.corpus import build_corpus
from k3kit.mini.draft.card import write_card
from k3kit.mini.draft.io import load_draft, load_gguf_draft, save_draft
from k3kit.mini.draft.target import measure_acceptance
from k3kit.mini.draft.train import HF_DIR, SUMMARY_NAME, DraftTrainSettings, load_target, workloads
from k3kit.mini.paths import DRAFT_DIR, DRAFT_GGUF_NAME


def ship(run_dir: str | Path, target_hf: str | Path, target_gguf: str | Path, dest: str | Path, *,
         out_type: str = "Q8_0", log=None) -> dict:
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    run, dest = Path(run_dir), Path(dest)
    summary = read_json(run / SUMMARY_NAME, "summary")
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        gguf = stage / DRAFT_GGUF_NAME
        report = convert_draft(run / HF_DIR, target_gguf, gguf, out_type=out_type, progress=False,
                               name=DRAFT_DIR)
        write_report(report, stage / "convert_report.json")
        rj = read_json(stage / "convert_report.json", "report")     # paths as shipped, not staged
        rj["output"], rj["source"] = DRAFT_GGUF_NAME, f"{HF_DIR}/ (float32, before the bfloat16 copy)"
        write_json(stage / "convert_report.json", rj)
        say(f"converted {run / HF_DIR} -> {gguf} ({out_type}, {gguf.stat().st_size} bytes)")

        target, tok = load_target(target_hf)
        draft = load_gguf_draft(gguf)
        settings: dict[str, Any] = {k: tuple(v) if k == "taps" and v is not None else v
                                    for k, v in summary["settings"].items()}
        s = DraftTrainSettings(**settings)
        corpus = build_corpus(s.corpus_bytes)
        held = data.pack(tok, corpus.heldout_docs)
        per = {}
        for name, ps in workloads(tok, held, s).items():
            acc = measure_acceptance(target, draft, ps, summary["card_tokens"])
            per[name] = {"prompts": len(ps), **acc.to_dict()}
            say(f"  shipped GGUF, {name}: tau {acc.tau:.3f}, histogram {acc.histogram}")
        summary["shipped"] = {"file": DRAFT_GGUF_NAME, "type": out_type, "bytes": gguf.stat().st_size,
                              "target_gguf": Path(target_gguf).name, "workloads": per}

        f32 = load_draft(run / HF_DIR)
        save_draft(f32, stage / HF_DIR, num_target_layers=summary["draft_config"]["num_target_layers"],
                   max_position_embeddings=summary["draft_config"]["max_position_embeddings"],
                   dtype=torch.bfloat16)
        write_json(stage / SUMMARY_NAME, summary)
        write_card(stage / "MODEL_CARD.md", summary)
        for p in [stage, *stage.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        if dest.exists():
            shutil.rmtree(dest)
        stage.rename(dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return summary
