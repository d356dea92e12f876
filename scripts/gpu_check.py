#!/usr/bin/env python3
"""GPU proof of FC-CIO (paper §3.3): SSD → HBM staging window → Triton scatter into device KV.

Run by ``scripts/gpu_check.sh`` on a lent GPU machine (an H200; < 8 minutes), or anywhere with
``--dry-run`` (no GPU: everything that needs none, on tiny shapes, with the Triton interpreter).
Checks, each a section of ``gpu_results.json``:

1. ``env``              torch/CUDA/device, kvikio version, compatibility mode, GDS availability.
2. ``scatter_bitexact`` the Triton kernel and the torch path against the byte-wise reference, for
                        every layout (MHA/MLA × layer_first/page_first/page_first_direct on the
                        device, and per-layer device paged KV from ``KvPageLayout.from_device_kv``).
3. ``kvikio_read``      kvikio ``CuFile.pread`` of a cold file straight into HBM (GDS or compat
                        mode, as reported), bytes checked.
4. ``restore``          FC-CIO restore of a layer-major prefix into device paged KV through the HBM
                        window, against the same bytes read sequentially into HBM; bytes checked.
5. ``overlap``          how much of the scatter time hides under the reads:
                        ``(t_reads + t_scatter - t_restore) / t_scatter``, clipped to [0, 1].
6. ``kernel``           scatter throughput (GB/s) of the Triton kernel, the torch path and a plain
                        per-plane ``index_copy_``.
7. ``device_verify``    restore into HBM with checksums verified in place by the device checksum
                        kernel: the check ran, no D2H copy beyond one mask byte per chunk,
                        bit-exact, timing with/without verification (scripts/gpu_check_verify.py;
                        skipped with the reason without a GPU).
8. ``linker``           the direct linker's load path (``FlatCakeLinker``: device pool mapped by
                        ``device_kv_of``, ``PageStore.get_layer_wise`` one layer at a time) into
                        CUDA tensors standing in for SGLang's MHA and MLA device pools: bit-exact
                        per layout, time to layer 0 usable vs the whole restore
                        (scripts/linker_restore.py; CPU tensors in the dry run).

Writes ``gpu_results.json`` and ``gpu_results.md`` (a markdown table) to ``--out``, else ``$OUT``,
else ``runs/gpu/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:  # the Triton interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_check_verify

import numpy as np  # noqa: E402
import torch  # noqa: E402

from flatcake.cio import ChunkBatch, RestoreEngine  # noqa: E402
from flatcake.cio.plan import batch_reads, plan_reads  # noqa: E402
from flatcake.media.directio import aligned_host_buffer  # noqa: E402
from flatcake.config import CioConfig  # noqa: E402
from flatcake.kernels.scatter import scatter_chunks  # noqa: E402
from flatcake.common.layout import KvPageLayout  # noqa: E402
from flatcake.media.directio import drop_page_cache  # noqa: E402
from gpu_check_verify import device_verify_check, markdown_row  # noqa: E402
from linker_restore import LINKER_IMPORT, measure as linker_measure  # noqa: E402

GB = 1e9


# ----------------------------------------------------------------------------- helpers
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def write_random(path: str, nbytes: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, min(nbytes, 64 << 20), dtype=np.uint8)
    with open(path, "wb") as f:
        done = 0
        while done < nbytes:
            k = min(len(block), nbytes - done)
            f.write(block[:k].tobytes())
            block = np.roll(block, 4099)
            done += k
    drop_page_cache(path)


def device_kv(layers: int, slots: int, heads: int, dim: int, mla: bool, device: str, dtype=torch.bfloat16):
    """Per-layer device paged KV: K and V ``[slots, heads, dim]`` (MLA: one ``[slots, 1, dim]``)."""
    if mla:
        ks = [torch.zeros(slots, 1, dim, dtype=dtype, device=device) for _ in range(layers)]
        return ks, None
    ks = [torch.zeros(slots, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
    vs = [torch.zeros(slots, heads, dim, dtype=dtype, device=device) for _ in range(layers)]
    return ks, vs


def layout_bytes(lay: KvPageLayout) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for layer in range(lay.geometry.layers) for p in lay.layer_planes(layer)])


# ----------------------------------------------------------------------------- 1. env
def env_report(device: str) -> dict:
    out = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "device": device}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["torch_cuda"] = torch.version.cuda
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        out["triton"] = f"unavailable: {e}"
    out["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "")
    try:
        import kvikio
        import kvikio.defaults

        out["kvikio"] = kvikio.__version__
        cm = kvikio.defaults.get("compat_mode")
        out["kvikio_compat_mode"] = getattr(cm, "name", str(cm))
    except Exception as e:  # noqa: BLE001
        out["kvikio"] = f"unavailable: {type(e).__name__}: {e}"
    out["nvidia_fs_driver"] = os.path.exists("/proc/driver/nvidia-fs")
    out["gds_probe"] = os.environ.get("FC_GDS_PROBE", "not run")  # set by gpu_check.sh
    return out


# ----------------------------------------------------------------------------- 2. bit-exactness
def scatter_bitexact(device: str, dry: bool) -> dict:
    """Triton and torch scatter vs the byte-wise reference, every layout, on ``device``."""
    from flatcake.adapter.host_pool import MHAHostPoolDouble, MLAHostPoolDouble

    pages, P, L = (6, 4, 3) if dry else (64, 16, 8)
    H, D, MLA_D = (2, 8, 20) if dry else (8, 128, 576)
    n = 7 if dry else 96
    res = {}
    cases = [(k, lay) for k in ("mha", "mla") for lay in ("layer_first", "page_first", "page_first_direct")]
    cases += [("device_mha", "device"), ("device_mla", "device")]
    for kind, lay_name in cases:
        outs = {}
        for impl in ("reference", "torch", "triton"):
            if kind == "mha":
                pool = MHAHostPoolDouble(pages * P, P, L, H, D, layout=lay_name)
                pool.kv_buffer = pool.kv_buffer.to(device)
                lay = KvPageLayout.from_host_pool(pool)
                buf = lambda: pool.kv_buffer.view(torch.uint8).reshape(-1)  # noqa: E731
            elif kind == "mla":
                pool = MLAHostPoolDouble(pages * P, P, L, MLA_D, layout=lay_name)
                pool.kv_buffer = pool.kv_buffer.to(device)
                lay = KvPageLayout.from_host_pool(pool)
                buf = lambda: pool.kv_buffer.view(torch.uint8).reshape(-1)  # noqa: E731
            else:
                ks, vs = device_kv(L, pages * P, H, MLA_D if kind == "device_mla" else D, kind == "device_mla", device)
                lay = KvPageLayout.from_device_kv(ks, vs, P)
                buf = lambda: layout_bytes(lay)  # noqa: E731
            cb = lay.geometry.chunk_bytes
            gen = torch.Generator().manual_seed(1)
            perm = torch.randperm(pages * L, generator=gen)[:n]
            page_ids, layer_ids = perm // L, perm % L
            staging = torch.randint(0, 256, (n * cb + 64,), dtype=torch.uint8, generator=gen).to(device)
            offs = torch.randperm(n, generator=gen) * cb
            scatter_chunks(staging, offs, lay, page_ids, layer_ids, impl=impl)
            sync(device)
            outs[impl] = buf().cpu().clone()
        res[f"{kind}-{lay_name}"] = {
            "triton_eq_reference": bool(torch.equal(outs["triton"], outs["reference"])),
            "torch_eq_reference": bool(torch.equal(outs["torch"], outs["reference"])),
            "chunks": n,
            "chunk_bytes": cb,
        }
    return res


# ----------------------------------------------------------------------------- 3. kvikio read
def kvikio_read(device: str, workdir: str, nbytes: int) -> dict:
    if not device.startswith("cuda"):
        return {"skipped": "no GPU (dry run)"}
    import kvikio

    path = os.path.join(workdir, "kvikio_read.bin")
    write_random(path, nbytes, seed=3)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    f = kvikio.CuFile(path, "r")
    try:
        t = time.perf_counter()
        n = f.pread(dst, nbytes, 0).get()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    finally:
        f.close()
    with open(path, "rb") as fh:
        host = np.frombuffer(fh.read(), dtype=np.uint8)
    ok = bool(torch.equal(dst.cpu(), torch.from_numpy(host.copy())))
    os.unlink(path)
    import kvikio.defaults

    cm = kvikio.defaults.get("compat_mode")
    return {"bytes": nbytes, "read": int(n), "bytes_equal": ok, "gb_per_s": nbytes / dt / GB,
            "compat_mode": getattr(cm, "name", str(cm)),
            "compat_mode_preferred": bool(kvikio.defaults.is_compat_mode_preferred())}


# ----------------------------------------------------------------------------- 4./5. restore + overlap
def _rounds(pages: int, round_pages: int, layers: int, cb: int) -> list[ChunkBatch]:
    """One :class:`ChunkBatch` per round of ``round_pages`` pages, layer-major inside the round
    (as FlatCake writes them): chunk (page i, layer l) of the round at ``base + (l*n + i) * cb``."""
    calls = []
    for r0 in range(0, pages, round_pages):
        n = min(round_pages, pages - r0)
        lay_ids = np.repeat(np.arange(layers, dtype=np.int64), n)
        i = np.tile(np.arange(n, dtype=np.int64), layers)
        calls.append(ChunkBatch(np.zeros(n * layers, np.int64), r0 * layers * cb + (lay_ids * n + i) * cb,
                                r0 + i, lay_ids, i, cb))
    return calls


def _sequential_read_s(eng: RestoreEngine, path: str, total: int, device: str) -> float:
    """Seconds to read ``total`` bytes of ``path`` in one stream into the staging device."""
    drop_page_cache(path)
    t = time.perf_counter()
    if device.startswith("cuda") and eng.engine_name == "kvikio":
        import kvikio

        dst = torch.empty(total, dtype=torch.uint8, device=device)
        f = kvikio.CuFile(path, "r")
        f.pread(dst, total, 0).get()
        f.close()
        torch.cuda.synchronize()
        del dst
    else:
        buf = aligned_host_buffer(16 << 20)[1]
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        got = 0
        while got < total:
            got += os.preadv(fd, [buf], got)
        os.close(fd)
    return time.perf_counter() - t


def _bytes_equal(calls: list[ChunkBatch], lay: KvPageLayout, path: str, device: str) -> bool:
    """Device KV against the file, chunk by chunk, one layer of one round at a time."""
    with open(path, "rb") as fh:
        data = torch.from_numpy(np.frombuffer(fh.read(), dtype=np.uint8).copy()).to(device)
    g = lay.geometry
    cb, P = g.chunk_bytes, g.page_size
    ok = True
    for b in calls:
        for layer in range(g.layers):
            m = b.layer == layer
            idx = torch.from_numpy(b.page[m]).to(device)
            exp = torch.stack([data[o: o + cb] for o in b.offset[m].tolist()])
            for plane, po, rb in zip(lay.layer_planes(layer), g.plane_offsets(), g.plane_row_bytes):
                ok &= bool(torch.equal(plane[idx].reshape(len(idx), -1), exp[:, po: po + P * rb]))
    return ok


def restore_check(device: str, workdir: str, dry: bool) -> tuple[dict, dict]:
    """Layer-major prefix on disk → FC-CIO restore into device paged KV; overlap of scatter/reads."""
    if dry:
        L, H, D, P, pages, round_pages = 4, 2, 64, 16, 256, 128  # 8 KiB chunks, 8 MiB
    else:
        L, H, D, P, pages, round_pages = 32, 8, 128, 64, 256, 128  # Llama-3.1-8B: 256 KiB chunks, 2 GiB
    ks, vs = device_kv(L, pages * P, H, D, False, device)
    lay = KvPageLayout.from_device_kv(ks, vs, P)
    cb = lay.geometry.chunk_bytes
    total = pages * L * cb
    path = os.path.join(workdir, "extent.bin")
    write_random(path, total, seed=5)
    calls = _rounds(pages, round_pages, L, cb)
    cfg = CioConfig(io_workers=8, verify_checksums=False)
    eng = RestoreEngine(cfg, lambda i: path, direct_io=True, chunk_bytes=cb, max_pages_per_restore=round_pages,
                        device=device)
    out = {"engine": eng.engine_name, "scatter": eng.scatter_impl, "bytes": total, "chunk_bytes": cb,
           "layers": L, "pages": pages, "staging_bytes_total": eng.staging_total_bytes}
    try:
        out["sequential_s"] = _sequential_read_s(eng, path, total, device)
        out["sequential_gb_per_s"] = total / out["sequential_s"] / GB
        t_restore, reps = _timed_restores(eng, calls, lay, path, device, scatter=True)
        out["restore_s"] = t_restore
        out["restore_gb_per_s"] = total / t_restore / GB
        out["ratio_to_sequential"] = out["restore_gb_per_s"] / out["sequential_gb_per_s"]
        out["merged_reads"] = sum(r.merged_reads for r in reps)
        out["failed"] = sum(len(r.failed_tags) for r in reps)
        out["bytes_equal"] = _bytes_equal(calls, lay, path, device)
        # overlap: reads alone (the restore's reads-only mode: same plan and double buffer), scatter alone
        t_reads, _ = _timed_restores(eng, calls, lay, path, device, scatter=False)
        t_scatter = _scatter_only(eng, calls, lay, device)
        ov = {"t_restore_s": t_restore, "t_reads_only_s": t_reads, "t_scatter_only_s": t_scatter}
        ov["overlap_fraction"] = max(0.0, min(1.0, (t_reads + t_scatter - t_restore) / t_scatter)) if t_scatter > 0 else 0.0
        ov["timing_meaningful"] = not DRY
    finally:
        eng.close()
        os.unlink(path)
    return out, ov


def _timed_restores(eng: RestoreEngine, calls, lay, path: str, device: str, scatter: bool):
    """Cold-cache restores of every round (``scatter=False``: reads only); ``(seconds, reports)``."""
    drop_page_cache(path)
    sync(device)
    t = time.perf_counter()
    reps = [eng.restore(c, lay, scatter=scatter) for c in calls]
    sync(device)
    return time.perf_counter() - t, reps


def _scatter_only(eng: RestoreEngine, calls, lay, device: str) -> float:
    """Time the scatter alone: every staging batch's chunks from a staging-sized buffer on the
    device (its contents do not matter for timing), with the restore's plan and batches."""
    buf = torch.empty(eng.staging_bytes, dtype=torch.uint8, device=device)
    jobs = []
    for chunks in calls:
        plan = plan_reads(chunks, gap_bytes=eng.cfg.gap_bytes, max_io_bytes=eng.max_io_bytes)
        for batch in batch_reads(plan.reads, eng.staging_bytes):
            starts = np.cumsum([0] + [r.nbytes for r in batch[:-1]])
            offs = np.concatenate([s0 + r.offsets for s0, r in zip(starts.tolist(), batch)])
            idx = np.concatenate([r.index for r in batch])
            jobs.append((torch.from_numpy(offs), torch.from_numpy(chunks.page[idx]), torch.from_numpy(chunks.layer[idx])))
    sync(device)
    t = time.perf_counter()
    for o, p, l in jobs:
        scatter_chunks(buf, o, lay, p, l, impl=eng.scatter_impl)
    sync(device)
    return time.perf_counter() - t


# ----------------------------------------------------------------------------- 6. kernel throughput
def kernel_throughput(device: str, dry: bool) -> dict:
    L, H, D, P, pages, n = (2, 2, 8, 4, 16, 8) if dry else (32, 8, 128, 64, 1024, 256)
    ks, vs = device_kv(L, pages * P, H, D, False, device)
    lay = KvPageLayout.from_device_kv(ks, vs, P)
    cb = lay.geometry.chunk_bytes
    gen = torch.Generator().manual_seed(9)
    staging = torch.randint(0, 256, (n * cb,), dtype=torch.uint8, generator=gen).to(device)
    offs = torch.arange(n) * cb
    pages_t = torch.randperm(pages, generator=gen)[:n]
    layers_t = torch.full((n,), L // 2, dtype=torch.int64)
    g = lay.geometry
    rows = staging.view(n, cb)
    idx_dev = pages_t.to(device)

    def index_copy():
        for plane, po, rb in zip(lay.layer_planes(L // 2), g.plane_offsets(), g.plane_row_bytes):
            plane.index_copy_(0, idx_dev, rows[:, po : po + P * rb].reshape(n, P, rb))

    fns = {
        "triton": lambda: scatter_chunks(staging, offs, lay, pages_t, layers_t, impl="triton"),
        "torch": lambda: scatter_chunks(staging, offs, lay, pages_t, layers_t, impl="torch"),
        "index_copy_": index_copy,
    }
    iters = 1 if dry else 20
    out = {"bytes_per_call": n * cb, "chunk_bytes": cb, "timing_meaningful": not dry}
    for name, fn in fns.items():
        fn()
        sync(device)
        ts = []
        for _ in range(iters):
            if device.startswith("cuda"):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
        med = sorted(ts)[len(ts) // 2]
        out[f"{name}_gb_per_s"] = n * cb / med / GB
    return out


# ----------------------------------------------------------------------------- report
def linker_check(device: str, workdir: str, dry: bool) -> dict:
    """Section 8: the linker's layer-wise load into stand-in device pools, per layout (MHA, MLA).
    GPU: 64 pages of 64 tokens, 32 layers, 8 KV heads x 128 (MHA: 8 MiB a page; MLA: 576-wide
    latent); dry run: 8 pages of 16 tokens, 4 layers."""
    shape = (dict(pages=8, page_size=16, layers=4, heads=2, head_dim=16) if dry
             else dict(pages=64, page_size=64, layers=32, heads=8, head_dim=128))
    out = {"import": LINKER_IMPORT}
    for kind in ("mha", "mla"):
        dims = dict(shape, head_dim=shape["head_dim"] if kind == "mha" else (24 if dry else 576))
        out[kind] = linker_measure(kind, workdir, device=device, **dims).as_dict()
    out["ok"] = all(out[k]["bit_exact"] for k in ("mha", "mla"))
    return out


def markdown(res: dict) -> str:
    lines = [f"# FC-CIO GPU check ({res['mode']}, {res['date']})", "", "| check | result |", "|---|---|"]
    e = res["env"]
    lines.append(f"| device | {e.get('gpu', e['device'])}, torch {e['torch']}, triton {e.get('triton')}, "
                 f"kvikio {e.get('kvikio')} (compat {e.get('kvikio_compat_mode')}), nvidia-fs {e['nvidia_fs_driver']}, "
                 f"GDS probe {e['gds_probe']} |")
    be = res["scatter_bitexact"]
    ok = all(v["triton_eq_reference"] and v["torch_eq_reference"] for v in be.values())
    lines.append(f"| scatter bit-exact ({len(be)} layouts) | {'all equal' if ok else 'MISMATCH: ' + str(be)} |")
    kr = res["kvikio_read"]
    if "skipped" in kr:
        lines.append(f"| kvikio → HBM | skipped ({kr['skipped']}) |")
    else:
        lines.append(f"| kvikio → HBM | {kr['gb_per_s']:.2f} GB/s, {kr['bytes'] / 2**30:.1f} GiB cold, "
                     f"bytes equal {kr['bytes_equal']}, compat {kr['compat_mode']} |")
    r = res["restore"]
    lines.append(f"| restore ({r['engine']} + {r['scatter']}, {r['bytes'] / 2**20:.0f} MiB, {r['merged_reads']} merged reads) | "
                 f"{r['restore_gb_per_s']:.2f} GB/s vs sequential {r['sequential_gb_per_s']:.2f} GB/s "
                 f"(ratio {r['ratio_to_sequential']:.2f}), bytes equal {r['bytes_equal']}, failed {r['failed']} |")
    o = res["overlap"]
    lines.append(f"| scatter/read overlap | {o['overlap_fraction']:.2f} (restore {o['t_restore_s']:.3f} s, reads only "
                 f"{o['t_reads_only_s']:.3f} s, scatter only {o['t_scatter_only_s']:.3f} s) |")
    k = res["kernel"]
    lines.append(f"| scatter throughput ({k['bytes_per_call'] / 2**20:.0f} MiB/call) | triton {k['triton_gb_per_s']:.1f} GB/s, "
                 f"torch {k['torch_gb_per_s']:.1f} GB/s, index_copy_ {k['index_copy__gb_per_s']:.1f} GB/s |")
    lines.append(markdown_row(res["device_verify"]))
    lk = res.get("linker", {})
    for kind in ("mha", "mla"):
        r = lk.get(kind)
        if r is None:
            lines.append(f"| linker load ({kind}) | error: {lk.get('error')} |")
            continue
        lines.append(f"| linker load ({kind}, {r['pages']} pages x {r['layers']} layers, {r['bytes'] / 2**20:.1f} MiB) | "
                     f"bit-exact {r['bit_exact']}, layer 0 usable {r['t_layer0_s'] * 1e3:.2f} ms of "
                     f"{r['t_total_s'] * 1e3:.2f} ms ({r['layer0_fraction']:.2f}), {r['gb_per_s']:.2f} GB/s |")
    if res["mode"] == "dry-run":
        lines += ["", "Dry run: no GPU; tiny shapes, Triton interpreter, POSIX engine on host memory. "
                  "Timings are not meaningful."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="no GPU: tiny shapes, Triton interpreter, host memory")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else runs/gpu)")
    ap.add_argument("--workdir", default=None, help="scratch folder on the SSD (default a temp dir under /tmp)")
    ap.add_argument("--kvikio-bytes", type=int, default=1 << 30)
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "runs" / "gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    work = args.workdir or tempfile.mkdtemp(prefix="fc-gpu-", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    res = {"mode": "dry-run" if dry else "gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    t0 = time.perf_counter()
    res["env"] = env_report(device)
    print("env:", json.dumps(res["env"]), flush=True)
    res["scatter_bitexact"] = scatter_bitexact(device, dry)
    print("scatter bit-exact:", json.dumps(res["scatter_bitexact"]), flush=True)
    res["kvikio_read"] = kvikio_read(device, work, args.kvikio_bytes)
    print("kvikio read:", json.dumps(res["kvikio_read"]), flush=True)
    res["restore"], res["overlap"] = restore_check(device, work, dry)
    print("restore:", json.dumps(res["restore"]), "\noverlap:", json.dumps(res["overlap"]), flush=True)
    res["kernel"] = kernel_throughput(device, dry)
    print("kernel:", json.dumps(res["kernel"]), flush=True)
    try:  # a failure here still leaves the other sections' report
        res["device_verify"] = device_verify_check(device, work, dry, device_kv=device_kv, write_random=write_random,
                                                   rounds=_rounds, bytes_equal=_bytes_equal)
    except Exception as e:  # noqa: BLE001
        res["device_verify"] = {"error": repr(e)[:500], "ok": False}
    print("device verify:", json.dumps(res["device_verify"]), flush=True)
    try:
        res["linker"] = linker_check(device, work, dry)
    except Exception as e:  # noqa: BLE001
        res["linker"] = {"error": repr(e)[:500], "ok": False}
    print("linker:", json.dumps(res["linker"]), flush=True)
    res["runtime_s"] = time.perf_counter() - t0
    (out_dir / "gpu_results.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (out_dir / "gpu_results.md").write_text(md)
    print(md)
    try:
        os.rmdir(work)
    except OSError:
        pass
    if res["device_verify"].get("ok") is False:
        print("device verify FAILED:", json.dumps(res["device_verify"]), file=sys.stderr)
        return 1
    if not res["linker"].get("ok"):
        print("linker load FAILED:", json.dumps(res["linker"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
