"""Short end-to-end replays on the tiny fixtures through SGLang's file backend and FlatCake,
with exact hit counts derived by hand (see the comments) and every page read back verified."""

import json

import pytest
import yaml

from flatcake.config import load_config
from flatcake.replay.cli import REPLAY_DEFAULTS, main, run_replay
from replay_fixtures import mooncake_path, tiny_profile, weka_path  # noqa: F401  (pytest fixtures)

PAGE = 64
PAGE_BYTES = 16384  # tiny profile: 256 B/token x 64 tokens

# every system's DRAM budget is 9 MiB, of which FlatCake's write backlog takes 8 MiB (equal capacity:
# docs/baselines.md), leaving it a 1 MiB DRAM medium
FC_OVERRIDES = {"dram.capacity_bytes": 9 << 20, "ssd.write_backlog_bytes": 8 << 20, "ssd.file_bytes": 4 << 20,
                "ssd.max_files": 8}
L3_MEDIA = ("dram", "backlog", "ssd")


def l3_tokens(r) -> int:
    """Hit tokens delivered from L3, whatever served them (DRAM, FlatCake's write backlog, SSD)."""
    return sum(r["hit_tokens"][m] for m in L3_MEDIA)


def _run(tmp_path, trace, profile, systems, **replay):
    cfg = load_config(None, FC_OVERRIDES)
    settings = {**REPLAY_DEFAULTS, "trace": trace, "systems": systems, "out": tmp_path / "out",
                "prefetch_threshold_tokens": 0, "host_pool_pages": 256, **replay}
    return run_replay(cfg, settings, profile, progress=False)


@pytest.mark.parametrize("system", ["file", "flatcake", "dram-only", "tiered"])
def test_mooncake_without_hbm_every_reuse_comes_from_l3(tmp_path, mooncake_path, tiny_profile, system):
    # 48 of the 88 pages were seen before, but r4 (block 4, exactly 512 tokens = 8 pages) can
    # reuse only 7: SGLang matches at most prompt - 1 tokens, so it computes its 8th page again
    # and writes it again (a key the L3 already holds): 47 hits, 41 pages computed and written
    s = _run(tmp_path, mooncake_path, tiny_profile, [system], hbm_pages=0)
    assert s["requests"] == 5 and s["prompt_pages"] == 88 and s["unique_pages"] == 40
    assert s["ideal_hit_rate"] == pytest.approx(47 / 88)
    r = s["systems"][system]
    assert r["verify_failures"] == 0 and r["backend_errors"] == 0
    assert r["hit_tokens"]["hbm"] == 0
    assert l3_tokens(r) == 47 * PAGE
    assert r["delivered_hit_rate"] == pytest.approx(47 / 88)
    assert r["written_pages"] == 41 and r["computed_pages"] == 41
    assert r["prompt_tokens"] == 1300 + 1536 + 600 + 2048 + 512
    if system == "file":
        assert r["ssd_read_bytes"] == 47 * PAGE_BYTES and r["ssd_read_ops"] == 47
        assert r["ssd_write_bytes"] == 40 * PAGE_BYTES  # HiCacheFile skips the key it holds
        assert r["read_amplification"] == 1.0 and r["write_amplification"] == 1.0
    elif system == "flatcake":  # the page it already holds is not stored again
        assert r["logical_write_bytes"] == 40 * PAGE_BYTES
    else:  # the DRAM-only and tiered baselines copy every page they are given
        assert r["logical_write_bytes"] == 41 * PAGE_BYTES


@pytest.mark.parametrize("system", ["file", "flatcake"])
def test_mooncake_with_small_hbm_exact_split(tmp_path, mooncake_path, tiny_profile, system):
    # HBM of 16 pages. r0 computes blocks 0,1; r1 hits them in HBM (16), computes block 3 (its
    # pages are the LRU tail and are evicted); r2 computes block 4 (evicting block 1); r3 finds
    # block 0 in HBM (8), blocks 1,3 in L3 (16), computes block 6; r4 (exactly block 4: SGLang
    # reuses 7 of its 8 pages, prompt - 1 tokens) finds 7 pages of block 4 in L3.
    s = _run(tmp_path, mooncake_path, tiny_profile, [system], hbm_pages=16)
    r = s["systems"][system]
    assert r["hit_tokens"]["hbm"] == 24 * PAGE
    assert l3_tokens(r) == 23 * PAGE
    assert r["l3_query_hit_pages"] == 23
    assert r["verify_failures"] == 0
    assert r["ttft_s"]["p99"] >= r["ttft_s"]["p50"] > 0


def test_weka_both_systems_side_by_side(tmp_path, weka_path, tiny_profile):
    s = _run(tmp_path, weka_path, tiny_profile, ["flatcake", "file"], hbm_pages=0, session_gap_s=2.0)
    assert s["requests"] == 6 and s["sessions"] == 2
    assert s["ideal_hit_rate"] == pytest.approx(11 / 22)
    for name in ("flatcake", "file"):
        r = s["systems"][name]
        assert r["verify_failures"] == 0
        assert r["delivered_hit_rate"] == pytest.approx(11 / 22)
        assert r["written_pages"] == 11
    # storage directories are removed at the end unless keep_data
    assert not (tmp_path / "out" / "hicache-file").exists()
    assert not (tmp_path / "out" / "flatcake-ssd").exists()


def test_prefetch_threshold_skips_short_l3_hits(tmp_path, weka_path, tiny_profile):
    # every L3 hit in this fixture is <= 4 pages = 256 tokens; a 320-token threshold skips them all
    s = _run(tmp_path, weka_path, tiny_profile, ["file"], hbm_pages=0, prefetch_threshold_tokens=320)
    r = s["systems"]["file"]
    assert r["hit_tokens"]["ssd"] == 0 and r["delivered_hit_rate"] == 0.0
    assert s["ideal_hit_rate"] == pytest.approx(0.5)


def test_cli_config_supplies_defaults_and_flags_override(tmp_path, mooncake_path):
    cfg = {
        "dram": {"capacity_bytes": 9 << 20},
        "ssd": {"file_bytes": 4 << 20, "max_files": 8, "write_backlog_bytes": 8 << 20},
        "model": {"name": "tiny/mha", "attention": "mha", "layers": 2, "kv_heads": 1, "head_dim": 32,
                  "page_size": 64, "params": 1e6, "q_heads": 2, "q_head_dim": 32},
        "replay": {"trace": str(mooncake_path), "systems": ["file"], "out": str(tmp_path / "cfg-out"),
                   "hbm_pages": 0, "prefetch_threshold_tokens": 0},
    }
    path = tmp_path / "replay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "flag-out"
    rc = main(["--config", str(path), "--systems", "file,flatcake", "--max-requests", "4", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] == 4 and list(s["systems"]) == ["file", "flatcake"]
    assert s["config"]["replay"]["hbm_pages"] == 0
    for r in s["systems"].values():
        assert set(r) >= {"delivered_hit_rate", "hit_tokens", "prompt_tokens", "ttft_s", "ssd_read_bytes",
                          "ssd_read_ops", "ssd_write_bytes", "read_amplification", "write_amplification",
                          "verify_failures", "wall_s", "ssd_read_gbps", "merged_reads"}
        assert l3_tokens(r) == 40 * PAGE  # 16 + 24 of 80 pages
    md = (out / "summary.md").read_text()
    assert "| delivered hit rate | 50.00% | 50.00% |" in md
    assert (out / "requests.csv").read_text().count("\n") == 1 + 2 * 4


def test_cli_rejects_unknown_system_and_replay_key(tmp_path, mooncake_path, capsys):
    assert main(["--trace", str(mooncake_path), "--systems", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown system" in capsys.readouterr().err
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"replay": {"trace": str(mooncake_path), "bogus": 1}}))
    assert main(["--config", str(path)]) == 2
    assert "bogus" in capsys.readouterr().err


def _long_prefix_trace(tmp_path):
    # two identical 5-block prompts of exactly 2560 tokens: with 16-token pages the second may
    # reuse 159 of its 160 pages (SGLang matches prompt - 1 tokens) = 2 read calls (128 + 31)
    path = tmp_path / "two.jsonl"
    line = json.dumps({"timestamp": 0, "input_length": 2560, "output_length": 1, "hash_ids": [0, 1, 2, 3, 4]})
    path.write_text(line + "\n" + line + "\n")
    return path


@pytest.mark.parametrize("policy,expect_l3", [("wait_complete", 159), ("timeout", 128)])
def test_timeout_policy_stops_between_128_page_calls(tmp_path, tiny_profile, policy, expect_l3):
    from dataclasses import replace

    prof = replace(tiny_profile, page_size=16)
    # a zero deadline lets the first 128-page call run and stops before the second
    s = _run(tmp_path, _long_prefix_trace(tmp_path), prof, ["file"], hbm_pages=0, prefetch_policy=policy,
             prefetch_timeout_base_s=0.0, prefetch_timeout_per_ki_token_s=0.0)
    r = s["systems"]["file"]
    assert r["l3_query_hit_pages"] == 159
    assert r["hit_tokens"]["ssd"] == expect_l3 * 16
    assert r["delivered_hit_rate"] == pytest.approx(expect_l3 / 320)
    assert r["verify_failures"] == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_every_pool_kind_replays_on_both_systems(tmp_path, weka_path, attention, layout):
    from flatcake.replay.engine import ModelProfile

    # 16 KiB pages either way: MHA 2 x 2 layers x 1 head x 32 x 2 B, MLA 2 layers x 64 x 2 B, x 64 tokens
    prof = ModelProfile(name=f"tiny/{attention}", attention=attention, layers=2, kv_heads=1, head_dim=32,
                        kv_cache_dim=64, page_size=64, layout=layout, params=1e6, q_heads=2, q_head_dim=32)
    s = _run(tmp_path, weka_path, prof, ["flatcake", "file"], hbm_pages=0, session_gap_s=2.0)
    for r in s["systems"].values():
        assert r["verify_failures"] == 0 and r["backend_errors"] == 0
        assert r["delivered_hit_rate"] == pytest.approx(0.5)


def test_injected_backend_failures_are_misses_never_wrong_bytes(tmp_path, weka_path, tiny_profile, monkeypatch):
    # SGLang's own fault injector wraps any backend the factory creates
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    s = _run(tmp_path, weka_path, tiny_profile, ["flatcake", "file"], hbm_pages=0, session_gap_s=2.0)
    for r in s["systems"].values():
        assert r["verify_failures"] == 0 and r["backend_errors"] == 0
        assert r["delivered_hit_rate"] <= s["ideal_hit_rate"]


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--max-requests", "0"], "replay.max_requests: must be at least 1"),
        (["--max-requests", "-1"], "replay.max_requests: must be at least 1"),
        (["--sessions", "0"], "replay.sessions: must be at least 1"),
        (["--hbm-pages", "-5"], "replay.hbm_pages: must be >= 0"),
        (["--think-time-scale", "-0.5"], "replay.think_time_scale: must be >= 0"),
        (["--systems", ""], "--systems: name at least one system"),
    ],
)
def test_bad_flags_exit_2_naming_the_field(flags, msg, capsys, tmp_path, mooncake_path):
    rc = main(["--trace", str(mooncake_path), "--out", str(tmp_path / "o"), "--no-progress"] + flags)
    assert rc == 2 and msg in capsys.readouterr().err


def test_unreadable_trace_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not json\n")
    rc = main(["--trace", str(bad), "--out", str(tmp_path / "o"), "--no-progress", "--systems", "file"])
    assert rc == 2 and "replay.trace" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_file_is_capped_at_flatcakes_ssd_capacity_by_default():
    from flatcake.replay.budget import file_extra_at_equal_capacity, footprint

    fc = {"ssd.max_files": 8, "ssd.file_bytes": 4 << 20}
    assert file_extra_at_equal_capacity(fc, {}) == {"max_size": 32 << 20}
    assert file_extra_at_equal_capacity(fc, {"max_size": "1G"})["max_size"] == "1G"
    assert footprint("file", 100 << 20, fc, {}) == 32 << 20
    assert footprint("file", 100 << 20, fc, {"max_size": 0}) == 100 << 20  # 0 = unbounded
    assert footprint("file", 100 << 20, fc, {"max_size": "1M"}) == 10**6  # SGLang's own size parser
    assert footprint("file", 100 << 20, fc, {"max_size": "1Mi"}) == 1 << 20
    assert footprint("flatcake", 5 << 20, fc, {}) == 8 << 20  # whole preallocated files
    assert footprint("flatcake", 100 << 20, fc, {}) == 32 << 20
    assert footprint("recompute", 100 << 20, fc, {}) == 0


def test_a_capped_file_backend_evicts_and_stays_within_its_size(tmp_path, mooncake_path, tiny_profile):
    cap = 10 * PAGE_BYTES
    s = _run(tmp_path, mooncake_path, tiny_profile, ["file"], hbm_pages=0, file_extra={"max_size": cap})
    r = s["systems"]["file"]
    hit_pages = r["hit_tokens"]["ssd"] // PAGE
    assert r["verify_failures"] == 0 and hit_pages < 48  # reuse was evicted (48 hits uncapped)
    assert r["written_pages"] == 88 - hit_pages  # every page not delivered is recomputed and written
    assert 0 < r["disk_bytes_at_end"] <= cap


def test_a_run_that_would_not_fit_is_refused_before_writing(tmp_path, mooncake_path, tiny_profile, monkeypatch, capsys):
    import shutil as _shutil
    from collections import namedtuple

    from flatcake.replay import budget

    cfg_path = tmp_path / "fc.yaml"
    cfg_path.write_text(yaml.safe_dump({**{"model": tiny_profile.__dict__}, "ssd": {"file_bytes": 4 << 20, "max_files": 8}}))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: usage(2 << 30, 0, (1 << 30) + (100 << 10)))
    out = tmp_path / "out"
    args = ["--trace", str(mooncake_path), "--config", str(cfg_path), "--out", str(out), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "disk budget" in err and "flatcake up to 0.0 GB" in err and "--ignore-disk-budget" in err
    assert "1.1 GB are free" in err and not out.exists()
    assert main(args + ["--qps", "10"]) == 2 and "one system at a time" in capsys.readouterr().err
    monkeypatch.setattr(budget.shutil, "disk_usage", _shutil.disk_usage)
    assert main(args + ["--ignore-disk-budget"]) == 0


def test_dram_only_at_a_small_capacity_evicts_lru_and_recompute_never_hits(tmp_path, mooncake_path, tiny_profile):
    s = _run(tmp_path, mooncake_path, tiny_profile, ["dram-only", "recompute"], hbm_pages=0)
    assert s["systems"]["recompute"]["delivered_hit_rate"] == 0 and s["systems"]["recompute"]["written_pages"] == 88
    cfg_small = {**FC_OVERRIDES, "dram.capacity_bytes": 16 * PAGE_BYTES}
    from flatcake.replay.cli import run_replay as rr

    settings = {**REPLAY_DEFAULTS, "trace": mooncake_path, "systems": ["dram-only"], "out": tmp_path / "o2",
                "prefetch_threshold_tokens": 0, "host_pool_pages": 256, "hbm_pages": 0}
    small = rr(load_config(None, cfg_small), settings, tiny_profile, progress=False)["systems"]["dram-only"]
    assert small["verify_failures"] == 0
    assert 0 < small["hit_tokens"]["dram"] < 48 * PAGE and small["hit_tokens"]["ssd"] == 0
    assert small["written_pages"] == 88 - small["hit_tokens"]["dram"] // PAGE


def test_scale_divides_bytes_and_capacities_and_keeps_hits(tmp_path, weka_path, tiny_profile, capsys):
    cfg_path = tmp_path / "fc.yaml"
    cfg_path.write_text(yaml.safe_dump({"model": tiny_profile.__dict__, "dram": {"capacity_bytes": 9 << 20},
                                        "ssd": {"file_bytes": 4 << 20, "max_files": 8,
                                                "write_backlog_bytes": 8 << 20}}))
    base = ["--trace", str(weka_path), "--config", str(cfg_path), "--no-progress", "--systems", "flatcake,file,tiered",
            "--hbm-pages", "0"]
    assert main(base + ["--out", str(tmp_path / "full")]) == 0
    assert main(base + ["--out", str(tmp_path / "s4"), "--scale", "4"]) == 0
    full = json.loads((tmp_path / "full" / "summary.json").read_text())
    s4 = json.loads((tmp_path / "s4" / "summary.json").read_text())
    assert (full["scale"], s4["scale"], s4["timings_meaningful"]) == (1, 4, False)
    assert s4["model"]["page_bytes"] * 4 == full["model"]["page_bytes"]
    assert s4["config"]["flatcake"]["ssd"]["file_bytes"] == (4 << 20) // 4
    assert s4["config"]["flatcake"]["dram"]["capacity_bytes"] == (9 << 20) // 4
    # the write backlog is a capacity too, and FlatCake's DRAM medium is the budget less it
    assert s4["config"]["flatcake"]["ssd"]["write_backlog_bytes"] == (8 << 20) // 4
    assert s4["equal_capacity"] == {"dram_bytes": (9 << 20) // 4, "ssd_bytes": (32 << 20) // 4,
                                    "flatcake_dram_bytes": (1 << 20) // 4, "flatcake_write_backlog_bytes": (8 << 20) // 4}
    assert s4["config"]["replay"]["tiered_extra"] == {"bucket_bytes": (256 << 20) // 4, "staging_bytes": (1 << 30) // 4}
    for name in ("flatcake", "file", "tiered"):
        a, b = full["systems"][name], s4["systems"][name]
        assert b["verify_failures"] == 0
        if name == "tiered":  # its background demotion races the next request: the split is timing's
            assert sum(b["hit_tokens"].values()) == sum(a["hit_tokens"].values())
        else:  # FlatCake's SSD pages come from its backlog or the disk as its writer thread ran
            assert (b["hit_tokens"]["hbm"], b["hit_tokens"]["dram"], l3_tokens(b)) == \
                (a["hit_tokens"]["hbm"], a["hit_tokens"]["dram"], l3_tokens(a))
            assert b["written_pages"] == a["written_pages"]
    assert "Scaled run (--scale 4)" in (tmp_path / "s4" / "summary.md").read_text()
    assert main(base + ["--out", str(tmp_path / "s3"), "--scale", "3"]) == 2
    assert "--scale: 3 must divide model.head_dim (32)" in capsys.readouterr().err
