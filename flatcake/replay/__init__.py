"""Trace replay (the main job): real request traces through an engine model and SGLang's L3
storage contract, FlatCake and SGLang's file backend side by side, with real bytes on real disk.

Modules, in data-flow order:

* :mod:`~flatcake.replay.traces`: Mooncake JSONL and WEKA Claude Code archive readers →
  :class:`~flatcake.replay.traces.TraceRequest` in arrival order; ideal (infinite-cache) hit rate.
* :mod:`~flatcake.replay.keys`: block ids → chained 64-hex SHA-256 page keys, as SGLang keys pages.
* :mod:`~flatcake.replay.engine`: model profile (KV geometry, prefill cost), HBM LRU prefix cache,
  host-pool free list, deterministic page bytes, and the per-request engine loop.
* :mod:`~flatcake.replay.systems`: the backends under test, called as SGLang's controller calls them.
* :mod:`~flatcake.replay.arrivals` and :mod:`~flatcake.replay.serving`: under load, when each
  request arrives (the rate sets conversation starts; a turn waits for the previous answer) and
  the concurrent serving model; :mod:`~flatcake.replay.sweep` runs it per rate and system.
* :mod:`~flatcake.replay.report`: ``summary.json`` / ``summary.md`` / TTFT CDF.
* :mod:`~flatcake.replay.cli`: ``flatcake-replay`` (also ``scripts/replay_trace.py``).

See ``docs/replay.md``.
"""
