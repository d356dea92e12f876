"""Issue 23, items 6 and 7, in scripts/bench_restore.py at tiny sizes: the page-wise baselines'
C reader (``csrc/pagewise_read.c``, in the extension) and its Python fallback read exactly the file's
bytes and copy exactly the described regions; the regions of a page or chunk in every host
layout are found right; every restore's JSON carries fio's read limit, each system's ratio to
it, the reader that ran and the I/O thread count; the sweep's targets are 0.85x fio and 1.0x
the best page-wise reader; nothing is left on disk. No timed assertions."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

bench_restore = importlib.import_module("bench_restore")
bench_common = importlib.import_module("bench_common")
fio_limit = importlib.import_module("fio_limit")
pagewise = importlib.import_module("native.pagewise")

needs_fio = pytest.mark.skipif(fio_limit.fio_path() is None, reason="fio not installed (make fio)")
C_READER = pagewise.PagewiseReader(4)
KINDS = [pytest.param(True, id="c-pthreads"), pytest.param(False, id="python-threads")]


def _reader(native: bool, threads: int = 4):
    if native and C_READER.kind != "c-pthreads":
        pytest.skip(f"no C reader here: {C_READER.why}")
    return C_READER if native and threads == 4 else pagewise.PagewiseReader(threads, native=native)


def _file(tmp_path, nbytes: int, seed: int = 7) -> tuple[str, bytes]:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return str(path), data


def _left(tmp_path, keep=("out.json",)):
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name not in keep)


# ---------------------------------------------------------------- the C reader and its fallback
@pytest.mark.parametrize("native", KINDS)
def test_reader_reads_exactly_the_files_bytes_for_edge_jobs(tmp_path, native):
    reader = _reader(native)
    size = (1 << 20) + 777  # not a multiple of anything
    path, data = _file(tmp_path, size)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = reader.read([], [], [], [])  # zero jobs
        assert got.shape == (0,)
        # one job, odd size at an odd offset
        dst = np.zeros(1001, dtype=np.uint8)
        assert reader.read([fd], [13], [1001], [dst.ctypes.data]).tolist() == [1001]
        assert dst.tobytes() == data[13:1014]
        # many jobs (> threads) of odd sizes, into one buffer, plus one running past the end of
        # the file (short: it reads what is there) and one starting exactly at the end
        rng = np.random.default_rng(1)
        n = 203
        lens = rng.integers(1, 9000, n)
        offs = rng.integers(0, size - 9000, n)
        lens[-2], offs[-2] = 5000, size - 1234
        lens[-1], offs[-1] = 100, size
        pos = np.concatenate([[0], np.cumsum(lens)[:-1]])
        buf = np.zeros(int(lens.sum()), dtype=np.uint8)
        got = reader.read(np.full(n, fd), offs, lens, buf.ctypes.data + pos)
        assert got[:-2].tolist() == lens[:-2].tolist() and got[-2] == 1234 and got[-1] == 0
        for i in range(n - 1):
            assert buf[pos[i]: pos[i] + got[i]].tobytes() == data[offs[i]: offs[i] + got[i]], i
    finally:
        os.close(fd)


@pytest.mark.parametrize("native", KINDS)
def test_reader_reads_odirect_slots_and_copies_their_segments(tmp_path, native):
    """Copy mode, O_DIRECT: each 8 KiB slot read into the thread's bounce slot, its 2-D
    segments copied out; the last slot of the file is short of the request (end of file)."""
    reader = _reader(native, threads=3)
    slot, n = 8192, 37
    path, data = _file(tmp_path, slot * n)
    src = np.frombuffer(data, dtype=np.uint8).reshape(n, slot)
    order = np.random.default_rng(2).permutation(n)  # job i reads slot order[i]
    # job i: rows 0..3 of 1024 B each (from byte 512 of the slot) to dst row block i, 2048 B apart,
    # plus 96 B from byte 7000 to a second place
    dst = np.zeros((n, 4, 2048), dtype=np.uint8)
    dst2 = np.zeros((n, 96), dtype=np.uint8)
    seg = bench_restore.segments(
        np.stack([dst.ctypes.data + np.arange(n) * dst[0].nbytes, dst2.ctypes.data + np.arange(n) * 96], axis=1),
        np.array([512, 7000]), np.array([4, 1]), np.array([1024, 96]), np.array([2048, 0]))
    bounce = bench_common.prefaulted(3 * slot)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = reader.read_copy(np.full(n, fd), order * slot, np.full(n, slot), bounce.ctypes.data, slot, seg)
        assert (got == slot).all()
        for i, s in enumerate(order):
            assert dst[i, :, :1024].tobytes() == src[s, 512: 512 + 4096].tobytes(), i
            assert not dst[i, :, 1024:].any()
            assert dst2[i].tobytes() == src[s, 7000: 7096].tobytes()
        # a request past the end: read short (O_DIRECT end of file), its segments not copied
        one = np.zeros((1, 4, 2048), dtype=np.uint8)
        seg1 = bench_restore.segments(np.array([[one.ctypes.data]]), np.array([0]), np.array([1]),
                                      np.array([64]), np.array([0]))
        big = bench_common.prefaulted(3 * 2 * slot)  # threads x bounce_stride
        got = reader.read_copy([fd], [(n - 1) * slot], [2 * slot], big.ctypes.data, 2 * slot, seg1)
        assert got.tolist() == [slot] and not one.any()
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        reader.read([-1], [0], [10], [dst.ctypes.data])  # a bad descriptor: EBADF
    with pytest.raises(ValueError, match="bounce slot"):
        reader.read_copy([0], [0], [2 * slot], bounce.ctypes.data, slot, seg1)


def test_reader_refuses_zero_threads():
    with pytest.raises(ValueError):
        pagewise.PagewiseReader(0, native=False)


@pytest.mark.parametrize("profile,page_size", [("llama3.2-1b", 4), ("deepseek-v2-lite", 4)])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_strided_runs_find_a_pages_and_a_chunks_bytes_in_every_layout(profile, page_size, layout):
    """The segments of a page's flat view (``scattered``) and of a (page, layer) chunk's planes
    (``scattered-layerwise``) address exactly the bytes SGLang's flat page and FlatCake's chunk
    hold, in their order."""
    from flatcake.cio.pagecopy import gather_pages
    from flatcake.common.layout import KvPageLayout

    pool, _ = bench_common.make_host_pool(profile, 3 * page_size, page_size, layout)
    page = 1

    def bytes_at(view):
        offs, rows, run, stride = bench_restore.strided_runs(view)
        return b"".join(ctypes.string_at(view.data_ptr() + int(o) + r * stride, run) for o in offs for r in range(rows))

    want = pool.get_data_page(page * page_size, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
    assert bytes_at(pool.get_data_page(page * page_size, flat=False)) == want
    kv = KvPageLayout.from_host_pool(pool)
    out = torch.empty((1, kv.geometry.chunk_bytes), dtype=torch.uint8)
    for layer in (0, kv.geometry.layers - 1):
        gather_pages(kv, np.array([page]), layer, out)
        got = b"".join(bytes_at(plane[page]) for plane in kv.layer_planes(layer))
        assert got == out.numpy().tobytes()


# ---------------------------------------------------------------- fio in the JSON, targets
def test_table_row_targets_are_085_fio_and_10_best_pagewise():
    cell = {"profile": "p", "attention": "mha", "page_size": 16, "layout": "page_first", "page_bytes": 4096,
            "systems": {"flatcake": {"gb_per_s": 1.0}}, "ratio_to_fio": {"flatcake": 0.85},
            "fio_read": {"gb_per_s": 1.2}, "ratio_to_sequential": {"flatcake": 0.5},
            "ratio_to_best_pagewise": 1.0, "best_pagewise": "scattered",
            "cpu_s_per_gb": {"flatcake": 0.2, "scattered": 0.3}}
    row = bench_restore.table_row(cell)
    assert row["meets_targets"] is True and row["targets"] == {"fio": True, "pagewise": True, "cpu": True}
    assert (row["fio_gb_per_s"], row["ratio_to_sequential"]) == (1.2, 0.5)  # sequential no longer a target
    assert bench_restore.table_row({**cell, "ratio_to_fio": {"flatcake": 0.84}})["targets"]["fio"] is False
    assert bench_restore.table_row({**cell, "ratio_to_fio": {"flatcake": None}})["meets_targets"] is False
    assert bench_restore.table_row({**cell, "ratio_to_best_pagewise": 0.99})["targets"]["pagewise"] is False
    assert bench_restore.table_row({**cell, "cpu_s_per_gb": {"flatcake": 0.4, "scattered": 0.3}})["meets_targets"] is False
    assert (bench_restore.TARGET_FIO, bench_restore.TARGET_PAGEWISE) == (0.85, 1.0)


def test_fio_nearest_in_time_and_missing_fio():
    before, after = {"best_gb_per_s": 2.0}, {"best_gb_per_s": 1.0}
    assert [bench_common.nearest_fio(i, 4, before, after) for i in range(4)] == [before, before, after, after]
    assert bench_common.nearest_fio(0, 4, {"error": "x"}, after) is after
    assert bench_common.fio_ratios([1.0, 1.0, 1.0, 1.0], before, after) == pytest.approx(0.75)
    assert bench_common.fio_ratios([1.0], {"error": "x"}, {"error": "y"}) is None


@needs_fio
def test_fio_read_lays_out_once_measures_again_and_removes_its_file(tmp_path):
    f = bench_common.FioRead(str(tmp_path), 1, block_sizes_mib=(1, 4))
    try:
        assert f.error is None and f.size_bytes == 4 << 20
        a, b = f.measure(), f.measure()
        for m in (a, b):
            assert sorted(m["by_bs_mib"]) == [1, 4] and m["best_gb_per_s"] == max(m["by_bs_mib"].values())
            assert m["iodepth"] == 32 and all("--direct=1" in c and "--ioengine=libaio" in c for c in m["commands"])
    finally:
        f.close()
    assert os.listdir(tmp_path) == []


def test_fio_read_without_fio_is_an_error_not_a_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(fio_limit, "fio_path", lambda: None)
    f = bench_common.FioRead(str(tmp_path), 1 << 20)
    assert "not installed" in f.measure()["error"]
    f.close()
    assert os.listdir(tmp_path) == []


def _check_cell(cell: dict, names) -> None:
    assert cell["pagewise_reader"] in ("c-pthreads", "python-threads") and cell["io_workers"] == 3
    fio = cell["fio_read"]
    if fio_limit.fio_path() is None:
        assert "error" in fio and all(v is None for v in cell["ratio_to_fio"].values())
        return
    assert fio["gb_per_s"] > 0 and fio["iodepth"] == 32 and len(fio["per_pass_gb_per_s"]) == len(cell["passes"])
    assert set(cell["ratio_to_fio"]) == set(names)
    for n in names:
        want = np.median([p[n]["gb_per_s"] / p["fio"]["best_gb_per_s"] for p in cell["passes"]])
        assert cell["ratio_to_fio"][n] == pytest.approx(want), n
    assert "QD 1" in cell["labels"]["sequential"] and "QD 32" in cell["labels"]["fio"]


def test_single_cell_json_carries_fio_ratios_reader_and_threads(tmp_path):
    out = tmp_path / "out.json"
    assert bench_restore.main(["--tokens", "64", "--page-size", "16", "--passes", "2", "--warmup", "0",
                               "--io-workers", "3", "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    _check_cell(res, bench_restore.SYSTEMS)
    assert res["pagewise_reader"] == C_READER.kind
    best = res["best_pagewise"]
    assert best in bench_restore.PAGEWISE
    p = res["passes"][0]
    assert (p["scattered"]["read_ops"], p["scattered-layerwise"]["read_ops"]) == (4, 64)
    assert _left(tmp_path) == []


def test_sweep_json_carries_fio_ratios_per_cell_and_the_new_targets(tmp_path):
    out = tmp_path / "out.json"
    assert bench_restore.main(["--profile", "llama3.2-1b,deepseek-v2-lite", "--page-size", "16",
                               "--layout", "layer_first", "--tokens", "32", "--passes", "1", "--warmup", "0",
                               "--io-workers", "3", "--systems", "scattered,scattered-layerwise",
                               "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["pagewise_reader"] == C_READER.kind and res["io_workers"] == 3
    assert res["targets"]["ratio_to_fio"] == 0.85 and res["targets"]["ratio_to_best_pagewise"] == 1.0
    for cell, row in zip(res["cells"], res["table"]):
        _check_cell(cell, ["scattered", "scattered-layerwise", "flatcake", "sequential"])
        assert row["ratio_to_fio"] == cell["ratio_to_fio"]["flatcake"]
        assert set(row["targets"]) == {"fio", "pagewise", "cpu"}
    assert _left(tmp_path) == []


def test_no_fio_flag_reports_no_ratio(tmp_path):
    out = tmp_path / "out.json"
    assert bench_restore.main(["--tokens", "32", "--page-size", "16", "--passes", "1", "--warmup", "0",
                               "--io-workers", "2", "--systems", "scattered", "--no-fio",
                               "--dir", str(tmp_path), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert "error" in res["fio_read"] and all(v is None for v in res["ratio_to_fio"].values())
    assert bench_restore.table_row(res)["targets"]["fio"] is False
    assert _left(tmp_path) == []


def test_mixed_io_summary_takes_each_pass_over_the_nearer_fio():
    """scripts/bench_mixed_io.py: fio read and write before and after the passes; each pass's
    GB/s over the nearer one, medians per policy."""
    bench_mixed_io = importlib.import_module("bench_mixed_io")
    runs = [{"policy": p, "read_gbps": r, "write_gbps": w, "restore_wall_s": 1.0}
            for p, r, w in (("on", 2.0, 1.0), ("off", 1.0, 1.0), ("off", 1.0, 0.5), ("on", 2.0, 0.5))]
    fio = {"read": {"before": {"best_gb_per_s": 4.0}, "after": {"best_gb_per_s": 2.0}},
           "write": {"before": {"best_gb_per_s": 2.0}, "after": {"error": "x"}}}
    s = bench_mixed_io.summarize(runs, fio)
    assert s["ratio_to_fio"]["read_gbps"] == {"on": pytest.approx(0.75), "off": pytest.approx(0.375)}
    assert s["ratio_to_fio"]["write_gbps"] == {"on": pytest.approx(0.375), "off": pytest.approx(0.375)}
    assert s["fio"] is fio and "ratio_to_fio" not in bench_mixed_io.summarize(runs)
