"""Aggregate per-request outcomes into ``summary.json`` and a side-by-side ``summary.md``.

Definitions (per system, over the replayed requests):

* ``delivered_hit_rate`` = (HBM hit pages + pages actually delivered from L3) / prompt pages: only
  pages in engine memory before prefill started count (a page the hit query reported but that was
  not read in time is a miss).
* ``hit_tokens`` = delivered pages × ``page_size``, by where they came from: ``hbm``, L3
  ``dram``, ``backlog`` (FlatCake's SSD pages served from its write backlog, the in-memory copy
  of a round not yet on disk: memory, not the disk) and ``ssd`` (read from the disk);
  ``backlog_hit_pages`` = ``hit_tokens.backlog`` in pages.
* ``read_amplification`` = SSD bytes read / logical bytes of the pages read from SSD (the
  system's ``logical_read_bytes_ssd``, which leaves out backlog hits as ``hit_tokens.ssd`` does).
* ``write_amplification`` = bytes written to the media (SSD + L3 DRAM) / logical page bytes stored.
* ``ssd_read_gbps`` = SSD bytes read / seconds spent inside the read calls (GB = 1e9 bytes).
* ``ttft_s``: measured storage time of the hit query and read calls + modelled host→HBM load +
  modelled prefill compute (see :mod:`flatcake.replay.engine`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from flatcake.replay.budget import EqualCapacity
from flatcake.replay.engine import RequestOutcome


def _ratio(a: float, b: float) -> float | None:
    return float(a) / float(b) if b else None


def ssd_read_amplification(counters: Mapping[str, int], ssd_page_bytes: int) -> float | None:
    """SSD bytes read / logical bytes of the pages read from SSD (None when nothing was).

    Args:
        counters: the system's cumulative counters: ``ssd_read_bytes`` and, where the system
            keeps it, ``logical_read_bytes_ssd`` (bytes of the pages it read from SSD).
        ssd_page_bytes: bytes of the pages delivered from SSD by placement (``hit_tokens.ssd``
            in pages × page bytes): the denominator where the counter is absent or 0.
    """
    logical = int(counters.get("logical_read_bytes_ssd", 0)) or ssd_page_bytes
    return _ratio(int(counters.get("ssd_read_bytes", 0)), logical)


def system_summary(outcomes: Sequence[RequestOutcome], counters: Mapping[str, int], page_size: int,
                   page_bytes: int, wall_s: float, errors: int = 0) -> dict[str, Any]:
    """One system's metrics.

    Args:
        outcomes: per-request outcomes, in replay order.
        counters: the system's cumulative I/O counters at the end (bytes, ops, pages).
        page_size: tokens per page.
        page_bytes: bytes per page.
        wall_s: seconds the engine spent on this system's requests (measured).
        errors: backend exceptions caught.
    """
    pages = sum(o.pages for o in outcomes)
    hbm = sum(o.hbm_pages for o in outcomes)
    dram = sum(o.dram_pages for o in outcomes)
    backlog = sum(o.backlog_pages for o in outcomes)
    ssd = sum(o.ssd_pages for o in outcomes) - backlog  # read from the disk
    ttft = np.array([o.ttft_s for o in outcomes], dtype=np.float64) if outcomes else np.zeros(1)
    read_s = sum(o.read_s for o in outcomes)
    ssd_read = int(counters.get("ssd_read_bytes", 0))
    media_written = int(counters.get("ssd_write_bytes", 0)) + int(counters.get("dram_write_bytes", 0))
    return {
        "delivered_hit_rate": _ratio(hbm + dram + backlog + ssd, pages),
        "hit_tokens": {"hbm": hbm * page_size, "dram": dram * page_size, "backlog": backlog * page_size,
                       "ssd": ssd * page_size},
        "backlog_hit_pages": int(backlog),
        "prompt_tokens": int(sum(o.prompt_tokens for o in outcomes)),
        "prompt_pages": pages,
        "l3_query_hit_pages": int(sum(o.l3_query_pages for o in outcomes)),
        "computed_pages": int(sum(o.computed_pages for o in outcomes)),
        "written_pages": int(sum(o.written_pages for o in outcomes)),
        "failed_write_pages": int(sum(o.failed_write_pages for o in outcomes)),
        "ttft_s": {
            "mean": float(ttft.mean()),
            "p50": float(np.percentile(ttft, 50)),
            "p99": float(np.percentile(ttft, 99)),
        },
        "ttft_parts_mean_s": {
            "query_measured": float(np.mean([o.query_s for o in outcomes])) if outcomes else 0.0,
            "read_measured": float(np.mean([o.read_s for o in outcomes])) if outcomes else 0.0,
            "load_modelled": float(np.mean([o.load_s for o in outcomes])) if outcomes else 0.0,
            "prefill_modelled": float(np.mean([o.prefill_s for o in outcomes])) if outcomes else 0.0,
        },
        "ssd_read_bytes": ssd_read,
        "ssd_read_ops": int(counters.get("ssd_read_ops", 0)),
        "ssd_over_read_bytes": int(counters.get("ssd_over_read_bytes", 0)),
        "ssd_write_bytes": int(counters.get("ssd_write_bytes", 0)),
        "ssd_write_ops": int(counters.get("ssd_write_ops", 0)),
        "dram_write_bytes": int(counters.get("dram_write_bytes", 0)),
        "logical_write_bytes": int(counters.get("logical_write_bytes", 0)),
        "read_amplification": ssd_read_amplification(counters, ssd * page_bytes),
        "write_amplification": _ratio(media_written, counters.get("logical_write_bytes", 0)),
        "merged_reads": int(counters.get("merged_reads", 0)),
        "verify_failures": int(sum(o.verify_failures for o in outcomes)),
        "backend_errors": int(errors),
        "query_s": float(sum(o.query_s for o in outcomes)),
        "read_s": float(read_s),
        "write_s": float(sum(o.write_s for o in outcomes)),
        "ssd_read_gbps": (ssd_read / read_s / 1e9) if read_s > 0 else None,
        "wall_s": float(wall_s),
    }


def _fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "–"
    if kind == "pct":
        return f"{100 * v:.2f}%"
    if kind == "s":
        return f"{v:.3f}"
    if kind == "gb":
        return f"{v / 1e9:.2f}"
    if kind == "x":
        return f"{v:.3f}"
    if kind == "gbps":
        return f"{v:.2f}"
    if isinstance(v, float):
        return f"{v:.3g}"
    return f"{v:,}" if isinstance(v, int) else str(v)


_ROWS: list[tuple[str, Any, str]] = [
    ("delivered hit rate", lambda s: s["delivered_hit_rate"], "pct"),
    ("hit tokens HBM", lambda s: s["hit_tokens"]["hbm"], ""),
    ("hit tokens L3 DRAM", lambda s: s["hit_tokens"]["dram"], ""),
    ("hit tokens L3 write backlog (memory)", lambda s: s["hit_tokens"].get("backlog", 0), ""),
    ("hit tokens L3 SSD (read from disk)", lambda s: s["hit_tokens"]["ssd"], ""),
    ("prompt tokens", lambda s: s["prompt_tokens"], ""),
    ("TTFT mean (s)", lambda s: s["ttft_s"]["mean"], "s"),
    ("TTFT p50 (s)", lambda s: s["ttft_s"]["p50"], "s"),
    ("TTFT p99 (s)", lambda s: s["ttft_s"]["p99"], "s"),
    ("  of which L3 query+read, measured (mean s)",
     lambda s: s["ttft_parts_mean_s"]["query_measured"] + s["ttft_parts_mean_s"]["read_measured"], "s"),
    ("  of which HBM load + prefill, modelled (mean s)",
     lambda s: s["ttft_parts_mean_s"]["load_modelled"] + s["ttft_parts_mean_s"]["prefill_modelled"], "s"),
    ("SSD read (GB)", lambda s: s["ssd_read_bytes"], "gb"),
    ("SSD read requests (syscalls)", lambda s: s["ssd_read_ops"], ""),
    ("merged reads (planned ranges)", lambda s: s["merged_reads"], ""),
    ("SSD read GB/s (in read calls)", lambda s: s["ssd_read_gbps"], "gbps"),
    ("SSD write (GB)", lambda s: s["ssd_write_bytes"], "gb"),
    ("read amplification", lambda s: s["read_amplification"], "x"),
    ("write amplification", lambda s: s["write_amplification"], "x"),
    ("verify failures", lambda s: s["verify_failures"], ""),
    ("write-back pages refused (failed puts)", lambda s: s["failed_write_pages"], ""),
    ("backend errors", lambda s: s["backend_errors"], ""),
    ("write calls (s, async in SGLang)", lambda s: s["write_s"], "s"),
    ("wall (s)", lambda s: s["wall_s"], "s"),
]


def scale_note(n: int) -> str:
    """What a ``--scale N`` run's numbers mean."""
    return (f"**Scaled run (--scale {n}):** page bytes and every capacity divided by {n}; hit rates, "
            "hits by medium, placement and reclaim are as at full size; bytes are 1/{n} of full size; "
            "timings (TTFT, latencies, throughput, GB/s) are NOT meaningful.").replace("{n}", str(n))


def policy_note(engine: Mapping[str, Any]) -> str:
    """The prefetch policy of a run (``engine``: :class:`~flatcake.replay.engine.EngineConfig`'s
    fields), for ``summary.md`` and the figures."""
    policy = engine.get("prefetch_policy", "?")
    if policy == "timeout":
        base, per_ki = engine.get("prefetch_timeout_base_s", 0), engine.get("prefetch_timeout_per_ki_token_s", 0)
        return (f"prefetch policy `timeout` (SGLang's default): a prefetch still reading {base:g} s + {per_ki:g} s "
                "per 1024 requested tokens after it was first waited for is cut; the rest is recomputed")
    if policy == "wait_complete":
        return "prefetch policy `wait_complete`: every hit page is waited for (not SGLang's default, `timeout`)"
    return f"prefetch policy `{policy}`"


def policy_label(engine: Mapping[str, Any]) -> str:
    """The prefetch policy in a few words (figure titles)."""
    policy = engine.get("prefetch_policy", "?")
    if policy == "timeout":
        return (f"prefetch policy: timeout ({engine.get('prefetch_timeout_base_s', 0):g} s + "
                f"{engine.get('prefetch_timeout_per_ki_token_s', 0):g} s per Ki tokens)")
    return f"prefetch policy: {policy}"


def markdown(summary: Mapping[str, Any]) -> str:
    """The side-by-side table of ``summary`` (as written to ``summary.md``)."""
    systems: Mapping[str, Any] = summary["systems"]
    names = list(systems)
    m = summary.get("model", {})
    lines = [
        "# FlatCake trace replay",
        "",
        *([scale_note(summary["scale"]), ""] if summary.get("scale", 1) > 1 else []),
        f"- trace: `{summary['trace']}` ({summary['requests']} requests, "
        f"{summary.get('prompt_pages', 0):,} prompt pages, {summary.get('unique_pages', 0):,} unique)",
        f"- ideal (infinite-cache) page hit rate: {_fmt(summary['ideal_hit_rate'], 'pct')}",
        f"- model profile: {m.get('name')} ({m.get('attention')}, {m.get('page_bytes', 0) / 1024:.0f} KiB "
        f"per {m.get('page_size')}-token page); HBM {summary.get('engine', {}).get('hbm_pages')} pages",
        f"- {policy_note(summary.get('engine', {}))}",
        *([f"- {EqualCapacity(**summary['equal_capacity']).note()}"] if summary.get("equal_capacity") else []),
        "- TTFT = measured storage time (L3 hit query + reads) + modelled host→HBM load + modelled "
        "prefill compute (no GPU here); requests are served one at a time (no queueing).",
        *[f"- system {n} skipped: {why}" for n, why in summary.get("skipped_systems", {}).items()],
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for label, get, kind in _ROWS:
        lines.append(f"| {label} | " + " | ".join(_fmt(get(systems[n]), kind) for n in names) + " |")
    lines += _pool_rows(systems, names)
    return "\n".join(lines) + "\n"


def _pool_rows(systems: Mapping[str, Any], names: list) -> list[str]:
    """Hybrid runs only (``pools`` in a system's summary): per pool, the pages it restored and
    how many failed verification; the restores dropped for a missing trailing window."""
    pools = list(dict.fromkeys(p for n in names for p in systems[n].get("pools", {})))
    if not pools:
        return []

    def cell(n: str, p: str) -> str:
        d = systems[n].get("pools", {}).get(p)
        return "–" if d is None else f"{d['delivered_pages']:,} ({d['verify_failures']} bad)"

    rows = [f"| pool {p}: pages restored (verify failures) | " + " | ".join(cell(n, p) for n in names) + " |"
            for p in pools]
    rows.append("| restores dropped: trailing window missing | "
                + " | ".join(_fmt(systems[n].get("trailing_misses")) for n in names) + " |")
    return rows


def plot_ttft_cdf(ttfts: Mapping[str, Sequence[float]], path, title: str = "") -> None:
    """Write a TTFT CDF (one line per system, seconds on a log axis) to ``path`` (PNG), titled
    ``title`` (the run's prefetch policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in ttfts.items():
        v = np.sort(np.asarray(vals, dtype=np.float64))
        if v.size:
            ax.plot(np.maximum(v, 1e-4), np.arange(1, v.size + 1) / v.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s): measured storage + modelled load and prefill")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
