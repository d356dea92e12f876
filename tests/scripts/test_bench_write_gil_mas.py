"""bench_write, bench_gil and bench_mas at tiny sizes (issue 23, items 5, 8, 9, 10): the ``--json``
schemas (fio's write limit and every system's ratio to it, the one durability rule, the busy
thread's own rate, the every-core-busy run, the ``fifo-N`` control), the measured window that
leaves set-up and tear-down out, every run kept beside the medians, and that nothing (files,
spinning processes) is left behind. No timed assertions: rates are only checked for sign."""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

bench_write = importlib.import_module("bench_write")
bench_gil = importlib.import_module("bench_gil")
bench_mas = importlib.import_module("bench_mas")

from flatcake.mas.lanes import LaneOp, make_lanes  # noqa: E402

WRITE_SYSTEMS = {"flatcake", "hicache_file", "sequential"}


def _left(tmp_path):
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.suffix != ".json")


# ------------------------------------------------------------------------------------ bench_write
def test_write_json_has_durability_fio_limit_and_every_pass(tmp_path):
    out = tmp_path / "out.json"
    assert bench_write.main(["--tokens", "64", "--passes", "2", "--warmup", "0", "--dir", str(tmp_path),
                             "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"passes_planned", "warmup_passes", "durability", "systems", "ratio_to_sequential",
                        "speedup_vs_hicache_file", "fio_write", "ratio_to_fio", "passes"}
    assert (res["passes_planned"], res["warmup_passes"], len(res["passes"])) == (2, 0, 2)
    assert res["durability"] == bench_write.DURABILITY and "fdatasync" in res["durability"]
    fio = res["fio_write"]
    assert fio["rw"] == "write" and fio["best_gb_per_s"] > 0 and len(fio["passes_gb_per_s"]) == 2
    assert all("--end_fsync=1" in c and "--rw=write" in c for c in fio["commands"])
    assert fio["best_gb_per_s"] == pytest.approx(statistics.median(fio["passes_gb_per_s"]))
    for p in res["passes"]:
        assert set(p) == WRITE_SYSTEMS | {"fio"}
        for n in WRITE_SYSTEMS:
            assert set(p[n]) == {"gb_per_s", "cpu_s", "ratio_to_fio"} and p[n]["gb_per_s"] > 0
            assert p[n]["ratio_to_fio"] == pytest.approx(p[n]["gb_per_s"] / p["fio"]["best_gb_per_s"])
    for n in WRITE_SYSTEMS:  # medians of the passes
        assert res["systems"][n]["gb_per_s"] == pytest.approx(statistics.median(p[n]["gb_per_s"] for p in res["passes"]))
        assert res["ratio_to_fio"][n] == pytest.approx(statistics.median(p[n]["ratio_to_fio"] for p in res["passes"]))
    assert _left(tmp_path) == []


def test_every_write_system_ends_with_one_fdatasync_of_each_file_it_wrote(tmp_path, monkeypatch):
    synced = []
    real = bench_write.sync_tree

    def spy(d):
        n = real(d)
        synced.append((os.path.basename(d).rsplit("-", 1)[0], n))
        return n

    monkeypatch.setattr(bench_write, "sync_tree", spy)
    assert bench_write.main(["--tokens", "64", "--passes", "1", "--warmup", "0", "--no-fio",
                             "--dir", str(tmp_path)]) == 0
    assert sorted(name for name, _ in synced) == sorted(WRITE_SYSTEMS)  # each once, no system skipped
    files = dict(synced)
    assert files["sequential"] == 1 and files["hicache_file"] >= 4 and files["flatcake"] >= 1  # 4 pages
    assert _left(tmp_path) == []


def test_write_summary_takes_medians_of_per_pass_ratios_and_fio():
    fio = [{"tool": "fio", "best_gb_per_s": 4.0, "best_bs_mib": 4, "version": "fio-3", "size_bytes": 1, "commands": []},
           {"tool": "fio", "error": "fio failed"}, {"tool": "fio", "best_gb_per_s": 2.0}]
    passes = [{"flatcake": {"gb_per_s": g, "cpu_s": 1.0}, "sequential": {"gb_per_s": 2.0, "cpu_s": 0.5},
               "hicache_file": {"gb_per_s": 1.0, "cpu_s": 2.0}, "fio": f} for g, f in zip((1.0, 1.8, 1.6), fio)]
    s = bench_write.summarize(passes, ["flatcake", "hicache_file", "sequential"])
    assert s["systems"]["flatcake"] == {"gb_per_s": 1.6, "cpu_s": 1.0}
    assert s["ratio_to_sequential"] == {"flatcake": 0.8, "hicache_file": 0.5, "sequential": 1.0}
    assert s["speedup_vs_hicache_file"] == 1.6
    assert s["fio_write"]["passes_gb_per_s"] == [4.0, None, 2.0] and s["fio_write"]["best_gb_per_s"] == 3.0
    assert [p["flatcake"]["ratio_to_fio"] for p in s["passes"]] == [0.25, None, 0.8]  # the pass's own fio
    assert s["ratio_to_fio"]["flatcake"] == pytest.approx(0.525)  # median of the passes that have one
    none = bench_write.summarize([{k: v for k, v in p.items() if k != "fio"} for p in passes],
                                 ["flatcake", "hicache_file", "sequential"])
    assert none["ratio_to_fio"] == {"flatcake": None, "hicache_file": None, "sequential": None}
    assert "not run" in none["fio_write"]["error"]


# -------------------------------------------------------------------------------------- bench_gil
class _FakeBurner:
    loops = 0


def test_window_counts_the_busy_thread_only_between_first_call_and_last_call():
    fb = _FakeBurner()
    win = bench_gil.Window(fb)
    fb.loops += 1000  # set-up
    win.setup_done()
    win.begin()
    fb.loops += 7
    time.sleep(0.001)
    win.end()
    win.teardown()
    fb.loops += 1000  # tear-down
    d = win.as_dict()
    assert d["busy_loops"] == 7 and win.loops_per_s == pytest.approx(7 / win.seconds)
    assert d["setup_end_s"] <= d["start_s"] <= d["end_s"] <= d["teardown_start_s"]


def test_ticker_keeps_only_ticks_inside_the_window():
    tk = bench_gil.Ticker()
    tk.ticks = [(1.0, 9.0), (2.0, 0.1), (3.0, 0.2), (4.0, 9.0)]
    assert tk.overshoot_ms(2.0, 3.0) == [0.1, 0.2]


def test_gil_json_has_busy_rates_both_cores_run_every_run_and_medians(tmp_path):
    out = tmp_path / "out.json"
    assert bench_gil.main(["--tokens", "64", "--repeats", "2", "--idle-s", "0.05", "--io-workers", "2",
                           "--hogs", "1", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res) == {"repeats", "tick_overshoot_p99_ms", "busy_over_idle", "busy_loops_per_s",
                        "busy_loops_over_idle", "gb_per_s", "cpu_s_per_gb_idle", "both_cores_busy", "runs"}
    assert res["repeats"] == 2 and len(res["runs"]) == 2
    assert set(res["tick_overshoot_p99_ms"]) == {"idle", "restore", "write"}
    assert set(res["busy_over_idle"]) == {"restore", "write"} and all(v > 0 for v in res["busy_over_idle"].values())
    assert set(res["busy_loops_per_s"]) == {"idle", "restore", "write"} and res["busy_loops_per_s"]["idle"] > 0
    assert all(v >= 0 for v in res["busy_loops_per_s"].values())
    assert set(res["gb_per_s"]) == {"restore_idle", "restore_busy", "write_idle", "write_busy"}
    both = res["both_cores_busy"]
    assert both["hog_processes"] == 1
    measured = {"restore_policy_idle", "restore_policy_normal", "write"}
    assert set(both["busy_loops_per_s"]) == measured | {"idle"}
    assert set(both["gb_per_s"]) == set(both["over_idle"]) == measured
    assert all(v > 0 for v in both["gb_per_s"].values())
    for k in ("restore", "write"):  # medians of the runs
        assert res["busy_over_idle"][k] == pytest.approx(statistics.median(r["busy_over_idle"][k] for r in res["runs"]))
    assert both["gb_per_s"]["write"] == pytest.approx(
        statistics.median(r["both_cores_busy"]["gb_per_s"]["write"] for r in res["runs"]))
    for r in res["runs"]:
        assert set(r["windows"]) == {"tick_restore", "tick_write", "restore_idle", "write_idle", "restore_busy",
                                     "write_busy", "both_restore_policy_idle", "both_restore_policy_normal",
                                     "both_write"}
        for w in r["windows"].values():  # set-up and tear-down lie outside every measured window
            assert w["setup_end_s"] <= w["start_s"] < w["end_s"] <= w["teardown_start_s"]
        assert r["windows"]["restore_idle"]["busy_loops"] == 0  # no busy thread there
        assert r["gb_per_s"]["write_busy"] == pytest.approx(
            4 * 524288 / r["windows"]["write_busy"]["seconds"] / 1e9)  # 4 pages of 512 KiB over the window
    assert _left(tmp_path) == []


def test_hogs_are_stopped_on_exit_and_exit_when_their_parent_dies():
    with bench_gil.hogs(2) as procs:
        assert all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    # a parent killed before it could stop its hog: the hog notices and exits by itself
    parent = subprocess.run([sys.executable, "-c", (
        "import os, subprocess, sys\n"
        f"p = subprocess.Popen([sys.executable, '-c', {bench_gil.HOG_SOURCE!r}, str(os.getpid())],\n"
        "                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid)\n")], capture_output=True, text=True, check=True, timeout=60)
    pid = int(parent.stdout.strip())
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        try:
            with open(f"/proc/{pid}/stat") as f:  # a zombie waiting to be reaped counts as gone
                if f.read().split(")")[-1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the hog outlived its parent")


@pytest.mark.parametrize("argv", [["--repeats", "0"], ["--hogs", "0"], ["--reps", "3"]])
def test_gil_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        bench_gil.parse_args(argv)
    assert e.value.code == 2


# -------------------------------------------------------------------------------------- bench_mas
def test_fifo_control_has_as_many_threads_as_mas():
    assert bench_mas.mas_threads(1) == 2
    assert bench_mas.schedulers(1) == ("fcfs", "fifo-2", "mas")
    assert bench_mas.schedulers(3) == ("fcfs", "fifo-4", "mas")


def _op(i, run, ssd=1):
    return LaneOp(f"r{i}", float(i), 0 if ssd else 1, ssd, ssd << 20, run=run)


def test_fifo_threads_start_in_submission_order_up_to_n_at_once():
    marks = []
    lanes = make_lanes("fifo-2", pending_reads=marks.append)  # bench_mas's fifo-N control
    started, release, both_running = [], threading.Event(), threading.Event()
    both = threading.Barrier(2, timeout=10)

    def run(i):
        def f():
            started.append(i)
            if i < 2:
                both.wait()  # ops 0 and 1 run at once: would time out on one thread
                both_running.set()
                release.wait(10)
        return f

    ops = [_op(i, run(i)) for i in range(4)]
    for op in ops:
        lanes.submit(op)
    assert both_running.wait(10)
    assert sorted(started) == [0, 1]  # both threads busy: op 2 waits
    release.set()
    lanes.close()
    assert all(op.wait(0) for op in ops) and started[2:] == [2, 3]
    assert [op.lane for op in ops] == ["fifo"] * 4
    assert lanes.stats()["fifo"] == 4 and lanes.stats()["lanes"] == "fifo-2"
    assert marks.count(1) == marks.count(-1) == 4  # every SSD op marked pending, then unmarked


def test_mas_json_has_fifo_n_control_hbm_on_and_every_run(tmp_path):
    out = tmp_path / "mas.json"
    assert bench_mas.main(["--agents", "2", "--short", "6", "--repeats", "1", "--dir", str(tmp_path),
                           "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["fifo_n"] == "fifo-2"
    assert res["io_threads"] == {"fcfs": 1, "fifo-2": 2, "mas": 2}
    assert set(res["systems"]) == {"fcfs", "fifo-2", "mas"}
    assert res["mix"]["hbm_pages"] == 512 and res["mix"]["repeats"] == 1
    for k in ("ttft_p99_ratio", "ttft_mean_ratio", "ttft_p99_ratio_vs_fifo_n", "ttft_mean_ratio_vs_fifo_n"):
        assert res[k] > 0
    s = res["systems"]
    assert res["ttft_p99_ratio_vs_fifo_n"] == pytest.approx(s["mas"]["ttft_s"]["p99"] / s["fifo-2"]["ttft_s"]["p99"])
    assert sorted(r["scheduler"] for r in res["runs"]) == ["fcfs", "fifo-2", "mas"]
    # the shared prompts are the trace's 2-block prefixes that more than one request starts with,
    # written in the warm-up (DRAM). Every one starts with the trace's block 0; the first measured
    # request restores both its blocks from DRAM (HBM is empty), each later one finds block 0 in
    # HBM and restores its own second block from DRAM: at least 512 tokens per prompt + 512
    mix = res["mix"]
    assert 1 <= mix["shared_prompts"] <= 6 and mix["shared_prompt_pages"] == mix["shared_prompts"] * 2 * 512 // 64
    assert mix["dram_bytes"] == 256 << 20  # a few prompts: the 256 MiB floor
    for name, sy in s.items():
        assert set(sy["hit_tokens"]) == {"hbm", "dram", "ssd"} and sy["verify_failures"] == 0, name
        assert sy["io_threads"] == res["io_threads"][name]
        assert sy["hit_tokens"]["dram"] >= mix["shared_prompts"] * 512 + 512, name
    assert _left(tmp_path) == []
