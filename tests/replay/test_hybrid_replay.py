"""Hybrid model profiles (model.pools) replayed through SGLang's v2 pool interface: FlatCake and
HiCacheFile with SGLang's own LogicalHostPool anchor and DeepSeekV4PagedHostPool pools, exact
hit counts derived by hand, every pool's pages verified bit-exact."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from flatcake.config import load_config
from flatcake.replay.cli import REPLAY_DEFAULTS, main, run_replay
from flatcake.replay.engine import ModelProfile
from flatcake.replay.hybrid import HybridPools, PoolContent
from replay_fixtures import mooncake_path  # noqa: F401  (pytest fixture)

PAGE = 64
# a 9 MiB DRAM budget, 8 MiB of it FlatCake's write backlog (equal capacity): a 1 MiB DRAM medium
FC_OVERRIDES = {"dram.capacity_bytes": 9 << 20, "ssd.write_backlog_bytes": 8 << 20, "ssd.file_bytes": 4 << 20,
                "ssd.max_files": 8}
POOLS = [{"name": "deepseek_v4_c4", "layers": 2, "item_bytes": 96},
         {"name": "deepseek_v4_c4_indexer", "layers": 2, "item_bytes": 40},
         {"name": "swa", "layers": 2, "item_bytes": 200, "hit_policy": "trailing_pages", "window_pages": 1}]
PROFILE = Path(__file__).resolve().parents[2] / "configs" / "model-deepseek-v4-flash.yaml"


def hybrid_profile(pools=POOLS) -> ModelProfile:
    return ModelProfile.from_dict({"name": "tiny/dsv4", "attention": "mla", "layers": 2, "kv_cache_dim": 8,
                                   "dtype": "uint8", "page_size": PAGE, "params": 1e6, "q_heads": 2,
                                   "q_head_dim": 32, "gpu_tflops": 100.0, "mfu": 0.5, "pcie_gbps": 10.0,
                                   "pools": pools})


def _run(tmp_path, trace, systems, profile=None, **replay):
    cfg = load_config(None, FC_OVERRIDES)
    settings = {**REPLAY_DEFAULTS, "trace": trace, "systems": systems, "out": tmp_path / "out",
                "prefetch_threshold_tokens": 0, "host_pool_pages": 256, "hbm_pages": 0, **replay}
    return run_replay(cfg, settings, profile or hybrid_profile(), progress=False)


@pytest.mark.parametrize("system", ["flatcake", "file"])
def test_hybrid_mooncake_reuses_restored_by_every_pool_where_the_window_was_stored(tmp_path, mooncake_path, system):
    # As the dense replay (test_replay_e2e): 47 of 88 pages are reusable reuses (r4, exactly
    # 512 tokens, may reuse 7 of its 8 pages: SGLang matches prompt - 1 tokens). The SWA window
    # (1 page) is stored at the end of each request's backup: r0 at page 15, r1 at 23, r2 (block
    # 4) at 7; r1 restores 16 pages (cut at r0's end), r3 24 (r1's end): 40 pages, 2 SWA
    # restores. r4's cut at 7 needs a window at page 6, never stored: no usable prefix, so it
    # computes and writes its 8 pages again (48 written); its window (page 7) is r2's: 5 SWA
    # pages written, 4 of them new.
    s = _run(tmp_path, mooncake_path, [system])
    r = s["systems"][system]
    assert r["hybrid"] is True and r["verify_failures"] == 0 and r["backend_errors"] == 0
    assert r["hit_tokens"]["dram"] + r["hit_tokens"]["backlog"] + r["hit_tokens"]["ssd"] == 40 * PAGE
    assert r["delivered_hit_rate"] == pytest.approx(40 / 88) and s["ideal_hit_rate"] == pytest.approx(47 / 88)
    assert r["written_pages"] == 48 and r["trailing_misses"] == 0
    p = r["pools"]
    for name, pb in (("deepseek_v4_c4", 192), ("deepseek_v4_c4_indexer", 80)):
        assert p[name] == {"hit_policy": "all_pages", "window_pages": None, "page_bytes": pb, "delivered_pages": 40,
                           "verify_failures": 0, "written_pages": 48, **({"counters": p[name]["counters"]}
                                                                        if system == "flatcake" else {})}
    assert (p["swa"]["delivered_pages"], p["swa"]["written_pages"], p["swa"]["verify_failures"]) == (2, 5, 0)
    assert p["swa"]["page_bytes"] == 400 and p["swa"]["window_pages"] == 1
    if system == "file":  # the harness's own accounting: every pool's bytes, one op per page
        assert r["ssd_read_bytes"] == 40 * (192 + 80) + 2 * 400 and r["ssd_read_ops"] == 40 * 2 + 2
        assert r["ssd_write_bytes"] == 40 * (192 + 80) + 4 * 400  # HiCacheFile skips the keys it holds
    else:  # FlatCake's extra-pool stores: each pool read exactly its pages
        assert r["logical_write_bytes"] == 40 * (192 + 80) + 4 * 400
        # per pool, whenever the write queue's writer ran: every hit from DRAM, from the write
        # backlog's in-memory copy (queued_hit_pages, not an SSD hit) or from the disk, every round
        # drained before the counters
        for name, pb, hits, written in (("deepseek_v4_c4", 192, 40, 40), ("deepseek_v4_c4_indexer", 80, 40, 40),
                                        ("swa", 400, 2, 4)):
            c = p[name]["counters"]
            assert c["hit_pages_ssd"] + c["queued_hit_pages"] + c["hit_pages_dram"] == hits
            assert c["logical_write_bytes"] == written * pb
            assert c["logical_read_bytes_ssd"] == c["hit_pages_ssd"] * pb  # read from the disk
        c4 = p["deepseek_v4_c4"]["counters"]  # the page split of the summary is the first pool's
        assert (r["hit_tokens"]["dram"], r["hit_tokens"]["backlog"], r["hit_tokens"]["ssd"]) == \
            (c4["hit_pages_dram"] * PAGE, c4["queued_hit_pages"] * PAGE, c4["hit_pages_ssd"] * PAGE)
    assert s["model"]["pools"][0]["page_bytes"] == 192 and s["model"]["page_bytes"] == 272


def test_a_prefix_without_its_trailing_window_is_not_restored(tmp_path):
    # r0 stores blocks 0,1,2 (24 pages) with its SWA window at page 23. r1 shares blocks 0,1 (16
    # pages) but the SWA state at page 16's cut was never stored: no usable prefix, 0 L3 hits
    # (a dense model would restore 16). r2 repeats r1: its cut at 24 has r1's window -> 24.
    # (1540 tokens: 4 past the 24 pages, so all 24 are reusable; SGLang matches prompt - 1 tokens)
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1540, "output_length": 1, "hash_ids": [0, 1, 2]},
            {"timestamp": 1, "input_length": 1540, "output_length": 1, "hash_ids": [0, 1, 7]},
            {"timestamp": 2, "input_length": 1540, "output_length": 1, "hash_ids": [0, 1, 7]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = _run(tmp_path, trace, ["flatcake", "file"])
    for n in ("flatcake", "file"):
        r = s["systems"][n]
        assert r["l3_query_hit_pages"] == 24
        assert r["hit_tokens"]["ssd"] + r["hit_tokens"]["backlog"] + r["hit_tokens"]["dram"] == 24 * PAGE
        assert r["verify_failures"] == 0 and r["pools"]["swa"]["delivered_pages"] == 1
        assert r["computed_pages"] == 24 + 24


def test_pool_contents_differ_per_pool_and_a_flipped_byte_fails(tmp_path):
    pools = HybridPools(hybrid_profile().pools, 4, PAGE, "page_first")
    c4, idx = (PoolContent(pools.pools[n], n) for n in ("deepseek_v4_c4", "deepseek_v4_c4_indexer"))
    assert (c4.page_bytes, idx.page_bytes) == (192, 80)
    assert pools.pools["deepseek_v4_c4"].num_host_pages == 4 and pools.pools["swa"].num_host_pages == 2  # 2 x window
    assert type(pools.anchor).__name__ == "LogicalHostPool" and pools.anchor.kv_buffer is None
    c4.fill(PAGE, "k")
    idx.fill(PAGE, "k")
    assert c4.verify(PAGE, "k") and idx.verify(PAGE, "k") and not c4.verify(PAGE, "other")
    assert not torch.equal(c4.expected("k")[:80].clone(), idx.expected("k"))  # seeds differ per pool
    pools.pools["deepseek_v4_c4"].kv_buffer[1, 1, 7] ^= 1  # page 1, layer 1, byte 7
    assert not c4.verify(PAGE, "k") and idx.verify(PAGE, "k")


def test_other_systems_are_skipped_and_qps_refused(tmp_path, mooncake_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"ssd": {"file_bytes": 4 << 20, "max_files": 8, "write_backlog_bytes": 8 << 20},
                                   "dram": {"capacity_bytes": 9 << 20},
                                   "model": hybrid_profile().as_dict() | {"pools": POOLS},
                                   "replay": {"trace": str(mooncake_path), "hbm_pages": 0, "host_pool_pages": 256,
                                              "prefetch_threshold_tokens": 0, "plot": False}}))
    out = tmp_path / "o"
    assert main(["--config", str(cfg), "--systems", "flatcake,tiered,dram-only,recompute", "--out", str(out),
                 "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert list(s["systems"]) == ["flatcake", "recompute"]
    assert set(s["skipped_systems"]) == {"tiered", "dram-only"} and "v2" in s["skipped_systems"]["tiered"]
    assert s["systems"]["recompute"]["hit_tokens"]["ssd"] == 0 and s["systems"]["flatcake"]["verify_failures"] == 0
    md = (out / "summary.md").read_text()
    assert "system tiered skipped" in md and "| pool swa: pages restored (verify failures) | 2 (0 bad) | – |" in md
    assert main(["--config", str(cfg), "--qps", "1", "--out", str(out)]) == 2
    assert "--qps" in capsys.readouterr().err
    assert main(["--config", str(cfg), "--systems", "tiered", "--out", str(out)]) == 2


@pytest.mark.parametrize("pools, msg", [
    ([{"name": "kv", "layers": 1, "item_bytes": 8}], "model.pools[0].name"),
    ([{"name": "swa", "layers": 1, "item_bytes": 8, "hit_policy": "trailing_pages"}], "at least one all_pages"),
    ([{"name": "swa", "layers": 0, "item_bytes": 8}], "model.pools[0].layers"),
    ([{"name": "swa", "layers": 1, "item_bytes": 8, "hit_policy": "sometimes"}], "model.pools[0].hit_policy"),
    ([{"name": "swa", "layers": 1, "item_bytes": 8, "colour": 1}], "unknown key"),
])
def test_bad_pools_name_the_field(pools, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        hybrid_profile(pools)


def test_shipped_deepseek_v4_flash_pools_and_scale():
    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import get_dsv4_indexer_bytes_per_token

    p = ModelProfile.from_dict(yaml.safe_load(PROFILE.read_text())["model"])
    pools = {s.name: s for s in p.pools}
    rows_per_page = p.page_size // 4  # C4: one row per 4 tokens
    assert pools["deepseek_v4_c4"].item_bytes == rows_per_page * 584
    assert pools["deepseek_v4_c4_indexer"].item_bytes == rows_per_page * get_dsv4_indexer_bytes_per_token(128, False)
    assert pools["swa"].item_bytes == p.page_size * 584 and pools["swa"].trailing
    assert all(s.layers == 43 for s in p.pools)
    assert p.page_bytes == 1970432 == p.layers * p.kv_cache_dim * p.page_size  # = the effective MLA page
    q = p.scaled(64)
    assert [s.item_bytes for s in q.pools] == [584, 132, 2336] and q.page_bytes == 1970432 // 64
    with pytest.raises(ValueError, match="--scale: 512 must divide model.pools"):
        p.scaled(512)


def test_an_indexer_page_missing_in_the_middle_cuts_the_hit_before_it(tmp_path):
    # No trailing pool: r0 stores 24 pages in both pools through HiCacheFile; the indexer's file
    # of page 10 is then deleted. r1 (same prefix) gets the KV run and C4's 24 pages, but the
    # indexer's boundary is 10: batch_exists_v2 -> 10, 10 pages restored by both pools.
    from flatcake.replay.engine import EngineConfig
    from flatcake.replay.hybrid_engine import HybridEngine
    from flatcake.replay.hybrid_systems import make_hybrid_system
    from flatcake.replay.keys import PageKeyer
    from flatcake.replay.traces import TraceRequest

    prof = hybrid_profile(POOLS[:2])
    sysm = make_hybrid_system("file", prof, 256, tmp_path, {}, {}, drop_cache=False)
    eng = HybridEngine(sysm, prof, EngineConfig(hbm_pages=0, host_pool_pages=256, prefetch_threshold_tokens=0))
    keys = PageKeyer(PAGE).keys(TraceRequest(arrival_s=0.0, namespace="t", session="t", block_ids=(0, 1, 2),
                                             block_tokens=512, prompt_tokens=1536, output_tokens=1))
    assert eng.run(keys, 1536).written_pages == 24
    victim = [f for f in (tmp_path / "hicache-file").iterdir() if f.name.startswith(keys[10] + ".deepseek_v4_c4_indexer")]
    assert len(victim) == 1
    victim[0].unlink()
    o = eng.run(keys, 1536)
    assert (o.l3_query_pages, o.ssd_pages, o.computed_pages) == (10, 10, 14)
    assert o.pool_pages == {"deepseek_v4_c4": 10, "deepseek_v4_c4_indexer": 10} and o.verify_failures == 0
    sysm.close()


def test_model_flag_replaces_the_configs_model(tmp_path, mooncake_path):
    cfg = tmp_path / "c.yaml"
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({"model": hybrid_profile().as_dict() | {"pools": POOLS}}))
    cfg.write_text(yaml.safe_dump({"ssd": {"file_bytes": 4 << 20, "max_files": 8}, "dram": {"capacity_bytes": 1 << 20},
                                   "model": {"profile": "nowhere.yaml"},
                                   "replay": {"trace": str(mooncake_path), "hbm_pages": 0, "host_pool_pages": 256,
                                              "prefetch_threshold_tokens": 0, "plot": False}}))
    out = tmp_path / "o"
    assert main(["--config", str(cfg), "--model", str(prof), "--systems", "file", "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["model"]["name"] == "tiny/dsv4" and s["config"]["model"] == {"profile": str(prof.resolve())}
    assert s["systems"]["file"]["hit_tokens"]["ssd"] == 40 * PAGE and s["systems"]["file"]["verify_failures"] == 0


def test_disk_budget_counts_every_pool_and_each_requests_trailing_window(tmp_path, mooncake_path, monkeypatch):
    import flatcake.replay.cli as cli

    seen = []
    monkeypatch.setattr(cli, "check_disk_budget", lambda names, nbytes, *a, **k: seen.append(nbytes) or {})
    _run(tmp_path, mooncake_path, ["file"])
    assert seen == [40 * (192 + 80) + 5 * 400]  # 40 unique pages of both all_pages pools + 5 SWA windows


def test_pages_sglangs_controller_backs_up_are_restored_by_the_replay(tmp_path):
    """SGLang 0.5.23's own HybridCacheController code (built with __new__, as
    tests/adapter/test_v2_controller.py) backs up one request through the replay's FlatCake v2
    system; the replay's HybridEngine then restores every page of every pool bit-exact: the
    replay's v2 calls and SGLang's agree on keys, transfers and hit policies."""
    import contextlib
    import queue
    from types import SimpleNamespace

    from flatcake.replay.engine import EngineConfig
    from flatcake.replay.hybrid_engine import HybridEngine
    from flatcake.replay.hybrid_systems import make_hybrid_system
    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    try:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
        from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as m
        from sglang.srt.mem_cache.utils import get_storage_hash_str
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SGLang's cache controller does not import here ({type(e).__name__}: {e})")

    class Group:
        def __init__(self, pools):
            self.entry_map = {PoolName(n): SimpleNamespace(host_pool=p) for n, p in pools.items()}

        @contextlib.contextmanager
        def layout_lease(self):
            yield

    prof = hybrid_profile()
    sysm = make_hybrid_system("flatcake", prof, 256, tmp_path, FC_OVERRIDES)
    hp = sysm.hybrid
    cc = m.HybridCacheController.__new__(m.HybridCacheController)
    cc.storage_backend, cc.storage_backend_type = sysm.backend, "dynamic"
    cc.page_size, cc.storage_host_pool = PAGE, hp.anchor
    cc.mem_pool_host = Group(hp.pools)
    cc.page_get_func, cc.page_set_func = cc._page_get_zero_copy, cc._page_set_zero_copy
    cc.storage_config = sysm.backend.storage_config
    cc.prefetch_sync_queue, cc.prefetch_hits_sync_groups = queue.Queue(), []

    n = 5
    tokens = list(range(1000, 1000 + n * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    eng = HybridEngine(sysm, prof, EngineConfig(hbm_pages=0, host_pool_pages=256, prefetch_threshold_tokens=0))
    kv_slots = torch.arange(n * PAGE, dtype=torch.int64)
    for s in hp.derived:
        for i, k in enumerate(keys):
            eng.content[s.name].fill(i * PAGE, k)
    eng.content["swa"].fill(0, keys[-1])  # the SWA window: the last page, at SWA host page 0
    op = m.StorageOperation(kv_slots, tokens, hash_value=list(keys), prefix_keys=[], pool_transfers=[
        PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(PAGE, dtype=torch.int64), keys=keys[-1:],
                     hit_policy=PoolHitPolicy.TRAILING_PAGES),
        *[PoolTransfer(name=PoolName(s.name), indices_from_pool=PoolName.KV) for s in hp.derived]])
    cc._page_backup_with_stable_layout(op)
    assert op.completed_tokens == n * PAGE

    # one token past the n pages SGLang backed up (a prompt of exactly n pages may reuse n - 1,
    # and the SWA window at page n - 2 was never stored)
    o = eng.run(keys, n * PAGE + 1)
    assert (o.l3_query_pages, o.dram_pages + o.ssd_pages, o.computed_pages, o.trailing_misses) == (n, n, 0, 0)
    assert o.pool_pages == {"deepseek_v4_c4": n, "deepseek_v4_c4_indexer": n, "swa": 1} and o.verify_failures == 0
    sysm.close()
