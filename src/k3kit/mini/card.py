"""Ship a trained mini K3: GGUF, QAT table, training curve and the model card.

`ship(run_dir, dest)` takes a `k3kit mini train` run directory and writes into `dest`:
  hf/                 the HF checkpoint + tokenizer, as trained
  mini-k3.gguf        `k3kit convert target` of hf/ (Q8_0 trunk, MXFP4 experts copied bit for bit)
  training_curve.png  train loss and held-out perplexity against tokens
  train_log.jsonl, summary.json, corpus_manifest.json, qat.json
  MODEL_CARD.md

The QAT table scores the held-out split with the weights as each format would hold them. All
variants start from the GGUF's own bytes (dequantized with k3kit.gguf.quants, loaded through
models/kimi_k3/gguf_map.py), so "shipped" is exactly the file, and each requantization is a real
encode -> decode with the ggml-exact codecs:
  * trunk F32 (the HF checkpoint), experts MXFP4          - what training evaluated
  * trunk Q8_0, experts MXFP4                             - mini-k3.gguf as shipped
  * trunk Q8_0, experts MXFP4 -> Q4_K                     - requantized experts lose the QAT grid
  * trunk Q8_0 -> Q4_K, experts MXFP4                     - the 2x24 GB-box trick for the trunk
Q4_K needs rows of 256. Trunk matrices whose rows are shorter stay Q8_0 (llama-quantize falls
back for them too); the mini's experts have rows of 128 (latent) and 64 (FFN), so for the
expert variant the super-blocks of 256 run over consecutive rows of each expert matrix (each
32-weight sub-block still has its own scale and min; only the fp16 super-scale is shared).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from k3kit._io import atomic_write, read_json
from k3kit.adapters.kimi_k3_hf import load_hf, save_hf
from k3kit.errors import K3Error
from k3kit.gguf import quants
from k3kit.gguf.format import is_trunk_matrix
from k3kit.gguf.shards import Model
from k3kit.mini import data, paths
from k3kit.mini.corpus import build_corpus
from k3kit.mini.train import (
    CHECKPOINT_NAME,
    HF_DIR,
    LOG_NAME,
    MANIFEST_NAME,
    SETTINGS_NAME,
    SUMMARY_NAME,
    count_params,
    evaluate,
)
from k3kit.models.kimi_k3.gguf_map import infer_optional_parts, load_gguf_tensors
from k3kit.models.kimi_k3.kda import use_fast_kda
from k3kit.models.kimi_k3.model import K3Model
from k3kit.models.kimi_k3.moe import use_fast_moe

CURVE_NAME = "training_curve.png"
QAT_NAME = "qat.json"
CARD_NAME = "MODEL_CARD.md"
LLAMA_WINDOWS = 16       # held-out windows scored by llama.cpp as a cross-check of the GGUF


def _roundtrip(a: np.ndarray, qtype: T, row: int) -> np.ndarray:
    """Encode `a` (float32, numpy order) to `qtype` in rows of `row` values and decode it."""
    flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1, row)
    raw = quants.quantize(flat, qtype)
    return quants.dequantize(raw, qtype, flat.size).reshape(a.shape)


class GGUFWeights:
    """The float32 values of every tensor of a GGUF, with optional requantization rules."""

    def __init__(self, path: Path):
        self.path = path
        self.model = Model.open(path)
        self.tensors = self.model.tensors
        self.err = [0.0, 0.0]         # squared re-encoding error, squared norm of what was re-encoded

    def get(self, name: str, experts_q4k: bool = False, trunk_q4k: bool = False) -> np.ndarray:
        """float32 values (numpy order); with a rule, re-encoded, the squared error tallied in `err`."""
        t = self.tensors[name]
        vals = quants.dequantize(np.asarray(self.model.view(name)), t.ggml_type, t.n_elements)
        vals = vals.reshape(t.np_shape)
        before = vals
        if experts_q4k and t.ggml_type == T.MXFP4:
            vals = _roundtrip(vals, T.Q4_K, 256)
        trunk = t.ggml_type == T.Q8_0 and is_trunk_matrix(name, len(t.shape))
        if trunk_q4k and trunk and t.shape[0] % 256 == 0:
            vals = _roundtrip(vals, T.Q4_K, t.shape[0])
        if vals is not before:
            self.err[0] += float(np.sum((vals - before) ** 2))
            self.err[1] += float(np.sum(before.astype(np.float64) ** 2))
        return vals

    def close(self) -> None:
        self.model.close()


def model_from_gguf(weights: GGUFWeights, like: K3Model, **rules: bool) -> K3Model:
    """A K3Model with `like`'s config holding the GGUF's weights (after `rules`)."""
    cfg = infer_optional_parts(type(like.cfg).from_dict(like.cfg.to_dict()), set(weights.tensors))
    model = K3Model(cfg)
    load_gguf_tensors(model, lambda n: weights.get(n, **rules), set(weights.tensors), str(weights.path))
    return model


def qat_table(hf_dir: Path, gguf: Path, windows: torch.Tensor, hf_trunk: str = "BF16") -> list[dict]:
    """Held-out nll/perplexity of the four weight formats described in the module docstring."""
    ref = load_hf(hf_dir)
    w = GGUFWeights(gguf)
    rows = []
    try:
        variants = [
            (hf_trunk, "MXFP4", "hf/ checkpoint as shipped", None),
            ("Q8_0", "MXFP4", "mini-k3.gguf as shipped", {}),
            ("Q8_0", "MXFP4 -> Q4_K", "experts requantized", {"experts_q4k": True}),
            ("Q8_0 -> Q4_K", "MXFP4", "trunk requantized (rows of 256; others stay Q8_0)",
             {"trunk_q4k": True}),
        ]
        for trunk, experts, what, rules in variants:
            w.err = [0.0, 0.0]
            model = ref if rules is None else model_from_gguf(w, ref, **rules)
            rel = math.sqrt(w.err[0] / w.err[1]) if w.err[1] else 0.0
            use_fast_kda(model)
            use_fast_moe(model)
            nll = evaluate(model, windows)
            rows.append({"trunk": trunk, "experts": experts, "what": what, "heldout_nll": nll,
                         "heldout_ppl": math.exp(nll), "requant_rel_error": rel})
    finally:
        w.close()
    return rows


def llama_cpp_nll(gguf: Path, windows: torch.Tensor) -> float | None:
    """Mean next-token nll of `windows` as llama.cpp (llama-cpp-python) computes it on the GGUF,
    or None when llama-cpp-python is not installed. Extra (AMX/repack) weight buffers are off:
    on AMX Xeons llama.cpp aborts with them for kimi-k3 Q8_0 weights (see tests/interop)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    params = llama_cpp.llama_cpp.llama_model_default_params

    def no_extra_bufts():
        p = params()
        p.use_extra_bufts = False
        return p

    n = windows.shape[1] - 1
    llama_cpp.llama_cpp.llama_model_default_params = no_extra_bufts
    try:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n + 8, n_batch=n + 8, logits_all=True,
                              verbose=False, n_threads=torch.get_num_threads(), type_k=0, type_v=0)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = params
    total = 0.0
    try:
        for w in windows.tolist():
            llm.reset()
            llm.eval(w[:-1])
            logits = np.asarray(llm.scores[:n], dtype=np.float64)
            top = logits.max(axis=-1, keepdims=True)
            logp = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
            total -= float(logp[np.arange(n), w[1:]].sum())
    finally:
        llm.close()
    return total / (windows.shape[0] * n)


def plot_curve(log: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["tokens"], r["loss"]) for r in log if "loss" in r]
    held = [(r["tokens"], r["heldout_nll"]) for r in log if "heldout_nll" in r]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    if train:
        ax.plot([t / 1e6 for t, _ in train], [v for _, v in train], lw=1, label="train loss (batch)")
    if held:
        ax.plot([t / 1e6 for t, _ in held], [v for _, v in held], "o-", ms=3, label="held-out nll")
    ax.set_xlabel("training tokens (M)")
    ax.set_ylabel("nats / token")
    ax.set_title("mini K3 on the CPython stdlib")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(out, lambda p: fig.savefig(p, format="png"))
    plt.close(fig)


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_json(p: Path) -> dict:
    if not p.exists():
        raise K3Error(f"{p}: missing (not a `k3kit mini train` run directory?)")
    return read_json(p)


def ship(run_dir: str | Path, dest: str | Path, *, gguf: bool = True, hf_dtype: torch.dtype = torch.bfloat16,
         log=print) -> Path:
    """Assemble the shipped artifacts of `run_dir` in `dest` (built in a temp dir, then renamed).

    The HF trunk is stored in `hf_dtype` (bfloat16 by default, as K3 ships: half the bytes of the
    float32 training weights; the experts are MXFP4 either way) and the GGUF is converted from it.
    """
    run = Path(run_dir)
    dest = Path(dest)
    summary = _read_json(run / SUMMARY_NAME)
    if summary.get("schedule_steps") is None and (run / CHECKPOINT_NAME).is_file():
        summary["schedule_steps"] = torch.load(run / CHECKPOINT_NAME, weights_only=False)["total_steps"]
    settings = _read_json(run / SETTINGS_NAME)
    manifest = _read_json(run / MANIFEST_NAME)
    log_rows = [json.loads(x) for x in (run / LOG_NAME).read_text().splitlines() if x.strip()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tmp.chmod(0o755)
        shutil.copytree(run / HF_DIR, tmp / paths.HF_NAME)
        if hf_dtype != torch.float32:
            save_hf(load_hf(run / HF_DIR), tmp / paths.HF_NAME, dtype=hf_dtype)
        for name in (LOG_NAME, SUMMARY_NAME, MANIFEST_NAME, SETTINGS_NAME):
            shutil.copyfile(run / name, tmp / name)
        plot_curve(log_rows, tmp / CURVE_NAME)
        table = None
        if gguf:
            from k3kit.convert.target import convert_target

            convert_target(tmp / paths.HF_NAME, tmp / paths.GGUF_NAME, "Q8_0", name=paths.MODEL_DIR)
            log(f"converted {tmp / paths.GGUF_NAME}")
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tmp / paths.HF_NAME / "tokenizer.json"))
            seq_len = settings["settings"]["seq_len"]
            held = data.heldout_windows(data.pack(tok, build_corpus(settings["settings"]["corpus_bytes"])
                                                  .heldout_docs), seq_len)
            hf_trunk = {torch.bfloat16: "BF16", torch.float16: "F16"}.get(hf_dtype, "F32")
            table = qat_table(tmp / paths.HF_NAME, tmp / paths.GGUF_NAME, held, hf_trunk)
            check = held[:LLAMA_WINDOWS]
            ll = llama_cpp_nll(tmp / paths.GGUF_NAME, check)
            if ll is not None:
                gw = GGUFWeights(tmp / paths.GGUF_NAME)
                ref = model_from_gguf(gw, load_hf(tmp / paths.HF_NAME))
                gw.close()
                use_fast_kda(ref)
                use_fast_moe(ref)
                table.append({"trunk": "Q8_0", "experts": "MXFP4", "what": "llama.cpp on mini-k3.gguf",
                              "windows": int(check.shape[0]), "heldout_nll": ll, "heldout_ppl": math.exp(ll),
                              "torch_same_windows_nll": evaluate(ref, check)})
                log(f"llama.cpp on the first {check.shape[0]} windows: nll {ll:.4f} "
                    f"(torch on the same GGUF weights {table[-1]['torch_same_windows_nll']:.4f})")
            (tmp / QAT_NAME).write_text(json.dumps(table, indent=2) + "\n")
            for r in table[:4]:
                log(f"QAT: trunk {r['trunk']:<13} experts {r['experts']:<14} ppl {r['heldout_ppl']:.3f}")
        card = render_card(summary, settings, manifest, log_rows, table, tmp)
        (tmp / CARD_NAME).write_text(card)
        for p in tmp.rglob("*"):          # package data: world-readable (mkstemp files are 0600)
            p.chmod(0o755 if p.is_dir() else 0o644)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.replace(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def render_card(summary: dict, settings: dict, manifest: dict, log_rows: list[dict], table: list[dict] | None,
                folder: Path) -> str:
    m = settings["model"]
    s = settings["settings"]
    kinds = m["layer_kinds"]
    hf_model = load_hf(folder / paths.HF_NAME)
    n_params, n_active = count_params(hf_model)
    experts = sum(p.numel() for n, p in hf_model.named_parameters() if n.endswith("_exps"))
    chat = summary.get("chat")
    base = summary.get("base", summary)
    L: list[str] = []
    add = L.append
    add("# mini K3\n")
    add(f"A {len(kinds)}-layer, {n_params / 1e6:.1f} M-parameter Kimi-K3: every architectural feature "
        "of the 2.8 T model (KDA + MLA "
        "hybrid, latent MoE with MXFP4 quantization-aware-trained routed experts, shared expert, "
        "attn-res, situ) at toy width, trained for "
        f"{base['seconds'] / 60:.0f} minutes on a shared 2-core CPU on the CPython standard library"
        + (f", then {chat['seconds'] / 60:.0f} minutes on generated conversations in Kimi-K3's chat format "
           "(thinking, tool declarations, calls and results, JSON answers)" if chat else "")
        + ". It is k3kit's reference model: small enough to run everywhere in tests, trained enough that "
        "its predictions (and a drafter's acceptance) mean something"
        + ("; it thinks, calls the tool a request needs and answers after the result in K3's format, "
           "which is what agent tests need, though the values it puts in a call's arguments are seldom "
           "the user's (it has not learned to copy them)" if chat else "")
        + ". It is not a useful assistant.\n")
    add("## Architecture\n")
    add("| | mini K3 | Kimi-K3 |\n|---|---|---|")
    mla = [i + 1 for i, k in enumerate(kinds) if k == "mla"]
    rows = [
        ("layers", f"{len(kinds)} ({kinds.count('kda')} KDA, {kinds.count('mla')} MLA at {mla}, 1-indexed)",
         "93 (69 KDA, 24 MLA: every 4th + last)"),
        ("hidden", m["hidden_size"], 7168),
        ("heads (KDA and MLA)", m["num_heads"], 64),
        ("KDA head_dim / conv kernel / gate lower bound", f"{m['kda_head_dim']} / {m['conv_kernel']} / "
         f"{m['gate_lower_bound']}", "128 / 4 / -5"),
        ("MLA q_lora / kv_lora / nope + pe / v, output gate",
         f"{m['q_lora_rank']} / {m['kv_lora_rank']} / {m['qk_nope_head_dim']} + {m['qk_rope_head_dim']} / "
         f"{m['v_head_dim']}, {'yes' if m['mla_output_gate'] else 'no'}", "1536 / 512 / 128 + 64 / 128, yes"),
        ("dense layers (FFN width)", f"{m['first_k_dense']} ({m['intermediate_size']})", "1 (18432)"),
        ("routed experts, top-k", f"{m['num_experts']}, top-{m['num_experts_per_tok']}", "896, top-16"),
        ("expert FFN / latent length / routed norm",
         f"{m['moe_intermediate_size']} / {m['expert_latent_size']} / "
         f"{'yes' if m['routed_expert_norm'] else 'no'}", "3072 / 3584 / yes"),
        ("shared experts", m["num_shared_experts"], 1),
        ("router", "sigmoid + selection bias, renormalised", "same"),
        ("attn-res block", m["attn_res_block_size"], 6),
        ("activation", f"situ (beta {m['situ_beta']}, linear beta {m['situ_linear_beta']})", "situ (4, 25)"),
        ("vocab / context", f"{m['vocab_size']} / {m['max_position_embeddings']} (trained at {s['seq_len']})",
         "163840 / 1M"),
        ("expert format", "MXFP4 (QAT)", "MXFP4 (QAT)"),
        ("parameters (active per token)", f"{n_params / 1e6:.2f} M ({n_active / 1e6:.2f} M); routed experts "
         f"{experts / 1e6:.2f} M", "~2.8 T"),
    ]
    for name, a, b in rows:
        add(f"| {name} | {a} | {b} |")
    add(f"\nContext: the file declares {m['max_position_embeddings']} tokens. As in K3, MLA is NoPE (the "
        "\"pe\" part of q.k is not rotated) and KDA is recurrent, so no position is out of range; training "
        f"saw {s['seq_len']}-token windows, so predictions far past that are what the model makes of them.")
    add("")
    add("## Data\n")
    tr, ho = manifest["train"], manifest["heldout"]
    add(f"{manifest['source']}, Python {manifest['python_implementation']} {manifest['python_version']}; "
        f"rules: {json.dumps(manifest['rules'])}.\n")
    add("| split | files | bytes | tokens | sha256 of the text |\n|---|---|---|---|---|")
    add(f"| train | {tr['files']} | {_fmt_int(tr['bytes'])} | {_fmt_int(manifest['train_tokens'])} | "
        f"`{tr['sha256']}` |")
    add(f"| held-out | {ho['files']} | {_fmt_int(ho['bytes'])} | {_fmt_int(manifest['heldout_tokens'])} | "
        f"`{ho['sha256']}` |")
    add("")
    tm = manifest["tokenizer"]
    add(f"Tokenizer: {tm['type']}, pre-tokenizer `{tm['pre']}`, {tm['vocab_size']} tokens "
        f"({tm['merges']} merges), special tokens "
        f"{', '.join(f'`{k}` {v}' for k, v in tm['special_tokens'].items())}; "
        f"sha256 `{tm['sha256']}`. Chat template: "
        + ("Kimi-K3's (llama.cpp's models/templates/Kimi-K3.jinja, in tokenizer_config.json and the GGUF); "
           "a reply ends with `<|end_of_msg|>`, the file's end-of-turn token.\n"
           if "<|end_of_msg|>" in tm["special_tokens"] else "Kimi-K2's (in tokenizer_config.json).\n"))
    add("## Training\n")
    add(f"AdamW (betas 0.9/0.95, weight decay {s['weight_decay']}), peak LR {s['lr']}, "
        f"{s['warmup']} warmup steps, "
        f"cosine to {s['min_lr_ratio']}x; batch {s['batch']} x {s['seq_len']} tokens (packed documents, "
        f"[BOS] doc [EOS]); gradient clip {s['grad_clip']}; fp32, {s['threads']} thread. Routed experts "
        "fake-quantized to MXFP4 in every forward (straight-through gradient). Load balancing: "
        f"selection-bias controller (step {s['bias_rate']}) plus an auxiliary balance loss "
        f"(coefficient {s['balance_coef']}). Seed {s['seed']}.\n")
    add(f"{base['steps']} steps, {_fmt_int(base['tokens'])} tokens in "
        f"{base['seconds'] / 60:.1f} min "
        f"({base['tokens'] / base['seconds']:.0f} tok/s on a 2-core machine shared with other jobs).\n")
    if chat:
        c = chat["settings"]
        add("### Chat stage\n")
        add("`k3kit mini chat-tune` (k3kit.mini.chat_tune): the five chat-marker ids after `[EOS]` "
            "renamed to "
            "Kimi-K3's markers (the merges and every other id unchanged), then "
            f"{chat['steps']} more steps in {chat['seconds'] / 60:.1f} min: {c['code_every']} steps of "
            f"{c['chat_batch']} x {c['chat_seq_len']} tokens of generated conversations "
            "(k3kit.mini.chat_data: no tools or two to four of seven declared, requests filled from "
            "fixed lists and the stdlib's "
            "modules, files and functions, each rendered by the template exactly as `k3kit serve` renders a "
            "request; every window starts at a conversation) for each step of stdlib code as above"
            + (f", the loss weighted 1 on the assistant's messages and {c['prompt_weight']} on the rest"
               if c.get("prompt_weight", 1.0) != 1.0 else "")
            + f"; {_fmt_int(chat['chat_tokens'])} chat tokens from "
            f"{_fmt_int(chat['conversations'])} conversations "
            f"(median {chat['conversation_tokens_median']} tokens); peak LR {c['lr']}, {c['warmup']} warmup "
            f"steps, cosine to {c['min_lr_ratio']}x; experts still MXFP4-aware, routers still balancing. "
            f"Held-out conversations ({chat['heldout_chats']}, indices never trained on): perplexity "
            f"{math.exp(chat['chat_nll_before']):.1f} before, **{math.exp(chat['chat_nll']):.3f}** after; "
            f"held-out code {base['heldout_ppl']:.2f} before, {summary['heldout_ppl']:.2f} after.\n")
    add(f"![training curve]({CURVE_NAME})\n")
    add("| step | tokens | held-out perplexity |\n|---|---|---|")
    for r in log_rows:
        if "heldout_ppl" in r:
            add(f"| {r['step']} | {_fmt_int(r['tokens'])} | {r['heldout_ppl']:.2f} |")
    add(f"\n(periodic rows: the first {s['eval_windows']} held-out windows; the full split is below.)\n")
    add("## Results\n")
    add(f"Held-out perplexity (all {summary['heldout_windows']} windows of {summary['seq_len']} tokens, "
        f"{_fmt_int(summary['heldout_tokens_scored'])} tokens scored): **{summary['heldout_ppl']:.2f}** "
        f"(nll {summary['heldout_nll']:.4f} nats). Unigram baseline (train-split token frequencies, "
        f"add-one smoothed, on the same tokens): **{summary['unigram_ppl']:.1f}**. (The float32 training "
        "weights; the shipped files hold the trunk in BF16 (hf/) and Q8_0 (GGUF): see the table.)\n")
    if table:
        add("### QAT: the experts are the 4-bit values\n")
        add("| trunk | routed experts | held-out perplexity | vs shipped | re-encoding error | |\n"
            "|---|---|---|---|---|---|")
        shipped = table[1]["heldout_nll"]
        for r in table[:4]:
            add(f"| {r['trunk']} | {r['experts']} | {r['heldout_ppl']:.3f} | "
                f"{100 * (math.exp(r['heldout_nll'] - shipped) - 1):+.3f} % | "
                f"{100 * r.get('requant_rel_error', 0.0):.1f} % | {r['what']} |")
        add("\n(re-encoding error: relative L2 error of the re-encoded tensors against the shipped values.)")
        if abs(table[2]["heldout_nll"] - shipped) < 1e-3:
            add("A model this small is flat in its routed-expert weights: a several-percent re-encoding "
                "error barely moves its perplexity, so the mini shows the mechanics of the QAT comparison "
                "rather than the calibration loss K3's experts would suffer.")
        for r in table[4:]:
            add(f"\nCross-check: llama.cpp (llama-cpp-python, CPU) on mini-k3.gguf, first {r['windows']} "
                f"held-out windows: nll {r['heldout_nll']:.4f} (perplexity {r['heldout_ppl']:.2f}); k3kit's "
                f"torch model on the same GGUF weights and windows: nll {r['torch_same_windows_nll']:.4f}.")
        add("\nQ4_K needs 256-value rows: trunk matrices with shorter rows stay Q8_0 in the trunk row, "
            "and the expert row packs consecutive expert rows (128 / 64 values) into each 256-value "
            "super-block.\n")
    add("## Files\n")
    add("| file | bytes | sha256 |\n|---|---|---|")
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != CARD_NAME:
            add(f"| {p.relative_to(folder)} | {_fmt_int(p.stat().st_size)} | `{_sha256(p)[:16]}…` |")
    add("")
    add("## Reproduce\n")
    sched = summary.get("schedule_steps") or base["steps"]
    stop = f" --stop-at {base['steps']}" if sched != base["steps"] else ""
    add(f"`k3kit mini train --out DIR --steps {sched}{stop} --seed {s['seed']} --batch {s['batch']} "
        f"--seq-len {s['seq_len']} --lr {s['lr']}` (deterministic for a given torch build and thread count"
        + ("; this run was sized by `--minutes`, which fixed the schedule from the speed of its first steps"
           if s.get("steps") is None else "")
        + ("; the time budget stopped it before the schedule's end" if stop else "")
        + "), then "
        + ("`k3kit mini ship DIR BASE`, `k3kit mini chat-tune --from BASE --out DIR2 --steps "
           f"{chat['steps']} --seed {chat['settings']['seed']}`, then `k3kit mini ship DIR2 DEST` "
           "(converts DEST/hf to the GGUF). " if chat else
           "`k3kit convert target DIR/hf -o mini-k3.gguf`. ")
        + "`k3kit mini path` prints the shipped GGUF, `--hf` the checkpoint.\n")
    return "\n".join(L)
