"""Real-server scenarios 7, 8 and 10 (``make e2e``, marked ``e2e_full``): SGLang 0.5.23's own
fault injection in front of FlatCake, its runtime storage-backend endpoints (attach / clear /
detach / re-attach / status), and FlatCake's Prometheus metrics on SGLang's ``/metrics``.

Two server lifetimes in all: the fault-injection server (scenario 7), and one server started with
HiCache but no L3 that gets FlatCake attached at runtime (scenario 8); scenario 10 reads the
metrics of that server's first backup and restore, before the clear (one test, one server).

Waits poll a state (``/flush_cache?timeout=``: SGLang defers the flush until its backups and
prefetches drained; :func:`e2e_kit.wait_metric`), never a clock.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List

import pytest
import requests

from e2e_kit import full_page_tokens, metric_sum, wait_metric
from flatcake.testing.reference import greedy
from flatcake.testing.server import (REQUEST_TIMEOUT_S, CpuServer, ServerSpec, flatcake_storage, metric_samples,
                                     metric_total)
from flatcake.testing.tiny_model import prompt_ids

PAGE = 16
#: bytes of one page of the default tiny Llama: 16 tokens x 8 KiB (2 layers x K,V x 4 heads x 128 x fp32)
PAGE_BYTES = 16 * 8192
ADMIN_KEY = "flatcake-e2e-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

pytestmark = pytest.mark.e2e_full


# ---------------------------------------------------------------------------------------- helpers

def admin(server: CpuServer, method: str, path: str, payload: dict | None = None,
          headers: Dict[str, str] | None = ADMIN) -> requests.Response:
    return requests.request(method, server.url + path, json=payload, headers=headers, timeout=REQUEST_TIMEOUT_S)


def wait_until(server: CpuServer, what: str, read: Callable[[], float], ok: Callable[[float], bool],
               timeout_s: float = 60.0) -> float:
    """Poll ``read()`` until ``ok(value)``; FlatCake's metrics refresh at most once a second."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.5)
        value = read()
    assert ok(value), f"{what} = {value} after {timeout_s} s\n{server.log_tail(20)}"
    return value


def served_pages(prompt_tokens: int) -> int:
    """Pages of a prompt SGLang can serve from a cache (its whole pages but the last token's)."""
    return full_page_tokens(prompt_tokens, PAGE) // PAGE


def stored_pages(prompt_tokens: int, new_tokens: int = 16) -> int:
    """Pages a finished request's backup stores: whole pages of the prompt and the generated
    tokens that have KV (all but the last)."""
    return (prompt_tokens + new_tokens - 1) // PAGE


# ---------------------------------------------------------------------------------------- scenario 7
def test_sglang_fault_injection_keeps_tokens_right_threads_alive_and_storage_serving(tiny_llama, tmp_path, servers):
    """SGLang's own ``HiCacheStorageFailureInjector`` (``mem_cache/hicache_storage.py`` 514-720,
    wrapped around the backend by ``StorageBackendFactory.create_backend`` when either variable is
    set; both are floats): before every data call (``batch_exists`` / ``batch_get_v1`` /
    ``batch_set_v1`` here; also the generic, single-key and v2 calls) it sleeps
    ``uniform(0, RANDOM_DELAY)`` seconds and with probability ``RANDOM_FAILURE`` answers a failure
    (0 / all False) without calling FlatCake; registration, ``clear``, ``get_stats`` and ``close``
    pass straight through. 27 requests in 5 rounds (repeats, a shared prefix, 1-4 concurrent
    clients, a flush after each round), then a restore and a backup that got past the injector."""
    failure, delay = 0.25, 0.1
    spec = ServerSpec(model_path=tiny_llama, page_size=PAGE, storage=flatcake_storage(tmp_path / "pool"),
                      env={"SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE": str(failure),
                           "SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY": str(delay)})
    a = prompt_ids(700, seed=71)
    prompts = {"a": a, "b": prompt_ids(400, seed=72), "c": prompt_ids(300, seed=73),
               "d": a[:480] + prompt_ids(150, seed=74),  # 30 pages shared with a
               "e": prompt_ids(200, seed=75)}
    with ThreadPoolExecutor(1) as bg:  # the transformers references while the server starts
        refs = bg.submit(lambda: {k: greedy(tiny_llama, ids, 16) for k, ids in prompts.items()})
        server = servers(spec, tmp_path, "faults")
        expected = refs.result()
    log = server.log_text()
    assert f"HiCache storage test injector enabled (random_delay_limit={delay}s, failure_prob={failure})" in log
    # FlatCake's FC-MAS plugin finds FlatCake behind the injector: its lanes run the prefetches
    assert "flatcake plugin: FC-MAS lanes drive" in log

    answers = []  # (round, name, Generation)

    def run(round_no: int, names: List[str], workers: int) -> None:
        with ThreadPoolExecutor(workers) as pool:
            for name, g in zip(names, pool.map(lambda n: server.generate(prompts[n]), names)):
                answers.append((round_no, name, g))
        server.flush()

    run(1, ["a", "b", "c", "d", "e"], 1)
    run(2, ["a", "b", "c", "d", "e", "a"], 4)
    run(3, ["d", "c", "b", "a", "e", "b"], 4)
    run(4, ["e", "d", "c", "b", "a"], 3)
    run(5, ["a", "c", "e", "b", "d"], 1)
    assert len(answers) == 27

    for round_no, name, g in answers:
        assert g.output_ids == expected[name], (round_no, name, g.meta)
        assert g.storage_tokens <= full_page_tokens(len(prompts[name]), PAGE)
    assert server.alive()

    # after the faulty workload the storage path still works: a flushed prompt is served from
    # FlatCake (each try fails at the injector with probability 1 - 0.75^2; 12 tries)
    later = []
    for _ in range(12):
        g = server.generate(prompts["a"])
        later.append(g)
        assert g.output_ids == expected["a"]
        if g.storage_tokens > 0:
            break
        server.flush()
    assert later[-1].storage_tokens > 0, [g.meta.get("cached_tokens_details") for g in later]
    # ... and the backup thread still stores: a fresh prompt whose backup the injector did not fail
    # (SGLang logs "Write page to storage: N pages failed" for each one it did) reaches FlatCake
    for i in range(8):
        fresh = prompt_ids(300, seed=90 + i)
        written = metric_sum(server, "flatcake_pages_written_total")
        failed = server.log_text().count("Write page to storage")
        g = server.generate(fresh)
        assert g.output_ids == greedy(tiny_llama, fresh, 16)
        server.flush()  # returns once its backup finished, stored or failed
        if server.log_text().count("Write page to storage") == failed:
            wait_metric(server, "flatcake_pages_written_total", written + stored_pages(len(fresh)))
            break
    else:
        pytest.fail("every fresh backup failed at the injector")
    assert requests.get(server.url + "/health_generate", timeout=60).status_code == 200

    log = server.log_text()
    # the injector did fail calls: SGLang logs a failed read or a failed backup batch
    injected = log.count("failed to retrieve page") + log.count("Write page to storage")
    assert injected > 0, "no injected failure seen in the log"
    # no thread died, nothing raised into SGLang's controller / scheduler
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:log.index("Traceback") + 3000]
    assert "Exception in thread" not in log
    assert metric_sum(server, "flatcake_pages_indexed") > 0
    assert wait_metric(server, "flatcake_mas_prefetches_total", 1) >= 1  # the lanes ran prefetches


# ---------------------------------------------------------------------------------------- scenarios 8 + 10
def test_runtime_attach_metrics_clear_detach_reattach(tiny_llama, tmp_path, servers):
    pool = tmp_path / "pool"
    a, c, b = prompt_ids(700, seed=81), prompt_ids(500, seed=82), prompt_ids(420, seed=83)
    spec = ServerSpec(model_path=tiny_llama, page_size=PAGE, storage=None, extra_args=["--admin-api-key", ADMIN_KEY])
    with ThreadPoolExecutor(1) as bg:  # the transformers references while the server starts
        refs = bg.submit(lambda: {k: greedy(tiny_llama, ids, 16) for k, ids in (("a", a), ("b", b), ("c", c))})
        server = servers(spec, tmp_path, "attach")
        expected = refs.result()
    status = admin(server, "GET", "/hicache/storage-backend").json()
    assert status["hicache_storage_backend"] is None

    cfg = flatcake_storage(pool)
    attach_req = {"hicache_storage_backend": "dynamic", "hicache_storage_backend_extra_config_json": json.dumps(cfg)}
    assert admin(server, "PUT", "/hicache/storage-backend", attach_req, headers=None).status_code == 401
    r = admin(server, "PUT", "/hicache/storage-backend", attach_req)
    assert r.status_code == 200, r.text + server.log_tail(40)
    assert "HiCache storage backend attached" in r.text
    status = admin(server, "GET", "/hicache/storage-backend").json()
    assert status["hicache_storage_backend"] == "dynamic"
    extra = json.loads(status["hicache_storage_backend_extra_config"])
    assert (extra["backend_name"], extra["class_name"], extra["ssd.path"]) == ("flatcake", "FlatCakeStorage", str(pool))
    assert server.log_text().count("flatcake: per-rank capacity") == 1

    # pages a request can be served from storage (whole pages of the prompt but its last token) and
    # pages its backup stores (whole pages of prompt + the 15 generated tokens that have KV)
    ha, hb = served_pages(len(a)), served_pages(len(b))  # 43, 26
    sa, sb, sc = stored_pages(len(a)), stored_pages(len(b)), stored_pages(len(c))  # 44, 27, 32

    # ---- backup, flush, restore from FlatCake
    first = server.generate(a)
    assert first.output_ids == expected["a"] and first.storage_tokens == 0
    wait_metric(server, "flatcake_pages_indexed", sa)
    server.flush(headers=ADMIN)
    again = server.generate(a)
    assert again.storage_tokens == ha * PAGE, again.meta
    assert (again.device_tokens, again.host_tokens) == (0, 0)
    assert again.output_ids == expected["a"]

    # ---- scenario 10: FlatCake's metrics and SGLang's storage histograms for that backup + restore
    wait_metric(server, "flatcake_hit_pages_total", ha)
    wait_metric(server, "sglang:prefetch_pgs_sum", ha)
    text = server.metrics()
    fc = metric_samples(text, "flatcake_")
    shown = "\n".join(line for line in text.splitlines()
                      if line.startswith(("flatcake_", "sglang:prefetch_pgs", "sglang:backup_pgs")))
    assert fc, "no flatcake_* metric on /metrics"
    pool_label = fc[0][1].get("pool", "")
    assert re.fullmatch(r"fc-[0-9a-f]{16}", pool_label), pool_label
    for name, lab, _ in fc:
        assert (lab.get("pool"), lab.get("tp_rank"), lab.get("pp_rank"), lab.get("dp_rank")) == (pool_label, "0", "0", "0"), (name, lab)
    assert f"pool {pool_label} in {pool}" in server.log_text()  # the label names the pool's files

    def metric(name: str, **labels: str) -> float:
        return metric_total(text, name, **labels)

    assert metric("flatcake_pages_written_total") == sa, shown
    assert metric("flatcake_pages_written_total", medium="ssd") == sa, "a one-shot prompt is placed on the SSD\n" + shown
    assert metric("flatcake_pages_indexed") == sa, shown
    assert metric("flatcake_scopes") >= 1, shown
    assert metric("flatcake_hit_pages_total") == ha, shown
    assert metric("flatcake_hit_pages_total", medium="ssd") == ha, shown
    assert metric("flatcake_restores_total") == 1, shown
    assert metric("flatcake_ssd_read_bytes_total") - metric("flatcake_ssd_over_read_bytes_total") == ha * PAGE_BYTES, shown
    assert metric("flatcake_ssd_read_ops_total") >= 1 and metric("flatcake_merged_reads_total") >= 1, shown
    assert metric("flatcake_restore_seconds_total") > 0, shown
    assert metric("flatcake_ssd_write_bytes_total") >= sa * PAGE_BYTES, shown
    assert metric("flatcake_used_bytes", medium="ssd") >= sa * PAGE_BYTES, shown
    assert metric("flatcake_capacity_bytes", medium="ssd") == 2 * (64 << 20), shown
    assert metric("flatcake_capacity_bytes", medium="dram") == 16 << 20, shown
    assert metric("flatcake_medium_state", medium="ssd", state="healthy") == 1, shown
    for name in ("flatcake_put_failures_total", "flatcake_get_failures_total", "flatcake_io_errors_total",
                 "flatcake_checksum_failures_total", "flatcake_quarantined_scopes_total"):
        assert metric(name) == 0, name + "\n" + shown
    # SGLang's own storage histograms, observed from get_stats(): one read of ha pages, sa pages backed up
    assert metric("sglang:prefetch_pgs_sum", storage_backend="dynamic") == ha, shown
    assert metric("sglang:prefetch_pgs_count", storage_backend="dynamic") == 1, shown
    assert metric("sglang:backup_pgs_sum", storage_backend="dynamic") == sa, shown
    assert metric("sglang:backup_pgs_count", storage_backend="dynamic") >= 1, shown
    assert metric("sglang:prefetch_bandwidth_count", storage_backend="dynamic") == 1, shown

    # ---- a second prompt stored, then clear: neither is served from storage any more
    server.generate(c)
    wait_metric(server, "flatcake_pages_indexed", sa + sc)
    reclaimed = metric_sum(server, "flatcake_reclaimed_scopes_total")
    r = admin(server, "POST", "/hicache/storage-backend/clear")
    assert r.status_code == 200, r.text
    wait_until(server, "flatcake_pages_indexed", lambda: metric_sum(server, "flatcake_pages_indexed"), lambda v: v == 0)
    assert metric_sum(server, "flatcake_reclaimed_scopes_total") > reclaimed
    server.flush(headers=ADMIN)
    cleared = server.generate(a)
    assert cleared.storage_tokens == 0, cleared.meta
    assert cleared.output_ids == expected["a"]
    # a is stored again by that request (SGLang forgot what L3 held at the clear); c is not requested
    wait_metric(server, "flatcake_pages_indexed", sa)
    server.generate(b)
    wait_metric(server, "flatcake_pages_indexed", sa + sb)

    # ---- detach: the server goes on without L3
    server.flush(headers=ADMIN)
    r = admin(server, "DELETE", "/hicache/storage-backend")
    assert r.status_code == 200, r.text + server.log_tail(30)
    assert admin(server, "GET", "/hicache/storage-backend").json()["hicache_storage_backend"] is None
    server.flush(headers=ADMIN)
    detached = server.generate(b)
    assert detached.storage_tokens == 0 and detached.output_ids == expected["b"]

    # ---- re-attach on the same pool: the cleared pages stay gone, the others are served
    server.flush(headers=ADMIN)
    r = admin(server, "PUT", "/hicache/storage-backend", attach_req)
    assert r.status_code == 200, r.text + server.log_tail(40)
    assert admin(server, "GET", "/hicache/storage-backend").json()["hicache_storage_backend"] == "dynamic"
    assert server.log_text().count("flatcake: per-rank capacity") == 2
    log = server.log_text()
    assert log.count(f"pool {pool_label} in {pool}") == 2  # the same pool re-opened
    # from its journal: a and b, stored after the clear; c's cleared pages are not brought back
    assert f"flatcake: rebuilt {sa + sb} pages in 2 scopes from {pool}/{pool_label}.journal" in log
    server.flush(headers=ADMIN)
    got_b = server.generate(b)
    assert got_b.storage_tokens == hb * PAGE, got_b.meta
    assert got_b.output_ids == expected["b"]
    got_c = server.generate(c)  # cleared before the detach: the re-open does not bring it back
    assert got_c.storage_tokens == 0, got_c.meta
    assert got_c.output_ids == expected["c"]
    got_a = server.generate(a)  # stored again after the clear: served
    assert got_a.storage_tokens == ha * PAGE, got_a.meta
    assert got_a.output_ids == expected["a"]

    # one pool label throughout; counters monotonic across the re-open (c stored again now)
    wait_metric(server, "flatcake_pages_indexed", sa + sb + sc)
    text = server.metrics()
    assert {lab["pool"] for _, lab, _ in metric_samples(text, "flatcake_")} == {pool_label}
    assert metric_total(text, "flatcake_pages_indexed") == sa + sb + sc
    assert metric_total(text, "flatcake_pages_written_total") == (sa + sc) + (sa + sb) + sc

    r = admin(server, "DELETE", "/hicache/storage-backend")
    assert r.status_code == 200, r.text
    log = server.log_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:log.index("Traceback") + 3000]
    assert "hicache_storage_pass_prefix_keys off" not in log
