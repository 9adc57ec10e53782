"""Rows in llama-bench's terms, the results object, and what is written from it.

llama-bench's field names where they overlap (`model_filename`, `model_type`, `model_size`,
`model_n_params`, `n_batch`, `n_threads`, `n_prompt`, `n_gen`, `n_depth`, `test_time`,
`avg_ns`, `stddev_ns`, `avg_ts`, `stddev_ts`, `samples_ns`, `samples_ts`: avg = mean of the
samples, stddev = their sample standard deviation), then k3kit's own: expert hit rate, payload
bytes per token, peak RSS, and with a draft the speculative figures. `-o md|json|jsonl|csv`
prints them; `--out DIR` writes results.json, report.md and the PNG plots the run has data for.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from k3kit._io import atomic_write, write_json
from k3kit.bench.concurrency import Round
from k3kit.bench.llama_cpp import PeerSamples
from k3kit.bench.runner import ConfigResult, Sample, mean_std

MIB = 1 << 20


def _timing(n_tokens: Sequence[int], seconds: Sequence[float]) -> dict[str, Any]:
    ns = [int(round(s * 1e9)) for s in seconds]
    ts = [n / s if s > 0 else 0.0 for n, s in zip(n_tokens, seconds, strict=True)]
    avg_ns, sd_ns = mean_std([float(x) for x in ns])
    avg_ts, sd_ts = mean_std(ts)
    return {"avg_ns": int(round(avg_ns)), "stddev_ns": int(round(sd_ns)), "avg_ts": avg_ts,
            "stddev_ts": sd_ts, "samples_ns": ns, "samples_ts": ts}


def _rate(h: int, m: int) -> float:
    return h / (h + m) if h + m else 0.0


def _spec(samples: Sequence[Sample]) -> dict[str, Any]:
    """Speculative figures summed over the samples (None-free only when every sample had a draft)."""
    passes = sum(s.speculative["target_passes"] for s in samples if s.speculative)
    committed = sum(s.speculative["committed_per_pass"] * s.speculative["target_passes"]
                    for s in samples if s.speculative)
    rows = sum(s.speculative["verify_rows"] for s in samples if s.speculative)
    hists = [s.speculative["acceptance_histogram"] for s in samples if s.speculative]
    hist = [0] * max((len(h) for h in hists), default=0)
    for h in hists:
        for m, c in enumerate(h):
            hist[m] += int(c)
    accepted = sum(m * c for m, c in enumerate(hist))
    return {"target_passes": passes, "draft_steps": sum(s.speculative["draft_steps"] for s in samples
                                                        if s.speculative),
            "verify_rows": rows, "verify_rows_per_pass": rows / passes if passes else 0.0,
            "committed_per_pass": committed / passes if passes else 0.0,
            "mean_accepted": accepted / passes if passes else 0.0, "acceptance_histogram": hist}


def k3kit_rows(results: Sequence[ConfigResult], common: dict[str, Any], workload: str,
               draft: str | None, n_prompt: int, n_gen: int, copy_gbps: float = 0.0) -> list[dict[str, Any]]:
    """llama-bench's rows for k3kit's runs; a decode row also says the bytes a token reads (the trunk
    once, each routed expert fetched once per pass) and that rate against the device's copy
    bandwidth (`copy_gbps`, bench.bandwidth)."""
    rows: list[dict[str, Any]] = []
    for r in results:
        c = r.config
        base = common | {
            "engine": "k3kit", "config": r.label, "settings": c.to_dict(), "workload": workload,
            "n_threads": c.threads or common["n_threads"], "expert_kernel": r.expert_kernel, "trunk": r.trunk,
            "expert_cache_mib": c.expert_cache_mib, "draft": draft, "test_time": r.test_time,
            "pinned_experts": r.pinned["pinned_experts"] if r.pinned else 0, "peak_rss_bytes": r.peak_rss,
        }
        s = r.samples
        if n_prompt > 0:
            pp_tokens = sum(x.n_prompt for x in s)
            pp_bytes = sum(x.pp_bytes for x in s)
            rows.append(base | {"test": f"pp{n_prompt}", "n_prompt": n_prompt, "n_gen": 0, "n_depth": 0}
                        | _timing([x.n_prompt for x in s], [x.prefill_s for x in s])
                        | {"expert_hit_rate": _rate(sum(x.pp_hits for x in s), sum(x.pp_misses for x in s)),
                           "payload_bytes": pp_bytes,
                           "payload_bytes_per_token": pp_bytes / pp_tokens if pp_tokens else 0.0})
        if n_gen > 0:
            tg_tokens = sum(x.n_gen for x in s)
            tg_bytes = sum(x.tg_bytes for x in s)
            depth = round(statistics.fmean(x.n_prompt for x in s))
            row = (base | {"test": f"tg{n_gen}", "n_prompt": 0, "n_gen": n_gen, "n_depth": depth}
                   | _timing([x.n_gen for x in s], [x.decode_s for x in s])
                   | {"expert_hit_rate": _rate(sum(x.tg_hits for x in s), sum(x.tg_misses for x in s)),
                      "payload_bytes": tg_bytes,
                      "payload_bytes_per_token": tg_bytes / tg_tokens if tg_tokens else 0.0})
            fetched = sum(x.tg_hits + x.tg_misses for x in s)
            read = r.weights_per_token + (fetched / tg_tokens * r.expert_bytes if tg_tokens else 0.0)
            row |= {"read_bytes_per_token": read, "read_gbps": read * row["avg_ts"] / 1e9}
            if copy_gbps:
                row["read_of_copy_bw"] = row["read_gbps"] / copy_gbps
            if draft is not None:
                row |= _spec(s)
            rows.append(row)
    return rows


def peer_rows(peers: Sequence[PeerSamples], common: dict[str, Any], workload: str, n_prompt: int,
              n_gen: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for p in peers:
        base = common | {"engine": "llama.cpp", "config": f"threads={p.threads}", "workload": workload,
                         "n_threads": p.threads}
        if n_prompt > 0:
            rows.append(base | {"test": f"pp{n_prompt}", "n_prompt": n_prompt, "n_gen": 0, "n_depth": 0}
                        | _timing(p.n_prompt, p.prefill_s))
        if n_gen > 0:
            rows.append(base | {"test": f"tg{n_gen}", "n_prompt": 0, "n_gen": n_gen,
                                "n_depth": round(statistics.fmean(p.n_prompt))}
                        | _timing([n_gen] * len(p.decode_s), p.decode_s))
    return rows


def add_ratios(rows: list[dict[str, Any]], peers: list[dict[str, Any]]) -> None:
    """k3kit avg_ts / llama.cpp avg_ts for the same test at the same thread count."""
    by = {(p["test"], p["n_threads"]): p for p in peers}
    for r in rows:
        p = by.get((r["test"], r["n_threads"]))
        if p is not None:
            r["llama_cpp_avg_ts"] = p["avg_ts"]
            r["ratio_vs_llama_cpp"] = r["avg_ts"] / p["avg_ts"] if p["avg_ts"] else None


def probe_rows(results: Sequence[ConfigResult], workload: str) -> list[dict[str, Any]]:
    """The DSpark runtime's published table: one line per configuration on the workload."""
    out = []
    for r in results:
        s = r.samples
        dec = sum(x.n_gen for x in s)
        secs = sum(x.decode_s for x in s)
        sp = _spec(s) if any(x.speculative for x in s) else None
        out.append({"workload": workload, "config": r.label,
                    "prompt_tokens": statistics.fmean(x.n_prompt for x in s) if s else 0.0,
                    "decode_tok_s": dec / secs if secs else 0.0,
                    "verify_rows": sp["verify_rows"] if sp else dec,
                    "draft_steps": sp["draft_steps"] if sp else 0,
                    "avg_commit_per_step": sp["committed_per_pass"] if sp else 1.0,
                    "storage_payload_bytes": sum(x.pp_bytes + x.tg_bytes for x in s)})
    return out


SERVER_ENGINES = ("k3kit serve", "llama-server")     # rows of --concurrency rounds over HTTP


def concurrency_rows(rounds: Sequence[Round], common: dict[str, Any], n_gen: int,
                     engine: str = "k3kit serve") -> list[dict[str, Any]]:
    rows = []
    for n in dict.fromkeys(r.clients for r in rounds):
        rs = [r for r in rounds if r.clients == n]
        ts = [r.tokens / r.wall_s if r.wall_s else 0.0 for r in rs]
        ttft = [c.ttft_s * 1e3 for r in rs for c in r.results]
        avg, sd = mean_std(ts)
        t_avg, t_sd = mean_std(ttft)
        rows.append(common | {"engine": engine, "test": f"tg{n_gen} x{n}", "n_clients": n,
                              "n_prompt": 0, "n_gen": n_gen, "avg_ts": avg, "stddev_ts": sd, "samples_ts": ts,
                              "samples_ns": [int(round(r.wall_s * 1e9)) for r in rs],
                              "completion_tokens": sum(r.tokens for r in rs),
                              "ttft_ms_avg": t_avg, "ttft_ms_stddev": t_sd,
                              "ttft_ms_max": max(ttft, default=0.0)})
    return rows


# -- text ------------------------------------------------------------------------------------

def _size(n: float) -> str:
    for unit, d in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= d:
            return f"{n / d:.2f} {unit}"
    return f"{n:.0f} B"


def _params(n: int) -> str:
    for unit, d in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= d:
            return f"{n / d:.2f} {unit}"
    return str(n)


def _rate_cell(r: dict[str, Any]) -> str:
    """GB/s a decode row reads, and its share of the device's copy bandwidth where measured."""
    if "read_gbps" not in r:
        return ""
    share = f" ({r['read_of_copy_bw']:.2f})" if "read_of_copy_bw" in r else ""
    return f"{r['read_gbps']:.1f}{share}"


def markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    lines = []
    m = res["model"]
    lines.append(f"model: {m['model_filename']} ({m['model_type']}, {_size(m['model_size'])}, "
                 f"{_params(m['model_n_params'])} params); workload {res['workload']['name']}; "
                 f"{res['reps']} repetitions; {res['machine']['cpu_info']}")
    lines.append("")
    spec = any("committed_per_pass" in r for r in rows)
    head = ["engine", "config", "threads", "test", "t/s", "hit rate", "payload/token", "peak RSS",
            "read/token", "GB/s (of copy)"]
    if spec:
        head += ["commit/pass", "verify rows/pass"]
    if any("ratio_vs_llama_cpp" in r for r in rows):
        head += ["vs llama.cpp"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in rows:
        if r["engine"] in SERVER_ENGINES:
            continue
        cells = [r["engine"], r["config"], str(r["n_threads"]), r["test"],
                 f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}",
                 f"{100 * r['expert_hit_rate']:.1f}%" if "expert_hit_rate" in r else "",
                 _size(r["payload_bytes_per_token"]) if "payload_bytes_per_token" in r else "",
                 _size(r["peak_rss_bytes"]) if "peak_rss_bytes" in r else "",
                 _size(r["read_bytes_per_token"]) if "read_bytes_per_token" in r else "", _rate_cell(r)]
        if spec:
            cells += [f"{r['committed_per_pass']:.2f}" if "committed_per_pass" in r else "",
                      f"{r['verify_rows_per_pass']:.2f}" if "verify_rows_per_pass" in r else ""]
        if "vs llama.cpp" in head:
            ratio = r.get("ratio_vs_llama_cpp")
            cells += [f"{ratio:.2f}x" if ratio else ""]
        lines.append("| " + " | ".join(cells) + " |")
    probes = res.get("probes") or []
    if probes:
        lines += ["", "| workload | config | prompt tokens | decode tok/s | verify rows | draft steps | "
                  "avg commit/step | storage payload |", "|---|---|---|---|---|---|---|---|"]
        for p in probes:
            lines.append(f"| {p['workload']} | {p['config']} | {p['prompt_tokens']:.0f} | "
                         f"{p['decode_tok_s']:.2f} | {p['verify_rows']} | {p['draft_steps']} | "
                         f"{p['avg_commit_per_step']:.2f} | "
                         f"{_size(p['storage_payload_bytes'])} |")
    conc = [r for r in rows if r["engine"] in SERVER_ENGINES]
    if conc:
        peer = {r["n_clients"]: r["avg_ts"] for r in conc if r["engine"] == "llama-server"}
        lines += ["", "| engine | clients | test | aggregate t/s | TTFT ms (mean ± sd) | TTFT ms max | "
                  "tokens | vs llama-server |", "|---|---|---|---|---|---|---|---|"]
        for r in conc:
            base = peer.get(r["n_clients"]) if r["engine"] != "llama-server" else None
            ratio = f"{r['avg_ts'] / base:.2f}x" if base else ""
            lines.append(f"| {r['engine']} | {r['n_clients']} | {r['test']} | {r['avg_ts']:.2f} ± "
                         f"{r['stddev_ts']:.2f} | {r['ttft_ms_avg']:.0f} ± {r['ttft_ms_stddev']:.0f} | "
                         f"{r['ttft_ms_max']:.0f} | {r['completion_tokens']} | "
                         f"{ratio} |")
    if res.get("profile"):
        p = res["profile"]
        lines += ["", f"expert profile: {p['path']} ({p['tokens']} routed rows, {p['layers']} MoE layers)"]
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in r.items()})
    return buf.getvalue()


def render(res: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(res, indent=2) + "\n"
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in res["rows"])
    if fmt == "csv":
        return csv_text(res["rows"])
    return markdown(res)


# -- files -----------------------------------------------------------------------------------

def write_outputs(res: dict[str, Any], out: Path) -> list[Path]:
    """results.json, report.md and the plots, each atomically; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    from k3kit.bench.plots import plot_all
    pngs = plot_all(res, out)
    res["plots"] = [p.name for p in pngs]
    written = [write_json(out / "results.json", res)]
    md = markdown(res) + "".join(f"\n![{p.stem}]({p.name})\n" for p in pngs)
    written.append(atomic_write(out / "report.md", md))
    return written + pngs
