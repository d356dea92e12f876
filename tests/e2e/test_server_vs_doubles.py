"""The real server's L3 calls against the replay's models of them, on one scenario.

FlatCake's knowledge of how SGLang drives an L3 backend (hit queries, 128-page prefetch reads,
backups) came from doubles: the replay's sequential engine model
(:class:`flatcake.replay.engine.Engine`) and its concurrent serving model
(:class:`flatcake.replay.serving.ServingModel`), both calling a real :class:`FlatCakeStorage`
(SGLang's own ``dynamic`` factory) over the host-pool doubles of
:mod:`flatcake.adapter.host_pool`. Here one scenario runs through all three — the real SGLang
0.5.23 server (CPU engine, HiCache in its default cache mode, ``write_through``, FlatCake as L3
through ``dynamic``) and both models with the same page size, prompts, device/HBM and host pool
sizes, prefetch threshold — and the calls FlatCake counted (``flatcake_sglang_calls_total``,
``flatcake_sglang_call_pages_total``, read from ``/metrics``; ``flatcake_stats()`` in the models)
must be equal: calls and pages of ``batch_exists`` (asked, present), ``batch_get_v1`` (asked,
delivered) and ``batch_set_v1`` (asked, stored), and nothing through the generic methods. Per
request, the tokens the server reports from the device cache and from storage must be the
pages the models took from HBM and from L3.

Scenario (page size 16, the server's default prefetch threshold of 256 tokens, 4 output tokens):
A 600 tokens; B 700 sharing A's first 400 (25 pages); E 600 sharing A's first 500 (31 pages:
its 6 new pages are under the threshold, so no hit query); C exactly 320 tokens (20 pages);
D 2100 tokens (131 pages: reads and writes of 128 + 3). Then ``/flush_cache`` and the same five
again: every prompt comes back from L3, B's and E's shared prefix from the device cache.

Differences the comparison does not count, on purpose:

* SGLang warms up with a request at start-up whose page it backs up (one ``batch_set_v1`` before
  ``/health_generate`` answers): the server's counts are taken after it, as deltas.
* SGLang also stores the pages a request's *output* completes (prompt and output go into its
  radix tree when the request finishes; one more ``batch_set_v1`` per request, and after a
  restore the same page again). The models have no output KV (a trace gives no output tokens'
  content). The scenario's outputs complete no page (4 tokens after tails of 0 to 12 tokens).
* The host-memory mode: with ``--hicache-host-memory-mode buffer_only`` (what ``flatcake-sglang``
  starts) SGLang remembers which keys storage holds and does not back up a page again: on this
  scenario its second round makes no ``batch_set_v1`` call (E's 6 pages and C's 20th are
  stored), 6 calls and 212 pages in all; everything else is as here (checked by hand). The
  models, like the default cache mode run here, back them up again; FlatCake answers "stored"
  without writing (its put skips keys it holds), so only these counts differ.
* ``prefix_keys``: SGLang passes hit queries and prefetch reads only the keys before the radix
  node the request's match ends in (``None`` for a hit query when there are none: B's after its
  25 device pages; a request extending B would get A's 25 keys, not 43), backups every key
  before the call's first key; the models pass every key before it to all three. Counts do not
  see it, but FlatCake's placement did: it read a session's next turn from a hit query's
  ``prefix_keys[-1]`` when none of the query was stored, which on the server is not the
  session's tail when the earlier turn is still in the device or host cache; it now decides it
  when the request's first new page is backed up (``tests/adapter/test_storage_placement.py``).

Fixed by this comparison (the models had them wrong): SGLang reuses at most ``prompt − 1``
tokens, so C (exactly 20 pages) asks L3 for 19 pages, reads 19, and after the flush computes and
backs up its 20th page again; the models asked for, read and reused all 20
(:func:`flatcake.replay.engine.reusable_pages`).
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import pytest

from e2e_kit import metric_sum, wait_metric
from flatcake.metrics import SGLANG_METHODS
from flatcake.testing.server import CpuServer, Generation, ServerSpec, flatcake_storage, metric_values
from flatcake.testing.tiny_model import TinyModelSpec, kv_bytes_per_token, prompt_ids

pytestmark = pytest.mark.e2e_full

PAGE = 16
MAX_NEW_TOKENS = 4
MAX_TOTAL_TOKENS = 4096  # the device KV pool: 256 pages (the models' HBM)
HICACHE_RATIO = 2.0  # the host pool: 512 pages
PREFETCH_THRESHOLD = 256  # SGLang's default storage prefetch threshold (tokens)
METHODS = tuple(SGLANG_METHODS)  # batch_exists, batch_get_v1, batch_set_v1 and the generic ones
ROUNDS = 2  # the five prompts, /flush_cache, the five again


def scenario() -> List[Tuple[str, List[int]]]:
    a = prompt_ids(600, seed=11)
    return [("A", a),
            ("B", a[:400] + prompt_ids(300, seed=12)),
            ("E", a[:500] + prompt_ids(100, seed=16)),
            ("C", prompt_ids(320, seed=13)),
            ("D", prompt_ids(2100, seed=14))]


def page_keys(ids: Sequence[int]) -> List[str]:
    """SGLang's own storage keys of the prompt's whole pages (its chained SHA-256)."""
    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    whole = len(ids) // PAGE * PAGE
    return list(get_storage_hash_str(list(ids[:whole]), None, page_size=PAGE)) if whole else []


# ------------------------------------------------------------------------------------ the models
def _profile():
    from flatcake.replay.engine import ModelProfile

    spec = TinyModelSpec(kind="llama")
    prof = ModelProfile(name="tiny-llama", attention="mha", layers=spec.layers, kv_heads=spec.kv_heads,
                        head_dim=spec.head_dim, dtype="float32", page_size=PAGE, layout="page_first_direct")
    assert prof.bytes_per_token == kv_bytes_per_token(spec)
    return prof


def _engine_config():
    from flatcake.replay.engine import EngineConfig

    return EngineConfig(hbm_pages=MAX_TOTAL_TOKENS // PAGE, host_pool_pages=int(MAX_TOTAL_TOKENS * HICACHE_RATIO) // PAGE,
                        prefetch_threshold_tokens=PREFETCH_THRESHOLD, prefetch_policy="wait_complete")


def _system(tmp_path, name: str):
    from flatcake.replay.systems import make_system

    own = {k: v for k, v in flatcake_storage(tmp_path).items() if "." in k and k != "ssd.path"}
    return make_system("flatcake", _profile(), _engine_config().host_pool_pages, tmp_path / name, own)


def _calls(system) -> Dict[str, dict]:
    return system.inner.flatcake_stats()["sglang_calls"]


def run_engine(tmp_path, prompts) -> Tuple[Dict[str, dict], List[Tuple[int, int]]]:
    """The sequential engine model: per request ``(HBM tokens, L3 tokens)``, and the calls."""
    from flatcake.replay.engine import Engine

    system = _system(tmp_path, "engine")
    engine = Engine(system, _profile(), _engine_config())
    got = []
    try:
        for _ in range(ROUNDS):
            for _, ids in prompts:
                o = engine.run(page_keys(ids), len(ids))
                assert o.verify_failures == 0 and o.failed_write_pages == 0
                got.append((o.hbm_pages * PAGE, o.l3_pages * PAGE))
            engine.flush()
        return _calls(system), got
    finally:
        system.close()


def run_serving(tmp_path, prompts) -> Tuple[Dict[str, dict], List[Tuple[int, int]]]:
    """The concurrent serving model, each round a fresh model (a flushed HBM) on one system; the
    five prompts are the turns of one conversation, so each waits for the previous answer, as
    the test's client does."""
    from flatcake.replay.serving import ServingConfig, ServingModel
    from flatcake.replay.traces import TraceRequest

    system = _system(tmp_path, "serving")
    reqs = [TraceRequest(arrival_s=float(i), namespace="scenario", session="scenario", block_ids=(),
                         block_tokens=PAGE, prompt_tokens=len(ids), output_tokens=MAX_NEW_TOKENS)
            for i, (_, ids) in enumerate(prompts)]
    keys = [page_keys(ids) for _, ids in prompts]
    got = []
    try:
        for _ in range(ROUNDS):
            model = ServingModel(system, _profile(), _engine_config(), ServingConfig(qps=1.0, think_time_scale=0.0))
            for r in model.run(reqs, keys):
                assert r.verify_failures == 0 and r.failed_write_pages == 0
                got.append((r.hbm_pages * PAGE, r.delivered * PAGE))
        return _calls(system), got
    finally:
        system.close()


# ------------------------------------------------------------------------------------ the server
def server_calls(server: CpuServer) -> Dict[str, dict]:
    """``flatcake_sglang_*`` from ``/metrics``, as ``flatcake_stats()["sglang_calls"]`` gives them."""
    text = server.metrics()
    out: Dict[str, dict] = {m: {"calls": 0} for m in METHODS}
    for lab, v in metric_values(text, "flatcake_sglang_calls_total"):
        out[lab["method"]]["calls"] += int(v)
    for lab, v in metric_values(text, "flatcake_sglang_call_pages_total"):
        row = out[lab["method"]]
        row[lab["what"]] = row.get(lab["what"], 0) + int(v)
    return out


def delta(after: Dict[str, dict], before: Dict[str, dict]) -> Dict[str, dict]:
    return {m: {k: v - before.get(m, {}).get(k, 0) for k, v in row.items()} for m, row in after.items()}


def settled(server: CpuServer, at_least: Dict[str, dict] | None = None, quiet_s: float = 4.0,
            timeout_s: float = 180.0) -> Dict[str, dict]:
    """The server's counts once they have not moved for ``quiet_s`` seconds (FlatCake refreshes
    its metrics at most once a second; backups finish after the answers) and, when given, every
    count has reached ``at_least`` (the models' counts, so a slow backup is waited for and an
    extra call still shows)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        now = server_calls(server)
        if now != last:
            last, since = now, time.monotonic()
        reached = at_least is None or all(now[m].get(k, 0) >= v for m, row in at_least.items() for k, v in row.items())
        if reached and time.monotonic() - since >= quiet_s:
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def test_the_servers_l3_calls_are_the_replay_models_calls(tiny_llama, tmp_path, servers):
    prompts = scenario()
    engine_calls, engine_hits = run_engine(tmp_path, prompts)
    serving_calls, serving_hits = run_serving(tmp_path, prompts)

    spec = ServerSpec(model_path=tiny_llama, page_size=PAGE, max_total_tokens=MAX_TOTAL_TOKENS,
                      hicache_ratio=HICACHE_RATIO, storage=flatcake_storage(tmp_path / "pool"))
    server = servers(spec, tmp_path, "vs-doubles")
    baseline = settled(server)  # SGLang's warm-up request backed up its page before /health_generate
    indexed = metric_sum(server, "flatcake_pages_indexed")
    unique_pages = len({k for _, ids in prompts for k in page_keys(ids)})
    answers: List[Generation] = []
    for rnd in range(ROUNDS):
        if rnd:
            # every page of the first round backed up first (a flush drops backups still pending)
            wait_metric(server, "flatcake_pages_indexed", indexed + unique_pages, timeout_s=180)
            settled(server)
            server.flush()
        for _, ids in prompts:
            answers.append(server.generate(ids, max_new_tokens=MAX_NEW_TOKENS))
    at_least = {m: {k: v + baseline[m].get(k, 0) for k, v in row.items()} for m, row in engine_calls.items()}
    real = delta(settled(server, at_least), baseline)
    server_hits = [(g.device_tokens + g.host_tokens, g.storage_tokens) for g in answers]

    names = [f"{rnd}:{n}" for rnd in range(ROUNDS) for n, _ in prompts]
    report = (f"\nrequest (device+host, storage tokens): server {dict(zip(names, server_hits))}"
              f"\n  engine {dict(zip(names, engine_hits))}\n  serving {dict(zip(names, serving_hits))}"
              f"\ncalls: server {real}\n  engine {engine_calls}\n  serving {serving_calls}")
    assert server_hits == engine_hits == serving_hits, report
    assert real == engine_calls == serving_calls, report
    # the scenario's numbers, derived by hand (module docstring): 205 = 37 + 18 + 19 + 131 pages
    assert real["batch_exists"] == {"calls": 8, "asked": 410, "present": 205}, report
    assert real["batch_get_v1"] == {"calls": 5, "asked": 205, "delivered": 205}, report
    # first round: 37 + 18 + 6 + 20 + 128 + 3 in 6 calls; second: E's 6 pages and C's 20th again
    assert real["batch_set_v1"] == {"calls": 8, "asked": 219, "stored": 219}, report
    assert all(real[m]["calls"] == 0 for m in ("batch_get", "batch_set", "exists", "get", "set")), report
    # the restores served the same bytes: the same greedy tokens as before the flush
    n = len(prompts)
    assert [g.output_ids for g in answers[n:]] == [g.output_ids for g in answers[:n]]
