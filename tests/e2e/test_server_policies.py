"""Real-server scenarios 2-5 of the real-server issue (``make e2e``): SGLang 0.5.23's own HiCache
policies, host layouts and page sizes in front of FlatCake, on a real CPU server (tiny Llama).

Four server lifetimes, each a (layout, page size, prefetch policy, write policy) combination, so
every value appears at least once and every layout and page size is asserted served from storage
in full pages:

====  ==================  ====  ==============  =======================  =====================================
test  host layout         page  prefetch        write                    also
====  ==================  ====  ==============  =======================  =====================================
1     page_first_direct   16    wait_complete   write_through            eviction (no flush); 16 concurrent
                                                                         multi-turn conversations
2     layer_first         64    timeout         write_through_selective  once-seen prompt not backed up
3     layer_first         1     wait_complete   write_back               eviction (no flush), then flush
4     page_first_direct   64    best_effort     write_through
====  ==================  ====  ==============  =======================  =====================================

What SGLang promises, and so what is asserted (``sglang/srt/mem_cache/unified_radix_cache.py``,
``unified_cache/unified_tree_core.py``):

* ``write_through``: a node is backed up to host, then L3, when inserted (hit threshold 1);
  ``write_through_selective``: only once hit twice (threshold 2: a prompt sent once is never
  backed up, a prompt sent twice is); ``write_back``: nothing is written until the device evicts
  the node (the host copy is then written to L3 when its D2H write is acknowledged).
* ``wait_complete``: a request waits for its whole L3 prefetch, so every stored full page is
  served from storage. ``timeout``: waits up to ``prefetch_timeout_base`` +
  ``prefetch_timeout_per_ki_token`` per 1024 tokens; test 2 sets the base to 60 s, so a prefetch
  that completes within a minute must be served whole. ``best_effort``: the scheduler takes what
  has arrived when it first looks, possibly nothing: only the tokens and the page granularity are
  asserted.
* Every answer equals the ``transformers`` greedy reference of its ids (a wrong restored byte
  changes the tiny model's greedy tokens: ``../shared/design/sglang-cpu-server-facts.md``).

Waits poll a state, never a clock: backups are drained when SGLang's host-to-storage counter
(``sglang:backuped_tokens_total``) reaches its device-to-host counter
(``sglang:hicache_backup_tokens_total``) and FlatCake indexes the pages; flushes go through
``/flush_cache?timeout=`` (SGLang defers them until the scheduler is idle).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import requests

from e2e_kit import assert_from_storage, full_page_tokens, wait_metric
from flatcake.metrics import REFRESH_S
from flatcake.testing.reference import greedy
from flatcake.testing.server import (REQUEST_TIMEOUT_S, CpuServer, Generation, ServerSpec, flatcake_storage,
                                     metric_total)
from flatcake.testing.tiny_model import prompt_ids

pytestmark = pytest.mark.e2e_full

#: the prompt length the storage checks use (43 / 10 / 699 full pages of 16 / 64 / 1 tokens)
PROMPT = 700
#: ``ssd.file_bytes`` for 64-token pages: one SGLang backup batch (128 pages of 512 KiB plus
#: headers) needs 65 MiB (``flatcake.adapter.startup.min_file_bytes``)
FILE_BYTES_PAGE64 = 72 << 20
#: SGLang's metrics of the two backup stages: device -> host (D2H) and host -> storage (L3)
HOST_BACKUP = "sglang:hicache_backup_tokens_total"
L3_BACKUP = "sglang:backuped_tokens_total"


# ---------------------------------------------------------------------------------------- helpers

def total(server: CpuServer, name: str, text: Optional[str] = None) -> float:
    """The sum of metric ``name`` over its samples (``text``: a ``/metrics`` page already read)."""
    return metric_total(server.metrics() if text is None else text, name)


def wait_backups_drained(server: CpuServer, host_tokens: int, timeout_s: float = 180.0) -> Tuple[float, float]:
    """Poll ``/metrics`` until SGLang wrote at least ``host_tokens`` tokens device -> host and
    every token it wrote to host also reached storage (L3 backups acknowledged). Returns
    ``(host, l3)`` tokens.

    Raises:
        AssertionError: not drained within ``timeout_s`` (the message holds both counters).
    """
    deadline = time.monotonic() + timeout_s
    host = l3 = 0.0
    while time.monotonic() < deadline:
        text = server.metrics()
        host, l3 = total(server, HOST_BACKUP, text), total(server, L3_BACKUP, text)
        if host >= host_tokens and l3 >= host:
            return host, l3
        time.sleep(0.5)
    raise AssertionError(f"backups not drained after {timeout_s} s: {HOST_BACKUP} = {host} "
                         f"(wanted >= {host_tokens}), {L3_BACKUP} = {l3}\n{server.log_tail(20)}")


def storage_spec(model: str, workdir: Path, page: int, layout: str, prefetch: str, write: str,
                 max_total_tokens: int = 4096, hicache_ratio: float = 2.0, **storage: object) -> ServerSpec:
    """A FlatCake server spec: a small pool in ``workdir/pool`` (72 MiB pool files for 64-token
    pages)."""
    if page == 64:
        storage.setdefault("ssd.file_bytes", FILE_BYTES_PAGE64)
    return ServerSpec(model_path=model, page_size=page, layout=layout, max_total_tokens=max_total_tokens,
                      hicache_ratio=hicache_ratio, prefetch_policy=prefetch, write_policy=write,
                      storage=flatcake_storage(workdir / "pool", **storage))


def flush_check(server: CpuServer, model: str, page: int, seed: int, sends: int = 1) -> Tuple[Generation, List[int]]:
    """Send a prompt ``sends`` times (reference tokens each time), wait until its backups reached
    FlatCake, flush the device and host tiers, and send it again. Returns the last answer and the
    reference tokens (the caller asserts what the prefetch policy promises)."""
    ids = prompt_ids(PROMPT, seed=seed)
    expected = greedy(model, ids)
    stored_pages = full_page_tokens(len(ids), page) // page
    text = server.metrics()
    host0, indexed0 = total(server, HOST_BACKUP, text), total(server, "flatcake_pages_indexed", text)
    for i in range(sends):
        g = server.generate(ids)
        assert g.output_ids == expected, f"send {i}: tokens differ from the reference"
        assert g.storage_tokens == 0, g.meta
    wait_backups_drained(server, host0 + stored_pages * page)
    wait_metric(server, "flatcake_pages_indexed", indexed0 + stored_pages)
    server.flush()
    return server.generate(ids), expected


# ------------------------------------------------------------------------ 16 concurrent conversations
SYSTEM_TOKENS = 128
CONVERSATIONS = 16
TURNS = 3


def _post_all(server: CpuServer, prompts: Sequence[List[int]]) -> List[Tuple[int, dict]]:
    """POST every prompt to ``/generate`` at once (one thread each, released together); returns
    ``(status, body)`` per prompt."""
    out: List[Tuple[int, dict]] = [(-1, {})] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        try:
            r = requests.post(server.url + "/generate", timeout=REQUEST_TIMEOUT_S, json={
                "input_ids": prompts[i],
                "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}})
            out[i] = (r.status_code, r.json() if r.status_code == 200 else {"text": r.text})
        except Exception as e:  # reported by the caller's assert, with the others
            out[i] = (-1, {"error": repr(e)})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _full_pages(ids: Sequence[int], page: int) -> set:
    """The full pages of a prompt SGLang stores, each named by the token prefix it ends (the
    storage key is a hash of that prefix, so equal prefixes are one page)."""
    return {tuple(ids[:end]) for end in range(page, full_page_tokens(len(ids), page) + 1, page)}


def conversations(server: CpuServer, model: str, page: int) -> Dict[int, List[Generation]]:
    """16 conversations sharing a 128-token system prompt, 3 turns each, every turn posted by 16
    threads at once; turn ``t + 1`` is turn ``t``'s prompt + its answer + new user ids. Between
    turns, once every prompt page the conversations sent is indexed by FlatCake and SGLang's
    backups drained, the device and host tiers are flushed, so later turns' prefixes come from
    FlatCake. Asserts every answer (HTTP 200, consistent cache counts, the reference tokens,
    computed in a thread while the server works); returns the answers per turn."""
    wait_backups_drained(server, 0)
    time.sleep(REFRESH_S + 0.5)  # FlatCake's gauges refresh once a second: read a settled one
    indexed0 = total(server, "flatcake_pages_indexed")
    system = prompt_ids(SYSTEM_TOKENS, seed=500)
    prompts = [system + prompt_ids(40 + 3 * c, seed=1000 + c) for c in range(CONVERSATIONS)]
    sent_pages: set = set()
    answers: Dict[int, List[Generation]] = {}
    checks: List[Tuple[str, List[int], Future]] = []
    with ThreadPoolExecutor(max_workers=1) as reference:
        for turn in range(TURNS):
            results = _post_all(server, prompts)
            bad = [(c, status, body) for c, (status, body) in enumerate(results) if status != 200]
            assert not bad, f"turn {turn + 1}: answers other than 200: {bad[:3]}\n{server.log_tail(30)}"
            gens = [Generation.from_response(body) for _, body in results]
            for c, (ids, g) in enumerate(zip(prompts, gens)):
                assert g.prompt_tokens == len(ids), g.meta
                assert g.cached_tokens == g.device_tokens + g.host_tokens + g.storage_tokens, g.meta
                assert g.cached_tokens <= full_page_tokens(len(ids), page), g.meta
                assert g.storage_tokens % page == 0, g.meta
                checks.append((f"turn {turn + 1} conversation {c}", g.output_ids, reference.submit(greedy, model, ids)))
                sent_pages |= _full_pages(ids, page)
            answers[turn] = gens
            if turn + 1 == TURNS:
                break
            # every full prompt page sent so far is in FlatCake and no backup is in flight: flush
            wait_metric(server, "flatcake_pages_indexed", indexed0 + len(sent_pages), timeout_s=180)
            wait_backups_drained(server, 0)
            server.flush()
            prompts = [ids + g.output_ids + prompt_ids(24 + 5 * c + 7 * turn, seed=2000 + 100 * turn + c)
                       for c, (ids, g) in enumerate(zip(prompts, gens))]
        for what, got, want in checks:
            assert got == want.result(), f"{what}: tokens differ from the transformers reference"
    return answers


# ---------------------------------------------------------------------------------------------- tests
def test_page_first_direct_16_write_through_wait_complete_eviction_and_conversations(tiny_llama, tmp_path, servers):
    """page_first_direct, 16-token pages, wait_complete, write_through (scenarios 2, 3, 4, 5).

    * flush check: a prompt backed up, flushed, served again: all 43 full pages from storage
      (FlatCake delivered exactly 43 pages), reference tokens;
    * eviction, no flush: a prompt, then 9 other prompts (6300 tokens) through a 2048-token device
      pool and a 3072-token host pool: the first prompt comes back with all its full pages from
      storage, none from device or host, reference tokens;
    * 16 concurrent 3-turn conversations sharing a system prompt: all HTTP 200, every answer the
      reference of its ids, and turns 2 and 3 (after a flush) served partly from storage.
    """
    page = 16
    spec = storage_spec(tiny_llama, tmp_path, page, "page_first_direct", "wait_complete", "write_through",
                        max_total_tokens=2048, hicache_ratio=1.5, prefetch_threshold=32,
                        **{"ssd.max_files": 4})
    server = servers(spec, tmp_path, "pfd16")

    # scenarios 4/5: backup -> flush -> again
    hits0 = total(server, "flatcake_hit_pages_total")
    again, expected = flush_check(server, tiny_llama, page, seed=11)
    assert_from_storage(again, page, expected, "write_through + wait_complete after flush")
    pages = again.storage_tokens // page
    assert wait_metric(server, "flatcake_hit_pages_total", hits0 + pages) == hits0 + pages

    # scenario 2: evicted through device and host by other prompts, no flush
    first_ids = prompt_ids(PROMPT, seed=21)
    first_expected = greedy(tiny_llama, first_ids)
    host0 = total(server, HOST_BACKUP)
    first = server.generate(first_ids)
    assert first.output_ids == first_expected
    assert first.cached_tokens == 0, first.meta  # a new prompt
    # in storage before the others come (SGLang keeps a node in host until its L3 write is acked)
    wait_backups_drained(server, host0 + full_page_tokens(PROMPT, page))
    others = [prompt_ids(PROMPT, seed=22 + i) for i in range(9)]
    assert len(others) * PROMPT > total(server, "sglang:hicache_host_total_tokens") + spec.max_total_tokens
    for ids in others:
        assert server.generate(ids).cached_tokens == 0  # nothing shared with the first prompt
    back = server.generate(first_ids)
    assert_from_storage(back, page, first_expected, "evicted through device and host")

    # scenario 3: 16 concurrent multi-turn conversations; turns 2 and 3 follow a flush
    answers = conversations(server, tiny_llama, page)
    for turn in (1, 2):
        storage = sum(g.storage_tokens for g in answers[turn])
        assert storage > 0, f"turn {turn + 1}: nothing from storage: {[g.meta for g in answers[turn][:2]]}"


def test_layer_first_64_write_through_selective_timeout(tiny_llama, tmp_path, servers):
    """layer_first, 64-token pages, timeout (60 s base), write_through_selective (scenarios 4, 5).

    A prompt sent once is never backed up (selective writes a node hit twice): after a flush it
    gets nothing from storage. A prompt sent twice is backed up: after a flush all its 10 full
    pages come from storage within the timeout, reference tokens.
    """
    page = 64
    spec = storage_spec(tiny_llama, tmp_path, page, "layer_first", "timeout", "write_through_selective",
                        prefetch_timeout_base=60)
    server = servers(spec, tmp_path, "lf64")

    once_ids = prompt_ids(PROMPT, seed=31)
    once_expected = greedy(tiny_llama, once_ids)
    assert server.generate(once_ids).output_ids == once_expected
    assert total(server, HOST_BACKUP) == 0  # hit once: selective writes nothing (the health checks fill no page)
    # the twice-sent prompt's backups are queued after anything the first could have queued
    twice, expected = flush_check(server, tiny_llama, page, seed=32, sends=2)
    assert_from_storage(twice, page, expected, "write_through_selective, sent twice, timeout policy")

    once = server.generate(once_ids)
    assert once.output_ids == once_expected
    assert (once.device_tokens, once.host_tokens, once.storage_tokens) == (0, 0, 0), once.meta


def test_layer_first_1_write_back_wait_complete_eviction(tiny_llama, tmp_path, servers):
    """layer_first, 1-token pages, wait_complete, write_back (scenarios 2, 4, 5).

    write_back writes nothing while the prompt stays on the device; 5 other prompts evict it
    through a 1024-token device pool (write-back to host, then to storage) and a 1536-token host
    pool: it comes back with all 699 tokens from storage, reference tokens. Then after a flush it
    is served from storage again.
    """
    page = 1
    spec = storage_spec(tiny_llama, tmp_path, page, "layer_first", "wait_complete", "write_back",
                        max_total_tokens=1024, hicache_ratio=1.5)
    server = servers(spec, tmp_path, "lf1")

    ids = prompt_ids(PROMPT, seed=41)
    expected = greedy(tiny_llama, ids)
    first = server.generate(ids)
    assert first.output_ids == expected and first.cached_tokens == 0
    assert total(server, HOST_BACKUP) == 0  # write_back: nothing leaves the device before eviction

    host_tokens = total(server, "sglang:hicache_host_total_tokens")
    others = [prompt_ids(PROMPT, seed=42 + i) for i in range(5)]
    assert len(others) * PROMPT > host_tokens + spec.max_total_tokens
    for other in others:
        server.generate(other)
    wait_backups_drained(server, full_page_tokens(PROMPT, page))
    back = server.generate(ids)
    assert_from_storage(back, page, expected, "write_back, evicted through device and host")

    server.flush()
    again = server.generate(ids)
    assert_from_storage(again, page, expected, "write_back, after flush")


def test_page_first_direct_64_write_through_best_effort(tiny_llama, tmp_path, servers):
    """page_first_direct, 64-token pages, best_effort, write_through (scenarios 4, 5).

    best_effort takes what arrived when the scheduler first looks: after backup and flush the
    prompt gets nothing from device or host, whole pages (possibly none: 0 in the runs inspected on
    the 2-core machine, the scheduler looks before the read lands) from storage, and the reference
    tokens; FlatCake delivered at least the pages SGLang used.
    """
    page = 64
    spec = storage_spec(tiny_llama, tmp_path, page, "page_first_direct", "best_effort", "write_through")
    server = servers(spec, tmp_path, "pfd64")

    again, expected = flush_check(server, tiny_llama, page, seed=51)
    assert again.output_ids == expected
    assert again.device_tokens == 0 and again.host_tokens == 0, again.meta
    assert again.storage_tokens % page == 0 and again.storage_tokens <= full_page_tokens(PROMPT, page), again.meta
    assert again.cached_tokens == again.storage_tokens
    if again.storage_tokens:
        wait_metric(server, "flatcake_hit_pages_total", again.storage_tokens // page)
