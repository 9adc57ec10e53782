"""PNG plots of a bench result (matplotlib, the `bench` extra), only those the run has data for.

  tok_s.png              avg_ts ± stddev per configuration and test (llama.cpp rows alongside)
  committed_per_pass.png with a draft: share of target passes committing 1..K+1 tokens
  payload_vs_cache.png   a swept expert cache: decode payload per token and hit rate vs MiB
  acceptance_vs_block.png a swept block size: tokens committed per pass vs block size
  concurrency.png        --concurrency: aggregate tok/s and mean TTFT vs clients
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3kit._io import atomic_write

KIB = 1024


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    def write(tmp: Path) -> None:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    atomic_write(path, write)
    plt.close(fig)
    return path


def plot_all(res: dict[str, Any], out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        from k3kit.errors import K3Error
        raise K3Error("--out plots need matplotlib (pip install 'k3kit[bench]')") from None
    matplotlib.use("Agg")
    rows = [r for r in res["rows"] if r["engine"] in ("k3kit", "llama.cpp")]
    made = [_tok_s(rows, out / "tok_s.png")] if rows else []
    ours = [r for r in rows if r["engine"] == "k3kit"]
    tg = [r for r in ours if r["n_gen"] > 0]
    if any(r.get("acceptance_histogram") for r in tg):
        made.append(_committed(tg, out / "committed_per_pass.png"))
    caches = {r["expert_cache_mib"] for r in tg}
    if len(caches) > 1:
        made.append(_payload(tg, out / "payload_vs_cache.png"))
    blocks = {r["settings"]["block_size"] for r in tg if "committed_per_pass" in r}
    if len(blocks) > 1 and None not in blocks:
        made.append(_acceptance(tg, out / "acceptance_vs_block.png"))
    conc = [r for r in res["rows"] if r["engine"] in ("k3kit serve", "llama-server")]
    if conc:
        made.append(_concurrency(conc, out / "concurrency.png"))
    return made


def _tok_s(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt
    tests = list(dict.fromkeys(r["test"] for r in rows))
    per = max(len([r for r in rows if r["test"] == t]) for t in tests)
    fig, axes = plt.subplots(1, len(tests), figsize=(len(tests) * max(3.5, 0.8 + 0.7 * per), 4.2),
                             squeeze=False)
    for ax, test in zip(axes[0], tests, strict=True):
        rs = [r for r in rows if r["test"] == test]
        labels = [f"{'llama.cpp ' if r['engine'] == 'llama.cpp' else ''}{r['config']}" for r in rs]
        colors = ["tab:gray" if r["engine"] == "llama.cpp" else "tab:blue" for r in rs]
        ax.bar(range(len(rs)), [r["avg_ts"] for r in rs], yerr=[r["stddev_ts"] for r in rs], color=colors,
               capsize=3)
        ax.set_xticks(range(len(rs)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(test)
        ax.set_ylabel("tok/s")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{Path(rows[0]['model_filename']).name}: tokens/s, mean ± sd over repetitions")
    fig.tight_layout()
    return _save(fig, path)


def _committed(tg: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    rs = [r for r in tg if r.get("acceptance_histogram")]
    width = 0.8 / len(rs)
    for i, r in enumerate(rs):
        h = r["acceptance_histogram"]
        total = sum(h) or 1
        ax.bar([m + 1 + (i - (len(rs) - 1) / 2) * width for m in range(len(h))], [c / total for c in h],
               width=width, label=f"{r['config']} (mean {r['committed_per_pass']:.2f})")
    ax.set_xlabel("tokens committed per target pass (accepted proposals + 1)")
    ax.set_ylabel("share of passes")
    ax.set_title("committed tokens per pass")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _series(tg: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by every swept setting except `key`, each group sorted by `key`."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in tg:
        others = " ".join(p for p in r["config"].split() if not p.startswith(f"{key}="))
        groups.setdefault(others or "all", []).append(r)
    for v in groups.values():
        v.sort(key=lambda r: r["settings"][key])
    return groups


def _payload(tg: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax2 = ax.twinx()
    xs = [r["expert_cache_mib"] for r in tg]
    for i, (name, rs) in enumerate(_series(tg, "expert_cache_mib").items()):
        x = [r["expert_cache_mib"] for r in rs]
        color = f"C{i}"
        ax.plot(x, [r["payload_bytes_per_token"] / KIB for r in rs], "o-", color=color,
                label=f"payload {name}")
        ax2.plot(x, [100 * r["expert_hit_rate"] for r in rs], "s--", color=color, alpha=0.5,
                 label=f"hit rate {name}")
    if min(xs) > 0 and max(xs) >= 10 * min(xs):
        ax.set_xscale("log")
    ax.set_xlabel("expert cache (MiB)")
    ax.set_ylabel("decode payload per token (KiB)")
    ax2.set_ylabel("expert hit rate (%)")
    ax2.set_ylim(0, 105)
    ax.set_title("expert bytes read per decoded token vs cache size")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _acceptance(tg: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, rs in _series(tg, "block_size").items():
        x = [r["settings"]["block_size"] for r in rs]
        ax.plot(x, [r["committed_per_pass"] for r in rs], "o-", label=f"committed/pass {name}")
        ax.plot(x, [r["mean_accepted"] for r in rs], "s--", alpha=0.6, label=f"accepted/pass {name}")
    ax.set_xlabel("draft block size (proposals per pass)")
    ax.set_ylabel("tokens per target pass")
    ax.set_title("acceptance vs block size")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _concurrency(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax2 = ax.twinx()
    for engine, color in (("k3kit serve", "tab:blue"), ("llama-server", "tab:gray")):
        rs = [r for r in rows if r["engine"] == engine]
        if not rs:
            continue
        x = [r["n_clients"] for r in rs]
        ax.errorbar(x, [r["avg_ts"] for r in rs], yerr=[r["stddev_ts"] for r in rs], fmt="o-", capsize=3,
                    color=color, label=f"{engine}: aggregate tok/s")
        ax2.plot(x, [r["ttft_ms_avg"] for r in rs], "s--", color=color, alpha=0.6,
                 label=f"{engine}: mean TTFT")
    ax.set_xlabel("concurrent clients")
    ax.set_xticks(sorted({r["n_clients"] for r in rows}))
    ax.set_ylabel("aggregate tok/s")
    ax2.set_ylabel("TTFT (ms)")
    ax.set_title("serving under concurrent clients")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)
