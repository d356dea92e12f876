"""``scripts/serve_bench.py``: the workload and statistics on synthetic data (quick, no server), and
end to end, small (``make e2e``, marked ``e2e_full``: two server lifetimes, 2-4 minutes on an idle
2-core machine, up to 9 under load): the WEKA slice's first three conversations against
``flatcake`` and ``none``, one rate, one run. Checks the JSON's shape, that every request was
answered and counted, that FlatCake served prompt tokens from storage on a trace with reuse (and
``none`` none), that the restore probe ran, and that nothing is left behind: no server process,
no storage directory, no ``/dev/shm`` file of its servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WEKA = ROOT.parent / "shared" / "traces" / "weka_kv_cache_tester" / "kv_cache_tester_traces_710.tar.xz"
POINT_KEYS = {"qps", "requests", "errors", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "prompt_tokens", "cached_tokens"}

sys.path.insert(0, str(ROOT / "scripts"))
import serve_bench  # noqa: E402

from flatcake.replay.traces import TraceRequest  # noqa: E402
from flatcake.testing.serve_client import Answer  # noqa: E402
from flatcake.testing.serve_workload import build_prompts, mooncake_slice, unique_pages  # noqa: E402


def _req(ns: str, ids, t: float, prompt_tokens=None, session=None) -> TraceRequest:
    return TraceRequest(arrival_s=t, namespace=ns, session=session or ns, block_ids=tuple(ids), block_tokens=64,
                        prompt_tokens=prompt_tokens or 64 * len(ids), output_tokens=100)


def test_prompts_share_token_prefixes_exactly_as_the_trace_shares_block_ids():
    reqs = [_req("weka:a", [1, 2, 3], 0.0), _req("weka:a", [1, 2, 3, 4, 5], 1.0, prompt_tokens=5 * 64 + 32),
            _req("weka:b", [1, 2], 2.0)]
    p = build_prompts(reqs, page_size=2, max_new_tokens=4)
    assert [x.pages for x in p] == [3, 5, 2]
    assert p[1].input_ids[:6] == p[0].input_ids  # ids 1-3 shared: 3 pages of 2 tokens
    assert len(p[1].input_ids) == 5 * 2 + 1  # + a tail of ceil(32 * 2 / 64) = 1 token of its own
    assert p[2].input_ids[:2] != p[0].input_ids[:2]  # another conversation's id 1 is another block
    assert [x.max_new_tokens for x in p] == [4, 4, 4]
    assert build_prompts(reqs, 2, 4) == p  # deterministic
    assert unique_pages(p, 2) == 5 + 2  # a's 5 distinct pages, b's 2


def test_mooncake_prefix_groups_take_requests_sharing_their_first_two_ids(tmp_path):
    lines = [{"timestamp": 0, "input_length": 1536, "output_length": 10, "hash_ids": [0, 1, 2]},
             {"timestamp": 10, "input_length": 1024, "output_length": 10, "hash_ids": [0, 7]},
             {"timestamp": 20, "input_length": 2048, "output_length": 10, "hash_ids": [0, 1, 2, 3]},
             {"timestamp": 30, "input_length": 512, "output_length": 10, "hash_ids": [0]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    got = mooncake_slice(path, groups=5)
    assert [q.block_ids for q in got] == [(0, 1, 2), (0, 1, 2, 3)]  # group 1 has two requests; 7 has one
    assert {q.session for q in got} == {"mooncake-group:1"}


def test_run_statistics_count_every_request_and_split_cached_tokens_by_tier():
    def ans(ttft, storage=0, wait=None, error=None):
        return Answer(ttft_s=ttft, prompt_tokens=100, cached={"device": 10, "host": 0, "storage": storage},
                      storage_wait_s=wait, error=error)

    answers = [ans(1.0), ans(2.0, storage=50, wait=0.5), ans(3.0, storage=20, wait=1.5), ans(None, error="x")]
    st = serve_bench.run_stats(2.0, answers, 10.0)
    assert (st["requests"], st["errors"], st["restores"]) == (4, 1, 2)
    assert st["ttft_p50_s"] == 2.0 and st["ttft_mean_s"] == 2.0
    assert st["cached_tokens"] == {"device": 30, "host": 0, "storage": 70}
    assert st["prompt_tokens"] == 300
    assert st["storage_share_of_restore_ttft"] == pytest.approx(2.0 / 5.0)
    point = serve_bench.median_point([st, dict(st, ttft_p50_s=4.0), dict(st, ttft_p50_s=3.0)])
    assert point["ttft_p50_s"] == 3.0 and len(point["runs"]) == 3
    assert point["cached_tokens"]["storage"] == 70



def _shm_in_use() -> set:
    """``/dev/shm`` files some live process has open or mapped."""
    held = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held.update(os.readlink(fd) for fd in (proc / "fd").iterdir())
            held.update(line.split(None, 5)[5] for line in (proc / "maps").read_text().splitlines()
                        if len(line.split(None, 5)) == 6)
        except OSError:
            continue
    return {p.replace(" (deleted)", "") for p in held if p.startswith("/dev/shm/")}


def _our_processes(marker: str) -> list:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(proc.name)
            except OSError:
                continue
    return found


def test_orphan_shm_files_of_dead_servers_are_removed_and_held_ones_kept(tmp_path):
    before = set(os.listdir("/dev/shm"))
    orphan, held, other = (Path("/dev/shm") / f"{p}fc-serve-bench-test-{os.getpid()}"
                           for p in ("sglang_", "sem.mp-", "other-"))
    for f in (orphan, held, other):
        f.write_bytes(b"x")
    try:
        with open(held, "rb"):
            serve_bench.remove_orphan_shm(before)
            assert not orphan.exists()  # SGLang's, new, nobody holds it
            assert held.exists()  # a live process has it open
            assert other.exists()  # not one of SGLang's names
    finally:
        for f in (orphan, held, other):
            f.unlink(missing_ok=True)


@pytest.mark.e2e_full
@pytest.mark.skipif(not WEKA.exists(), reason=f"the WEKA trace is not at {WEKA}")
def test_serve_bench_small_run_writes_the_schema_counts_every_request_and_leaves_nothing(tmp_path):
    out, js = tmp_path / "out", tmp_path / "sb.json"
    shm_before = set(os.listdir("/dev/shm"))
    cmd = [sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "--quick", "--systems", "flatcake,none",
           "--conversations", "3", "--max-blocks", "256", "--max-requests", "10", "--rates", "2", "--runs", "1",
           # a device pool of one request: a conversation's next turn finds its prefix evicted
           # whenever another conversation ran in between, so reuse reaches the L3 on any machine
           "--device-tokens", "320",
           "--out", str(out), "--json", str(js)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(js.read_text())

    assert doc["rates"] == [2.0]
    assert set(doc["systems"]) == {"flatcake", "none"}, doc["skipped"]
    assert doc["skipped"] == {}
    requests = doc["traces"]["weka"]["requests"]
    assert requests == 10
    for name, s in doc["systems"].items():
        [point] = s["per_rate"]
        assert POINT_KEYS <= set(point), (name, sorted(point))
        assert set(point["cached_tokens"]) == {"device", "host", "storage"}
        assert point["qps"] == 2.0
        assert point["requests"] == requests and point["errors"] == 0, (name, point["runs"])
        assert 0 < point["ttft_p50_s"] <= point["ttft_p99_s"]
        assert point["prompt_tokens"] == doc["traces"]["weka"]["prompt_tokens"]
        assert len(point["runs"]) == 1
    # the slice reuses its prefixes: FlatCake serves some from storage; HiCache without L3 cannot
    assert doc["systems"]["flatcake"]["per_rate"][0]["cached_tokens"]["storage"] > 0
    assert doc["systems"]["none"]["per_rate"][0]["cached_tokens"]["storage"] == 0
    # the restore probe: FlatCake served the flushed prompt from storage
    assert doc["probe"]["flatcake"]["restore_storage_tokens"] > 0
    assert (out / "summary.md").exists() and (out / "weka_ttft_vs_qps.png").exists()

    # nothing left: no process of its servers, no storage directory, no /dev/shm file of theirs
    assert _our_processes(str(out)) == []
    assert not list((out / "work").glob("*-l3"))
    leaked = (set(os.listdir("/dev/shm")) - shm_before) - {Path(p).name for p in _shm_in_use()}
    assert not leaked, leaked
