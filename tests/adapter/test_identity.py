"""Pool identity (flatcake.adapter.identity): more than one FlatCake per host. Processes with the
same namespace and DP rank on one ssd.path (SGLang's --dp-size replicas without DP attention all
get dp_rank 0; several servers of one model) each get their own pool, find it again after a
restart, and MLA followers find their own server's writer; ssd.path rank templates."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from flatcake_testkit import page_matches, slots_of, write_pages

from flatcake.adapter import identity
from flatcake.config import ConfigError, load_config
from flatcake.gva import journal
from flatcake.media import pool_dir


def keys_of(tag: str, n: int = 4) -> list[str]:
    return [f"{tag}-{i}" for i in range(n)]


def reads_back(be, pool, keys, first_page: int = 20) -> bool:
    """``keys`` are all hits and read back bit-exact into host pages ``first_page...``."""
    pages = range(first_page, first_page + len(keys))
    if be.batch_exists(keys) != len(keys):
        return False
    if be.batch_get_v1(keys, slots_of(pool, pages)) != [True] * len(keys):
        return False
    return all(page_matches(pool, p * pool.page_size, k) for p, k in zip(pages, keys))


def test_two_processes_with_dp_rank_0_on_one_path_get_their_own_pools(make_backend, ssd_dir):
    a, apool = make_backend()
    b, bpool = make_backend()  # same namespace, dp_rank 0, same ssd.path: used to fail on the lock
    assert (a.identity.instance, b.identity.instance) == ("dp0", "dp0-s1")
    assert a.store.ssd.prefix != b.store.ssd.prefix
    assert b.store.ssd.prefix == pool_dir.pool_prefix(b.namespace, "dp0-s1")
    assert pool_dir.is_live(ssd_dir, a.store.ssd.prefix) and pool_dir.is_live(ssd_dir, b.store.ssd.prefix)
    ka, kb = keys_of("a"), keys_of("b")
    assert write_pages(a, apool, ka, range(4)) == [True] * 4
    assert write_pages(b, bpool, kb, range(4)) == [True] * 4
    assert reads_back(a, apool, ka) and reads_back(b, bpool, kb)
    assert (a.batch_exists(kb), b.batch_exists(ka)) == (0, 0)  # each reads only its own pool
    assert set(pool_dir.scan(ssd_dir)) == {a.store.ssd.prefix, b.store.ssd.prefix}


def test_both_restart_and_each_finds_its_own_pages(make_backend):
    a, apool = make_backend()
    b, bpool = make_backend()
    ka, kb = keys_of("a"), keys_of("b")
    write_pages(a, apool, ka, range(4))
    write_pages(b, bpool, kb, range(4))
    prefixes = (a.store.ssd.prefix, b.store.ssd.prefix)
    a.close()
    b.close()
    a2, apool2 = make_backend()  # warm restart, in the same order: lowest free slot first
    b2, bpool2 = make_backend()
    assert (a2.store.ssd.prefix, b2.store.ssd.prefix) == prefixes
    assert (a2.store.rebuilt.pages, b2.store.rebuilt.pages) == (4, 4)
    assert reads_back(a2, apool2, ka) and reads_back(b2, bpool2, kb)
    assert (a2.batch_exists(kb), b2.batch_exists(ka)) == (0, 0)


def test_a_restarted_process_retakes_the_slot_it_freed(make_backend):
    a, apool = make_backend()
    b, bpool = make_backend()
    kb = keys_of("b")
    write_pages(b, bpool, kb, range(4))
    prefix = b.store.ssd.prefix
    b.close()  # a keeps slot 0
    b2, bpool2 = make_backend()
    assert b2.identity.slot == 1 and b2.store.ssd.prefix == prefix
    assert reads_back(b2, bpool2, kb)


def test_dp_replicas_are_named_by_sglang_replica_index_whatever_the_start_order(make_backend, monkeypatch):
    """Without DP attention SGLang passes dp_rank 0 to every replica; the replica index its DP
    controller spawned the process for (runtime_context.get_parallel().dp_rank) names the pool."""
    import sglang.srt.runtime_context as rc

    def replica(r):
        monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(dp_rank=r))

    replica(0)
    r0, pool0 = make_backend()
    replica(1)
    r1, pool1 = make_backend()
    assert (r0.identity.instance, r1.identity.instance) == ("dp0", "dp1")
    k0, k1 = keys_of("r0"), keys_of("r1")
    write_pages(r0, pool0, k0, range(4))
    write_pages(r1, pool1, k1, range(4))
    r0.close()
    r1.close()
    replica(1)  # restart in the other order: each replica still opens its own pool
    s1, spool1 = make_backend()
    replica(0)
    s0, spool0 = make_backend()
    assert (s0.identity.instance, s1.identity.instance) == ("dp0", "dp1")
    assert reads_back(s0, spool0, k0) and reads_back(s1, spool1, k1)
    assert (s0.batch_exists(k1), s1.batch_exists(k0)) == (0, 0)


def test_outside_sglang_there_is_no_replica():
    assert identity.sglang_replica() is None


def test_attention_dp_rank_names_the_pool_before_the_replica():
    sc = SimpleNamespace(dp_rank=2, is_mla_model=False, tp_rank=1, pp_rank=0)
    assert identity.dp_rank_of(sc, None) == 2 and identity.dp_rank_of(sc, 2) == 2
    assert identity.dp_rank_of(SimpleNamespace(dp_rank=0), 3) == 3
    assert identity.rank_values(sc, None) == {"tp_rank": 1, "pp_rank": 0, "dp_rank": 2}


def test_a_fixed_pool_id_opens_the_same_pool_whatever_the_start_order(make_backend):
    a, apool = make_backend(extra={"ssd.pool_id": "srv-a"})
    b, bpool = make_backend(extra={"ssd.pool_id": "srv-b"})
    assert (a.identity.instance, b.identity.instance) == ("dp0-id=srv-a", "dp0-id=srv-b")
    ka, kb = keys_of("a"), keys_of("b")
    write_pages(a, apool, ka, range(4))
    write_pages(b, bpool, kb, range(4))
    a.close()
    b.close()
    b2, bpool2 = make_backend(extra={"ssd.pool_id": "srv-b"})
    a2, apool2 = make_backend(extra={"ssd.pool_id": "srv-a"})
    assert reads_back(a2, apool2, ka) and reads_back(b2, bpool2, kb)


@pytest.mark.parametrize("bad", ["", "-x", "a b", "x" * 65, "a/b"])
def test_a_bad_pool_id_names_the_field(bad):
    with pytest.raises(ConfigError, match="ssd.pool_id"):
        load_config(None, {"ssd.pool_id": bad})


def test_the_start_up_line_shows_the_pool_identity(make_backend, ssd_dir, caplog):
    caplog.set_level(logging.INFO, logger="flatcake")
    make_backend()
    b, _ = make_backend()
    lines = [r.getMessage() for r in caplog.records if r.name == "flatcake" and "per-rank capacity" in r.getMessage()]
    assert len(lines) == 2
    assert f"pool {b.store.ssd.prefix} in {ssd_dir} (dp0 slot 1);" in lines[1]
    assert "(dp0 slot 0);" in lines[0]


# ---- MLA: writer and followers of several servers in one directory ---------------------------


def test_mla_followers_find_their_own_servers_writer(make_backend, monkeypatch):
    def server(tag):
        monkeypatch.setattr(identity, "group_key", lambda: tag)

    server("A")
    wa, wapool = make_backend(mla=True, tp_rank=0, tp_size=2)
    server("B")
    wb, wbpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    fb, fbpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    server("A")
    fa, fapool = make_backend(mla=True, tp_rank=1, tp_size=2)
    assert (wa.identity.slot, wb.identity.slot, fa.identity.slot, fb.identity.slot) == (0, 1, 0, 1)
    assert pool_dir.read_lock_tag(wb.cfg.ssd.path, wb.store.ssd.prefix) == "B"
    ka, kb = keys_of("A"), keys_of("B")
    write_pages(wa, wapool, ka, range(4))
    write_pages(wb, wbpool, kb, range(4))
    assert wa.store.flush_writes(30) and wb.store.flush_writes(30)  # followers mirror the writers' journals
    assert reads_back(fa, fapool, ka) and reads_back(fb, fbpool, kb)
    assert (fa.batch_exists(kb), fb.batch_exists(ka)) == (0, 0)


def follower_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "cannot see its writer rank's pool" in r.getMessage()]


def test_a_follower_that_cannot_see_its_writer_warns_once_after_the_grace_period(make_backend, monkeypatch, caplog):
    """MLA with TP over two hosts: the writer's pool is on the other host's disk."""
    monkeypatch.setattr(journal, "FOLLOWER_GRACE_S", 0.0)  # a short grace: no sleep in the test
    monkeypatch.setattr(identity, "FOLLOWER_WAIT_S", 0.1)  # its writer never appears here
    caplog.set_level(logging.INFO, logger="flatcake")
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    assert not f.identity.identified
    assert follower_warnings(caplog) == []  # not before the first hit query
    assert f.batch_exists(keys_of("x")) == 0
    assert f.batch_exists(keys_of("y")) == 0
    warned = follower_warnings(caplog)
    assert len(warned) == 1
    assert f.store.ssd.journal_path in warned[0] and "does not exist" in warned[0]
    assert "0 L3 hits" in warned[0] and "put ssd.path on storage every host of the TP group shares" in warned[0]


def test_a_follower_that_sees_its_writer_does_not_warn(make_backend, monkeypatch, caplog):
    monkeypatch.setattr(journal, "FOLLOWER_GRACE_S", 0.0)
    caplog.set_level(logging.INFO, logger="flatcake")
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2)
    write_pages(w, wpool, keys_of("k"), range(4))
    assert w.store.flush_writes(30)  # a follower sees the writer's rounds once written and journaled
    assert f.batch_exists(keys_of("k")) == 4
    assert follower_warnings(caplog) == []


# ---- ssd.path templates ---------------------------------------------------------------------


def test_rank_templates_in_ssd_path_are_expanded_per_rank(make_backend, tmp_path):
    tmpl = str(tmp_path / "nvme{tp_rank}" / "pp{pp_rank}-dp{dp_rank:02d}")
    r1, pool1 = make_backend(tp_rank=1, tp_size=2, extra={"ssd.path": tmpl})
    r0, _ = make_backend(tp_rank=0, tp_size=2, extra={"ssd.path": tmpl})
    assert r1.cfg.ssd.path == str(tmp_path / "nvme1" / "pp0-dp00")
    assert r0.cfg.ssd.path == str(tmp_path / "nvme0" / "pp0-dp00")
    assert r1.cfg.ssd.paths == (r1.cfg.ssd.path,)
    assert os.path.isfile(os.path.join(r1.cfg.ssd.path, r1.store.ssd.prefix + ".lock"))
    assert os.path.isfile(os.path.join(r0.cfg.ssd.path, r0.store.ssd.prefix + ".lock"))
    write_pages(r1, pool1, keys_of("t"), range(4))
    assert pool_dir.scan(r1.cfg.ssd.path)[r1.store.ssd.prefix].pool_indices == [0]


def test_mla_follower_ranks_expand_tp_rank_to_the_writers(make_backend, tmp_path):
    tmpl = str(tmp_path / "nvme{tp_rank}")
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2, extra={"ssd.path": tmpl})
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2, extra={"ssd.path": tmpl})
    assert f.cfg.ssd.path == w.cfg.ssd.path == str(tmp_path / "nvme0")
    assert not os.path.exists(tmp_path / "nvme1")
    write_pages(w, wpool, keys_of("m"), range(4))
    assert w.store.flush_writes(30)  # a follower sees the writer's rounds once written and journaled
    assert reads_back(f, fpool, keys_of("m"))


def test_templates_in_every_drive_entry_are_expanded(tmp_path):
    cfg = load_config(None, {"ssd.path": [str(tmp_path / "a{tp_rank}"), str(tmp_path / "b{tp_rank}")]})
    out = identity.expand_ssd_paths(cfg, {"tp_rank": 3, "pp_rank": 0, "dp_rank": 0})
    assert out.ssd.paths == (str(tmp_path / "a3"), str(tmp_path / "b3")) and out.ssd.path == str(tmp_path / "a3")
    plain = load_config(None, {"ssd.path": str(tmp_path)})
    assert identity.expand_ssd_paths(plain, {"tp_rank": 3, "pp_rank": 0, "dp_rank": 0}) is plain


@pytest.mark.parametrize("bad", ["/x/{rank}", "/x/{}", "/x/{0}", "/x/{tp_rank!r}", "/x/{tp_rank:s}", "/x/{tp_rank",
                                 "/x/tp_rank}", "/x/{{literal}}"])
def test_a_bad_template_names_ssd_path(bad):
    with pytest.raises(ConfigError, match=r"ssd\.path"):
        load_config(None, {"ssd.path": bad})


def test_a_bad_template_fails_the_backend_at_construction(make_backend, tmp_path):
    with pytest.raises(ConfigError, match=r"ssd\.path .*unknown placeholder \{node\}"):
        make_backend(extra={"ssd.path": str(tmp_path / "{node}")})
    assert list(tmp_path.iterdir()) == [tmp_path / "ssd"]  # nothing created


def test_drive_entries_that_expand_to_one_directory_are_refused(tmp_path):
    cfg = load_config(None, {"ssd.path": [str(tmp_path / "a{tp_rank}"), str(tmp_path / "a{pp_rank}")]})
    with pytest.raises(ConfigError, match=r"ssd\.path: .*listed twice"):
        identity.expand_ssd_paths(cfg, {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0})


def test_a_follower_waits_for_its_own_writer_and_never_takes_another_servers_slot(ssd_dir, monkeypatch, caplog):
    """Slot 0 is another server's live writer; this follower's writer (slot 1) records its
    group only at the 300th poll (15 s of a start-up): the follower waits for it, logging while
    it waits, and takes slot 1; a follower whose writer never appears gets no slot (None)."""
    import logging

    caplog.set_level(logging.INFO, logger="flatcake")
    ident = identity.PoolIdentity("dp0")
    other = pool_dir.take_writer_lock(ssd_dir, pool_dir.pool_prefix("ns", "dp0"))  # slot 0: another server
    pool_dir.write_lock_tag(ssd_dir, pool_dir.pool_prefix("ns", "dp0"), "A")
    open(os.path.join(ssd_dir, pool_dir.pool_prefix("ns", "dp0") + "-00000.pool"), "wb").close()
    clock = [0.0]
    polls = []
    mine = []

    def sleep(s):  # a fake clock: each poll advances it by its 50 ms
        polls.append(s)
        clock[0] += s
        if len(polls) == 300:  # the writer of slot 1 starts and opens its pool
            prefix = pool_dir.pool_prefix("ns", "dp0-s1")
            mine.append(pool_dir.take_writer_lock(ssd_dir, prefix))
            open(os.path.join(ssd_dir, prefix + "-00000.pool"), "wb").close()
            pool_dir.write_lock_tag(ssd_dir, prefix, "B")

    monkeypatch.setattr(identity.time, "sleep", sleep)
    monkeypatch.setattr(identity.time, "monotonic", lambda: clock[0])
    try:
        assert identity.find_writer_slot(ssd_dir, "ns", ident, "B", wait_s=600.0) == 1
        assert len(polls) == 300
        waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
        assert len(waits) == 1 and "for its writer rank's pool" in waits[0]  # at 10 s of 15
        polls.clear()
        assert identity.find_writer_slot(ssd_dir, "ns", ident, "C", wait_s=2.0) is None  # never slot 0
        assert len(polls) == 40
    finally:
        os.close(other)
        for fd in mine:
            os.close(fd)


def test_a_follower_without_its_writer_reads_no_pool_and_says_so(make_backend, tmp_path, monkeypatch, caplog):
    """Another server's MLA writer holds slot 0 of the directory; a follower rank of a second
    server whose writer never comes reads nothing of it: every lookup a miss, an ERROR, and its
    start-up line says so."""
    import logging

    caplog.set_level(logging.INFO, logger="flatcake")
    w, wpool = make_backend(mla=True, tp_rank=0, tp_size=2)
    write_pages(w, wpool, keys_of("m"), range(4))
    assert w.store.flush_writes(30)
    monkeypatch.setattr(identity, "FOLLOWER_WAIT_S", 0.2)
    monkeypatch.setattr(identity, "group_key", lambda: "host=other/ppid=1")  # a second server
    f, fpool = make_backend(mla=True, tp_rank=1, tp_size=2, extra={"ssd.path": w.cfg.ssd.path})
    assert f.identity.slot == identity.UNIDENTIFIED_SLOT and not f.identity.identified
    assert f.batch_exists(keys_of("m")) == 0
    assert not reads_back(f, fpool, keys_of("m")[:1])
    assert any(r.levelname == "ERROR" and "found no writer pool of its server" in r.getMessage() for r in caplog.records)
    assert any("no writer of this server found: misses" in r.getMessage() for r in caplog.records)
    assert sorted(pool_dir.scan(w.cfg.ssd.path)) == [w.store.ssd.prefix]  # the follower created nothing
