"""The SGLang backend reports each C loop's state (issue 23 item 17): ``flatcake_stats()
["native_loops"]``, the start-up line (and a WARNING naming each loop that fell back, with its
reason) and the ``flatcake_native_loop_state`` metric, also through Prometheus' multiprocess
files as SGLang's ``/metrics`` reads them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from flatcake.native import loops as native_loop

from flatcake.store import native_write
from flatcake.adapter.startup import native_summary, native_warning

#: the extension with the C loops is built (pip install; a build without a compiler has none)
BUILT = native_loop.library()[0] is not None
LOOPS = ["restore", "plan", "zero_copy", "gather", "write", "xxh3", "fcds"]


def messages(caplog, level) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flatcake" and r.levelno == level]


@pytest.mark.skipif(not BUILT or os.environ.get("FLATCAKE_ZERO_COPY") == "1",
                    reason="needs the built extension, zero copy off")
def test_the_start_up_line_lists_every_loop_and_flatcake_stats_reports_them(make_backend, caplog):
    caplog.set_level(logging.INFO, logger="flatcake")
    be, _ = make_backend()
    line = next(m for m in messages(caplog, logging.INFO) if "per-rank capacity" in m)
    assert line.endswith("; C loops native (restore, plan, gather, write, xxh3, fcds), off (zero_copy)")
    assert not [m for m in messages(caplog, logging.WARNING) if "C loops" in m]
    st = be.flatcake_stats()["native_loops"]
    assert list(st) == LOOPS and st["write"] == {"state": "native", "reason": ""}
    assert st["zero_copy"]["state"] == "off" and st == native_loop.report()


def test_a_loop_that_fell_back_is_named_with_its_reason_at_start_up(make_backend, caplog, monkeypatch):
    monkeypatch.setitem(native_write.LOOP.state, "fn", None)  # as a failed build leaves it
    caplog.set_level(logging.INFO, logger="flatcake")
    be, _ = make_backend()
    line = next(m for m in messages(caplog, logging.INFO) if "per-rank capacity" in m)
    assert "FALLBACK (" in line and "write" in line.split("FALLBACK (")[1].split(")")[0]
    warned = [m for m in messages(caplog, logging.WARNING) if "C loops" in m]
    assert len(warned) == 1
    assert "C loops fell back to Python: " in warned[0]
    assert "write (turned off in this process (its LOOP.state))" in warned[0]
    assert be.flatcake_stats()["native_loops"]["write"]["state"] == "fallback"


def test_the_summary_and_warning_of_a_report():
    rep = {"restore": {"state": "native", "reason": ""}, "zero_copy": {"state": "off", "reason": "X not 1"},
           "write": {"state": "fallback", "reason": "extension not built (ModuleNotFoundError)"}}
    assert native_summary(rep) == "C loops native (restore), off (zero_copy), FALLBACK (write)"
    assert native_warning(rep) == (
        "flatcake: C loops fell back to Python: write (extension not built (ModuleNotFoundError)). The fallbacks "
        "give the same bytes, several times slower (writes at about 0.5 GB/s); python -m flatcake.native shows "
        "each loop's state (rebuild the extension: pip install --no-deps -e . with a C compiler)")
    assert native_warning({"restore": {"state": "native", "reason": ""}}) is None


def test_the_metric_has_one_series_per_loop_and_state(make_backend, monkeypatch):
    prom = pytest.importorskip("prometheus_client")
    monkeypatch.setitem(native_write.LOOP.state, "fn", None)
    be, _ = make_backend()
    be.storage_config.enable_storage_metrics = True
    be.prometheus_registry = prom.CollectorRegistry()
    be.refresh_metrics(force=True)
    lab = {"pool": be.store.ssd.prefix, "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
    got = {(s.labels["loop"], s.labels["state"]): s.value for m in be.prometheus_registry.collect()
           if m.name == "flatcake_native_loop_state" for s in m.samples}
    assert set(got) == {(loop, state) for loop in LOOPS for state in native_loop.STATES}
    assert be.prometheus_registry.get_sample_value("flatcake_native_loop_state",
                                                   {**lab, "loop": "write", "state": "fallback"}) == 1
    assert be.prometheus_registry.get_sample_value("flatcake_native_loop_state",
                                                   {**lab, "loop": "write", "state": "native"}) == 0
    for loop, r in be.flatcake_stats()["native_loops"].items():
        assert sum(got[(loop, s)] for s in native_loop.STATES) == 1 and got[(loop, r["state"])] == 1


def test_the_metric_reaches_another_process_through_multiprocess_files(tmp_path):
    prom = pytest.importorskip("prometheus_client")
    from prometheus_client import multiprocess

    code = ("from flatcake.metrics import make_exporter\n"
            "e = make_exporter({'pool': 'fc-test'})\n"
            "e.update({'native_loops': {'write': {'state': 'fallback', 'reason': 'cc failed'},"
            " 'xxh3': {'state': 'native', 'reason': ''}}})\n")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)},
                   check=True, timeout=300)
    reg = prom.CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    lab = {"pool": "fc-test", "tp_rank": "", "pp_rank": "", "dp_rank": ""}
    assert reg.get_sample_value("flatcake_native_loop_state", {**lab, "loop": "write", "state": "fallback"}) == 1
    assert reg.get_sample_value("flatcake_native_loop_state", {**lab, "loop": "write", "state": "native"}) == 0
    assert reg.get_sample_value("flatcake_native_loop_state", {**lab, "loop": "xxh3", "state": "native"}) == 1
