"""Printing bench_out_of_core.py's `ab` runs: one line per run, medians over the valid ones,
pair ratios. A module beside the benchmark, imported by it (benchmarks/ is not a package)."""

from __future__ import annotations

import statistics
from typing import Any

from ooc_disk import GIB, valid_run


def report_ab(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Print `ab` runs one per line, then per mode the medians over the runs `valid_run` keeps,
    and each valid pair's ratio to the first mode (the peer measured minutes apart, alternated)."""
    print(f"\n{'pair':>4} {'mode':<16} {'limit before/after MB/s':>23} {'disk MB/s':>9} {'tok/s':>6} "
          f"{'payload MB/s':>12} {'of limit':>8} {'sys s':>6} {'RSS GiB':>7} {'load':>5} valid")
    for r in runs:
        r["limit"] = (r["seq_before"] + r["seq_after"]) / 2
        r["payload_Bps"] = r["payload_per_token"] * r["decode_tok_s"]
        r["valid"] = valid_run(r)
        print(f"{r['pair']:>4} {r['mode']:<16} {r['seq_before'] / 1e6:11.0f}/{r['seq_after'] / 1e6:<11.0f} "
              f"{r['decode_disk_Bps'] / 1e6:9.0f} {r['decode_tok_s']:6.3f} {r['payload_Bps'] / 1e6:12.0f} "
              f"{r['payload_Bps'] / r['limit']:8.2f} {r['cpu_sys_s']:6.1f} {r['peak_rss'] / GIB:7.2f} "
              f"{r.get('load_avg_1min', 0):5.1f} {'yes' if r['valid'] else 'NO'}")
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    summary: dict[str, Any] = {}
    for m in modes:
        ok = [r for r in runs if r["mode"] == m and r["valid"]]
        if ok:
            summary[m] = {k: statistics.median(r[k] for r in ok) for k in ("payload_Bps", "decode_tok_s")}
            summary[m]["frac"] = statistics.median(r["payload_Bps"] / r["limit"] for r in ok)
            summary[m]["valid"] = len(ok)
            print(f"{m:<16} {len(ok)} valid runs: median payload {summary[m]['payload_Bps'] / 1e6:.0f} MB/s, "
                  f"{summary[m]['frac']:.2f} of the limit, {summary[m]['decode_tok_s']:.3f} tok/s")
    same = len({tuple(r["tokens"]) for r in runs}) == 1
    print(f"tokens identical in all {len(runs)} runs: {same}")
    for m in modes[1:]:
        ratios = []
        for pair in sorted({r["pair"] for r in runs}):
            a = [r for r in runs if r["pair"] == pair and r["mode"] == modes[0] and r["valid"]]
            b = [r for r in runs if r["pair"] == pair and r["mode"] == m and r["valid"]]
            if a and b:
                ratios.append(b[0]["payload_Bps"] / a[0]["payload_Bps"])
        if ratios:
            print(f"ratio {m} / {modes[0]} payload MB/s over {len(ratios)} valid pairs: "
                  f"median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
    return {"summary": summary, "tokens_identical": same}


def fmt_rate(bps: float) -> str:
    return f"{bps / 1e6:7.0f}"
