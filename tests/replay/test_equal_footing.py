"""The baselines on equal footing with FlatCake (issue 23, items 1, 3 and 4):

* ``file`` reads the disk under load too: the serving model drops HiCacheFile's page files from
  the OS page cache after every call, as the one-request-at-a-time engine does (checked with
  ``mincore``), and counts its writes;
* FlatCake's write backlog is memory: divided by ``--scale`` like every capacity, counted in the
  DRAM budget of an equal-capacity run, and its hits reported apart from SSD hits;
* the prefetch policy is SGLang's default, ``timeout``, with SGLang's parameters, and every
  summary says which policy ran.
"""

import ctypes
import ctypes.util
import json
import mmap
import os
from pathlib import Path

import pytest
import yaml

from flatcake.config import load_config
from flatcake.replay.budget import equal_capacity, flatcake_keys_at_equal_capacity
from flatcake.replay.cli import REPLAY_DEFAULTS, apply_scale, main, resolve_model, run_replay
from flatcake.replay.engine import Engine, EngineConfig
from flatcake.replay.keys import PageKeyer
from flatcake.replay.serving import Live, ServingConfig, ServingModel, serving_summary
from flatcake.replay.startup import storage_keys
from flatcake.replay.systems import make_system
from flatcake.replay.traces import TraceRequest
from replay_fixtures import mooncake_path, tiny_profile  # noqa: F401  (pytest fixtures)

ROOT = Path(__file__).resolve().parents[2]
PAGE = 64
PAGE_BYTES = 16384  # tiny profile
# a 9 MiB DRAM budget per system, 8 MiB of it FlatCake's write backlog: a 1 MiB DRAM medium
FC = {"dram.capacity_bytes": 9 << 20, "ssd.write_backlog_bytes": 8 << 20, "ssd.file_bytes": 8 << 20,
      "ssd.max_files": 4, "placement.l_agent_tokens": 1024}
FC_YAML = {"dram": {"capacity_bytes": 9 << 20}, "ssd": {"write_backlog_bytes": 8 << 20, "file_bytes": 8 << 20,
                                                         "max_files": 4}}
WAIT = dict(hbm_pages=0, host_pool_pages=512, prefetch_threshold_tokens=0, prefetch_policy="wait_complete")


def req(at, blocks, session, tail=32):
    """A request of conversation ``session``; block ids share one namespace (same blocks, same keys)."""
    return TraceRequest(at, "weka:t", session, tuple(blocks), 64, len(blocks) * 64 + tail, 4)


# ----------------------------------------------------------------------------- page-cache residency
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_pages(path) -> int:
    """OS pages of ``path`` in the page cache now (``mincore`` on a shared read-only mapping,
    which faults nothing in; the caller owns the file, so Linux reports the page cache's state)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(b & 1 for b in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_resident_pages_sees_a_read_file_in_the_page_cache_and_not_after_a_drop(tmp_path):
    from flatcake.media.directio import drop_page_cache

    f = tmp_path / "page.bin"
    f.write_bytes(os.urandom(64 << 10))
    f.read_bytes()
    assert resident_pages(f) == (64 << 10) // mmap.PAGESIZE
    assert drop_page_cache(str(f), sync=True)
    assert resident_pages(f) == 0


@pytest.mark.parametrize("drop", [True, False])
def test_file_pages_read_and_written_under_load_leave_the_page_cache(tmp_path, tiny_profile, drop):
    """Item 1: the serving model (--qps) drops HiCacheFile's page files after each read and
    write, outside the timed calls, as the one-request-at-a-time engine does; without the drop
    (the control) the files it read stay cached."""
    keyer = PageKeyer(tiny_profile.page_size)
    history = list(range(40))
    system = make_system("file", tiny_profile, 512, tmp_path, FC, drop_page_cache=drop)
    files = lambda: sorted((tmp_path / "hicache-file").rglob("*.bin"))  # noqa: E731
    try:
        warm = req(0.0, history, "a")
        Engine(system, tiny_profile, EngineConfig(**WAIT)).run(keyer.keys(warm), warm.prompt_tokens)
        written_warm = files()
        assert len(written_warm) == 40
        if drop:
            assert sum(resident_pages(f) for f in written_warm) == 0  # the serial engine dropped them
        before = system.counters()
        measured = [req(0.0, history + [100, 101], "b")]
        lives = ServingModel(system, tiny_profile, EngineConfig(**WAIT), ServingConfig(qps=100.0)).run(
            measured, [keyer.keys(r) for r in measured])
        after = system.counters()
        assert lives[0].delivered == 40 and lives[0].verify_failures == 0
        new = sorted(set(files()) - set(written_warm))
        assert len(new) == 2  # pages 100 and 101, written back by the backup thread
        resident_read = sum(resident_pages(f) for f in written_warm)
        if drop:
            assert resident_read == 0 and sum(resident_pages(f) for f in new) == 0
        else:
            assert resident_read > 0
        # the write-back is counted under load too (prepare_set/after_call around each put)
        assert after["ssd_write_ops"] - before["ssd_write_ops"] == 2
        assert after["ssd_write_bytes"] - before["ssd_write_bytes"] == 2 * PAGE_BYTES
        assert after["ssd_read_ops"] - before["ssd_read_ops"] == 40
    finally:
        system.close()


# ----------------------------------------------------------------------------- equal capacity
def test_the_write_backlog_is_counted_in_flatcakes_dram_budget(tmp_path, tiny_profile):
    """Item 3: every system gets dram.capacity_bytes; FlatCake's DRAM medium is that less its
    write backlog (the demo's 256 MiB budget: 128 MiB medium + 128 MiB backlog)."""
    demo = storage_keys(load_config(ROOT / "configs" / "demo.yaml"))
    cap = equal_capacity(demo)
    assert (cap.dram_bytes, cap.flatcake_dram_bytes, cap.flatcake_write_backlog_bytes) == \
        (256 << 20, 128 << 20, 128 << 20)
    assert cap.ssd_bytes == 32 * (256 << 20)
    assert "DRAM 256 MiB per system (FlatCake: 128 MiB DRAM medium + 128 MiB write backlog), SSD 8 GiB" in cap.note()
    assert flatcake_keys_at_equal_capacity(FC)["dram.capacity_bytes"] == 1 << 20
    assert equal_capacity({"dram.capacity_bytes": 1 << 30}).flatcake_dram_bytes == 0  # the defaults: all backlog
    with pytest.raises(ValueError, match="ssd.write_backlog_bytes=1073741824 exceeds dram.capacity_bytes=1048576"):
        equal_capacity({"dram.capacity_bytes": 1 << 20})
    # built for a comparison, FlatCake gets 1 MiB of DRAM and the 8 MiB backlog; dram-only all 9 MiB
    fc = make_system("flatcake", tiny_profile, 256, tmp_path, FC, equal_capacity=True)
    only = make_system("dram-only", tiny_profile, 256, tmp_path, FC, equal_capacity=True)
    alone = make_system("flatcake", tiny_profile, 256, tmp_path / "alone", FC)  # benchmarks: keys as given
    try:
        assert (fc.inner.cfg.dram.capacity_bytes, fc.inner.cfg.ssd.write_backlog_bytes) == (1 << 20, 8 << 20)
        assert fc.inner.flatcake_stats()["media"]["dram"]["capacity_bytes"] == 1 << 20
        assert only.capacity_pages == (9 << 20) // PAGE_BYTES
        assert alone.inner.cfg.dram.capacity_bytes == 9 << 20
    finally:
        for s in (fc, only, alone):
            s.close()


def test_scale_divides_the_write_backlog_like_every_capacity(tmp_path):
    """Item 3: --scale 32 on the demo's config (as make results scales): DRAM budget 8 MiB, write
    backlog 4 MiB, so the FlatCake built for the comparison has a 4 MiB DRAM medium and a 4 MiB
    backlog, at 1/32 of the 768 KiB pages."""
    cfg = load_config(ROOT / "configs" / "demo.yaml")
    settings = {**REPLAY_DEFAULTS, **cfg.replay}
    cfg, settings, profile = apply_scale(cfg, settings, resolve_model(cfg, ROOT / "configs"), 32)
    assert (cfg.dram.capacity_bytes, cfg.ssd.write_backlog_bytes) == (8 << 20, 4 << 20)
    assert profile.page_bytes == (768 << 10) // 32
    fc_keys = storage_keys(cfg)
    system = make_system("flatcake", profile, 256, tmp_path, fc_keys, equal_capacity=True)
    try:
        assert (system.inner.cfg.dram.capacity_bytes, system.inner.cfg.ssd.write_backlog_bytes) == (4 << 20, 4 << 20)
        assert system.inner.flatcake_stats()["write_backlog_limit_bytes"] == 4 << 20
    finally:
        system.close()
    with pytest.raises(ValueError, match="--scale: ssd.write_backlog_bytes=4096 divided by 2 rounds to 0"):
        apply_scale(load_config(None, {"ssd.write_backlog_bytes": 4096}), dict(REPLAY_DEFAULTS), profile, 2)


def test_a_backlog_larger_than_the_dram_budget_is_refused_naming_both_keys(tmp_path, mooncake_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"dram": {"capacity_bytes": 1 << 20}, "ssd": {"file_bytes": 4 << 20, "max_files": 8},
                                   "replay": {"hbm_pages": 0, "prefetch_threshold_tokens": 0, "plot": False}}))
    base = ["--trace", str(mooncake_path), "--config", str(cfg), "--no-progress"]
    assert main(base + ["--systems", "file,flatcake", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "ssd.write_backlog_bytes=1073741824 exceeds dram.capacity_bytes=1048576" in err
    assert not (tmp_path / "o").exists()
    assert main(base + ["--systems", "file", "--out", str(tmp_path / "f")]) == 0  # no FlatCake, no backlog


# ----------------------------------------------------------------------------- backlog hits
def _hold_the_writer(monkeypatch):
    """Every FlatCake the replay builds keeps its SSD rounds in its write backlog (a restore marked
    in flight on its queue holds the writer) until its final counters are read."""
    import flatcake.replay.startup as startup

    real = startup.make_system

    def make(name, *a, **k):
        system = real(name, *a, **k)
        if name == "flatcake":
            queue, counters = system.inner.store.queue, system.counters
            queue.defer_max_s = queue.urgent_bytes = float("inf")  # no bound on the deferral here
            queue.reads_begin()

            def release_then_count():
                queue.reads_end()
                return counters()

            system.counters = release_then_count
        return system

    monkeypatch.setattr(startup, "make_system", make)  # every replay builds its systems there


def test_pages_served_from_the_write_backlog_are_backlog_hits_not_ssd_hits(tmp_path, mooncake_path, tiny_profile,
                                                                              monkeypatch):
    """Item 3, the one-request-at-a-time replay: no round reaches the disk before the end, so
    every FlatCake reuse outside its DRAM medium is served from the backlog's memory: counted in
    hit_tokens.backlog / backlog_hit_pages (and the store's queued_hit_pages), none as SSD hits.
    The file backend beside it reads every reuse from its SSD."""
    _hold_the_writer(monkeypatch)
    settings = {**REPLAY_DEFAULTS, "trace": mooncake_path, "systems": ["flatcake", "file"], "out": tmp_path / "out",
                "prefetch_threshold_tokens": 0, "host_pool_pages": 256, "hbm_pages": 0, "plot": False}
    s = run_replay(load_config(None, FC), settings, tiny_profile, progress=False)
    fc, file = s["systems"]["flatcake"], s["systems"]["file"]
    assert fc["verify_failures"] == 0 and fc["delivered_hit_rate"] == pytest.approx(47 / 88)
    assert fc["hit_tokens"]["ssd"] == 0 and fc["hit_tokens"]["backlog"] > 0
    assert fc["hit_tokens"]["dram"] + fc["hit_tokens"]["backlog"] == 47 * PAGE
    assert fc["backlog_hit_pages"] * PAGE == fc["hit_tokens"]["backlog"]
    assert fc["ssd_read_bytes"] == 0 and fc["read_amplification"] is None  # nothing came from the disk
    assert file["hit_tokens"] == {"hbm": 0, "dram": 0, "backlog": 0, "ssd": 47 * PAGE}
    assert file["backlog_hit_pages"] == 0
    md = (tmp_path / "out" / "summary.md").read_text()
    assert f"| hit tokens L3 write backlog (memory) | {fc['hit_tokens']['backlog']:,} | 0 |" in md
    assert f"| hit tokens L3 SSD (read from disk) | 0 | {47 * PAGE:,} |" in md
    rows = (tmp_path / "out" / "requests.csv").read_text().splitlines()
    col = rows[0].split(",").index("backlog_pages")
    assert sum(int(r.split(",")[col]) for r in rows[1:] if r.split(",")[1] == "flatcake") == fc["backlog_hit_pages"]
    assert s["equal_capacity"]["flatcake_dram_bytes"] == 1 << 20


def test_under_load_a_backlog_page_counts_as_backlog_only_while_its_round_is_in_memory(tmp_path, tiny_profile):
    """Item 3, the serving model: pages still queued when read are backlog hits; pages the hit
    query saw queued but whose round reached the disk before the read are SSD hits (the medium
    is looked up again just before each read call)."""
    keyer = PageKeyer(tiny_profile.page_size)
    history = list(range(40))  # agent context: an SSD scope
    system = make_system("flatcake", tiny_profile, 512, tmp_path, FC)
    store = system.inner.store
    ecfg = EngineConfig(**WAIT)
    held = []

    def stats():  # the store's counters now (counters() would wait for the held queue to drain)
        return system.inner.flatcake_stats()

    try:
        store.queue.defer_max_s = store.queue.urgent_bytes = float("inf")  # no bound on the deferral here
        store.queue.reads_begin()  # hold the writer: the warm rounds stay in memory
        held.append(1)
        warm = req(0.0, history, "a")
        Engine(system, tiny_profile, ecfg).run(keyer.keys(warm), warm.prompt_tokens)
        first = [req(0.0, history + [100], "b")]
        lives = ServingModel(system, tiny_profile, ecfg, ServingConfig(qps=100.0)).run(
            first, [keyer.keys(r) for r in first])
        s = serving_summary(lives, PAGE, 1.0)
        assert (lives[0].delivered, lives[0].ssd_pages, lives[0].backlog_pages) == (40, 40, 40)
        assert s["hit_tokens"] == {"hbm": 0, "dram": 0, "backlog": 40 * PAGE, "ssd": 0}
        assert s["backlog_hit_pages"] == 40 and s["verify_failures"] == 0

        # the hit query sees the next request's pages queued; they reach the disk before its read
        real_summary = system.medium_summary
        calls, flushed = [], []

        def summary_then_flush(keys):  # on the hit-query thread: must not raise (the run would wait)
            m = real_summary(keys)
            calls.append(m.media)
            if len(calls) == 1:
                store.queue.reads_end()  # the writer may run now: every round goes to disk
                held.pop()
                flushed.append(store.flush_writes(300))
            return m

        system.medium_summary = summary_then_flush
        before = stats()
        second = [req(0.0, history + [200], "c")]
        lives = ServingModel(system, tiny_profile, ecfg, ServingConfig(qps=100.0)).run(
            second, [keyer.keys(r) for r in second])
        after = stats()
        assert flushed == [True]
        assert set(calls[0][:40]) == {"queued"} and set(calls[1]) == {"ssd"}
        assert (lives[0].delivered, lives[0].ssd_pages, lives[0].backlog_pages) == (40, 40, 0)
        assert serving_summary(lives, PAGE, 1.0)["hit_tokens"]["ssd"] == 40 * PAGE
        assert after["queued_hit_pages"] - before["queued_hit_pages"] == 0
        assert after["logical_read_bytes_ssd"] - before["logical_read_bytes_ssd"] == 40 * PAGE_BYTES
    finally:
        if held:
            store.queue.reads_end()
        system.close()


# ----------------------------------------------------------------------------- prefetch policy
def test_the_default_prefetch_policy_is_sglangs_timeout_with_sglangs_parameters():
    """Item 4: SGLang 0.5.23's --hicache-storage-prefetch-policy default and its
    prefetch_timeout_base / prefetch_timeout_per_ki_token defaults, in the replay and the configs."""
    import msgspec

    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    from sglang.srt.arg_groups.fields.memory import Memory
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    policy = next(f.default for f in msgspec.structs.fields(Memory) if f.name == "hicache_storage_prefetch_policy")
    _, _, base, per_ki, _ = HybridCacheController.parse_storage_backend_extra_config(None)
    e = EngineConfig()
    assert (e.prefetch_policy, e.prefetch_timeout_base_s, e.prefetch_timeout_per_ki_token_s) == (policy, base, per_ki)
    assert (policy, base, per_ki) == ("timeout", 1.0, 0.25)
    assert REPLAY_DEFAULTS["prefetch_policy"] == "timeout"
    assert e.prefetch_timeout_s(2048) == 1.5  # 1 s + 0.25 s per 1024 tokens asked
    assert EngineConfig(prefetch_policy="wait_complete").prefetch_timeout_s(2048) is None
    for name in ("demo", "results", "results-mooncake"):
        rp = load_config(ROOT / "configs" / f"{name}.yaml").replay
        assert (rp["prefetch_policy"], rp["prefetch_timeout_base_s"], rp["prefetch_timeout_per_ki_token_s"]) == \
            ("timeout", 1.0, 0.25), name


def test_the_timeout_budget_is_for_the_span_asked_not_the_hit(tmp_path, tiny_profile):
    """As SGLang (stats_requested_tokens): 400 pages asked, 200 stored. With 0.1 s per Ki tokens
    the budget is 2.5 s (1.25 s for the hit alone); each read call is made to report 2 s, so the
    second 128-page call still runs."""
    keyer = PageKeyer(tiny_profile.page_size)
    system = make_system("file", tiny_profile, 512, tmp_path, FC)
    try:
        eng = Engine(system, tiny_profile, EngineConfig(hbm_pages=0, host_pool_pages=512, prefetch_threshold_tokens=0,
                                                        prefetch_timeout_base_s=0.0,
                                                        prefetch_timeout_per_ki_token_s=0.1))
        warm = req(0.0, range(200), "a")
        eng.run(keyer.keys(warm), warm.prompt_tokens)
        real_get = system.get

        def slow_get(*a):
            out = real_get(*a)
            system.last_call_s = 2.0
            return out

        system.get = slow_get
        asked = req(1.0, list(range(200)) + list(range(1000, 1200)), "a")
        out = eng.run(keyer.keys(asked), asked.prompt_tokens)
        assert (out.l3_query_pages, out.ssd_pages, out.read_s) == (200, 200, 4.0)
    finally:
        system.close()


def test_the_admission_wait_starts_at_the_first_poll_that_finds_the_prefetch_not_done(tiny_profile):
    """As SGLang's _start_storage_prefetch_wait: a request behind a full running batch is not
    polled and its clock does not run; polled, it waits its budget, then is admitted with what
    was read and the rest revoked."""
    cfg = ServingConfig(qps=1.0, max_running=1)
    model = ServingModel(None, tiny_profile, EngineConfig(), cfg, host_pool=tiny_profile.make_host_pool(256))
    model.lanes.close()  # no prefetch runs here: only the GPU thread's admission is exercised
    r = Live(0, ("k0", "k1", "k2", "k3"), 4 * 64 + 8, 4, arrival=0.0, timeout_s=0.5)
    r.hit, r.media = 4, ("ssd",) * 4
    model._waiting.append(r)
    busy = [Live(1, (), 64, 4, arrival=0.0)]
    model._admit_locked(busy, 5.0)  # the batch is full: not polled
    assert r.deadline == float("inf") and r in model._waiting
    running: list = []
    model._admit_locked(running, 10.0)  # first blocked poll: the clock starts
    assert r.deadline == 10.5 and not running
    model._admit_locked(running, 10.4)
    assert not running
    r.read_pages = 1
    model._admit_locked(running, 10.6)
    assert running == [r] and r.cancelled and (r.delivered, r.revoked_tokens) == (1, 3 * 64)
    assert r.prefetch_s == pytest.approx(10.6)


def test_every_summary_names_the_prefetch_policy(tmp_path, mooncake_path, tiny_profile, capsys):
    """Item 4: summary.json and summary.md of both replays say which policy ran (and the sweep's
    figures are titled with it); an unknown policy is refused."""
    settings = {**REPLAY_DEFAULTS, "trace": mooncake_path, "systems": ["file"], "prefetch_threshold_tokens": 0,
                "host_pool_pages": 256, "hbm_pages": 0, "plot": False}
    for policy in ("timeout", "wait_complete"):
        out = tmp_path / policy
        s = run_replay(load_config(None, FC), {**settings, "out": out, "prefetch_policy": policy}, tiny_profile,
                       progress=False)
        assert s["prefetch_policy"] == s["engine"]["prefetch_policy"] == policy
        assert f"prefetch policy `{policy}`" in (out / "summary.md").read_text()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**FC_YAML, "model": tiny_profile.as_dict(),
                                   "replay": {"hbm_pages": 0, "prefetch_threshold_tokens": 0}}))
    out = tmp_path / "sweep"
    assert main(["--trace", str(mooncake_path), "--config", str(cfg), "--systems", "flatcake,file", "--qps", "20",
                 "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "summary.json").read_text())
    assert result["prefetch_policy"] == "timeout" and {r["prefetch_policy"] for r in result["runs"]} == {"timeout"}
    assert result["engine"]["prefetch_timeout_base_s"] == 1.0
    assert result["equal_capacity"]["flatcake_write_backlog_bytes"] == 8 << 20
    md = (out / "summary.md").read_text()
    assert "prefetch policy `timeout` (SGLang's default)" in md and "write backlog" in md
    assert "| backlog hit pages |" in md
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"replay": {"prefetch_policy": "best_effort"}}))
    assert main(["--trace", str(mooncake_path), "--config", str(bad), "--out", str(tmp_path / "b")]) == 2
    assert "replay.prefetch_policy: must be one of timeout, wait_complete" in capsys.readouterr().err

