"""Figures of a ``--qps`` sweep (PNG, matplotlib), the shape of the paper's evaluation (§4):
delivered hit rate vs QPS with the ideal as a line, mean and P50 TTFT vs QPS, token throughput
vs QPS, hit tokens by medium per system, SSD prefetch latency vs QPS, read amplification per
system. Inputs are the sweep's ``points`` (:func:`flatcake.replay.sweep.sweep_points`); every
figure is titled with the run's prefetch policy (``subtitle``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

FIGURES = {
    "hit_rate_vs_qps.png": "delivered hit rate vs QPS (dashed: ideal)",
    "ttft_vs_qps.png": "mean and P50 TTFT vs QPS",
    "throughput_vs_qps.png": "token throughput vs QPS",
    "hit_tokens_by_medium.png": "hit tokens by medium (HBM / DRAM / write backlog / SSD) per system, highest QPS",
    "ssd_prefetch_vs_qps.png": "SSD prefetch latency (mean, P99) vs QPS",
    "read_amplification.png": "SSD read amplification per system, highest QPS",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(points: Sequence[dict], label: str, get) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for p in points:
        run = p["systems"].get(label)
        v = get(run) if run is not None else None
        if v is not None:
            xs.append(p["qps"])
            ys.append(v)
    return xs, ys


def _lines(ax, points, labels, get, ylabel: str, style: str = "-o") -> None:
    for label in labels:
        xs, ys = _series(points, label, get)
        if xs:
            ax.plot(xs, ys, style, label=label)
    ax.set_xlabel("QPS (requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def plot_sweep(points: Sequence[dict[str, Any]], ideal_hit_rate: Optional[float], out_dir: Path,
               subtitle: str = "") -> list[str]:
    """Write :data:`FIGURES` into ``out_dir``, each titled ``subtitle`` (the prefetch policy);
    returns the file names written (none when the sweep is empty)."""
    if not points:
        return []
    plt = _plt()

    def save(fig, path, **kw):  # every figure carries the subtitle, above its axes
        if subtitle:
            fig.suptitle(subtitle, fontsize=8)
            fig.tight_layout(rect=(0, 0, 1, 0.95))
        fig.savefig(path, **kw)

    out_dir = Path(out_dir)
    labels = list(dict.fromkeys(label for p in points for label in p["systems"]))
    last = points[-1]

    fig, ax = plt.subplots(figsize=(6, 4))
    _lines(ax, points, labels, lambda r: r["delivered_hit_rate"], "delivered hit rate")
    if ideal_hit_rate is not None:
        ax.axhline(ideal_hit_rate, linestyle="--", color="k", label="ideal")
    ax.legend()
    fig.tight_layout()
    save(fig, out_dir / "hit_rate_vs_qps.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, stat in zip(axes, ("mean", "p50")):
        _lines(ax, points, labels, lambda r, s=stat: r["ttft_s"][s], f"TTFT {stat} (s)")
        ax.set_title(f"TTFT {stat}")
    axes[0].legend()
    fig.tight_layout()
    save(fig, out_dir / "ttft_vs_qps.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    _lines(ax, points, labels, lambda r: r["tokens_per_s"], "tokens / s")
    ax.legend()
    fig.tight_layout()
    save(fig, out_dir / "throughput_vs_qps.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(labels)
    for medium, name in (("hbm", "HBM"), ("dram", "DRAM"), ("backlog", "write backlog"), ("ssd", "SSD")):
        vals = [last["systems"][lb]["hit_tokens"].get(medium, 0) if lb in last["systems"] else 0 for lb in labels]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel(f"hit tokens at {last['qps']:g} QPS")
    ax.legend()
    fig.tight_layout()
    save(fig, out_dir / "hit_tokens_by_medium.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    _lines(ax, points, labels, lambda r: r["ssd_prefetch_s"]["mean"], "SSD prefetch latency (s)")
    for label in labels:
        xs, ys = _series(points, label, lambda r: r["ssd_prefetch_s"]["p99"])
        if xs:
            ax.plot(xs, ys, ":x", label=f"{label} P99")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no SSD restores in this run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    save(fig, out_dir / "ssd_prefetch_vs_qps.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    vals = [last["systems"].get(lb, {}).get("read_amplification") or 0.0 for lb in labels]
    ax.bar(labels, vals)
    ax.set_ylabel(f"SSD bytes read / page bytes delivered ({last['qps']:g} QPS)")
    fig.tight_layout()
    save(fig, out_dir / "read_amplification.png", dpi=110)
    plt.close(fig)
    return list(FIGURES)


__all__ = ["FIGURES", "plot_sweep"]
