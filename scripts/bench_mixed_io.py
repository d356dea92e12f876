#!/usr/bin/env python3
"""Mixed read/write benchmark (Tutti, design notes §3; ``docs/design.md``, "Write queue"):
restores of long sessions while a writer streams new sessions, with the write queue's policy
on (``ssd.write_backlog_bytes > 0``: writes held while a restore is in flight, drained in the
gaps) and off (``0``: each put writes its rounds itself, concurrently with the restores).

Each pass uses a new FlatCake store (core ``PageStore`` on an SGLang host-pool double of random
bytes) in a new directory under ``--dir``, removed right after the pass:

1. store ``--read-sessions`` sessions of ``--read-tokens`` tokens (flushed to disk; not timed);
2. start the writer thread: it stores new sessions of ``--write-tokens`` tokens, one put per
   round of 128 pages, as SGLang's backup thread does, until the restores are done;
3. restore the stored sessions ``--restores`` times (one ``get`` of a whole session each,
   ``--gap-ms`` of idle "compute" between two restores, as a scheduler step would leave);
4. stop the writer; with the policy on, wait until its queue is on disk (timed as writing).

``read_gbps`` = bytes restored / seconds inside the restore calls; ``restore_wall_s`` = those
seconds; ``write_gbps`` = bytes the writer stored / seconds from its start until they were on
disk. Passes alternate on/off (``--passes`` of each); medians are reported, ``read_speedup`` =
median read_gbps on / off. Every restored page is checked (the leading run must be complete).

    python scripts/bench_mixed_io.py --json runs/bench/mixed_io.json

**The disk's limit** is fio's (``scripts/fio_limit.py``: O_DIRECT, libaio, queue depth 32, the
best of 1, 4 and 16 MiB requests), read and write, on ``--dir``'s file system with the restored
sessions' bytes, measured before the first pass and after the last; each pass's GB/s is taken
over the nearer of the two (the first half of the passes: before; the rest: after), and
``ratio_to_fio`` is the median of those per-pass ratios per policy. The raw O_DIRECT figures
printed first are our own single-stream reads and writes (one stream, queue depth 1), kept for
reference.

``--json FILE`` writes exactly ``{"read_gbps": {"on", "off"}, "write_gbps": {"on", "off"},
"restore_wall_s": {"on", "off"}, "read_speedup": x}``, plus, unless ``--no-raw``, ``"fio":
{"read": {"before", "after"}, "write": {"before", "after"}}`` (fio_limit's dicts) and
``"ratio_to_fio": {"read_gbps": {"on", "off"}, "write_gbps": {"on", "off"}}`` (``null`` where
fio gave no figure).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import PROFILES, make_host_pool, nearest_fio, write_json  # noqa: E402
from fio_limit import fio_limit, ratio_to_fio  # noqa: E402
from flatcake.config import STORAGE_BATCH_PAGES  # noqa: E402

POLICIES = ("on", "off")


def parse_args(argv=None):
    """Command-line arguments (``argv``: list of str; ``None`` = ``sys.argv[1:]``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="llama3.2-1b", choices=sorted(PROFILES))
    ap.add_argument("--page-size", type=int, default=None, help="tokens per page (default: the profile's)")
    ap.add_argument("--read-sessions", type=int, default=2, help="sessions restored (default 2)")
    ap.add_argument("--read-tokens", type=int, default=4096, help="tokens per restored session (default 4096)")
    ap.add_argument("--write-tokens", type=int, default=2048, help="tokens per streamed session (default 2048)")
    ap.add_argument("--restores", type=int, default=6, help="restores per pass (default 6)")
    ap.add_argument("--gap-ms", type=float, default=10.0, help="idle ms between two restores (default 10)")
    ap.add_argument("--backlog-mib", type=int, default=256, help="ssd.write_backlog_bytes with the policy on (MiB)")
    ap.add_argument("--passes", type=int, default=2, help="passes of each policy, alternating (default 2)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the temporary pools go")
    ap.add_argument("--no-raw", action="store_true",
                    help="skip the disk references: fio's limit and our raw O_DIRECT single-stream figures")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    a.page_size = a.page_size or PROFILES[a.profile]["page_size"]
    for name in ("read_sessions", "read_tokens", "write_tokens", "restores", "passes", "backlog_mib", "page_size"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if a.read_tokens % a.page_size or a.write_tokens % a.page_size:
        ap.error("--read-tokens and --write-tokens must be multiples of the page size")
    return a


def open_store(pool, directory: str, backlog_bytes: int, nbytes: int):
    """A core ``PageStore`` on ``pool`` with its files in ``directory``: 256 MiB files (or one
    128-page round), enough for ``2 * nbytes``; DRAM off; the streamed sessions are agent
    sessions (``placement.l_agent_tokens`` 1024) so a full backlog makes the writer wait,
    never drops them."""
    from flatcake.config import load_config
    from flatcake.common.layout import KvPageLayout
    from flatcake.store.page_store import PageStore

    lay = KvPageLayout.from_host_pool(pool)
    mib = 1 << 20
    file_bytes = -(-max(256 * mib, STORAGE_BATCH_PAGES * lay.geometry.page_bytes + 4 * mib) // mib) * mib
    cfg = load_config(None, {"ssd.path": directory, "ssd.file_bytes": file_bytes,
                             "ssd.max_files": max(8, 2 * nbytes // file_bytes + 4), "dram.capacity_bytes": 0,
                             "ssd.write_backlog_bytes": backlog_bytes, "ssd.write_backlog_wait_s": 600.0,
                             "placement.l_agent_tokens": 1024})
    return PageStore(cfg, lay.geometry, f"bench-mixed|{lay.name}"), lay


class Writer(threading.Thread):
    """Streams new sessions into the store (one put per 128-page round) until :attr:`stop`
    (at least one session)."""

    def __init__(self, store, lay, src_pages: list, pages_per_session: int, tag: str):
        super().__init__(name="bench-writer", daemon=True)
        self.store, self.lay, self.src, self.n, self.tag = store, lay, src_pages, pages_per_session, tag
        self.stop = threading.Event()
        self.stored_pages = 0
        self.failed_pages = 0
        self.t0 = 0.0

    def run(self) -> None:
        """Store sessions ``<tag>-w<s>-<i>`` from the source pages until stopped."""
        self.t0 = time.perf_counter()
        s = 0
        while s == 0 or not self.stop.is_set():  # at least one whole session
            keys = [f"{self.tag}-w{s}-{i}" for i in range(self.n)]
            for a in range(0, self.n, STORAGE_BATCH_PAGES):
                ks = keys[a: a + STORAGE_BATCH_PAGES]
                ok = self.store.put(ks, self.lay, self.src[a: a + len(ks)], keys[:a] or None)
                self.stored_pages += sum(ok)
                self.failed_pages += len(ok) - sum(ok)
            s += 1


def one_pass(args, pool, policy: str, base: Path, idx: int) -> dict:
    """One pass with the policy ``policy`` (``"on"``/``"off"``; ``"alone"``: no writer, the
    restores' reference) in a new directory (removed)."""
    P = args.page_size
    read_pages, write_pages = args.read_tokens // P, args.write_tokens // P
    n_read = args.read_sessions * read_pages
    backlog = args.backlog_mib << 20 if policy == "on" else 0
    d = tempfile.mkdtemp(prefix="fc-mixed-", dir=base)
    store = None
    try:
        store, lay = open_store(pool, d, backlog, (n_read + 64 * write_pages) * pool_page_bytes(pool))
        page_bytes = store.geometry.page_bytes
        sessions = [[f"p{idx}-r{s}-{i}" for i in range(read_pages)] for s in range(args.read_sessions)]
        for s, keys in enumerate(sessions):  # stored before the clock starts
            for a in range(0, read_pages, STORAGE_BATCH_PAGES):
                ks = keys[a: a + STORAGE_BATCH_PAGES]
                assert all(store.put(ks, lay, list(range(a, a + len(ks))), keys[:a] or None))
        if store.queue is not None:
            store.queue.flush(600)
        dst = list(range(read_pages, 2 * read_pages))
        writer = Writer(store, lay, list(range(2 * read_pages, 2 * read_pages + write_pages)), write_pages, f"p{idx}")
        if policy != "alone":
            writer.start()
        inside = 0.0
        for r in range(args.restores):
            keys = sessions[r % len(sessions)]
            t = time.perf_counter()
            got = store.get(keys, lay, dst)
            inside += time.perf_counter() - t
            if not all(got):
                raise RuntimeError(f"restore {r} delivered {sum(got)} of {len(got)} pages")
            time.sleep(args.gap_ms / 1000.0)
        writer.stop.set()
        if writer.is_alive():
            writer.join()
        if store.queue is not None:
            store.queue.flush(600)
        write_s = max(1e-9, time.perf_counter() - writer.t0) if writer.t0 else float("inf")
        snap = store.snapshot_stats()
        return {"policy": policy, "read_gbps": args.restores * read_pages * page_bytes / inside / 1e9,
                "restore_wall_s": inside, "write_gbps": writer.stored_pages * page_bytes / write_s / 1e9,
                "written_pages": writer.stored_pages, "failed_pages": writer.failed_pages,
                "write_deferred_s": snap["write_deferred_s"], "dropped_pages": snap["write_backlog_dropped_pages"]}
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(d, ignore_errors=True)


def raw_disk(base: Path, nbytes: int = 512 << 20, block: int = 16 << 20) -> dict:
    """The disk alone, without FlatCake's CPU work: O_DIRECT reads of ``nbytes`` in ``block``
    pieces (GB/s) alone, then with one thread streaming O_DIRECT writes to another file at the
    same time (read and write GB/s). Both files are removed."""
    import mmap
    import os

    d = tempfile.mkdtemp(prefix="fc-mixed-raw-", dir=base)
    try:
        rpath, wpath = os.path.join(d, "r.bin"), os.path.join(d, "w.bin")
        buf, wbuf = mmap.mmap(-1, block), mmap.mmap(-1, block)
        buf.write(os.urandom(block))
        wbuf.write(os.urandom(block))
        fd = os.open(rpath, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        wfd = os.open(wpath, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            for off in range(0, nbytes, block):
                os.pwritev(fd, [buf], off)
            os.fsync(fd)

            def read_all() -> float:
                """GB/s of one O_DIRECT pass over the read file."""
                t = time.perf_counter()
                for off in range(0, nbytes, block):
                    os.preadv(fd, [buf], off)
                return nbytes / (time.perf_counter() - t) / 1e9

            alone = read_all()
            stop, written = threading.Event(), [0]

            def write_loop() -> None:
                """O_DIRECT writes of ``block`` bytes, cycling over ``2 * nbytes``, until stopped."""
                off = 0
                while not stop.is_set():
                    os.pwritev(wfd, [wbuf], off)
                    off = (off + block) % (2 * nbytes)
                    written[0] += block

            w = threading.Thread(target=write_loop, daemon=True)
            t0 = time.perf_counter()
            w.start()
            mixed = read_all()
            stop.set()
            w.join()
            return {"read_alone_gbps": alone, "read_with_writes_gbps": mixed,
                    "write_gbps": written[0] / (time.perf_counter() - t0) / 1e9}
        finally:
            os.close(fd)
            os.close(wfd)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def pool_page_bytes(pool) -> int:
    """Bytes of one page of ``pool`` on every layer."""
    from flatcake.common.layout import KvPageLayout

    return KvPageLayout.from_host_pool(pool).geometry.page_bytes


def summarize(runs: list[dict], fio: dict | None = None) -> dict:
    """The ``--json`` object: medians per policy and ``read_speedup`` (on / off); with ``fio``
    (``{"read": {"before", "after"}, "write": {...}}``) also ``fio`` and ``ratio_to_fio``, the
    median per policy of each pass's GB/s over the nearer fio measurement."""
    med = {k: {p: statistics.median(r[k] for r in runs if r["policy"] == p) for p in POLICIES}
           for k in ("read_gbps", "write_gbps", "restore_wall_s")}
    off = med["read_gbps"]["off"]
    out = {**med, "read_speedup": med["read_gbps"]["on"] / off if off > 0 else 0.0}
    if fio is not None:
        ratios: dict = {}
        for k, rw in (("read_gbps", "read"), ("write_gbps", "write")):
            ratios[k] = {}
            for p in POLICIES:
                r = [ratio_to_fio(run[k], nearest_fio(i, len(runs), fio[rw]["before"], fio[rw]["after"]))
                     for i, run in enumerate(runs) if run["policy"] == p]
                r = [x for x in r if x is not None]
                ratios[k][p] = statistics.median(r) if r else None
        out.update({"fio": fio, "ratio_to_fio": ratios})
    return out


def measure_fio(base: Path, nbytes: int) -> dict:
    """fio's read and write limits on ``base``'s file system (``nbytes`` a job), printed."""
    got = {rw: fio_limit(str(base), nbytes, rw) for rw in ("read", "write")}
    print("fio (O_DIRECT, libaio, QD 32, best of 1/4/16 MiB): " + "; ".join(
        f"{rw} {f['best_gb_per_s']:.2f} GB/s ({f['best_bs_mib']} MiB)" if "error" not in f else f"{rw}: {f['error']}"
        for rw, f in got.items()), flush=True)
    return got


def main(argv=None) -> dict:
    """Run the passes, print each and the summary; returns the ``--json`` object."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    P = args.page_size
    pages = 2 * (args.read_tokens // P) + args.write_tokens // P
    pool, _ = make_host_pool(args.profile, pages * P, P, "page_first")
    base = Path(args.dir)
    fio_bytes = args.read_sessions * args.read_tokens * pool.get_size_per_token()
    fio_before = None if args.no_raw else measure_fio(base, fio_bytes)
    raw = None if args.no_raw else raw_disk(base)
    if raw:
        print(f"our own single-stream O_DIRECT (one stream, QD 1, 16 MiB; no FlatCake): read "
              f"{raw['read_alone_gbps']:.2f} GB/s; with a writer streaming: read {raw['read_with_writes_gbps']:.2f} "
              f"GB/s, write {raw['write_gbps']:.2f} GB/s", flush=True)
    alone = one_pass(args, pool, "alone", base, -1)
    print(f"reference: restores alone (no writer) read {alone['read_gbps']:.2f} GB/s in "
          f"{alone['restore_wall_s']:.2f} s", flush=True)
    runs = []
    for i in range(2 * args.passes):
        policy = POLICIES[i % 2] if (i // 2) % 2 == 0 else POLICIES[1 - i % 2]  # on off off on on off ...
        r = one_pass(args, pool, policy, base, i)
        runs.append(r)
        print(f"pass {i} policy {policy:3s}: read {r['read_gbps']:.2f} GB/s in {r['restore_wall_s']:.2f} s, "
              f"write {r['write_gbps']:.2f} GB/s ({r['written_pages']} pages, deferred {r['write_deferred_s']:.2f} s, "
              f"dropped {r['dropped_pages']}, failed {r['failed_pages']})", flush=True)
    fio = None
    if fio_before is not None:
        after = measure_fio(base, fio_bytes)
        fio = {rw: {"before": fio_before[rw], "after": after[rw]} for rw in ("read", "write")}
    out = summarize(runs, fio)
    print(f"median: read GB/s on {out['read_gbps']['on']:.2f} / off {out['read_gbps']['off']:.2f} "
          f"(speedup {out['read_speedup']:.2f}x); write GB/s on {out['write_gbps']['on']:.2f} / "
          f"off {out['write_gbps']['off']:.2f}; restore s on {out['restore_wall_s']['on']:.2f} / "
          f"off {out['restore_wall_s']['off']:.2f}")
    if fio is not None:
        r = out["ratio_to_fio"]
        f = {k: {p: "-" if v is None else f"{v:.2f}" for p, v in d.items()} for k, d in r.items()}
        print(f"ratio to fio (each pass over the nearer fio figure): read on {f['read_gbps']['on']} / off "
              f"{f['read_gbps']['off']}; write on {f['write_gbps']['on']} / off {f['write_gbps']['off']}")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
