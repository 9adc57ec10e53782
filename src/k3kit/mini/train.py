"""Train the mini K3: every K3 feature at toy width, on the CPython stdlib, on a CPU, in minutes.

What a run does (all deterministic given the seed and thread count):
* builds the corpus (k3kit.mini.corpus) and trains the 4096-token BPE (k3kit.mini.tokenizer) on
  the train split; packs both splits into token streams (k3kit.mini.data);
* builds the reference K3Model (k3kit.models.kimi_k3) and switches its KDA and MoE modules to
  the training-speed paths of fast_kda.py / fast_moe.py (same numbers, chunked and batched);
* AdamW with linear warmup and cosine decay, gradient clipping; the routed experts train
  quantization-aware: the forward pass sees them rounded to MXFP4 (straight-through gradient),
  so the MXFP4 checkpoint written at the end is exactly the model that was evaluated;
* load balancing without an auxiliary loss (DeepSeek-V3 / Kimi-K2 style): after each step every
  MoE layer's selection bias moves by `bias_rate` towards under-loaded experts (sign of the
  load gap); the bias only picks experts, it never weighs them;
* held-out perplexity every `eval_every` steps on a fixed slice, and on the whole held-out split
  at the end; one JSON line per logged step in train_log.jsonl;
* saves <out>/hf (config.json, model.safetensors, tokenizer.json, tokenizer_config.json),
  settings, corpus manifest and summary.json; <out>/checkpoint.pt allows `resume`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from k3kit._io import atomic_write, write_json
from k3kit.adapters.kimi_k3_hf import save_hf
from k3kit.errors import K3Error
from k3kit.mini import data, tokenizer
from k3kit.mini.corpus import build_corpus
from k3kit.models.kimi_k3.config import KDA, MLA, K3ModelConfig
from k3kit.models.kimi_k3.kda import KDA as KDAModule
from k3kit.models.kimi_k3.kda import use_fast_kda
from k3kit.models.kimi_k3.model import K3Model
from k3kit.models.kimi_k3.moe import LatentMoE, use_fast_moe

LOG_NAME = "train_log.jsonl"
SETTINGS_NAME = "train_settings.json"
SUMMARY_NAME = "summary.json"
MANIFEST_NAME = "corpus_manifest.json"
CHECKPOINT_NAME = "checkpoint.pt"
HF_DIR = "hf"
# The context the mini declares (config, tokenizer, GGUF). K3's MLA is NoPE and KDA is recurrent, so
# no position is out of range; this is the budget a sequence may use (multi-turn chats with a long
# system prompt fit), not a trained length: training windows are `seq_len` (256).
CONTEXT_LENGTH = 32768


def mini_config(vocab_size: int = tokenizer.DEFAULT_VOCAB_SIZE, **overrides) -> K3ModelConfig:
    """The shipped mini K3: 6 layers (MLA at layers 4 and 6, 1-indexed: every 4th and the last),
    a dense first layer, 32 latent experts (latent 128, FFN 64) top-4 with one shared expert,
    attn-res block 3, 2 heads (KDA head_dim 64; MLA nope 32 + pe 32, v 64, q/kv lora 128).

    Sized for ~40 min on a shared 2-core CPU (~300 tok/s measured under load): fewer parameters,
    more tokens. Widths that feed Q8_0/MXFP4 weights are multiples of 32; hidden 256 and the
    dense FFN (512) are multiples of 256 so the biggest trunk matrices can be requantized to Q4_K.
    """
    base: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=256, layer_kinds=[KDA, KDA, KDA, MLA, KDA, MLA],
        num_heads=2, max_position_embeddings=CONTEXT_LENGTH, rms_norm_eps=1e-5,
        kda_head_dim=64, conv_kernel=4, gate_lower_bound=-5.0,
        q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
        mla_output_gate=True, intermediate_size=512, first_k_dense=1,
        num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64, expert_latent_size=128,
        routed_expert_norm=True, num_shared_experts=1, routed_scaling_factor=1.0, moe_renormalize=True,
        experts_mxfp4=True, attn_res_block_size=3, situ_beta=4.0, situ_linear_beta=25.0,
    )
    base.update(overrides)
    return K3ModelConfig(**base).validate("mini_config")


@dataclass
class TrainSettings:
    seq_len: int = 256
    batch: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    steps: int | None = None          # None: sized from `minutes` after the first steps
    minutes: float | None = None      # wall-clock budget; the run stops (and saves) when it is spent
    seed: int = 0
    eval_every: int = 25
    eval_windows: int = 16            # periodic eval: the first N held-out windows
    bias_rate: float = 1e-2           # router selection-bias step (aux-loss-free balancing; DeepSeek-V3
                                      # uses 1e-3 over far more steps than a 40-minute run takes)
    balance_coef: float = 0.01        # small auxiliary balance loss (see fast_moe.balance_loss)
    threads: int = 1                  # 2 OpenMP threads on 2 shared cores ran 7x slower (spinning)
    vocab_size: int = tokenizer.DEFAULT_VOCAB_SIZE
    corpus_bytes: int | None = None   # cap on the corpus (tests); None: the whole stdlib
    checkpoint_every: int = 50
    stop_at: int | None = None        # end early after this step (checkpointed): a run to `resume`
    log_every: int = 10

    def validate(self) -> TrainSettings:
        for name in ("seq_len", "batch", "eval_every", "eval_windows", "threads", "checkpoint_every",
                     "log_every"):
            if getattr(self, name) <= 0:
                raise K3Error(f"train settings: {name} must be positive, got {getattr(self, name)}")
        if self.steps is None and self.minutes is None:
            raise K3Error("train settings: give --steps or --minutes (or both)")
        if self.steps is not None and self.steps <= 0:
            raise K3Error(f"train settings: steps must be positive, got {self.steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise K3Error(f"train settings: minutes must be positive, got {self.minutes}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup >= 0):
            raise K3Error("train settings: need lr > 0, 0 <= min_lr_ratio <= 1, warmup >= 0")
        return self


def lr_at(step: int, total: int, s: TrainSettings) -> float:
    """Linear warmup to `lr`, then cosine down to lr * min_lr_ratio at `total`."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, (step - s.warmup) / max(1, total - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def init_weights(model: K3Model, seed: int) -> K3Model:
    """GPT-style init for training (k3kit's init_random is for numerics tests, not learning).

    Matrices N(0, 0.02), residual-branch outputs scaled by 1/sqrt(2 * layers); norms 1; attn-res
    scores 0 (a uniform mix); KDA decays spread log-uniformly over [1e-3, 0.5] per step at init
    (memories from ~2 to ~1000 tokens), depthwise convs near identity on the newest input.
    """
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    out_std = 0.02 / math.sqrt(2 * cfg.num_layers)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dim() == 1 and leaf in ("attn_norm", "ffn_norm", "norm", "o_norm", "q_a_norm", "kv_a_norm",
                                     "routed_norm"):
            p.fill_(1.0)
        elif leaf.endswith("res_score") or leaf == "bias":
            p.zero_()
        elif leaf in ("q_conv", "k_conv", "v_conv"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            p[:, -1] += 1.0            # the last tap multiplies the current input
        elif leaf == "A_log":
            p.zero_()
        elif leaf == "dt_bias":
            # g = lb * sigmoid(exp(A_log) * (u + dt_bias)); with u ~ 0, A_log = 0 pick dt_bias for g
            lb = abs(cfg.gate_lower_bound or 5.0)
            target = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(0.5), generator=g))
            p.copy_(torch.logit(target / lb))
        elif leaf in ("gate_exps", "up_exps"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        elif leaf == "down_exps":
            p.copy_(torch.randn(p.shape, generator=g) * out_std)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "routed_up.weight")):
            p.copy_(torch.randn(p.shape, generator=g) * out_std)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def build_model(cfg: K3ModelConfig, seed: int) -> K3Model:
    """The reference model with the training-speed KDA and MoE paths switched on."""
    torch.manual_seed(seed)
    model = init_weights(K3Model(cfg), seed)
    use_fast_kda(model)
    use_fast_moe(model)
    return model


def lm_loss(model: K3Model, batch: Tensor, routes: bool = False, balance_coef: float = 0.0,
            weights: Tensor | None = None):
    """(next-token cross-entropy, routes, the training objective: CE + balance_coef * mean balance term).
    `weights` [B, T] (one per predicted token, batch[:, 1:]) makes the CE a weighted mean."""
    out = model(batch[:, :-1], return_routes=routes)
    logits = out.logits
    if weights is None:
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    else:
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none")
        w = weights.reshape(-1).to(ce.dtype)
        loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    terms: list[Tensor] = [
        t for m in model.modules()
        if isinstance(m, LatentMoE) and (t := getattr(m, "balance_loss", None)) is not None]
    objective = loss + balance_coef * torch.stack(terms).mean() if terms and balance_coef else loss
    return loss, out.routes, objective


@torch.no_grad()
def evaluate(model: K3Model, windows: Tensor, batch: int = 8) -> float:
    """Mean next-token negative log-likelihood (nats) over `windows` [n, seq_len + 1]."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch]
        logits = model(w[:, :-1]).logits
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                       reduction="sum"))
        count += w[:, 1:].numel()
    model.train(was)
    return total / count


@torch.no_grad()
def balance_routers(model: K3Model, routes: dict[int, Tensor], rate: float) -> dict[int, float]:
    """Aux-loss-free balancing: bias_e += rate * sign(mean load - load_e). Returns, per MoE layer,
    the max/mean load ratio of this step (1.0 = perfectly balanced)."""
    imbalance = {}
    for il, ids in routes.items():
        moe = model.layers[il].ffn
        assert isinstance(moe, LatentMoE)
        load = torch.bincount(ids.reshape(-1), minlength=moe.cfg.num_experts).float()
        moe.router.bias.add_(rate * torch.sign(load.mean() - load))  # in place, as `+=` on a Parameter
        imbalance[il] = float(load.max() / load.mean())
    return imbalance


def param_groups(model: K3Model, weight_decay: float) -> list[dict]:
    """Decay matrices (and the expert stacks); leave norms, scores, decays and convs alone."""
    decay: list[Tensor] = []
    no_decay: list[Tensor] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and not name.endswith(("_conv",)) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def tokenizer_config(tok, context_length: int = CONTEXT_LENGTH) -> dict:
    """tokenizer_config.json: the special tokens and chat template, as HF and the converter read them;
    model_max_length is the model's context."""
    ids = tokenizer.special_token_ids(tok)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.BOS,
        "eos_token": tokenizer.EOS,
        "pad_token": tokenizer.PAD,
        "mask_token": tokenizer.MASK,
        "additional_special_tokens": list(tokenizer.CHAT_TOKENS),
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": context_length,
        "chat_template": tokenizer.CHAT_TEMPLATE,
        "special_token_ids": ids,
    }


@dataclass
class TrainResult:
    out_dir: Path
    steps: int
    tokens: int
    seconds: float
    final_loss: float
    heldout_nll: float
    heldout_ppl: float
    unigram_ppl: float
    params: int
    active_params: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d


def count_params(model: K3Model) -> tuple[int, int]:
    """(all parameters, parameters one token uses: experts counted top-k of E)."""
    cfg = model.cfg
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if name.endswith(("gate_exps", "up_exps", "down_exps")):
            active += p.numel() * cfg.num_experts_per_tok // cfg.num_experts
        else:
            active += p.numel()
    return total, active


def train(out_dir: str | Path, settings: TrainSettings, model_cfg: K3ModelConfig | None = None, *,
          resume: bool = False, log: Callable[[str], None] | None = None) -> TrainResult:
    """Run one training job into `out_dir` (see the module docstring)."""
    s = settings.validate()
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise K3Error(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / CHECKPOINT_NAME
    if resume and not ckpt_path.is_file():
        raise K3Error(f"{ckpt_path}: no checkpoint to resume from")
    torch.set_num_threads(s.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t_start = time.perf_counter()

    corpus = build_corpus(s.corpus_bytes)
    tok = tokenizer.train_tokenizer(corpus.train_docs, s.vocab_size)
    train_stream = data.pack(tok, corpus.train_docs)
    held_stream = data.pack(tok, corpus.heldout_docs)
    ids = tokenizer.special_token_ids(tok)
    say(f"corpus: {corpus.manifest['train']['files']} train files ({train_stream.numel()} tokens), "
        f"{corpus.manifest['heldout']['files']} held-out files ({held_stream.numel()} tokens); "
        f"tokenizer {s.vocab_size} tokens in {time.perf_counter() - t_start:.1f} s")

    cfg = model_cfg or mini_config(s.vocab_size)
    if cfg.vocab_size != s.vocab_size:
        raise K3Error(f"model vocab_size {cfg.vocab_size} differs from the tokenizer's {s.vocab_size}")
    cfg.bos_token_id, cfg.eos_token_id = ids["bos"], ids["eos"]
    if s.seq_len > cfg.max_position_embeddings:
        raise K3Error(f"seq_len {s.seq_len} exceeds the model context {cfg.max_position_embeddings}")
    model = build_model(cfg, s.seed)
    n_params, n_active = count_params(model)
    opt = torch.optim.AdamW(param_groups(model, s.weight_decay), lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    held_all = data.heldout_windows(held_stream, s.seq_len)
    held_eval = held_all[:s.eval_windows]
    unigram = data.unigram_perplexity(train_stream, held_all[:, 1:].reshape(-1), cfg.vocab_size)

    step, total_steps, tokens_seen, spent = 0, s.steps, 0, 0.0
    log_path = out / LOG_NAME
    if resume:
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, total_steps, tokens_seen, spent = ck["step"], ck["total_steps"], ck["tokens"], ck["seconds"]
        _truncate_log(log_path, step)
        say(f"resumed at step {step} of {total_steps}")
    else:
        log_path.write_text("")
        write_json(out / SETTINGS_NAME, {"settings": asdict(s), "model": cfg.to_dict(), "params": n_params,
                                         "active_params": n_active})
        write_json(out / MANIFEST_NAME,
                   {**corpus.manifest, "tokenizer": tokenizer.tokenizer_manifest(tok),
                    "train_tokens": train_stream.numel(), "heldout_tokens": held_stream.numel()})
    say(f"model: {n_params / 1e6:.2f} M parameters ({n_active / 1e6:.2f} M active per token); "
        f"unigram held-out perplexity {unigram:.1f}")

    model.train()
    t_run = time.perf_counter() - spent
    budget = s.minutes * 60 if s.minutes is not None else None
    last_loss, last_eval, imbalance = float("nan"), None, 1.0
    with log_path.open("a", encoding="utf-8") as logf:
        if step == 0:
            nll = evaluate(model, held_eval)
            logf.write(json.dumps({"step": 0, "tokens": 0, "seconds": 0.0, "heldout_nll": nll,
                                   "heldout_ppl": math.exp(nll)}) + "\n")
        while total_steps is None or step < total_steps:
            elapsed = time.perf_counter() - t_run
            if budget is not None and elapsed >= budget:
                say(f"time budget of {s.minutes} min spent at step {step}")
                break
            if s.stop_at is not None and step >= s.stop_at:
                break
            if total_steps is None and step == 20:
                # size the schedule from the measured speed (eval passes cost ~ one step per window / 4)
                assert budget is not None  # validate(): no steps means minutes are given
                per_step = elapsed / step
                n_evals = budget / per_step / s.eval_every
                eval_cost = n_evals * per_step * s.eval_windows / 8
                total_steps = max(step + 1, int((budget - eval_cost) / per_step))
                say(f"{per_step:.2f} s/step: schedule set to {total_steps} steps")
            sched_total = total_steps if total_steps is not None else 10 ** 9
            lr = lr_at(step, sched_total, s)
            for grp in opt.param_groups:
                grp["lr"] = lr
            batch = data.train_batch(train_stream, s.batch, s.seq_len, s.seed, step)
            loss, routes, objective = lm_loss(model, batch, routes=True, balance_coef=s.balance_coef)
            opt.zero_grad(set_to_none=True)
            objective.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip))
            opt.step()
            imb = balance_routers(model, routes, s.bias_rate)
            imbalance = max(imb.values()) if imb else 1.0
            step += 1
            tokens_seen += batch[:, 1:].numel()
            last_loss = float(loss.detach())
            rec = None
            if step % s.log_every == 0 or step == total_steps:
                el = time.perf_counter() - t_run
                rec = {"step": step, "tokens": tokens_seen, "seconds": round(el, 2), "loss": last_loss,
                       "lr": lr, "grad_norm": gnorm, "max_load_ratio": imbalance}
            if step % s.eval_every == 0 or step == total_steps:
                last_eval = evaluate(model, held_eval)
                rec = rec or {"step": step, "tokens": tokens_seen,
                              "seconds": round(time.perf_counter() - t_run, 2)}
                rec.update(heldout_nll=last_eval, heldout_ppl=math.exp(last_eval))
            if rec is not None:
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                el = time.perf_counter() - t_run
                tps = tokens_seen / max(el, 1e-9)
                eta = ""
                if total_steps:
                    eta = f" eta {(total_steps - step) * el / step / 60:.1f} min"
                ppl = f" held-out ppl {math.exp(last_eval):.2f}" if last_eval is not None else ""
                say(f"step {step}/{total_steps or '?'} loss {last_loss:.3f} lr {lr:.2e} "
                    f"{tps:.0f} tok/s max-load {imbalance:.2f}{ppl}{eta}")
            if step % s.checkpoint_every == 0 or step == s.stop_at:
                atomic_write(ckpt_path, partial(torch.save, {
                    "model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "total_steps": total_steps, "tokens": tokens_seen,
                    "seconds": time.perf_counter() - t_run}))

    seconds = time.perf_counter() - t_run
    nll = evaluate(model, held_all)
    say(f"held-out ({held_all.shape[0]} windows of {s.seq_len}): nll {nll:.4f}, "
        f"perplexity {math.exp(nll):.2f} "
        f"(unigram {unigram:.1f})")

    hf = out / HF_DIR
    save_hf(model, hf)
    atomic_write(hf / "tokenizer.json", lambda p: tok.save(str(p)))
    write_json(hf / "tokenizer_config.json", tokenizer_config(tok, cfg.max_position_embeddings))
    result = TrainResult(out, step, tokens_seen, seconds, last_loss, nll, math.exp(nll), unigram,
                         n_params, n_active)
    write_json(out / SUMMARY_NAME,
               {**result.to_dict(), "schedule_steps": total_steps, "heldout_windows": held_all.shape[0],
                "seq_len": s.seq_len,
                "heldout_tokens_scored": held_all[:, 1:].numel(), "kda_modules": _count(model, KDAModule),
                "moe_modules": _count(model, LatentMoE)})
    say(f"saved {hf}")
    return result


def _count(model: torch.nn.Module, cls: type) -> int:
    return sum(isinstance(m, cls) for m in model.modules())


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines past a resumed checkpoint's step (they will be written again)."""
    if not path.is_file():
        return
    keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
    atomic_write(path, "".join(ln + "\n" for ln in keep))


def settings_from_dict(d: dict) -> TrainSettings:
    names = {f.name for f in fields(TrainSettings)}
    return TrainSettings(**{k: v for k, v in d.items() if k in names})
