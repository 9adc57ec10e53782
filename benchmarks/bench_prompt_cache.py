"""An agent workload with and without the prompt cache: time to first token and expert payload per turn.

    python benchmarks/bench_prompt_cache.py [--model GGUF] [--system-tokens 4000] [--exchanges 8]
        [--conversations 1,8] [--tool-tokens 300] [--reply-tokens 100] [--draft] [--interval N]
        [--expert-cache-mib M] [--off-exchanges all|LIST] [--think-s 1] [--ahead on|off]
        [--plot PNG] [--json]

Each conversation: a system prompt of about `--system-tokens` tokens (tool definitions and
instructions, text of the standard library), then `--exchanges` exchanges (turns of the
conversation), each adding a user message of about `--tool-tokens` tokens (a tool's output)
and the model's reply (up to `--reply-tokens`, greedy), sent back as the assistant message the
chat route answers with; the client then takes `--think-s` (a tool runs) before its next turn,
while the server prefills that turn's start (its prefill ahead, k3kit.serve.next_turn; `--ahead
off` leaves it out; the "ahead MB" column is the expert bytes it read). The conversations of one row run
together through one BatchScheduler (continuous batching, in process, no HTTP: what is
measured is the scheduler and the model). The same
workload runs with the cache off (`--prompt-cache-mib 0`) and on (default budget), alternating;
the table gives per turn the median TTFT over the conversations, the ratio off/on, the prompt
tokens restored and the expert bytes read from the file (the store's ledger) from the turn's
start until every conversation had its first token (the prefill's payload; the replies' decode
reads the same with the cache on or off). `--off-exchanges LIST` (exchange numbers) measures the
cache-off side of those exchanges only, replaying their prompts without a cache after the run
with it (where the whole cache-off workload would take hours: a K3-geometry slice with 8
conversations) and checking that the replayed exchanges' replies are the cached run's tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from k3kit.adapters.session import open_session
from k3kit.errors import K3Error
from k3kit.mini.paths import shipped_draft, shipped_gguf
from k3kit.runtime.loader import LoadOptions
from k3kit.runtime.sampling import Sampling
from k3kit.serve.api import ChatRequest
from k3kit.serve.batch import BatchScheduler
from k3kit.serve.next_turn import next_turn_ids
from k3kit.serve.prompt_cache import PromptCache, default_interval
from k3kit.serve.scheduler import FinishEvent, GenerationRequest, TokenEvent
from k3kit.serve.tool_parsers import ChatOutput, output_parser
from k3kit.serve.tools import ChatInputs, chat_inputs

SOURCES = ["json/__init__.py", "argparse.py", "pathlib.py", "textwrap.py", "shutil.py", "logging/__init__.py"]


def stdlib_text() -> str:
    import sysconfig
    lib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((lib / s).read_text(errors="replace") for s in SOURCES if (lib / s).exists())


def cut(codec, text: str, tokens: int, start: int = 0) -> str:
    ids = codec.encode(text[start:start + 8 * tokens], add_bos=False)[:tokens]
    return codec.decode_bytes(ids).decode(errors="replace")


class Conversation:
    """One client's conversation and its next prompt. With a chat template the messages are
    rendered and tokenized again every turn, as a client does, and each reply goes back as the
    assistant message the chat route answers with (its parser's content, tool calls and
    reasoning); the server's prefill ahead of the next turn (k3kit.serve.next_turn) is `ahead`. A
    synthetic file (random vocabulary, no template) keeps token ids instead: the reply's own
    tokens, then the next message's as plain "role: content" text (its random tokens' text would
    not tokenize back to them, and every turn would miss the cache where a real model's
    conversation hits it)."""

    def __init__(self, codec, system: str):
        self.codec = codec
        self.templated = True
        try:
            codec.chat.render([{"role": "system", "content": system}], add_generation_prompt=True)
        except K3Error:
            self.templated = False
        self.messages: list[dict] = [{"role": "system", "content": system}]
        self.ids: list[int] = [] if self.templated else list(codec.encode(f"system: {system}\n"))
        self.text = ""
        self.body: ChatRequest | None = None
        self.inputs: ChatInputs | None = None

    def ask(self, content: str) -> list[int]:
        """Add a user message; the prompt of the request that answers it."""
        self.messages.append({"role": "user", "content": content})
        if self.templated:            # as the chat route reads and renders the messages
            self.body = ChatRequest.model_validate({"messages": self.messages})
            self.inputs = inputs = chat_inputs(self.body, self.codec.chat.source)
            self.text = self.codec.chat.render(inputs.messages, add_generation_prompt=True,
                                               tools=inputs.tools, **inputs.variables)
            return list(self.codec.encode(self.text))
        self.ids += self.codec.encode(f"user: {content}\nassistant: ", add_bos=False)
        return list(self.ids)

    def parser(self):
        i = self.inputs
        if i is None:
            return None
        return output_parser(i.format, self.text, tools=i.tools, call_offset=i.call_offset)

    def request(self, prompt: tuple[int, ...], reply_tokens: int) -> GenerationRequest:
        """The request the chat route makes of the prompt (its format's markers shown to the parser)."""
        parser = self.parser()
        shown = self.codec.control_ids(parser.markers) if parser is not None else frozenset()
        return GenerationRequest(prompt, reply_tokens, Sampling(), shown=shown)

    def answer(self, text: str, tokens: list[int]) -> list[int]:
        """Add the model's reply (its text and the tokens that produced it); the tokens the server
        prefills ahead of the next turn ([]: none)."""
        if not self.templated:
            self.messages.append({"role": "assistant", "content": text})
            self.ids += tokens
            return []
        assert self.body is not None
        parser = self.parser()
        if parser is None:
            message = {"role": "assistant", "content": text}
        else:
            out = ChatOutput(parser)
            out.feed(text)
            out.finish()
            message = out.message()
        self.messages.append(message)
        return next_turn_ids(self.codec, self.body, message)


def run_turns(session, cache: PromptCache | None, args, n_conv: int, text: str,
              asked: list[tuple[list[tuple[int, ...]], list[list[int]]]] | None = None) -> list[dict]:
    """The workload through one scheduler; `asked`, when given, receives each turn's prompts and
    replies' token ids. With the cache, each reply's conversation is prefilled ahead (as the chat
    route does) during the client's `--think-s` before its next turn."""
    codec = session.codec
    sched = BatchScheduler(session.model, codec, loaded=session.target, max_batch=256, max_queue=64,
                           prompt_cache=cache, step_factory=args.step)
    system = cut(codec, text, args.system_tokens)
    convs = [Conversation(codec, system) for _ in range(n_conv)]
    rows = []
    ahead_bytes = 0
    try:
        for t in range(args.exchanges):
            asks = [cut(codec, text, args.tool_tokens, start=(1 + t * n_conv + i) * 4000)
                    for i in range(n_conv)]
            prompts = [tuple(c.ask(a)) for c, a in zip(convs, asks, strict=True)]
            reqs = [c.request(p, args.reply_tokens) for c, p in zip(convs, prompts, strict=True)]
            row, replies = measure(session, sched, reqs)
            rows.append({"turn": t + 1, **row, "ahead_bytes": ahead_bytes})
            if asked is not None:
                asked.append((prompts, [list(ids) for _, ids in replies]))
            before = session.target.stats().bytes_read
            for c, r, (reply, tokens) in zip(convs, reqs, replies, strict=True):
                ahead = c.answer(reply, tokens)
                if cache is not None and args.ahead and len(ahead) > len(r.prompt_ids):
                    sched.prefill_ahead(ahead, r)
            time.sleep(args.think_s)
            ahead_bytes = session.target.stats().bytes_read - before
    finally:
        sched.close()
    return rows


def measure(session, sched, reqs: list[GenerationRequest]) -> tuple[dict, list]:
    """One turn: every request submitted at once; median TTFT, cached tokens, the prefill's expert
    bytes (read until the last first token), and the replies (text, ids)."""
    prompts = [r.prompt_ids for r in reqs]
    before = session.target.stats().bytes_read
    firsts: list[int] = []          # expert bytes read when each first token came
    ttft, cached, replies = asyncio.run(_serve(sched, reqs, partial(_ledger, session, firsts)))
    row = {"prompt_tokens": statistics.median(len(p) for p in prompts), "ttft_s": statistics.median(ttft),
           "cached_tokens": statistics.median(cached), "expert_bytes": max(firsts, default=before) - before}
    return row, replies


def replay_off(session, args, asked: list[tuple[list[tuple[int, ...]], list[list[int]]]],
               turns: list[int]) -> tuple[list[dict], bool]:
    """The cache-off side of the chosen turns only: each turn's prompts (those of the run with the
    cache, which are the cache-off run's, since a cache hit changes no token) through a scheduler
    without a cache, each turn as the whole workload would meet it. Also whether the replies were
    the cached run's, token for token."""
    rows, same = [], True
    for t in turns:
        sched = BatchScheduler(session.model, session.codec, loaded=session.target, max_batch=256,
                               max_queue=64, prompt_cache=None, step_factory=args.step)
        try:
            prompts, cached_replies = asked[t - 1]
            row, replies = measure(session, sched, [GenerationRequest(p, args.reply_tokens, Sampling())
                                                    for p in prompts])
        finally:
            sched.close()
        rows.append({"turn": t, **row})
        same &= [list(ids) for _, ids in replies] == cached_replies
    return rows, same


def _ledger(session, into: list[int]) -> None:
    into.append(session.target.stats().bytes_read)


async def _serve(sched, reqs, on_first=lambda: None):
    t0 = time.perf_counter()
    with sched._cv:
        streams = [sched.submit(r) for r in reqs]

    async def one(stream):
        first, cached, toks, ids = None, 0, [], []
        async for ev in stream:
            if isinstance(ev, TokenEvent):
                if first is None:
                    first = time.perf_counter() - t0
                    on_first()
                toks.append(ev.text)
                ids += ev.tokens
            elif isinstance(ev, FinishEvent):
                cached = ev.cached_tokens
        return first or 0.0, cached, ("".join(toks), ids)
    out = await asyncio.gather(*[one(s) for s in streams])
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", action="store_true", help="serve with the shipped drafter (DSpark)")
    ap.add_argument("--system-tokens", type=int, default=4000)
    ap.add_argument("--exchanges", type=int, default=8, help="turns of each conversation")
    ap.add_argument("--tool-tokens", type=int, default=300)
    ap.add_argument("--reply-tokens", type=int, default=100)
    ap.add_argument("--conversations", default="1,8")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--interval", type=int, default=0,
                    help="tokens between recurrent copies (default: the server's, from the state size)")
    ap.add_argument("--expert-cache-mib", type=float, default=LoadOptions.expert_cache_mib,
                    help="the expert LRU's budget (a file larger than it streams experts every turn)")
    ap.add_argument("--off-exchanges", default="all",
                    help="turns measured with the cache off: 'all' runs the whole workload without it; a "
                         "list (2,8) replays only those turns' prompts without a cache, after the cached run")
    ap.add_argument("--think-s", type=float, default=1.0,
                    help="seconds each client takes between a reply and its next turn (a tool runs)")
    ap.add_argument("--ahead", choices=("on", "off"), default="on",
                    help="the server's prefill ahead of each conversation's next turn (with the cache)")
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.ahead = args.ahead == "on"
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = args.model or str(shipped_gguf())
    session = open_session(model, LoadOptions(expert_cache_mib=args.expert_cache_mib),
                           draft=shipped_draft() if args.draft else None)
    args.step = None
    if args.draft:
        from k3kit.runtime.speculative import SpeculativeDecoder
        stops = session.codec.stop_ids()
        args.step = lambda target, sampler: SpeculativeDecoder(target, session.draft_model, sampler.sampling,
                                                               sampler.generator, stop_ids=stops)
    m = session.model
    text = stdlib_text()
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
              "model": Path(model).name, "draft": args.draft, "rows": {}}
    for n in [int(x) for x in args.conversations.split(",")]:
        warm = argparse.Namespace(**{**vars(args), "exchanges": 1})
        run_turns(session, None, warm, min(n, 2), text)      # touch the weights and the expert cache first
        interval = args.interval or default_interval(m.recurrent_bytes, m.positional_row_bytes)
        same = None
        if args.off_exchanges == "all":
            off = run_turns(session, None, args, n, text)
            on = run_turns(session, PromptCache(2 << 30, interval), args, n, text)
        else:
            asked: list[tuple[list[tuple[int, ...]], list[list[int]]]] = []
            on = run_turns(session, PromptCache(2 << 30, interval), args, n, text, asked)
            off, same = replay_off(session, args, asked, [int(x) for x in args.off_exchanges.split(",")])
        result["rows"][n] = {"off": off, "on": on, "same_tokens": same}
        name = Path(model).name + (" + DSpark" if args.draft else "")
        print(f"\n{n} conversation(s), {name}: median per turn")
        print("| turn | prompt tokens | TTFT off (s) | TTFT on (s) | off/on | cached tokens | "
              "prefill expert MB off | on | ahead MB |")
        print("|---|---|---|---|---|---|---|---|---|")
        pairs = [(a, on[a["turn"] - 1]) for a in off]
        for a, b in pairs:
            print(f"| {a['turn']} | {a['prompt_tokens']:.0f} | {a['ttft_s']:.3f} | {b['ttft_s']:.3f} | "
                  f"{a['ttft_s'] / max(b['ttft_s'], 1e-9):.1f}x | {b['cached_tokens']:.0f} | "
                  f"{a['expert_bytes'] / 1e6:.1f} | {b['expert_bytes'] / 1e6:.1f} | "
                  f"{b['ahead_bytes'] / 1e6:.1f} |")
        later = [a["ttft_s"] / max(b["ttft_s"], 1e-9) for a, b in pairs if a["turn"] > 1]
        if later:
            print(f"exchanges {', '.join(str(a['turn']) for a, _ in pairs if a['turn'] > 1)}: "
                  f"TTFT off/on min {min(later):.1f}x, median {statistics.median(later):.1f}x")
        if same is not None:
            per_turn = ", ".join(f"{b['ttft_s']:.3f}" for b in on)
            print(f"with the cache on: TTFT per turn {per_turn} s; "
                  f"replayed turns' replies the same tokens as with the cache: {same}")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for n, r in result["rows"].items():
            for key, style in (("off", "--"), ("on", "-")):
                ax.plot([x["turn"] for x in r[key]], [x["ttft_s"] for x in r[key]], style, marker="o",
                        label=f"{n} conv., cache {key}")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (s, median)")
        ax.set_yscale("log")
        ax.set_title(f"Prompt cache, agent workload ({Path(model).name})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
    if args.json:
        print(json.dumps(result))
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
