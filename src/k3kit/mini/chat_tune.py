"""Teach a trained mini K3 Kimi-K3's chat format: thinking, responses, tool calls and results.

`chat_tune(base, out, settings)` starts from a shipped (or `k3kit mini ship`ped) mini directory:
its tokenizer's five chat-marker ids are renamed to K3's XTML markers
(`tokenizer.with_chat_tokens`; merges and all other ids stay, so every weight keeps its meaning),
and the model trains further on generated conversations (`chat_data`) rendered by K3's template,
alternating with windows of the stdlib code it was trained on so it keeps that skill. The experts
stay quantization-aware (MXFP4 in every forward) and the routers keep balancing, as in `train`.

The output directory has what `k3kit mini ship` reads (hf/, train_log.jsonl with the base run's
rows followed by this stage's, summary.json, train_settings.json, corpus_manifest.json), with a
`chat` entry in the summary and settings describing this stage.
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from k3kit._io import atomic_write, write_json
from k3kit.adapters.kimi_k3_hf import load_hf, save_hf
from k3kit.errors import K3Error
from k3kit.mini import chat_data, data, tokenizer
from k3kit.mini.corpus import build_corpus
from k3kit.mini.train import (
    HF_DIR,
    LOG_NAME,
    MANIFEST_NAME,
    SETTINGS_NAME,
    SUMMARY_NAME,
    balance_routers,
    evaluate,
    lm_loss,
    param_groups,
    tokenizer_config,
)
from k3kit.models.kimi_k3.kda import use_fast_kda
from k3kit.models.kimi_k3.moe import use_fast_moe
from k3kit.tokenizer.chat import ChatTemplate

HELDOUT_FROM = 1_000_000   # conversation indices from here on are the held-out chats


@dataclass
class ChatTuneSettings:
    minutes: float = 30.0
    steps: int | None = None       # fixes the schedule (and ignores `minutes`): what reproduces a run
    conversations: int = 20000     # training conversations (indices 0..n-1)
    chat_seq_len: int = 768
    chat_batch: int = 3
    code_every: int = 2            # chat steps per code step (the base run's batch and seq_len)
    lr: float = 1e-3
    prompt_weight: float = 0.1     # loss weight of chat tokens outside assistant messages (1 = all equal)
    warmup: int = 10
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_rate: float = 1e-2
    balance_coef: float = 0.01
    seed: int = 0
    threads: int = 1
    heldout_chats: int = 64
    eval_every: int = 25

    def validate(self) -> ChatTuneSettings:
        for name in ("minutes", "conversations", "chat_seq_len", "chat_batch", "code_every", "lr",
                     "threads", "heldout_chats", "eval_every"):
            if not getattr(self, name) > 0:
                raise K3Error(f"chat-tune settings: {name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.prompt_weight <= 1:
            raise K3Error(f"chat-tune settings: prompt_weight must be in [0, 1], got {self.prompt_weight}")
        return self


# An assistant message's text: what the model writes when served (from after its opener to its
# <|end_of_msg|>); the tokens inside weigh fully in the chat loss, the rest `prompt_weight`.
_ASSISTANT = re.compile(r'<\|open\|>message role="assistant"[^<]*<\|sep\|>(.*?<\|end_of_msg\|>)', re.S)


def chat_stream_weighted(tok: Tokenizer, template: ChatTemplate, facts: chat_data.Facts, indices: range,
                         prompt_weight: float = 1.0) -> tuple[Tensor, Tensor, list[int]]:
    """[BOS] conversation [EOS] for each index, concatenated; each token's loss weight as a
    prediction target (1 inside assistant messages, `prompt_weight` elsewhere); where each starts."""
    eos = tok.token_to_id(tokenizer.EOS)
    texts = [chat_data.render(chat_data.conversation(i, facts), template) for i in indices]
    parts, weights, starts, at = [], [], [], 0
    for text, enc in zip(texts, tok.encode_batch(texts), strict=True):   # [BOS] first, as served
        ids = np.asarray([*enc.ids, eos], dtype=np.int64)
        w = np.full(ids.size, prompt_weight, dtype=np.float32)
        spans = [m.span(1) for m in _ASSISTANT.finditer(text)]
        if spans and prompt_weight != 1.0:
            begin = np.asarray([o[0] for o in enc.offsets])
            end = np.asarray([o[1] for o in enc.offsets])
            for a, b in spans:
                w[:len(enc.ids)][(begin >= a) & (end <= b) & (end > begin)] = 1.0
        starts.append(at)
        at += ids.size
        parts.append(ids)
        weights.append(w)
    return torch.from_numpy(np.concatenate(parts)), torch.from_numpy(np.concatenate(weights)), starts


def chat_stream(tok: Tokenizer, template: ChatTemplate, facts: chat_data.Facts,
                indices: range) -> tuple[Tensor, list[int]]:
    """[BOS] conversation [EOS] for each index, concatenated, and where each one starts."""
    stream, _, starts = chat_stream_weighted(tok, template, facts, indices)
    return stream, starts


def chat_picks(stream: Tensor, starts: list[int], batch: int, seq_len: int, seed: int,
               step: int) -> list[int]:
    """Where `batch` windows of seq_len + 1 tokens start: each at a conversation's first token (so
    the tool declarations and the request are in view of the reply), running on into the next."""
    r = random.Random(f"{seed}:{step}")
    limit = stream.numel() - seq_len - 1
    picks = [s for s in (r.choice(starts) for _ in range(batch * 4)) if s <= limit][:batch]
    if len(picks) < batch:
        raise K3Error("chat stream too short for a batch of windows")
    return picks


def chat_windows(stream: Tensor, starts: list[int], seq_len: int) -> Tensor:
    limit = stream.numel() - seq_len - 1
    return torch.stack([stream[s:s + seq_len + 1] for s in starts if s <= limit])


def _lr(step: int, total: int, s: ChatTuneSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, (step - s.warmup) / max(1, total - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def chat_tune(base: str | Path, out_dir: str | Path, settings: ChatTuneSettings,
              log: Callable[[str], None] | None = None) -> dict:
    """Run the chat stage from the mini in `base` into `out_dir` (see the module docstring)."""
    s = settings.validate()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    base, out = Path(base), Path(out_dir)
    for name in (HF_DIR, LOG_NAME, SUMMARY_NAME, SETTINGS_NAME, MANIFEST_NAME):
        if not (base / name).exists():
            raise K3Error(f"{base / name}: missing (chat-tune starts from a shipped mini directory)")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    base_settings = json.loads((base / SETTINGS_NAME).read_text())
    base_summary = json.loads((base / SUMMARY_NAME).read_text())
    manifest = json.loads((base / MANIFEST_NAME).read_text())
    code = base_settings["settings"]

    tok = tokenizer.with_chat_tokens(Tokenizer.from_file(str(base / HF_DIR / "tokenizer.json")))
    template = ChatTemplate(tokenizer.CHAT_TEMPLATE, where="the mini's chat template")
    corpus = build_corpus(code.get("corpus_bytes"))
    facts = chat_data.Facts.from_sources(corpus.train_paths, corpus.train_docs)
    t0 = time.perf_counter()
    train_chat, train_weights, train_starts = chat_stream_weighted(
        tok, template, facts, range(s.conversations), s.prompt_weight)
    held_chat, held_starts = chat_stream(tok, template, facts,
                                         range(HELDOUT_FROM, HELDOUT_FROM + s.heldout_chats))
    code_stream = data.pack(tok, corpus.train_docs)
    held_code = data.heldout_windows(data.pack(tok, corpus.heldout_docs), code["seq_len"])
    held_chat_w = chat_windows(held_chat, held_starts, s.chat_seq_len)
    lengths = np.diff([*train_starts, train_chat.numel()])
    say(f"{s.conversations} conversations, {train_chat.numel()} tokens (median {int(np.median(lengths))}, "
        f"max {int(lengths.max())}) in {time.perf_counter() - t0:.1f} s")

    model = load_hf(base / HF_DIR).float()
    use_fast_kda(model)
    use_fast_moe(model)
    model.train()
    opt = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    code_nll0 = evaluate(model, held_code[:code["eval_windows"]])
    chat_nll0 = evaluate(model, held_chat_w, batch=4)
    say(f"before: held-out code ppl {math.exp(code_nll0):.2f} (first {code['eval_windows']} windows), "
        f"chat ppl {math.exp(chat_nll0):.2f}")

    base_rows = [json.loads(x) for x in (base / LOG_NAME).read_text().splitlines() if x.strip()]
    base_tokens, base_seconds = base_summary["tokens"], base_summary["seconds"]
    rows: list[dict] = []
    step, total, tokens, chat_tokens = 0, s.steps, 0, 0
    budget = s.minutes * 60 if s.steps is None else math.inf
    t_run = time.perf_counter()
    last_loss = float("nan")
    while total is None or step < total:
        elapsed = time.perf_counter() - t_run
        if elapsed >= budget:
            break
        if total is None and step == 12:
            total = max(step + 1, int(budget / (elapsed / step) * 0.97))
            say(f"{elapsed / step:.2f} s/step: schedule set to {total} steps")
        lr = _lr(step, total or 10 ** 9, s)
        for grp in opt.param_groups:
            grp["lr"] = lr
        is_code = (step + 1) % (s.code_every + 1) == 0
        if is_code:
            batch = data.train_batch(code_stream, code["batch"], code["seq_len"], s.seed + 7, step)
        else:
            picks = chat_picks(train_chat, train_starts, s.chat_batch, s.chat_seq_len, s.seed, step)
            batch = torch.stack([train_chat[p:p + s.chat_seq_len + 1] for p in picks])
            weights = torch.stack([train_weights[p + 1:p + s.chat_seq_len + 1] for p in picks])
            chat_tokens += batch[:, 1:].numel()
        loss, routes, objective = lm_loss(model, batch, routes=True, balance_coef=s.balance_coef,
                                          weights=None if is_code else weights)
        opt.zero_grad(set_to_none=True)
        objective.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip))
        opt.step()
        balance_routers(model, routes, s.bias_rate)
        step += 1
        tokens += batch[:, 1:].numel()
        last_loss = float(loss.detach())
        if step % 10 == 0 or step % s.eval_every == 0 or step == total:
            rec = {"step": base_summary["steps"] + step, "tokens": base_tokens + tokens,
                   "seconds": round(base_seconds + time.perf_counter() - t_run, 2), "loss": last_loss,
                   "lr": lr, "grad_norm": gnorm, "stage": "chat"}
            if step % s.eval_every == 0 or step == total:
                code_nll = evaluate(model, held_code[:code["eval_windows"]])
                chat_nll = evaluate(model, held_chat_w, batch=4)
                rec.update(heldout_nll=code_nll, heldout_ppl=math.exp(code_nll), chat_nll=chat_nll,
                           chat_ppl=math.exp(chat_nll))
                say(f"step {step}/{total or '?'} loss {last_loss:.3f} lr {lr:.2e} code ppl "
                    f"{math.exp(code_nll):.2f} chat ppl {math.exp(chat_nll):.3f} "
                    f"({time.perf_counter() - t_run:.0f} s)")
            rows.append(rec)
    seconds = time.perf_counter() - t_run
    held_all = data.heldout_windows(data.pack(tok, corpus.heldout_docs), code["seq_len"])
    code_nll = evaluate(model, held_all)
    chat_nll = evaluate(model, held_chat_w, batch=4)
    say(f"after {step} steps in {seconds / 60:.1f} min: held-out code ppl {math.exp(code_nll):.2f} "
        f"(all {held_all.shape[0]} windows), chat ppl {math.exp(chat_nll):.3f}")

    hf = out / HF_DIR
    if hf.exists():
        shutil.rmtree(hf)
    model.eval()
    save_hf(model, hf)
    atomic_write(hf / "tokenizer.json", lambda p: tok.save(str(p)))
    cfg = json.loads((base / HF_DIR / "config.json").read_text())
    write_json(hf / "tokenizer_config.json", tokenizer_config(tok, cfg.get("max_position_embeddings", 32768)))
    chat = {"settings": asdict(s), "steps": step, "tokens": tokens, "chat_tokens": chat_tokens,
            "seconds": seconds, "conversations": s.conversations,
            "conversation_tokens_median": int(np.median(lengths)),
            "heldout_chats": int(held_chat_w.shape[0]), "chat_nll_before": chat_nll0, "chat_nll": chat_nll,
            "code_nll_before_first_windows": code_nll0}
    atomic_write(out / LOG_NAME, "".join(json.dumps(r) + "\n" for r in [*base_rows, *rows]))
    write_json(out / SETTINGS_NAME, {**base_settings, "chat": chat["settings"]})
    write_json(out / MANIFEST_NAME, {**manifest, "tokenizer": tokenizer.tokenizer_manifest(tok)})
    summary = {**base_summary, "out_dir": str(out), "steps": base_summary["steps"] + step,
               "tokens": base_tokens + tokens, "seconds": base_seconds + seconds, "final_loss": last_loss,
               "heldout_nll": code_nll, "heldout_ppl": math.exp(code_nll),
               "base": {k: base_summary[k]
                        for k in ("steps", "tokens", "seconds", "heldout_nll", "heldout_ppl")},
               "chat": chat}
    write_json(out / SUMMARY_NAME, summary)
    say(f"saved {hf}")
    return summary
