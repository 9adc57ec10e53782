"""What structured output costs: decode tok/s of the shipped mini K3 free and under a JSON schema,
plain (AR) and with its DSpark drafter, and the grammar's share of a decode step.

    python benchmarks/bench_grammar.py [--prompts chat|code|schemas] [--schemas 8] [--tokens 128]
                                        [--rounds 3] [--threads 1] [--draft GGUF] [--json]

`--prompts chat` (the default) asks as an API client would: a user message rendered by the
mini's Kimi-K3 template with `response_format: json_schema` (the schema in the template's system
message) and thinking off, so the answer is the response channel; `code` continues Python
snippets ("config = ", ...) where the model would not write JSON by itself; `schemas` asks as
`chat` does, each request under its own random schema (k3kit.mini.draft.schema_data's generator
from a seed no drafter training run draws: schemas the drafter never saw).

Each round runs every prompt through `k3kit.runtime.engine.generate` (the loop `k3kit generate`
runs; greedy) in four configurations, in turns so that a drifting machine slows all alike: AR
free, AR under the schema, DSpark free, DSpark under the schema (the drafter proposes under the
grammar too, row by row, and the target's rows are masked the same way). A free run is cut at
the number of tokens its prompt's schema run produced, so both decode the same number of tokens.

Reported per configuration: decode tok/s (median over rounds of the tokens over the decode time
of all prompts), tokens committed per target pass, and, under the schema, the grammar's time
per decode step (llguidance filling the bitmasks, the mask applied to the logits, the matcher
advanced over the picked tokens: k3kit.runtime.constraint.MaskTimes) as a share of the step
(the decode time over the target passes). Greedy tokens must be the same with and without the
draft; the script says so, or exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from k3kit.adapters.session import open_session
from k3kit.bench.run import cpu_info
from k3kit.kernels import qmatmul
from k3kit.mini.draft.schema_data import chat_prompt as schema_prompt
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.runtime.constraint import Grammar, Vocabulary
from k3kit.runtime.engine import generate
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import Sampler, make_sampling
from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder

SCHEMA: dict[str, Any] = {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "tags": {"type": "array", "items": {"enum": ["new", "old", "hot"]}, "maxItems": 3},
        "point": {"type": "object", "properties": {
            "x": {"type": "number", "minimum": -99, "maximum": 99, "multipleOf": 0.5},
            "y": {"type": "number", "minimum": -99, "maximum": 99, "multipleOf": 0.5}},
            "required": ["x", "y"], "additionalProperties": False},
        "ok": {"type": "boolean"}},
    "required": ["name", "id", "tags", "point", "ok"], "additionalProperties": False}
PROMPTS = ["config = ", "data = json.loads(", "return ", "self.options = "]
ASKS = ["Describe a user named Ada as JSON.", "Give me the record of item 42 as JSON.",
        "Return the point (3, 4) with its tags as JSON.", "A new, hot item called lamp, as JSON."]
HELD_OUT_SEED = 2_718_281_828
CONFIGS = [("AR free", False, False), ("AR schema", False, True), ("DSpark free", True, False),
           ("DSpark schema", True, True)]


def machine() -> str:
    return (f"{cpu_info()}, {os.cpu_count()} CPUs, native kernels {qmatmul.native_simd()}, "
            f"{torch.get_num_threads()} torch thread(s)")


def chat_prompt(codec: Any, ask: str) -> str:
    """The served prompt of a chat request for `ask` under SCHEMA, as `k3kit serve` renders it."""
    return schema_prompt(codec, ask, SCHEMA, name="record")


def held_out_requests(codec: Any, vocab: Vocabulary, n: int) -> tuple[list[str], list[Grammar]]:
    """n chat requests under random schemas (k3kit.mini.draft.schema_data's generator, from a seed
    no training run draws: its rounds use seed * 7919 + round)."""
    import random

    from k3kit.mini.draft.schema_data import random_ask, random_schema
    r = random.Random(HELD_OUT_SEED)
    texts, grammars = [], []
    for _ in range(n):
        schema = random_schema(r)
        texts.append(schema_prompt(codec, random_ask(r, schema), schema))
        grammars.append(vocab.json_schema(schema))
    return texts, grammars


def run_one(session: Any, prompt: list[int], grammar: Grammar | None, draft: bool,
            tokens: int) -> dict[str, Any]:
    codec = session.codec
    stop = codec.stop_ids()
    constraint = grammar.constraint() if grammar is not None else None
    step = None
    if draft:
        def step(model: Any, sampler: Sampler) -> SpeculativeDecoder:
            return SpeculativeDecoder(model, session.draft_model, sampler.sampling, sampler.generator,
                                      schedule=ScheduleConfig(draft_cost=None), stop_ids=stop,
                                      history=sampler.history, constraint=sampler.constraint)
    res = generate(session.model, prompt, max_tokens=tokens, sampling=make_sampling(0.0), stop_ids=stop,
                   step=step, constraint=constraint)
    st = res.stats
    decoded = max(st.generated_tokens - 1, 0)
    passes = int(st.speculative.get("target_passes", 0)) if st.speculative else decoded
    times = constraint.times if constraint is not None else None
    return {"tokens": res.token_ids, "decoded": decoded, "seconds": st.decode_seconds,
            "passes": passes, "mask_seconds": times.total if times else 0.0,
            "fill": times.fill if times else 0.0, "apply": times.apply if times else 0.0,
            "consume": times.consume if times else 0.0, "reason": st.stop_reason}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", choices=("chat", "code", "schemas"), default="chat",
                    help="chat requests with response_format (default), code snippets, or chat requests "
                         "under random schemas no drafter was trained on (--schemas of them)")
    ap.add_argument("--schemas", type=int, default=8, help="requests of --prompts schemas (default 8)")
    ap.add_argument("--tokens", type=int, default=128, help="max tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draft", default=None, metavar="GGUF",
                    help="the drafter (default: the shipped one, `k3kit mini path --draft`)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    draft_path = Path(args.draft) if args.draft else shipped_draft()
    session = open_session(shipped_gguf(), LoadOptions(), draft=draft_path)
    try:
        codec = session.codec
        vocab = Vocabulary(codec.tokenizer.to_str(), codec.n_vocab, codec.stop_ids())
        t0 = time.perf_counter()
        grammar = vocab.json_schema(SCHEMA)
        compile_s = time.perf_counter() - t0
        if args.prompts == "schemas":
            texts, grammars = held_out_requests(codec, vocab, args.schemas)
        else:
            texts = [chat_prompt(codec, a) for a in ASKS] if args.prompts == "chat" else PROMPTS
            grammars = [grammar] * len(texts)
        prompts = [codec.encode(p) for p in texts]
        # the schema's token counts: free runs decode exactly as many
        first = [run_one(session, p, g, False, args.tokens) for p, g in zip(prompts, grammars, strict=True)]
        lengths = [len(r["tokens"]) for r in first]
        complete = [r["reason"] == "stop" for r in first]
        per: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in CONFIGS}
        outputs: dict[tuple[str, int], list[int]] = {}
        for r in range(args.rounds):
            order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
            for name, draft, constrained in order:
                agg = {"decoded": 0, "seconds": 0.0, "passes": 0, "mask_seconds": 0.0, "fill": 0.0,
                       "apply": 0.0, "consume": 0.0}
                for i, p in enumerate(prompts):
                    res = run_one(session, p, grammars[i] if constrained else None, draft, lengths[i])
                    outputs.setdefault((name, i), res["tokens"])
                    for k in agg:
                        agg[k] += res[k]
                per[name].append(agg)
        same = all(outputs[("AR " + kind, i)] == outputs[("DSpark " + kind, i)]
                   for kind in ("free", "schema") for i in range(len(prompts)))
        valid = all(isinstance(json.loads(codec.decode_bytes(outputs[("AR schema", i)]).decode()), dict)
                    for i in range(len(prompts)) if complete[i])
    finally:
        session.close()

    rows = []
    for name, _, constrained in CONFIGS:
        runs = per[name]
        tok_s = statistics.median(a["decoded"] / a["seconds"] for a in runs)
        step_s = statistics.median(a["seconds"] / a["passes"] for a in runs)
        mask_s = statistics.median(a["mask_seconds"] / a["passes"] for a in runs)
        rows.append({"config": name, "tok_s": tok_s,
                     "tokens_per_pass": runs[0]["decoded"] / runs[0]["passes"],
                     "step_ms": step_s * 1e3, "mask_ms": mask_s * 1e3 if constrained else None,
                     "mask_share": mask_s / step_s if constrained else None,
                     "fill_ms": statistics.median(a["fill"] / a["passes"] for a in runs) * 1e3,
                     "apply_ms": statistics.median(a["apply"] / a["passes"] for a in runs) * 1e3,
                     "consume_ms": statistics.median(a["consume"] / a["passes"] for a in runs) * 1e3})
    by = {r["config"]: r for r in rows}
    ratios = {"AR schema / AR free": by["AR schema"]["tok_s"] / by["AR free"]["tok_s"],
              "DSpark schema / DSpark free": by["DSpark schema"]["tok_s"] / by["DSpark free"]["tok_s"],
              "DSpark free / AR free": by["DSpark free"]["tok_s"] / by["AR free"]["tok_s"],
              "DSpark schema / AR schema": by["DSpark schema"]["tok_s"] / by["AR schema"]["tok_s"]}
    result = {"machine": machine(), "model": "shipped mini K3 + its DSpark drafter",
              "prompt_kind": args.prompts, "prompts": len(prompts),
              "decoded_tokens": sum(lengths) - len(lengths), "rounds": args.rounds,
              "schema_compile_ms": compile_s * 1e3, "rows": rows, "ratios": ratios,
              "schema_outputs_complete": sum(complete), "same_tokens_ar_dspark": same,
              "schema_outputs_parse": valid}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"machine: {result['machine']}")
        print(f"{result['model']}; {len(prompts)} {args.prompts} prompts, {result['decoded_tokens']} decoded "
              "tokens per "
              f"configuration and round, greedy; median of {args.rounds} rounds; schema compiled in "
              f"{compile_s * 1e3:.1f} ms")
        print(f"| {'configuration':14s} | {'tok/s':>7s} | {'tok/pass':>8s} | {'step ms':>7s} "
              f"| {'mask ms':>7s} | {'mask % of step':>14s} | {'fill/apply/consume ms':>21s} |")
        print(f"|{'-' * 16}|{'-' * 9}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 16}|{'-' * 23}|")
        for r in rows:
            mask = f"{r['mask_ms']:.3f}" if r["mask_ms"] is not None else "-"
            share = f"{100 * r['mask_share']:.1f}%" if r["mask_share"] is not None else "-"
            parts = (f"{r['fill_ms']:.3f}/{r['apply_ms']:.3f}/{r['consume_ms']:.3f}"
                     if r["mask_ms"] is not None else "-")
            print(f"| {r['config']:14s} | {r['tok_s']:7.1f} | {r['tokens_per_pass']:8.2f} "
                  f"| {r['step_ms']:7.2f} | {mask:>7s} | {share:>14s} | {parts:>21s} |")
        for k, v in ratios.items():
            print(f"{k}: {v:.2f}")
        print("greedy tokens: AR and DSpark the same" if same else "ERROR: AR and DSpark tokens differ")
        print(f"schema outputs: {sum(complete)} of {len(prompts)} complete within --tokens, "
              + ("each a JSON object" if valid else "ERROR: one does not parse"))
    return 0 if same and valid else 1


if __name__ == "__main__":
    sys.exit(main())
