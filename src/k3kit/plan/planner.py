"""`make_plan`: model headers + a machine -> placement, decode speed, requant fixes, command lines.

One result dict, from which both the human report and `--json` are printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from k3kit.errors import K3Error
from k3kit.gguf.requant.plan import TARGETS
from k3kit.plan import expert_io, recipes
from k3kit.plan.facts import DraftFacts, ModelFacts, open_model, read_draft, read_facts, requantized
from k3kit.plan.hardware import Hardware
from k3kit.plan.placement import Placement, place
from k3kit.plan.profile import Profile, load_profile
from k3kit.plan.speed import estimate, formulas
from k3kit.plan.units import fmt_bytes

GiB = 1 << 30
EMBD_OUTPUT = (r"^token_embd\.weight$", r"^output\.weight$")
DEFAULT_CTX = 32768
MIN_SAVING = 0.01  # a requant saving less than 1% of the trunk is not a suggestion


@dataclass(frozen=True)
class PlanOptions:
    ctx: int | None = None        # None: min(DEFAULT_CTX, the model's context)
    tau: float = 4.0
    verify: int = 8               # rows per verify pass: DSpark's block 7 + the current token
    draft: str | None = None      # a draft GGUF
    draft_bytes: int | None = None
    profile: str | None = None
    gpu_reserve: int = 1 * GiB    # CUDA context + compute buffers, per GPU
    ram_reserve: int = 4 * GiB    # OS + the server process

    def check(self) -> None:
        if self.ctx is not None and self.ctx < 1:
            raise K3Error(f"--ctx {self.ctx}: must be >= 1")
        if not 1 <= self.verify <= 256:
            raise K3Error(f"--verify {self.verify}: must be 1..256")
        if not 1.0 <= self.tau <= self.verify:
            raise K3Error(f"--tau {self.tau:g}: tokens committed per pass must be between 1 and the verify "
                          f"width ({self.verify})")
        if self.draft is not None and self.draft_bytes is not None:
            raise K3Error("--draft and --draft-bytes: give one")


def _context_length(facts: ModelFacts, model_kv: dict[str, Any]) -> int | None:
    item = model_kv.get(Keys.LLM.CONTEXT_LENGTH.format(arch=facts.arch))
    if item is None or item.vtype == GGUFValueType.ARRAY:
        return None
    return int(item.value)


def _one(facts: ModelFacts, hw: Hardware, opts: PlanOptions, ctx: int, draft: DraftFacts | None,
         profile: Profile | None) -> tuple[Placement, dict[str, Any], dict[str, Any] | None]:
    pl = place(facts, hw, ctx=ctx, draft=draft, gpu_reserve=opts.gpu_reserve, ram_reserve=opts.ram_reserve,
               profile=profile)
    ar = estimate(facts, hw, pl, rows=1, tokens=1.0, draft=None, profile=profile)
    spec = (estimate(facts, hw, pl, rows=opts.verify, tokens=opts.tau, draft=draft, profile=profile)
            if draft is not None else None)
    return pl, ar, spec


def make_plan(model_path: str | Path, hw: Hardware, opts: PlanOptions) -> dict[str, Any]:
    opts.check()
    draft: DraftFacts | None = None
    if opts.draft is not None:
        draft = read_draft(opts.draft)
    elif opts.draft_bytes is not None:
        draft = DraftFacts(None, opts.draft_bytes, 0)
    with open_model(model_path) as model:
        facts = read_facts(model)
        n_ctx = _context_length(facts, dict(model.kv))
        if opts.ctx is None:
            ctx = min(DEFAULT_CTX, n_ctx or DEFAULT_CTX)
        elif n_ctx and opts.ctx > n_ctx:
            raise K3Error(f"--ctx {opts.ctx}: {facts.path.name} was trained for {n_ctx} tokens of context")
        else:
            ctx = opts.ctx
        profile = load_profile(opts.profile, facts) if opts.profile else None
        variants: list[ModelFacts] = []
        main_bpw = _bits_per_weight(_trunk_type(facts))
        for t in TARGETS:
            if _bits_per_weight(t.name) > main_bpw:
                continue  # cannot shrink the trunk's bulk: not worth planning
            for include in ((), EMBD_OUTPUT) if t.name == "Q4_K" else ((),):
                v = requantized(model, facts, t.name, include)
                if v.trunk_bytes < facts.trunk_bytes * (1 - MIN_SAVING):
                    variants.append(v)

    pl, ar, spec = _one(facts, hw, opts, ctx, draft, profile)
    suggestions: list[dict[str, Any]] = []
    for v in sorted(variants, key=lambda v: -v.trunk_bytes):
        pl2, ar2, spec2 = _one(v, hw, opts, ctx, draft, profile)
        suggestions.append({
            "to": v.requant, "include": list(v.requant_include),
            "trunk_bytes_after": v.trunk_bytes, "saved_bytes": facts.trunk_bytes - v.trunk_bytes,
            "trunk_by_type_after": v.trunk_by_type, "fits_after": pl2.fits,
            "decode_tok_s_after": {"ar": ar2["tok_s"], "speculative": spec2["tok_s"] if spec2 else None},
            "command": recipes.requant_command(facts, v.requant or "", v.requant_include),
        })
    fix = next((s for s in suggestions if s["fits_after"]), None)
    problems = list(pl.problems)
    if not pl.fits:
        if fix is not None:
            inc = " (token_embd/output too)" if fix["include"] else ""
            problems.append(f"fix: requantize the trunk {_trunk_type(facts)} -> {fix['to']}{inc}: "
                            f"{fmt_bytes(facts.trunk_bytes)} -> {fmt_bytes(fix['trunk_bytes_after'])} "
                            f"(saves {fmt_bytes(fix['saved_bytes'])}): {fix['command']}")
        elif suggestions:
            problems.append("no trunk requant makes it fit: lower --ctx, drop the drafter, or add --nodes")

    ram_backed = facts.routed_expert_bytes - pl.experts.gpu_bytes
    io = expert_io.for_plan(ram_backed, facts.trunk_bytes, pl.ram.free + pl.experts.ram_bytes, hw.ram or 0)
    cmds = recipes.commands(facts, hw, pl, ctx=ctx, draft=draft, draft_path=opts.draft, verify=opts.verify,
                            gpu_reserve=opts.gpu_reserve)
    result: dict[str, Any] = {
        "model": facts.summary(),
        "hardware": hw.to_dict(),
        "options": {"ctx": ctx, "tau": opts.tau, "verify_rows": opts.verify,
                    "gpu_reserve_bytes": opts.gpu_reserve, "ram_reserve_bytes": opts.ram_reserve,
                    "profile": profile.to_dict() if profile else None},
        "fits": pl.fits,
        "problems": problems,
        "trunk_bytes": facts.trunk_bytes,
        "trunk_by_type": facts.trunk_by_type,
        "routed_expert_bytes": facts.routed_expert_bytes,
        "total_bytes": facts.total_bytes,
        "kv_state": _kv_state(facts, ctx),
        "draft": draft.to_dict(ctx) | {"device": pl.draft_device} if draft else None,
        "placement": {
            "ngl": pl.ngl, "units": facts.n_layer + 1,
            "layers_on_gpu": sum(1 for u, d in pl.unit_device.items() if d != "ram" and u < facts.n_layer),
            "output_layer": pl.unit_device.get(facts.n_layer, "ram"), "token_embd": "ram",
            "draft_device": pl.draft_device,
            "experts": {"gpu_layers": sorted(pl.experts.gpu_layers), "gpu_bytes": pl.experts.gpu_bytes,
                        "ram_bytes": pl.experts.ram_bytes, "storage_bytes": pl.experts.storage_bytes,
                        "resident_fraction": pl.experts.resident_fraction},
        },
        "devices": [d.to_dict() for d in pl.devices],
        "expert_io": io.to_dict() | {"decode_tok_s": ar["tok_s"]},
        "requant": suggestions,
        "decode_tok_s": {"ar": ar["tok_s"], "speculative": spec["tok_s"] if spec else None},
        "bound_by": {"ar": ar["bound_by"], "speculative": spec["bound_by"] if spec else None},
        "speed": {"formula": formulas(facts, pl, rows=opts.verify, tau=opts.tau, draft=draft is not None,
                                      profile=profile),
                  "ar": _public(ar), "speculative": _public(spec) if spec else None},
        "commands": cmds,
    }
    return result


def _public(est: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in est.items() if not k.startswith("_")}


def _trunk_type(facts: ModelFacts) -> str:
    """The type holding most of the trunk's matrices (F32 norms and router aside)."""
    return next((t for t in facts.trunk_by_type if t != "F32"), next(iter(facts.trunk_by_type), "F32"))


def _bits_per_weight(type_name: str) -> float:
    qtype = GGMLQuantizationType.__members__.get(type_name)
    if qtype is None:
        return float("inf")
    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def _kv_state(facts: ModelFacts, ctx: int) -> dict[str, Any]:
    mla = [la for la in facts.layers if la.kind == "MLA"]
    kda = [la for la in facts.layers if la.kind == "KDA"]
    return {"ctx": ctx,
            "mla_bytes_per_token": sum(la.kv_bytes_per_token for la in mla),
            "mla_bytes": sum(la.kv_bytes_per_token * ctx for la in mla),
            "kda_state_bytes": sum(la.state_bytes for la in kda),
            "total_bytes": sum(la.kv_state_bytes(ctx) for la in facts.layers)}
