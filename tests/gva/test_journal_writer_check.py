"""MLA follower ranks check once, after a grace period, that their writer's pool is visible
(flatcake.gva.journal.JournalReader.check_writer): a journal that never appears or that no live
writer holds gets one WARNING; a visible writer gets none. A fake clock: no sleeps."""

from __future__ import annotations

import fcntl
import logging
import os

from flatcake.gva.journal import JournalReader, JournalWriter, writer_invisible

PREFIX = "fc-00000000000000dd"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "flatcake"]


def test_no_journal_warns_exactly_once_after_the_grace_period(ssd_dir, caplog):
    caplog.set_level(logging.WARNING, logger="flatcake")
    clock = Clock()
    r = JournalReader(os.path.join(ssd_dir, PREFIX + ".journal"), grace_s=10.0, clock=clock)
    for t in (100.0, 105.0, 109.9):
        clock.t = t
        assert r.poll() == (False, [])
    assert warnings_of(caplog) == [] and r.writer_missing is None
    clock.t = 110.0
    r.poll()
    clock.t = 500.0
    r.poll()
    r.poll()
    got = warnings_of(caplog)
    assert len(got) == 1
    assert "10 seconds after start" in got[0] and f"{PREFIX}.journal does not exist" in got[0]
    assert ssd_dir in got[0] and "run TP within one host" in got[0]
    assert r.writer_missing == f"its journal {os.path.join(ssd_dir, PREFIX + '.journal')} does not exist"


def test_a_journal_no_live_writer_holds_is_reported(ssd_dir):
    path = os.path.join(ssd_dir, PREFIX + ".journal")
    JournalWriter(path).close()  # left by an earlier run on this host; no lock held
    assert writer_invisible(path) == (f"no running process holds its lock {PREFIX}.lock "
                                      "(the journal there is left from an earlier run)")


def test_a_live_writer_is_visible_and_nothing_is_logged(ssd_dir, caplog):
    caplog.set_level(logging.WARNING, logger="flatcake")
    path = os.path.join(ssd_dir, PREFIX + ".journal")
    w = JournalWriter(path)
    fd = os.open(os.path.join(ssd_dir, PREFIX + ".lock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the writer process holds its pool
    try:
        clock = Clock()
        r = JournalReader(path, grace_s=1.0, clock=clock)
        clock.t += 5
        assert r.poll() == (False, [])
        assert writer_invisible(path) is None and r.writer_missing is None
        assert warnings_of(caplog) == []
        r.close()
    finally:
        os.close(fd)
        w.close()
