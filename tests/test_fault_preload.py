"""Faults where the shipped paths run (issue 23 item 13): the LD_PRELOAD interposer
(``flatcake.testing.fault_preload``) makes FlatCake's C loops see EIO and ENOSPC, in the default
configuration (C restore, write queue with its C piece writer).

Each case runs a store in a child process started with the interposer (it cannot be loaded into
the test process afterwards); the child prints what it saw as JSON."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flatcake.native import loops as native_loop
from flatcake.testing import fault_preload

HERE = Path(__file__).resolve().parent
#: the calling object the interposer names for FlatCake's C loops: the extension's file
EXT = os.path.basename(native_loop.extension_path())

CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from flatcake_testkit import fill_page, make_store, page_matches, put_pages
    from flatcake.store import native_write
    from flatcake.cio import native_restore
    from flatcake.testing.fault_preload import Interposer

    ssd_dir = sys.argv[1]
    fi = Interposer.attach()
    out = {{"attached": fi is not None}}
    store, pool, lay = make_store(ssd_dir)  # the default configuration: write queue on, C loops
    out["native"] = [loop.wait_built() is not None for loop in (native_restore.LOOP, native_write.LOOP)]
    a, b, c = ([f"{{s}}{{i}}" for i in range(4)] for s in "abc")
    assert put_pages(store, pool, lay, a, range(4)) == [True] * 4
    assert put_pages(store, pool, lay, b, range(4, 8)) == [True] * 4
    assert store.flush_writes(60)

    def get(keys, first):  # sentinels in the destination slots first: a miss must leave them
        for i in range(len(keys)):
            fill_page(pool, (first + i) * pool.page_size, f"sentinel{{i}}")
        got = store.get(keys, lay, list(range(first, first + len(keys))))
        right = [page_matches(pool, (first + i) * pool.page_size, k if ok else f"sentinel{{i}}")
                 for i, (ok, k) in enumerate(zip(got, keys))]
        return got, right

    fi.set_rate(1.0, ("eio",))  # every read of a pool file fails
    fi.arm()
    out["a_under_eio"] = get(a, 40)
    fi.arm(False)
    out["b_after"], out["a_after"] = get(b, 44), get(a, 48)
    fi.set_rate(1.0, ("enospc",))  # every write to a pool file fails
    fi.arm()
    out["c_put"] = put_pages(store, pool, lay, c, range(8, 12))  # queued: True now, written later
    out["flushed"] = store.flush_writes(60)
    fi.arm(False)
    out["c_after"] = get(c, 52)
    st = store.snapshot_stats()
    out["errors"], out["deferred_write_failures"] = st["errors"], st["deferred_write_failures"]
    store.close()
    store, pool, lay = make_store(ssd_dir)  # what is on disk
    out["restart"] = {{"a": get(a, 40), "b": get(b, 44), "c": get(c, 48)}}
    store.close()
    out["faults"] = [f.__dict__ for f in fi.report()]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """What the child saw (one run for the module's tests)."""
    d = tmp_path_factory.mktemp("faultpreload")
    lib, why = fault_preload.build(d)
    if lib is None:
        pytest.skip(f"the fault interposer needs a C compiler: {why}")
    ssd_dir = d / "ssd"
    ssd_dir.mkdir()
    env = fault_preload.environment(lib, path_prefix=f"{ssd_dir}/", suffix=".pool")
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=str(HERE)), str(ssd_dir)], env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(d, ignore_errors=True)  # the pool files and the interposer
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def faults_of(out: dict, symbol: str, kind: str) -> dict:
    """Injected faults of ``symbol``/``kind`` by calling object."""
    return {f["caller"]: f["count"] for f in out["faults"] if (f["symbol"], f["kind"]) == (symbol, kind)}


def test_the_c_restore_sees_injected_eio_and_answers_a_miss_with_nothing_corrupted(out):
    assert out["attached"] and out["native"] == [True, True]  # the shipped paths: the C restore, the C writer
    # the EIO reached the C restore's own pread (not Python's os.pread, which binds pread64)
    eio = faults_of(out, "pread", "eio")  # pread: in the extension, only the C restore calls it
    assert set(eio) == {EXT} and eio[EXT] >= 1
    assert out["errors"].get("read/EIO", 0) >= 1
    got, right = out["a_under_eio"]
    assert got == [False] * 4 and right == [True] * 4  # misses; the slots kept their sentinels
    got, right = out["b_after"]
    assert got == [True] * 4 and right == [True] * 4  # another scope: served bit-exact
    got, right = out["a_after"]
    assert got == [False] * 4 and right == [True] * 4  # the failed round was dropped: misses from now on
    # after a restart: b intact; a (whose bytes the EIO did not change) a miss or its own bytes
    assert out["restart"]["b"] == [[True] * 4, [True] * 4]
    assert out["restart"]["a"][1] == [True] * 4


def test_the_write_queues_c_piece_writer_sees_injected_enospc_and_the_round_is_a_miss(out):
    enospc = faults_of(out, "pwrite", "enospc")
    assert set(enospc) == {EXT} and enospc[EXT] >= 1  # the C piece loop's pwrite (the extension's only one)
    assert out["c_put"] == [True] * 4 and out["flushed"]  # queued, then failed after the fact
    assert out["deferred_write_failures"] == 1 and out["errors"].get("deferred write/ENOSPC", 0) == 1
    got, right = out["c_after"]
    assert got == [False] * 4 and right == [True] * 4
    assert out["restart"]["c"] == [[False] * 4, [True] * 4]  # never journaled: not found at restart
    assert out["restart"]["b"] == [[True] * 4, [True] * 4]  # nothing stored before was touched
