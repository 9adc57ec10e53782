"""What a decode step costs on the host: aten ops, host syncs and host microseconds per layer.

On a small model (and on a GPU for any model) a decode step's time is mostly Python and torch's
dispatcher, not arithmetic: every aten op costs a few microseconds of host work, and every read
of a tensor's value on the host (`.item()`, `bool(t)`, `int(t)`, `.tolist()`) stalls a GPU
stream until the device has caught up. This module measures both for any callable step, on any
machine:

* ops: every aten op the step dispatches, counted by a `TorchDispatchMode` (`OpCounter`), by
  name (`aten.mul`, `aten.view`, ...). The native kernels (k3kit.kernels' `_qmatmul`, `_kda`,
  `_fused`) are called with buffers or addresses and are not aten ops: they are counted apart
  (`native_calls`).
* syncs: `aten._local_scalar_dense` (what `.item()`, `bool()`, `int()`, `float()` of a tensor
  dispatch) plus `Tensor.tolist()` calls. `tolist()` on a CPU tensor dispatches nothing at all
  (it reads the memory directly), and on a device tensor one `_to_copy` to the CPU, never a
  `_local_scalar_dense` per element; it is counted by wrapping `Tensor.tolist` while counting.
  On the CPU none of these is a real sync (there is no stream to wait for); they are counted
  because each is one on a device.
* d2h: copies from a non-CPU device to the CPU (`aten._to_copy` / `aten.copy_` whose source is
  not on the CPU and whose result is): zero on a CPU-only run.
* host time: the step's wall time minus the time spent inside matrix products: the native
  kernels' calls (timed by wrapping the extension modules' functions, a fraction of a
  microsecond each) and the aten matrix products (`COMPUTE_OPS`: mm, bmm, mv, addmm, ...; timed
  inside a counting run, where the dispatch mode's own overhead sits outside the timed call).
  What is left is Python, the dispatcher and the elementwise / view / copy ops, which on a decode
  row are dispatcher-bound; it is measured in runs without the dispatch mode, so the counter's
  overhead is not in it. With one torch thread every time is the calling thread's CPU time
  (`time.thread_time`: the kernels run on that thread, and a busy machine's waits are not
  counted); with more, wall time (`time.perf_counter`).

`profile(fn, ...)` runs a step callable under both; `Recorder` wraps the named phases of a
longer loop (an AR step, a DSpark draft step, a verify pass) so that one generation measures all
three (`host_profile`, what `k3kit bench --host-profile` prints), with, for a model that batches
sequences, a server's pass of one decoding sequence (`forward_batch`, the serving arithmetic).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3kit.runtime.protocols import BatchedModel

# aten ops whose time is arithmetic, not host overhead (their time is subtracted from the wall)
COMPUTE_OPS = frozenset({"mm", "bmm", "mv", "addmm", "addmv", "baddbmm", "addbmm", "dot", "vdot",
                         "_weight_int8pack_mm", "convolution", "_int_mm"})
SYNC_OPS = frozenset({"_local_scalar_dense", "item"})


def clock() -> Callable[[], float]:
    """The clock of a measurement: the thread's CPU time with one torch thread, else wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
COPY_OPS = frozenset({"_to_copy", "copy_", "to"})


def _packet(func: Any) -> str:
    """`aten.mul.Tensor` -> "mul"."""
    packet = getattr(func, "overloadpacket", None)
    return str(getattr(packet, "__name__", func)).split(".")[-1]


def _device_of(x: Any) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class OpCounter(TorchDispatchMode):
    """Counts aten ops, host syncs and device->host copies; times the matrix products.

    `where`: an op name whose Python call sites to record (`sites`, "file:line" -> count), to
    find which line dispatches e.g. the `detach`es of a step ("*": every op)."""

    def __init__(self, where: str | None = None):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs = 0
        self.d2h = 0
        self.compute_seconds = 0.0
        self.where = where
        self.sites: Counter[str] = Counter()
        self.clock = clock()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _packet(func)
        self.ops[name] += 1
        if name in SYNC_OPS:
            self.syncs += 1
        if self.where is not None and (self.where == "*" or name == self.where):
            self.sites[_caller()] += 1
        if name in COMPUTE_OPS:
            t0 = self.clock()
            out = func(*args, **kwargs)
            self.compute_seconds += self.clock() - t0
            return out
        out = func(*args, **kwargs)
        if name in COPY_OPS:
            src = _device_of(args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None)
            dst = _device_of(out)
            if src is not None and dst is not None and src.type != "cpu" and dst.type == "cpu":
                self.d2h += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _caller() -> str:
    """The innermost k3kit frame of the current Python stack ("module.py:line")."""
    import traceback
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "k3kit" in fr.filename and "bench/host.py" not in fr.filename:
            return f"{fr.filename.rsplit('k3kit/', 1)[-1]}:{fr.lineno}"
    return "?"


class _TimedModule:
    """A stand-in for a native extension module: every function call timed into `clock`."""

    def __init__(self, mod: ModuleType, clock: _Clock):
        self._mod, self._clock = mod, clock

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._mod, name)
        if not callable(attr):
            return attr
        acc = self._clock
        now = acc.now

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = now()
            try:
                return attr(*args, **kwargs)
            finally:
                acc.seconds += now() - t0
                acc.calls += 1
        return timed


@dataclass
class _Clock:
    seconds: float = 0.0
    calls: int = 0
    now: Callable[[], float] = time.perf_counter


# (module, attribute) pairs: where the native extensions are called from
_NATIVE_CALLERS = (("k3kit.kernels.qmatmul", "_qmatmul"), ("k3kit.kernels.kda_step", "_kda"),
                   ("k3kit.kernels.fused", "_fused"), ("k3kit.layers.quantized_linear", "_qmatmul"),
                   ("k3kit.kernels.attn", "_attn"))


@contextmanager
def native_clock() -> Iterator[_Clock]:
    """Time every call into the native kernels (`_qmatmul`, `_kda`, `_fused`, `_attn`) while
    inside. The modules that call them are found among those loaded (a model has loaded them;
    bench never imports kernels)."""
    acc = _Clock(now=clock())
    callers = ((sys.modules.get(name), attr) for name, attr in _NATIVE_CALLERS)
    saved = [(m, m.__dict__.get(attr), attr) for m, attr in callers if m is not None]
    try:
        for m, ext, attr in saved:
            if ext is not None:
                setattr(m, attr, _TimedModule(ext, acc))
        yield acc
    finally:
        for m, ext, attr in saved:
            setattr(m, attr, ext)


@contextmanager
def counting(where: str | None = None) -> Iterator[OpCounter]:
    """Count the aten ops, syncs and copies of what runs inside (and `Tensor.tolist` calls)."""
    counter = OpCounter(where)
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counter.syncs += 1
        counter.ops["tolist"] += 1
        if self.device.type != "cpu":
            counter.d2h += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


@dataclass
class PhaseProfile:
    """One phase's figures, per call (a decode step, a draft step, a verify pass)."""

    name: str
    layers: int                 # the layers one call runs (the per-layer figures divide by it)
    calls: int = 0              # calls timed (and, as many, counted)
    wall_us: float = 0.0        # per call
    native_us: float = 0.0      # per call, inside the native kernels
    compute_us: float = 0.0     # per call, inside aten matrix products
    ops: float = 0.0            # aten ops per call (tolist calls included)
    native_calls: float = 0.0   # native kernel calls per call
    syncs: float = 0.0          # per call
    d2h: float = 0.0            # per call
    top: dict[str, float] = field(default_factory=dict)   # the most frequent ops, per call

    @property
    def host_us(self) -> float:
        return max(self.wall_us - self.native_us - self.compute_us, 0.0)

    @property
    def host_us_per_layer(self) -> float:
        return self.host_us / max(self.layers, 1)

    @property
    def ops_per_layer(self) -> float:
        return self.ops / max(self.layers, 1)

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.name, "layers": self.layers, "calls": self.calls,
                "wall_us": round(self.wall_us, 1), "native_us": round(self.native_us, 1),
                "compute_us": round(self.compute_us, 1), "host_us": round(self.host_us, 1),
                "host_us_per_layer": round(self.host_us_per_layer, 1), "ops": round(self.ops, 1),
                "ops_per_layer": round(self.ops_per_layer, 1), "native_calls": round(self.native_calls, 1),
                "syncs": round(self.syncs, 2), "d2h": round(self.d2h, 2),
                "top_ops": {k: round(v, 1) for k, v in self.top.items()}}


class Recorder:
    """Wraps the callables of named phases; each call is timed (`counting` False) or counted
    (`counting` True) into its phase. Run the same loop once each way."""

    def __init__(self, layers: dict[str, int], where: str | None = None):
        self.phases = {name: PhaseProfile(name, n) for name, n in layers.items()}
        self.counting = False
        self.where = where
        self.sites: Counter[str] = Counter()
        self._timed: Counter[str] = Counter()
        self._counted: Counter[str] = Counter()
        self._ops: dict[str, Counter[str]] = {name: Counter() for name in layers}
        self._active = False
        self.recording = True         # False: a warm-up run, nothing recorded

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._active or not self.recording:   # a phase inside a phase counts once, in the outer one
                return fn(*args, **kwargs)
            self._active = True
            try:
                return self._run(name, fn, args, kwargs)
            finally:
                self._active = False
        return run

    def _run(self, name: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        p = self.phases[name]
        if self.counting:
            with counting(self.where) as c, native_clock() as nc:
                out = fn(*args, **kwargs)
            self._counted[name] += 1
            p.compute_us += c.compute_seconds * 1e6
            self._ops[name].update(c.ops)
            p.syncs += c.syncs
            p.d2h += c.d2h
            p.native_calls += nc.calls
            self.sites.update(c.sites)
            return out
        with native_clock() as nc:
            now = nc.now
            t0 = now()
            out = fn(*args, **kwargs)
            wall = now() - t0
        self._timed[name] += 1
        p.wall_us += wall * 1e6
        p.native_us += nc.seconds * 1e6
        return out

    def result(self) -> list[PhaseProfile]:
        """Per-call means of every phase that ran."""
        out = []
        for name, p in self.phases.items():
            n_t, n_c = self._timed[name], self._counted[name]
            if not n_t and not n_c:
                continue
            ops = self._ops[name]
            q = PhaseProfile(name, p.layers, calls=n_t)
            if n_t:
                q.wall_us, q.native_us = p.wall_us / n_t, p.native_us / n_t
            if n_c:
                q.compute_us = p.compute_us / n_c
                q.ops = sum(ops.values()) / n_c
                q.syncs, q.d2h, q.native_calls = p.syncs / n_c, p.d2h / n_c, p.native_calls / n_c
                q.top = {k: v / n_c for k, v in ops.most_common(12)}
            out.append(q)
        return out


def profile(fn: Callable[[], Any], layers: int, *, calls: int = 16, warmup: int = 2, name: str = "step",
            where: str | None = None) -> PhaseProfile:
    """Time `calls` calls of `fn` (after `warmup`), then count `calls` more."""
    rec = Recorder({name: layers}, where)
    step = rec.wrap(name, fn)
    for _ in range(warmup):
        fn()
    for counted in (False, True):
        rec.counting = counted
        for _ in range(calls):
            step()
    return rec.result()[0]


def host_profile(session: Any, prompt: Sequence[int], n_gen: int, *, block_size: int | None = None,
                 where: str | None = None) -> tuple[list[PhaseProfile], Counter[str]]:
    """AR decode steps of `session`'s model (forward + greedy pick) and, with a draft, a DSpark
    generation's draft steps and verify passes: a warm-up generation of `n_gen` tokens, then
    `n_gen` timed, then `n_gen` counted (the prompt's draft context is built at prefill, as its
    one-off, outside the draft steps).
    Returns the phases and, with `where`, the call sites of that op."""
    from k3kit.runtime.engine import generate
    from k3kit.runtime.sampling import Sampler, make_sampling
    from k3kit.runtime.speculative import ScheduleConfig, SpeculativeDecoder

    model = session.model
    n_layers = int(getattr(model, "num_layers", 1))
    draft = session.draft_model
    d_cfg = getattr(draft, "cfg", None)
    d_layers = int(getattr(d_cfg, "num_layers", 0) or getattr(draft, "num_layers", 1) or 1)
    rec = Recorder({"ar": n_layers, "serve": n_layers, "draft": d_layers, "verify": n_layers}, where)
    sampling = make_sampling(0.0, seed=0)

    def ar(model: Any, sampler: Sampler) -> Any:
        def one(anchor: int, remaining: int = 1) -> list[int]:
            return [sampler(model.forward([anchor])[-1])]
        return rec.wrap("ar", one)

    prompt = list(prompt)
    # a warm-up run first (first calls make caches and tables: one-offs, not a step's cost)
    for recording, counted in ((False, False), (True, False), (True, True)):
        rec.recording, rec.counting = recording, counted
        generate(model, prompt, max_tokens=n_gen + 1, sampling=sampling, step=ar)
    if isinstance(model, BatchedModel):
        # a server's pass of one decoding sequence (forward_batch: the serving arithmetic)
        serve = rec.wrap("serve", model.forward_batch)
        for recording, counted in ((False, False), (True, False), (True, True)):
            rec.recording, rec.counting = recording, counted
            seq = model.open_sequence()
            try:
                tok = int(torch.argmax(model.forward_batch([(seq, prompt)])[0]))
                for _ in range(n_gen):
                    tok = int(torch.argmax(serve([(seq, [tok])])[0]))
            finally:
                model.close_sequence(seq)
    if draft is not None:
        def spec(model: Any, sampler: Sampler) -> SpeculativeDecoder:
            dec = SpeculativeDecoder(model, draft, sampler.sampling, sampler.generator,
                                     schedule=ScheduleConfig())
            prefill = dec.prefill

            def prefill_and_sync(ids: Sequence[int]) -> Any:
                out = prefill(ids)
                dec._sync()           # the prompt's draft context: a one-off, not a draft step's
                return out
            dec.prefill = prefill_and_sync  # type: ignore[method-assign]
            dec.propose = rec.wrap("draft", dec.propose)  # type: ignore[method-assign]
            return dec
        verify = model.verify
        model.verify = rec.wrap("verify", verify)
        try:
            for recording, counted in ((False, False), (True, False), (True, True)):
                rec.recording, rec.counting = recording, counted
                generate(model, prompt, max_tokens=n_gen + 1, sampling=sampling, step=spec)
        finally:
            del model.verify
    return rec.result(), rec.sites


def render(phases: Sequence[PhaseProfile], fmt: str = "md") -> str:
    """A markdown table (per layer and per call) or JSON lines of `to_dict`."""
    import json
    if fmt in ("json", "jsonl"):
        rows = [p.to_dict() for p in phases]
        text = json.dumps(rows, indent=2) if fmt == "json" else "\n".join(json.dumps(r) for r in rows)
        return text + "\n"
    lines = ["| phase | layers | ops/layer | host us/layer | syncs | d2h | ops | wall us | native us "
             "| matmul us | host us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in phases:
        lines.append(f"| {p.name} | {p.layers} | {p.ops_per_layer:.1f} | {p.host_us_per_layer:.1f} | "
                     f"{p.syncs:.2f} | {p.d2h:.2f} | {p.ops:.0f} | {p.wall_us:.0f} | {p.native_us:.0f} | "
                     f"{p.compute_us:.0f} | {p.host_us:.0f} |")
    for p in phases:
        lines.append(f"\n{p.name}: " + ", ".join(f"{k} {v:.0f}" for k, v in p.top.items()))
    return "\n".join(lines) + "\n"
