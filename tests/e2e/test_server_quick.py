"""The real-server tests ``make test`` runs: SGLang 0.5.23's own server (CPU engine, HiCache, its
scheduler, cache controller, prefetch and backup threads) with FlatCake as L3.

One server started through ``flatcake-sglang --hicache-storage-backend flatcake`` (buffer_only host
memory + the FC-MAS plugin): a prompt is backed up, ``/flush_cache`` drops the device and host
tiers, and the same prompt is served from FlatCake with the tokens of the first run and of a
``transformers`` reference (scenarios 1 and 9 of ``docs/real-server.md``). Then a second server
(plain ``dynamic`` backend) on the same pool, after SGLang killed the first one's scheduler
(``close()`` never ran), serves its first request from FlatCake (scenario 6).
"""

from __future__ import annotations

from e2e_kit import backup_flush_again, full_page_tokens, metric_sum, wait_metric
from flatcake.testing.reference import greedy
from flatcake.testing.server import ServerSpec, flatcake_storage
from flatcake.testing.tiny_model import prompt_ids

PAGE = 16


def test_launcher_server_serves_flushed_prompt_from_flatcake_and_a_restart_serves_it_again(tiny_llama, tmp_path, servers):
    pool = tmp_path / "pool"
    ids = prompt_ids(700, seed=1)
    expected = greedy(tiny_llama, ids, 16)
    stored = full_page_tokens(len(ids), PAGE)  # 688 tokens: 43 pages of 16

    spec = ServerSpec(model_path=tiny_llama, page_size=PAGE, storage=flatcake_storage(pool), launcher=True)
    server = servers(spec, tmp_path, "launcher")
    log = server.log_text()
    assert "--hicache-host-memory-mode buffer_only" in log or "buffer_only" in log
    assert "flatcake plugin: FC-MAS lanes drive" in log

    again = backup_flush_again(server, ids, expected, PAGE)
    assert again.storage_tokens == stored

    # the plugin's lanes ran the prefetch: it needed SSD pages (a one-shot prompt is placed on SSD)
    assert wait_metric(server, "flatcake_mas_prefetches_total", 1, lane="ssd") >= 1
    assert metric_sum(server, "flatcake_hit_pages_total") == stored // PAGE
    server.stop()

    restarted = servers(ServerSpec(model_path=tiny_llama, page_size=PAGE, storage=flatcake_storage(pool)),
                        tmp_path, "restarted")
    after = restarted.generate(ids)
    assert after.storage_tokens == stored, after.meta
    assert after.output_ids == expected
