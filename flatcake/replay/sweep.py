"""``flatcake-replay --qps R[,R...] [--scheduler fcfs,mas]``: the trace under load, through the
concurrent serving model (:mod:`flatcake.replay.serving`), for each rate, scheduler and system.

Each (rate, scheduler, system) run gets a fresh store in ``<out>/<STORAGE_DIRS[system]>``,
removed afterwards unless ``keep_data``; every system at equal capacity
(:func:`~flatcake.replay.budget.equal_capacity`: FlatCake's write backlog counted in its DRAM
budget). Outputs in ``<out>/``: ``summary.json`` (``{"trace", "requests", "ideal_hit_rate",
"prefetch_policy", "engine", "equal_capacity", "points": [{"qps", "systems": {label:
summary}}], "runs": [{"qps", "scheduler", "system", "prefetch_policy",
...serving_summary...}]}``; a label is the system's name, or ``system/scheduler`` when several
schedulers ran), ``summary.md`` (the table, linking the figures) and the figures of
:mod:`flatcake.replay.figures` (titled with the prefetch policy).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

from flatcake.replay.engine import EngineConfig, ModelProfile, reusable_counts
from flatcake.replay.serving import ServingConfig, serve
from flatcake.replay.budget import EqualCapacity, check_disk_budget, equal_capacity
from flatcake.replay.startup import load_requests, make_replay_system
from flatcake.replay.systems import FIXED_SCHEDULER, FLATCAKE_SYSTEMS, STORAGE_DIRS
from flatcake.replay.figures import FIGURES, plot_sweep
from flatcake.replay.report import policy_label, policy_note, scale_note, ssd_read_amplification
from flatcake.replay.traces import ideal_hit_rate

SCHEDULERS = ("fcfs", "mas")


def parse_rates(text: str) -> list[float]:
    """``"0.1,0.25,1"`` -> ``[0.1, 0.25, 1.0]``.

    Raises:
        ValueError: a rate that is not a number > 0 (message names ``--qps``).
    """
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--qps: expected comma-separated numbers (got {text!r})") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--qps: rates must be > 0 (got {text!r})")
    return rates


def parse_schedulers(text: str) -> list[str]:
    """``"fcfs,mas"`` -> ``["fcfs", "mas"]``.

    Raises:
        ValueError: an unknown scheduler (message names ``--scheduler``).
    """
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SCHEDULERS]
    if not names or bad:
        raise ValueError(f"--scheduler: must be fcfs, mas or fcfs,mas (got {text!r})")
    return names


def sweep_pairs(schedulers: Sequence[str], systems: Sequence[str]) -> list[tuple[str, str]]:
    """(scheduler, system) runs of one rate: every system under every scheduler, in that order,
    except a system with a fixed scheduler (``flatcake-fcfs``), which runs once, under it."""
    pairs = [(sched, name) for sched in schedulers for name in systems if name not in FIXED_SCHEDULER]
    return pairs + [(FIXED_SCHEDULER[name], name) for name in systems if name in FIXED_SCHEDULER]


def run_sweep(fc_keys: dict, settings: dict[str, Any], profile: ModelProfile, ecfg: EngineConfig,
              rates: Sequence[float], schedulers: Sequence[str], ssd_restores: int = 1) -> dict[str, Any]:
    """Serve the trace of ``settings`` at every rate under every scheduler on every system.

    Returns:
        ``{"trace", "requests", "ideal_hit_rate", "points", "runs"}`` (also written to
        ``<out>/summary.json``).

    Raises:
        flatcake.replay.budget.DiskBudgetError: the largest system's footprint would not fit
            (checked unless ``settings["disk_budget"]`` is False).
    """
    out = Path(settings["out"])
    reqs, keys = load_requests(settings, profile)
    if settings["disk_budget"]:  # one system at a time, each on a fresh store
        unique = len({k for ks in keys for k in ks})
        check_disk_budget(settings["systems"], unique * profile.page_bytes, fc_keys, settings["file_extra"], out,
                          together=False)
    capacity = equal_capacity(fc_keys) if set(settings["systems"]) & set(FLATCAKE_SYSTEMS) else None
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for qps in rates:
        for sched, name in sweep_pairs(schedulers, settings["systems"]):
            system = make_replay_system(name, profile, settings, out, fc_keys)
            try:
                s = serve(system, profile, ecfg, ServingConfig(qps=qps, scheduler=sched, ssd_restores=ssd_restores,
                                                            think_time_scale=settings["think_time_scale"]),
                          reqs, keys)
            finally:
                system.close()
                if not settings["keep_data"] and name in STORAGE_DIRS:
                    shutil.rmtree(out / STORAGE_DIRS[name], ignore_errors=True)
            s["read_amplification"] = read_amplification(s, profile.page_size, profile.page_bytes)
            runs.append({"qps": qps, "scheduler": sched, "system": name, "prefetch_policy": ecfg.prefetch_policy, **s})
    hits, total = ideal_hit_rate(keys, reusable_counts(reqs, keys, profile.page_size))
    result = {"trace": os.path.normpath(str(settings["trace"])), "requests": len(reqs),
              "ideal_hit_rate": hits / total if total else None, "prefetch_policy": ecfg.prefetch_policy,
              "engine": dict(ecfg.__dict__), **({"equal_capacity": capacity.as_dict()} if capacity else {}),
              "scale": settings.get("scale", 1),
              "timings_meaningful": settings.get("scale", 1) == 1,
              "skipped_systems": dict(settings.get("skipped_systems", {})),
              "points": sweep_points(runs, multi_scheduler=len(schedulers) > 1), "runs": runs}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    figures = (plot_sweep(result["points"], result["ideal_hit_rate"], out, policy_label(ecfg.__dict__))
               if settings.get("plot", True) else [])
    (out / "summary.md").write_text(serving_markdown(result, figures))
    return result


def sweep_points(runs: Sequence[dict], multi_scheduler: bool) -> list[dict[str, Any]]:
    """Runs grouped by rate: ``[{"qps", "systems": {label: run}}]`` in rate order; ``label`` is
    the system name, or ``system/scheduler`` when several schedulers ran (``flatcake-fcfs``
    keeps its name)."""
    points: dict[float, dict] = {}
    for r in runs:
        label = r["system"] if not multi_scheduler or r["system"] in FIXED_SCHEDULER else f"{r['system']}/{r['scheduler']}"
        points.setdefault(r["qps"], {"qps": r["qps"], "systems": {}})["systems"][label] = r
    return [points[q] for q in sorted(points)]


def read_amplification(run: dict, page_size: int, page_bytes: int) -> Optional[float]:
    """SSD bytes read / logical bytes of the pages read from SSD (None without SSD hits;
    :func:`~flatcake.replay.report.ssd_read_amplification`)."""
    ssd_bytes = run["hit_tokens"]["ssd"] // page_size * page_bytes
    return ssd_read_amplification(run["counters"], ssd_bytes) if ssd_bytes else None


def serving_markdown(result: dict[str, Any], figures: Sequence[str] = ()) -> str:
    """One row per (rate, scheduler, system), the configured ``qps`` beside the ``offered qps``
    the run measured; "–" where nothing was measured (e.g. no SSD restore at all); then links
    to ``figures``. Above the table: the prefetch policy and the equal capacities."""
    head = ("| qps | scheduler | system | offered qps | hit rate | backlog hit pages | TTFT mean (s) | TTFT p99 (s) | "
            "queue p99 (s) | SSD prefetch p99 (s) | DRAM-lane wait p99 (s) | declined tok | revoked tok | tok/s | "
            "failed-put pages | verify failures |")
    ideal = result.get("ideal_hit_rate")
    notes = [f"- {policy_note(result.get('engine') or {'prefetch_policy': result.get('prefetch_policy', '?')})}"]
    if result.get("equal_capacity"):
        notes.append(f"- {EqualCapacity(**result['equal_capacity']).note()}")
    rows = [f"Trace `{result['trace']}`, {result['requests']} requests, ideal hit rate "
            f"{'–' if ideal is None else format(ideal, '.2%')}.", "", *notes, "", head, "|" + "---|" * 16]
    if result.get("scale", 1) > 1:
        rows[1:1] = ["", scale_note(result["scale"])]
    def f(v, spec=".3f"):
        return "–" if v is None else format(v, spec)

    for r in result["runs"]:
        rows.append(f"| {r['qps']:g} | {r['scheduler']} | {r['system']} | {f(r.get('offered_qps'), '.3g')} | "
                    f"{f(r['delivered_hit_rate'], '.2%')} | {r.get('backlog_hit_pages', 0):,} | "
                    f"{f(r['ttft_s']['mean'])} | {f(r['ttft_s']['p99'])} | {f(r['queue_s']['p99'])} | "
                    f"{f(r['ssd_prefetch_s']['p99'])} | {f(r['dram_lane_wait_p99_s'])} | "
                    f"{r['declined_prefetch_tokens']:,} | {r['revoked_prefetch_tokens']:,} | "
                    f"{f(r['tokens_per_s'], ',.0f')} | {r.get('failed_write_pages', 0):,} | {r['verify_failures']} |")
    squeezed = [r for r in result["runs"] if r.get("turns_before_previous_answer")]
    if squeezed:
        worst = max(squeezed, key=lambda r: r["turns_before_previous_answer"])
        rows += ["", f"Note: in {len(squeezed)} run(s) some turns arrived before the previous turn of their "
                 f"conversation was answered (up to {worst['turns_before_previous_answer']} of {worst['requests']} "
                 f"requests, at {worst['qps']:g} QPS), which the arrival model should prevent (a turn waits for "
                 "the previous turn's answer; flatcake/replay/arrivals.py): a bug to report."]
    if figures:
        rows += ["", "Figures: " + ", ".join(f"[{FIGURES[n]}]({n})" for n in figures)]
    return "\n".join(rows) + "\n"


__all__ = ["SCHEDULERS", "parse_rates", "parse_schedulers", "read_amplification", "run_sweep", "serving_markdown",
           "sweep_points", "sweep_pairs"]
