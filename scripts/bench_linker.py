#!/usr/bin/env python3
"""Direct linker restore on the CPU: time to the first usable layer vs the whole restore, per page size.

``FlatCakeLinker``'s load path (``scripts/linker_restore.py``: the device pool mapped by
``device_kv_of``, ``PageStore.get_layer_wise`` one layer at a time, FC-CIO's sorted, merged reads
into the staging window and the scatter) into CPU tensors standing in for SGLang's device pool,
from a cold pool on ``--workdir`` (page cache dropped). The paper's claim (§3.3) is that layer 0
is usable long before the whole prefix has landed, so prefill starts under the restore: the
``layer0_fraction`` column is that share (1 / layers when reads dominate and overlap perfectly).

    .venv/bin/python scripts/bench_linker.py --page-sizes 16 32 64 --prefix-tokens 4096 --out runs/linker.json

Prints one JSON object (and writes it to ``--out`` when given): the shape, and per page size and
layout (``mha``, ``mla``) a :class:`linker_restore.LinkerRestore` record, each the median-time run
of ``--repeat`` (``repeats``: every run's times, rate and bit-exactness, in the order run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from linker_restore import LINKER_IMPORT, measure  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 32, 64], help="tokens per page")
    ap.add_argument("--prefix-tokens", type=int, default=4096, help="tokens restored per run")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4, help="MHA KV heads (MLA: one latent)")
    ap.add_argument("--head-dim", type=int, default=128, help="MHA head dim (MLA latent: 576)")
    ap.add_argument("--kinds", nargs="+", default=["mha", "mla"], choices=["mha", "mla"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="directory on the SSD under test (default: a temp dir in /tmp)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="fc-bench-linker-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "device": "cpu", "import": LINKER_IMPORT,
           "prefix_tokens": args.prefix_tokens, "layers": args.layers, "repeat": args.repeat, "runs": []}
    try:
        for page_size in args.page_sizes:
            pages = max(1, args.prefix_tokens // page_size)
            for kind in args.kinds:
                runs = [measure(kind, work, device="cpu", pages=pages, page_size=page_size, layers=args.layers,
                                heads=args.heads, head_dim=args.head_dim if kind == "mha" else 576, seed=r)
                        for r in range(args.repeat)]
                each = [{k: r.as_dict()[k] for k in ("t_layer0_s", "t_total_s", "gb_per_s", "bit_exact")} for r in runs]
                runs.sort(key=lambda r: r.t_total_s)
                median = runs[len(runs) // 2].as_dict()
                median["all_bit_exact"] = all(r.bit_exact for r in runs)
                median["repeats"] = each  # every run, in the order run; the cell's figures are the median's
                res["runs"].append(median)
                print(f"page {page_size:>3} {kind}: layer 0 usable {median['t_layer0_s'] * 1e3:8.2f} ms of "
                      f"{median['t_total_s'] * 1e3:8.2f} ms ({median['layer0_fraction']:.2f}), "
                      f"{median['gb_per_s']:.2f} GB/s (runs {', '.join(format(e['gb_per_s'], '.2f') for e in each)}), "
                      f"bit-exact {median['all_bit_exact']}", file=sys.stderr)
    finally:
        if args.workdir is None:
            try:
                os.rmdir(work)
            except OSError:
                pass
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if all(r["all_bit_exact"] for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
