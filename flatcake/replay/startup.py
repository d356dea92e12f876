"""How every replay starts (issue 25): the requests and their page keys, FlatCake's keys, the
systems and one engine per system, written once for the one-request-at-a-time replay
(:func:`flatcake.replay.cli.run_replay`), the serving sweep (:func:`flatcake.replay.sweep.run_sweep`)
and the cluster replay (:func:`flatcake.replay.cluster_replay.run_nodes` and each node,
:mod:`flatcake.replay.node_agent`)::

    storage_keys(cfg)                   FlatCake's flattened keys (every config section but
                                        model: and replay:), the systems' capacities come from them
    EngineConfig.from_settings(s)       the engine knobs (flatcake.replay.engine_core)
    load_requests(settings, profile)    the trace's requests in arrival order and their page keys
    make_replay_system(name, ...)       a fresh system at equal capacity: through SGLang's v2
                                        interface for a hybrid profile, else the dense one
    make_engine(system, profile, cfg)   its engine: HybridEngine (hybrid profile) or Engine

Every engine starts cold: an empty HBM prefix cache and an empty host pool over a fresh, empty
store (``make_system`` empties the system's storage directory first).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from flatcake.replay.engine import Engine, ModelProfile
from flatcake.replay.engine_core import EngineConfig
from flatcake.replay.hybrid_engine import HybridEngine
from flatcake.replay.hybrid_systems import make_hybrid_system
from flatcake.replay.keys import PageKeyer
from flatcake.replay.systems import make_system
from flatcake.replay.traces import TraceRequest, load_trace


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested sections as dotted keys: ``{"ssd": {"path": p}}`` -> ``{"ssd.path": p}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def storage_keys(cfg) -> dict[str, Any]:
    """FlatCake's keys of a :class:`~flatcake.config.FlatCakeConfig` as the systems take them:
    every section but ``model`` and ``replay``, flattened (``dram.capacity_bytes``, ...)."""
    return flatten(cfg.model_dump(exclude={"model", "replay"}))


def load_requests(settings: Mapping[str, Any], profile: ModelProfile) -> tuple[list[TraceRequest], list[list[str]]]:
    """The trace of the merged replay ``settings`` (``trace``, ``max_requests``, ``sessions``,
    ``session_gap_s``, ``skip_sessions``, ``max_context_tokens``) in arrival order, and each
    request's page keys at ``profile.page_size``.

    Raises:
        flatcake.replay.traces.TraceFormatError: an unreadable trace.
    """
    reqs = load_trace(Path(settings["trace"]), max_requests=settings["max_requests"], sessions=settings["sessions"],
                      session_gap_s=settings["session_gap_s"], skip_sessions=settings["skip_sessions"],
                      max_context_tokens=settings["max_context_tokens"])
    keyer = PageKeyer(profile.page_size)
    return reqs, [keyer.keys(r) for r in reqs]


def make_replay_system(name: str, profile: ModelProfile, settings: Mapping[str, Any], out: Path,
                       fc_keys: Mapping[str, Any]):
    """System ``name`` for a comparison run, at equal capacity, its storage under ``out``: a
    :class:`~flatcake.replay.hybrid_systems.V2System` for a hybrid profile, else an
    :class:`~flatcake.replay.systems.L3System` (``settings``: ``host_pool_pages``,
    ``file_extra``, ``drop_page_cache``, ``tiered_extra``, ``mooncake_extra``).

    Raises:
        ValueError: an unknown system, or one the hybrid replay does not run.
    """
    if profile.hybrid:  # SGLang's v2 pool interface (flatcake/replay/hybrid*.py)
        return make_hybrid_system(name, profile, settings["host_pool_pages"], out, fc_keys, settings["file_extra"],
                                  settings["drop_page_cache"], equal_capacity=True)
    return make_system(name, profile, settings["host_pool_pages"], out, fc_keys, settings["file_extra"],
                       settings["drop_page_cache"], settings["tiered_extra"],
                       mooncake_extra=settings.get("mooncake_extra"), equal_capacity=True)


def make_engine(system, profile: ModelProfile, cfg: EngineConfig):
    """The one-request-at-a-time engine of ``system``: :class:`~flatcake.replay.hybrid_engine.HybridEngine`
    for a hybrid profile, else :class:`~flatcake.replay.engine.Engine`."""
    if profile.hybrid:
        return HybridEngine(system, profile, cfg)
    return Engine(system, profile, cfg)


__all__ = ["flatten", "load_requests", "make_engine", "make_replay_system", "storage_keys"]
