"""One `k3kit bench` run end to end: check everything, measure, and build the results object."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from k3kit import __version__
from k3kit.bench import report, workloads
from k3kit.bench.bandwidth import copy_gbps
from k3kit.bench.config import Config, expand
from k3kit.bench.profile import RouteRecorder
from k3kit.errors import K3Error
from k3kit.gguf.shards import Model
from k3kit.plan.facts import open_model, read_facts
from k3kit.plan.profile import load_profile


@dataclass
class BenchOptions:
    model: Path
    base: Config
    draft: Path | None = None
    n_prompt: int = 512
    n_gen: int = 128
    reps: int = 5
    workload: str = "stdlib"
    sweeps: Sequence[str] = ()
    concurrency: Sequence[int] = ()
    llama_cpp: bool = False
    profile_out: Path | None = None
    pin_profile: Path | None = None
    device: str = "cpu"
    dtype_name: str = "f32"
    trunk: str | None = None
    expert_prefetch: str = "auto"
    arith: str = "auto"
    cold: bool | str = False                # the expert read path (--expert-io: False = page, "direct")
    cpu_moe: int = 0                        # --cpu-moe (-1) / --n-cpu-moe N
    prefill_chunk: int = 512
    feature_ring: str = "f16"
    draft_device: str | None = None
    serve_args: Sequence[str] = ()          # model/draft flags handed to `k3kit serve`
    stdlib_docs: Callable[[], Sequence[str]] = field(default=lambda: ())
    show_progress: bool = True

    def check(self) -> None:
        for flag, v, low in (("-p", self.n_prompt, 0), ("-n", self.n_gen, 0), ("-r", self.reps, 1),
                             ("--prefill-chunk", self.prefill_chunk, 1)):
            if v < low:
                raise K3Error(f"{flag} {v}: must be >= {low}")
        if self.n_prompt == 0 and self.n_gen == 0:
            raise K3Error("-p 0 -n 0: nothing to measure")
        if self.reps > 1000:
            raise K3Error(f"-r {self.reps}: at most 1000 repetitions")


def cpu_info() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_info(path: Path) -> dict[str, Any]:
    """llama-bench's model fields from the headers: filename, type, size, parameter count."""
    with open_model(path) as m:
        facts = read_facts(m)
        n_params = sum(t.n_elements for t in m.tensors.values())
        size = sum(t.nbytes for t in m.tensors.values())
        experts = {m.tensors[n].ggml_type.name for n in m.tensors if "_exps" in n}
    trunk = next((t for t in facts.trunk_by_type if t != "F32"), "F32")
    n = n_params
    label = next((f"{n / d:.1f}{u}" for u, d in (("T", 1e12), ("B", 1e9), ("M", 1e6)) if n >= d), str(n))
    return {"model_filename": str(path), "model_type": f"{facts.arch} {label} {trunk}"
            + (f" + {'/'.join(sorted(experts))} experts" if experts else ""),
            "model_size": size, "model_n_params": n_params, "n_layer": facts.n_layer,
            "n_experts": facts.n_experts, "experts_used": facts.experts_used, "name": facts.name}


class Progress:
    """A rich bar over every repetition of every configuration: configuration, prompt and ETA."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and sys.stderr.isatty()
        self._p: Any = None
        self._task: Any = None

    @contextmanager
    def running(self) -> Iterator[Progress]:
        if not self.enabled:
            yield self
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeRemainingColumn(), transient=True)
        with self._p:
            self._task = self._p.add_task("bench", total=self.total)
            yield self

    def __call__(self, config: str, what: str) -> None:
        if self._p is None:
            return
        advance = 1 if what.startswith(("prompt", "llama.cpp: prompt")) or " round " in what else 0
        self._p.update(self._task, description=f"[{config}] {what}", advance=advance)


def run_bench(o: BenchOptions, command: Sequence[str] = ()) -> dict[str, Any]:
    import torch

    from k3kit.bench import concurrency as conc
    from k3kit.bench.llama_cpp import find_llama_server, run_peer
    from k3kit.bench.runner import RunSpec, run_all
    from k3kit.runtime.loader import DTYPES, LoadOptions
    o.check()
    configs, keys = expand(o.base, o.sweeps, draft=o.draft is not None)
    labels = [c.label(keys) for c in configs]
    info = model_info(o.model)             # an unreadable model fails here, before any loading
    if o.draft is not None:
        with open_model(o.draft):
            pass
    pin_probs = None
    if o.pin_profile is not None:
        with Model.open(o.model) as m:
            pin_probs = dict(load_profile(o.pin_profile, read_facts(m)).probs)
    w = workloads.resolve(o.workload, o.stdlib_docs)
    if o.profile_out is not None and o.profile_out.is_dir():
        raise K3Error(f"{o.profile_out}: is a directory (--profile-experts takes a file name)")
    LoadOptions(device=o.device)            # a bad --device is an error before anything runs

    # the codec, for turning texts into prompts (the one the engine will use)
    from k3kit.tokenizer.codec import TextCodec
    with Model.open(o.model) as m:
        codec = TextCodec(m.kv, str(o.model))
        ctx_kv = m.kv.get(f"{m.arch}.context_length")
        n_ctx = int(ctx_kv.value) if ctx_kv is not None and isinstance(ctx_kv.value, int | float) else 0
    room = (n_ctx - o.n_gen - 1) if n_ctx else 1 << 30
    if o.n_prompt + o.n_gen + 1 > (n_ctx or 1 << 30):
        raise K3Error(f"{o.model}: -p {o.n_prompt} + -n {o.n_gen} tokens do not fit its context of {n_ctx}")
    prompts = workloads.fit(codec, w, o.n_prompt, o.reps, room)

    spec = RunSpec(model=o.model, draft=o.draft, n_prompt=o.n_prompt, n_gen=o.n_gen, reps=o.reps,
                   device=o.device, dtype=DTYPES[o.dtype_name], trunk=o.trunk, prefill_chunk=o.prefill_chunk,
                   expert_prefetch=o.expert_prefetch, arith=o.arith, cold=o.cold, cpu_moe=o.cpu_moe,
                   feature_ring=o.feature_ring, draft_device=o.draft_device, pin_probs=pin_probs,
                   pin_where=str(o.pin_profile) if o.pin_profile else "")
    recorder = RouteRecorder() if o.profile_out is not None else None
    threads = sorted({c.threads or torch.get_num_threads() for c in configs})
    llama_server = find_llama_server() if o.llama_cpp and o.concurrency else None
    if o.llama_cpp and o.concurrency and llama_server is None:
        print("k3kit bench: no llama-server binary (build one with `python benchmarks/llama_server.py` "
              "or set K3KIT_LLAMA_SERVER): the --concurrency rounds have no llama.cpp peer", file=sys.stderr)
    total = (len(configs) + (len(threads) if o.llama_cpp else 0)
             + len(o.concurrency) * (2 if llama_server else 1)) * o.reps
    started = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    t0 = time.perf_counter()
    bar = Progress(total, o.show_progress)
    peers = []
    rounds: list[Any] = []
    peer_rounds: list[Any] = []
    with bar.running():
        results, run_info = run_all(spec, configs, labels, prompts, recorder, bar)
        if o.concurrency:
            server = conc.Server(o.model, o.serve_args)
            try:
                rounds = conc.run_rounds(server, prompts, o.n_gen, o.concurrency, o.reps,
                                         lambda what: bar("serve", what))
            finally:
                server.close()
        if llama_server is not None:
            # llama.cpp's server on the same file, one slot per client of the largest round, each
            # slot with room for the longest prompt and the generated tokens
            slot_ctx = max(len(p) for p in prompts) + o.n_gen + 16
            peer = conc.LlamaServer(llama_server, o.model, max(o.concurrency), slot_ctx, max(threads))
            try:
                peer_rounds = conc.run_rounds(peer, prompts, o.n_gen, o.concurrency, o.reps,
                                              lambda what: bar("llama-server", what))
            finally:
                peer.close()
        if o.llama_cpp:
            for n in threads:
                def tick(what: str, n: int = n) -> None:
                    bar(f"threads={n}", what)
                peers.append(run_peer(o.model, prompts, o.n_gen, n, o.prefill_chunk, tick))
    profile = None
    if recorder is not None and o.profile_out is not None:
        p = recorder.write(o.model, o.profile_out)
        profile = {"path": str(o.profile_out), "tokens": p["tokens"], "layers": len(p["layers"])}

    common = {"build_commit": f"k3kit {__version__}", "cpu_info": cpu_info(), "gpu_info": "",
              "backends": "CUDA" if o.device.startswith("cuda") else "CPU",
              "model_filename": info["model_filename"], "model_type": info["model_type"],
              "model_size": info["model_size"], "model_n_params": info["model_n_params"],
              "n_batch": o.prefill_chunk, "n_threads": torch.get_num_threads(), "use_mmap": True}
    wname = w.name
    copy = copy_gbps(o.device.split(",")[0]) if o.n_gen > 0 else 0.0
    rows = report.k3kit_rows(results, common, wname, str(o.draft) if o.draft else None, o.n_prompt, o.n_gen,
                             copy_gbps=copy)
    prow = report.peer_rows(peers, common, wname, o.n_prompt, o.n_gen)
    report.add_ratios(rows, prow)
    crow = (report.concurrency_rows(rounds, common, o.n_gen)
            + report.concurrency_rows(peer_rounds, common, o.n_gen, engine="llama-server"))
    return {
        "format": "k3kit-bench", "version": 1, "k3kit_version": __version__, "command": list(command),
        "started": started, "seconds": time.perf_counter() - t0,
        "load_seconds": run_info.get("load_seconds", 0.0),
        "machine": {"cpu_info": common["cpu_info"], "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "copy_gbps": copy, "copy_device": o.device.split(",")[0]},
        "model": info, "draft": str(o.draft) if o.draft else None,
        "workload": w.to_dict() | {"prompts_used": len(prompts), "prompt_tokens": [len(p) for p in prompts]},
        "n_prompt": o.n_prompt, "n_gen": o.n_gen, "reps": o.reps,
        "sweep": {k: list(dict.fromkeys(c.to_dict()[k] for c in configs)) for k in keys},
        "configs": [{"label": lbl, "settings": c.to_dict(), "expert_kernel": r.expert_kernel,
                     "trunk": r.trunk, "pinned": r.pinned}
                    for lbl, c, r in zip(labels, configs, results, strict=True)],
        "rows": rows + prow + crow,
        "probes": report.probe_rows(results, wname),
        "profile": profile,
        "outputs": {"token_ids": [[s.token_ids for s in r.samples] for r in results],
                    "llama_cpp_token_ids": [p.token_ids for p in peers]},
    }


__all__ = ["BenchOptions", "run_bench"]
