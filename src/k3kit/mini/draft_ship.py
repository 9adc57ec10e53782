"""Ship a trained drafter: convert it against the shipped target GGUF, measure the converted
file's acceptance (the artifact, not the float32 weights it came from), and write the asset
directory (GGUF, bfloat16 HF copy, card, summary, converter report) as one atomic rename.

    python -m k3kit.mini.draft_ship RUN_DIR --target-hf HF_DIR --target-gguf T.gguf --dest DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from k3kit.convert.draft import convert_draft, write_report
from k3kit.mini import data
from k3kit.mini.corpus import build_corpus
from k3kit.mini.draft_card import write_card
from k3kit.mini.draft_io import load_draft, load_gguf_draft, save_draft
from k3kit.mini.draft_target import measure_acceptance
from k3kit.mini.paths import DRAFT_GGUF_NAME
from k3kit.mini.train_draft import HF_DIR, SUMMARY_NAME, DraftTrainSettings, load_target, workloads


def ship(run_dir: str | Path, target_hf: str | Path, target_gguf: str | Path, dest: str | Path, *,
         out_type: str = "Q8_0", log=None) -> dict:
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    run, dest = Path(run_dir), Path(dest)
    summary = json.loads((run / SUMMARY_NAME).read_text())
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        gguf = stage / DRAFT_GGUF_NAME
        report = convert_draft(run / HF_DIR, target_gguf, gguf, out_type=out_type, progress=False)
        write_report(report, stage / "convert_report.json")
        rj = json.loads((stage / "convert_report.json").read_text())      # paths as shipped, not staged
        rj["output"], rj["source"] = DRAFT_GGUF_NAME, f"{HF_DIR}/ (float32, before the bfloat16 copy)"
        (stage / "convert_report.json").write_text(json.dumps(rj, indent=2) + "\n")
        say(f"converted {run / HF_DIR} -> {gguf} ({out_type}, {gguf.stat().st_size} bytes)")

        target, tok = load_target(target_hf)
        draft = load_gguf_draft(gguf)
        s = DraftTrainSettings(**{k: tuple(v) if k == "taps" and v is not None else v
                                  for k, v in summary["settings"].items()})
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
        (stage / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3kit.mini.draft_ship", description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--target-hf", required=True)
    ap.add_argument("--target-gguf", required=True)
    ap.add_argument("--dest", required=True)
    ap.add_argument("--type", default="Q8_0", choices=["Q8_0", "BF16", "F32"])
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ship(a.run_dir, a.target_hf, a.target_gguf, a.dest, out_type=a.type)
    return 0


if __name__ == "__main__":
    sys.exit(main())
