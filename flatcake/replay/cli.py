"""``flatcake-replay`` / ``python scripts/replay_trace.py``: replay a real trace through FlatCake and
SGLang's file backend side by side, with real bytes on real disk.

Usage::

    flatcake-replay --config configs/demo.yaml --out runs/demo
    flatcake-replay --trace ../shared/traces/mooncake/conversation_trace.jsonl \\
        --config configs/demo.yaml --max-requests 300 --systems flatcake,file --out runs/mc

Every flag defaults to the config's ``replay:`` section (then to built-in defaults), so the first
line is the whole demo. Input paths in the config (``replay.trace``, ``model.profile``) are
relative to the config file; ``--out`` and paths given on the command line to the current
directory. Outputs in ``--out``: ``summary.json``, ``summary.md`` (printed at the end) and
``requests.csv`` (one row per request and system) and ``ttft_cdf.png``. The storage directories
(``<out>/hicache-file``, ``<out>/flatcake-ssd``) are emptied at the start and removed at the end
unless ``replay.keep_data`` / ``--keep-data``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from tqdm import tqdm

from flatcake.common.align import ALIGN
from flatcake.config import ConfigError, FlatCakeConfig, load_config, read_yaml
from flatcake.replay.budget import DiskBudgetError, check_disk_budget, equal_capacity, file_max_size
from flatcake.replay.engine import EngineConfig, ModelProfile, RequestOutcome, reusable_counts
from flatcake.replay.hybrid_engine import hybrid_summary
from flatcake.replay.hybrid_systems import restrict_to_hybrid
from flatcake.replay.report import markdown, plot_ttft_cdf, policy_label, system_summary
from flatcake.replay.startup import load_requests, make_engine, make_replay_system, storage_keys
from flatcake.replay.sweep import parse_rates, parse_schedulers, run_sweep, serving_markdown
from flatcake.replay.systems import FIXED_SCHEDULER, FLATCAKE_SYSTEMS, STORAGE_DIRS, SYSTEMS
from flatcake.replay.traces import DEFAULT_SESSION_GAP_S, TraceFormatError, detect_format, ideal_hit_rate

log = logging.getLogger("flatcake.replay")

_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL_PROFILE = _CONFIGS / "model-qwen2.5-0.5b.yaml"

#: replay-section keys of the harness, with their defaults (``docs/replay.md`` lists them with
#: units); the engine model's keys and defaults are :class:`EngineConfig`'s fields, added below
HARNESS_DEFAULTS: dict[str, Any] = {
    "trace": None,
    "systems": ["flatcake", "file"],
    "max_requests": None,
    "out": "runs/replay",
    "sessions": None,  # WEKA: conversations to read (archive order)
    "session_gap_s": DEFAULT_SESSION_GAP_S,  # WEKA: seconds between conversation starts
    "skip_sessions": 0,
    "max_context_tokens": None,  # WEKA: skip conversations with a larger prompt
    "drop_page_cache": True,
    "keep_data": False,
    "file_extra": {},  # HiCacheFile's extra config; max_size defaults to FlatCake's SSD capacity
    "tiered_extra": {},  # tiered baseline: bucket_bytes, staging_bytes, io_depth (docs/baselines.md)
    "mooncake_extra": {},  # mooncake: lease_ttl_ms, bucket_bytes, staging_bytes, ... (docs/baselines.md)
    "think_time_scale": 1.0,  # --qps: factor on the gaps between a conversation's turns
    "disk_budget": True,  # refuse a run that would not fit on the output's file system
    "plot": True,  # write ttft_cdf.png (matplotlib)
}

#: every replay-section key and its default: the harness's plus :class:`EngineConfig`'s
REPLAY_DEFAULTS: dict[str, Any] = {**HARNESS_DEFAULTS, **{f.name: f.default for f in dataclasses.fields(EngineConfig)}}


def _resolve(path: Optional[str], base: Path) -> Optional[Path]:
    if path is None:
        return None
    p = Path(os.path.expanduser(str(path)))
    return p if p.is_absolute() else (base / p)


def resolve_model(cfg: FlatCakeConfig, config_dir: Path) -> ModelProfile:
    """The model profile: ``model.profile`` (a YAML file with a ``model:`` section, relative to
    the config) overlaid with the other ``model.*`` keys; default ``configs/model-qwen2.5-0.5b.yaml``."""
    m = dict(cfg.model or {})
    prof_path = _resolve(m.pop("profile", None), config_dir) if "profile" in m else None
    if prof_path is None and not m:
        prof_path = DEFAULT_MODEL_PROFILE
    base: dict = {}
    if prof_path is not None:
        base = dict(read_yaml(prof_path).get("model") or {})
        base.pop("profile", None)
    base.update(m)
    return ModelProfile.from_dict(base)


def replay_settings(cfg: FlatCakeConfig, args: argparse.Namespace, config_dir: Path) -> dict[str, Any]:
    """Merge built-in defaults < config ``replay:`` < command-line flags."""
    rp = dict(cfg.replay or {})
    unknown = set(rp) - set(REPLAY_DEFAULTS)
    if unknown:
        raise ConfigError(f"replay: unknown key(s) {sorted(unknown)}")
    s = {**REPLAY_DEFAULTS, **rp}
    if s["trace"] is not None:
        s["trace"] = _resolve(s["trace"], config_dir)
    if args.trace:
        s["trace"] = Path(args.trace)
    if args.systems is not None:
        s["systems"] = [x.strip() for x in args.systems.split(",") if x.strip()]
        if not s["systems"]:
            raise ConfigError("--systems: name at least one system")
    if isinstance(s["systems"], str):
        s["systems"] = [x.strip() for x in s["systems"].split(",") if x.strip()]
    for flag in ("max_requests", "out", "sessions", "hbm_pages", "think_time_scale"):
        v = getattr(args, flag)
        if v is not None:
            s[flag] = v
    if args.keep_data:
        s["keep_data"] = True
    if args.ignore_disk_budget:
        s["disk_budget"] = False
    for key in ("max_requests", "sessions"):
        if s.get(key) is not None and s[key] < 1:
            raise ConfigError(f"replay.{key}: must be at least 1 (got {s[key]})")
    from flatcake.replay.mooncake import check_extra

    from flatcake.replay.tiered import check_extra as check_tiered_extra

    try:
        s["mooncake_extra"] = check_extra(s["mooncake_extra"] or {})
        check_tiered_extra(s.get("tiered_extra") or {})  # validated only: its defaults are merged where scaled
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if float(s["think_time_scale"]) < 0:
        raise ConfigError(f"replay.think_time_scale: must be >= 0 (got {s['think_time_scale']})")
    if s.get("hbm_pages") is not None and s["hbm_pages"] < 0:
        raise ConfigError(f"replay.hbm_pages: must be >= 0 (got {s['hbm_pages']})")
    if s["prefetch_policy"] not in EngineConfig.POLICIES:
        raise ConfigError(f"replay.prefetch_policy: must be one of {', '.join(EngineConfig.POLICIES)} "
                          f"(got {s['prefetch_policy']!r})")
    bad = [x for x in s["systems"] if x not in SYSTEMS]
    if bad:
        raise ConfigError(f"replay.systems: unknown system(s) {bad} (known: {', '.join(SYSTEMS)})")
    if s["trace"] is None:
        raise ConfigError("replay.trace: no trace given (use --trace PATH or replay.trace)")
    if not Path(s["trace"]).exists():
        raise ConfigError(f"replay.trace: not found: {s['trace']} (the public traces live in the shared/ folder "
                          "beside the repository: ../shared/traces/; give another path with --trace PATH)")
    if Path(s["out"]).exists() and not Path(s["out"]).is_dir():
        raise ConfigError(f"replay.out: not a directory: {s['out']}")
    return s


def apply_scale(cfg: FlatCakeConfig, settings: dict, profile: ModelProfile, n: int):
    """``--scale N``: page bytes (:meth:`ModelProfile.scaled`) and every capacity divided by
    ``n`` — ``dram.capacity_bytes``, ``ssd.file_bytes`` (rounded down to 4 KiB; ``max_files``
    kept), ``ssd.write_backlog_bytes`` and ``cio.staging_bytes`` when set, and the byte sizes in
    ``file_extra``/``tiered_extra``/``mooncake_extra``
    — so pages per medium, and with them hit rates, placement and reclaim, are as at full size.
    Page counts (HBM, host pool) and token thresholds are unchanged. Returns ``(cfg, settings,
    profile)``; ``settings["scale"]`` records ``n``.

    Raises:
        ValueError: ``n`` does not divide the model's KV dimension, or a capacity would round to
            0 (messages name ``--scale``).
    """
    profile = profile.scaled(n)

    def down(v: int, field: str) -> int:
        out = (int(v) // n) // ALIGN * ALIGN
        if v and out == 0:
            raise ValueError(f"--scale: {field}={v} divided by {n} rounds to 0")
        return out

    upd = {"dram": {"capacity_bytes": down(cfg.dram.capacity_bytes, "dram.capacity_bytes")},
           "ssd": {"file_bytes": down(cfg.ssd.file_bytes, "ssd.file_bytes"),
                   "write_backlog_bytes": down(cfg.ssd.write_backlog_bytes, "ssd.write_backlog_bytes")}}
    if cfg.cio.staging_bytes:
        upd["cio"] = {"staging_bytes": down(cfg.cio.staging_bytes, "cio.staging_bytes")}
    cfg = load_config(None, {**cfg.model_dump(), **{k: {**getattr(cfg, k).model_dump(), **v} for k, v in upd.items()}})
    settings = dict(settings, scale=n)
    from flatcake.replay.tiered import DEFAULT_BUCKET_BYTES, DEFAULT_STAGING_BYTES

    settings["tiered_extra"] = {"bucket_bytes": DEFAULT_BUCKET_BYTES, "staging_bytes": DEFAULT_STAGING_BYTES,
                                **dict(settings.get("tiered_extra") or {})}  # its defaults scale too
    file_extra = dict(settings.get("file_extra") or {})
    if file_max_size(file_extra):  # an int or a size string ("2G"), parsed as HiCacheFile does
        file_extra["max_size"] = down(file_max_size(file_extra), "file_extra.max_size")
    settings["file_extra"] = file_extra
    settings["tiered_extra"] = {k: down(v, f"tiered_extra.{k}") if k in ("bucket_bytes", "staging_bytes") else v
                                for k, v in settings["tiered_extra"].items()}  # io_depth is a count, not bytes
    from flatcake.replay.mooncake import check_extra

    mc = check_extra(settings.get("mooncake_extra") or {})  # its defaults scale too
    settings["mooncake_extra"] = {**mc, **{k: down(mc[k], f"mooncake_extra.{k}") for k in ("bucket_bytes", "staging_bytes")}}
    return cfg, settings, profile


def _disk_bytes(root: Path) -> int:
    """Bytes allocated on disk under ``root`` (st_blocks * 512)."""
    total = 0
    if root.exists():
        for dirpath, _dirs, files in os.walk(root):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                except OSError:
                    pass
    return total


def _replay_requests(engines: dict, reqs, keys, progress: bool) -> dict[str, list[RequestOutcome]]:
    """Serve every request on every system's engine, one request at a time, rotating which
    system goes first so neither always meets a warmer or colder disk."""
    names = list(engines)
    outcomes: dict[str, list[RequestOutcome]] = {n: [] for n in names}
    bar = tqdm(total=len(reqs), desc="replay", unit="req", disable=not progress, file=sys.stderr)
    hit = dict.fromkeys(names, 0)  # running delivered-hit pages, for the bar
    seen_pages = 0
    for i, (r, ks) in enumerate(zip(reqs, keys)):
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            o = engines[n].run(ks, r.prompt_tokens)
            outcomes[n].append(o)
            hit[n] += o.hbm_pages + o.l3_pages
        seen_pages += len(ks)
        bar.update(1)
        if progress:
            bar.set_postfix({n: f"{hit[n] / max(1, seen_pages):.1%}" for n in names}, refresh=False)
    bar.close()
    return outcomes


def _close_systems(systems: dict, out: Path, keep_data: bool) -> tuple[dict, dict]:
    """Final counters and on-disk bytes of every system; closes them and, unless ``keep_data``,
    removes their storage directories. Returns ``(counters, disk_bytes)``."""
    counters, disk = {}, {}
    for n, s in systems.items():
        try:
            counters[n] = s.counters()
        except Exception:
            counters[n] = {}
        s.close()
        if n not in STORAGE_DIRS:
            disk[n] = 0
            continue
        root = out / STORAGE_DIRS[n]
        disk[n] = _disk_bytes(root)
        if not keep_data:
            shutil.rmtree(root, ignore_errors=True)
    return counters, disk


def _write_requests_csv(path: Path, outcomes: dict[str, list[RequestOutcome]]) -> None:
    """One row per request and system (``ssd_pages`` by placement, ``backlog_pages`` of them
    served from FlatCake's write backlog in memory)."""
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request", "system", "pages", "prompt_tokens", "hbm_pages", "l3_query_pages",
                    "dram_pages", "ssd_pages", "backlog_pages", "computed_pages", "written_pages",
                    "failed_write_pages", "verify_failures", "query_s", "read_s", "load_s", "prefill_s", "ttft_s",
                    "write_s"])
        for n, outs in outcomes.items():
            for i, o in enumerate(outs):
                w.writerow([i, n, o.pages, o.prompt_tokens, o.hbm_pages, o.l3_query_pages, o.dram_pages,
                            o.ssd_pages, o.backlog_pages, o.computed_pages, o.written_pages, o.failed_write_pages,
                            o.verify_failures, f"{o.query_s:.6f}", f"{o.read_s:.6f}", f"{o.load_s:.6f}",
                            f"{o.prefill_s:.6f}", f"{o.ttft_s:.6f}", f"{o.write_s:.6f}"])


def run_replay(cfg: FlatCakeConfig, settings: dict[str, Any], profile: ModelProfile,
               progress: bool = True) -> dict[str, Any]:
    """Replay ``settings['trace']`` through every system and write the outputs.

    Returns:
        The summary (also written to ``<out>/summary.json``).
    """
    out = Path(settings["out"])
    trace = Path(settings["trace"])
    t0 = time.perf_counter()
    reqs, keys = load_requests(settings, profile)
    hits, total = ideal_hit_rate(keys, reusable_counts(reqs, keys, profile.page_size))
    unique = len({k for ks in keys for k in ks})
    load_s = time.perf_counter() - t0

    ecfg = EngineConfig.from_settings(settings)
    fc_keys = storage_keys(cfg)
    names = list(settings["systems"])
    if settings["disk_budget"]:  # all systems hold their data at once
        est = unique * profile.page_bytes + len(reqs) * profile.trailing_bytes  # hybrid: + each request's window
        check_disk_budget(names, est, fc_keys, settings["file_extra"], out, together=True)
    capacity = equal_capacity(fc_keys) if set(names) & set(FLATCAKE_SYSTEMS) else None  # ValueError: B > D
    out.mkdir(parents=True, exist_ok=True)  # only once the trace has been read and the run fits
    systems = {n: make_replay_system(n, profile, settings, out, fc_keys) for n in names}  # hybrid: v2 systems
    try:
        outcomes = _replay_requests({n: make_engine(systems[n], profile, ecfg) for n in names}, reqs, keys, progress)
    finally:
        counters, disk = _close_systems(systems, out, settings["keep_data"])

    fmt = detect_format(trace)
    summary: dict[str, Any] = {
        "trace": os.path.normpath(str(trace)),
        "trace_format": fmt,
        "requests": len(reqs),
        "sessions": len({r.session for r in reqs}) if fmt == "weka" else None,
        "prompt_pages": total,
        "unique_pages": unique,
        "ideal_hit_rate": hits / total if total else None,
        "model": {**profile.as_dict(), "page_bytes": profile.page_bytes,
                  "bytes_per_token": profile.bytes_per_token},
        "engine": ecfg.__dict__,
        "prefetch_policy": ecfg.prefetch_policy,
        **({"equal_capacity": capacity.as_dict()} if capacity is not None else {}),
        "trace_load_s": load_s,
        "scale": settings.get("scale", 1),
        "timings_meaningful": settings.get("scale", 1) == 1,
        "skipped_systems": dict(settings.get("skipped_systems", {})),
        "systems": {},
    }
    for n in names:
        s = system_summary(outcomes[n], counters.get(n, {}), profile.page_size, profile.page_bytes,
                           sum(o.wall_s for o in outcomes[n]), systems[n].errors)
        s["disk_bytes_at_end"] = disk.get(n, 0)
        if profile.hybrid:
            s.update(hybrid_summary(outcomes[n], counters.get(n, {}), systems[n]))
        summary["systems"][n] = s
    summary["config"] = {
        "replay": {k: (str(v) if isinstance(v, Path) else v) for k, v in settings.items()},
        "flatcake": cfg.model_dump(exclude={"model", "replay"}),
        "model": cfg.model,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    if settings.get("plot", True):
        plot_ttft_cdf({n: [o.ttft_s for o in outcomes[n]] for n in names}, out / "ttft_cdf.png",
                      title=policy_label(ecfg.__dict__))
    _write_requests_csv(out / "requests.csv", outcomes)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flatcake-replay",
        description="Replay a real KV-reuse trace through FlatCake and SGLang's file backend.",
    )
    p.add_argument("--config", help="YAML config (FlatCake keys + model: + replay: sections)")
    p.add_argument("--trace", help="trace: Mooncake .jsonl or WEKA .tar.xz")
    p.add_argument("--model", help="model profile YAML (a model: section) replacing the config's model: section")
    p.add_argument("--systems", help="comma-separated systems (default flatcake,file)")
    p.add_argument("--max-requests", type=int, help="replay the first N requests (arrival order)")
    p.add_argument("--out", help="output directory (summary.json, summary.md, requests.csv)")
    p.add_argument("--sessions", type=int, help="WEKA: conversations to interleave")
    p.add_argument("--hbm-pages", type=int, help="HBM prefix-cache capacity in pages")
    p.add_argument("--keep-data", action="store_true", help="keep the storage directories")
    p.add_argument("--ignore-disk-budget", action="store_true",
                   help="run even when the systems' estimated disk footprint exceeds the free space")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--scale", type=int, default=1,
                   help="divide page bytes and every capacity by N (hit rates, placement and reclaim as at full "
                        "size; timings not meaningful)")
    p.add_argument("--qps", help="serve under load at these offered rates (req/s, comma-separated; conversations "
                   "start at R / mean requests per conversation): the concurrent serving model, outputs "
                   "summary.json, summary.md and figures")
    p.add_argument("--think-time-scale", type=float,
                   help="with --qps: factor on the gaps between a conversation's turns (default 1: the trace's own)")
    p.add_argument("--scheduler", help="with --qps: prefetch I/O order, fcfs | mas | fcfs,mas (default: the config's mas.scheduler)")
    p.add_argument("--ssd-restores", type=int, help="with --qps: concurrent SSD restores in the mas lanes "
                   "(default: the config's cio.windows)")
    p.add_argument("--nodes", type=int, help="replay on N FlatCake nodes in network namespaces, with and without "
                   "the cluster-wide index (needs root and the cluster extra; flatcake/replay/cluster_replay.py)")
    p.add_argument("--router", choices=("affinity", "round-robin"),
                   help="with --nodes: a conversation's requests to one node (affinity, default) or spread")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config) if args.config else load_config(None)
        config_dir = Path(args.config).resolve().parent if args.config else Path.cwd()
        if args.model:  # --model replaces the config's model: section (path relative to the cwd)
            cfg = cfg.model_copy(update={"model": {"profile": str(Path(args.model).resolve())}})
        profile = resolve_model(cfg, config_dir)
        settings = replay_settings(cfg, args, config_dir)
        if args.scale != 1:
            cfg, settings, profile = apply_scale(cfg, settings, profile, args.scale)
        if profile.hybrid:
            if args.qps is not None:
                raise ValueError("--qps: the serving model does not run a hybrid model profile (model.pools) "
                                 "yet; replay it without --qps")
            restrict_to_hybrid(settings)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"flatcake-replay: {e}", file=sys.stderr)
        return 2
    if args.nodes is not None or args.router is not None:  # several nodes: flatcake/replay/cluster_replay.py
        from flatcake.replay.cluster_replay import run_nodes

        return run_nodes(cfg, settings, profile, args)
    if set(settings["systems"]) & set(FLATCAKE_SYSTEMS):  # FlatCake's write backlog fits its DRAM budget
        try:
            equal_capacity(storage_keys(cfg))
        except ValueError as e:
            print(f"flatcake-replay: {e}", file=sys.stderr)
            return 2
    try:  # serving flags are checked even without --qps: a typo never passes silently
        scheds = parse_schedulers(cfg.mas.scheduler if args.scheduler is None else args.scheduler)
        rates = parse_rates(args.qps) if args.qps is not None else None
        restores = cfg.cio.windows if args.ssd_restores is None else args.ssd_restores
        if restores < 1:
            raise ValueError(f"--ssd-restores: must be at least 1 (got {restores})")
        if rates is None and (args.ssd_restores is not None or args.scheduler is not None):
            raise ValueError("--scheduler and --ssd-restores apply to the serving model: add --qps R")
        fixed = [n for n in settings["systems"] if n in FIXED_SCHEDULER]
        if rates is None and fixed:
            raise ValueError(f"{', '.join(fixed)} differs from flatcake only under load (its prefetch-I/O "
                             "order): add --qps R")
    except ValueError as e:
        print(f"flatcake-replay: {e}", file=sys.stderr)
        return 2
    if "mooncake" in settings["systems"]:  # after every check: a bad flag exits 2 here, not in the namespace
        rc = _mooncake_namespace(settings, sys.argv[1:] if argv is None else list(argv))
        if rc is not None:
            return rc
    t0 = time.perf_counter()
    if rates is not None:
        return _serve(cfg, settings, profile, rates, scheds, restores, t0)
    try:
        summary = run_replay(cfg, settings, profile, progress=not args.no_progress)
    except TraceFormatError as e:
        print(f"flatcake-replay: replay.trace: {e}", file=sys.stderr)
        return 2
    except DiskBudgetError as e:
        print(f"flatcake-replay: {e}", file=sys.stderr)
        return 2
    print(markdown(summary))
    print(f"wrote {Path(settings['out']) / 'summary.json'} in {time.perf_counter() - t0:.1f} s")
    bad = sum(s["verify_failures"] for s in summary["systems"].values())
    return 1 if bad else 0


def _mooncake_namespace(settings: dict, argv: list) -> Optional[int]:
    """The ``mooncake`` system runs only inside a network namespace (its listeners bind all
    addresses): outside one, run this replay again inside a new one and return its exit status;
    where that cannot be done, drop the system, record why in ``settings["skipped_systems"]``
    and return None (the replay goes on without it)."""
    from flatcake.replay import mooncake

    reason = mooncake.unavailable_reason()
    if reason is None and not os.environ.get(mooncake.NETNS_ENV):
        try:
            return mooncake.run_in_namespace(argv)
        except RuntimeError as e:
            reason = str(e)
    if reason is not None:
        print(f"flatcake-replay: skipping system mooncake: {reason}", file=sys.stderr)
        settings["systems"] = [n for n in settings["systems"] if n != "mooncake"]
        settings["skipped_systems"] = {**settings.get("skipped_systems", {}), "mooncake": reason}
    return None


def _serve(cfg: FlatCakeConfig, settings: dict, profile: ModelProfile, rates: list, scheds: list, restores: int,
           t0: float) -> int:
    """``--qps``: the concurrent serving sweep (:mod:`flatcake.replay.sweep`)."""
    try:
        ecfg = EngineConfig.from_settings(settings)
        fc_keys = storage_keys(cfg)
        result = run_sweep(fc_keys, settings, profile, ecfg, rates, scheds, restores)
    except (ValueError, TraceFormatError) as e:
        print(f"flatcake-replay: {e}", file=sys.stderr)
        return 2
    print(serving_markdown(result))
    print(f"wrote {Path(settings['out']) / 'summary.json'} in {time.perf_counter() - t0:.1f} s")
    return 1 if any(r["verify_failures"] for r in result["runs"]) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
