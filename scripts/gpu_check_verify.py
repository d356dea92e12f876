"""Section 7 of ``scripts/gpu_check.py``: the GPU restore verifies chunks in HBM (paper §3.3).

On a GPU machine: a layer-major prefix on disk with its xxh3-64 and device checksums (as record
v3 carries them) is restored into device paged KV through the HBM window with
``cio.verify_checksums`` on, while every device-to-host tensor copy made from Python
(``Tensor.cpu/.to/.copy_/.tolist/.item``) is counted. Asserts (a) the device check ran (the
engine's mask bytes equal the chunks verified, and a round with one wrong expected device
checksum comes back with exactly that chunk failed), (b) nothing but the masks came back to the
host (no D2H copy as large as a chunk; D2H bytes <= one byte per chunk + 64 B per restore
call), (c) the restore is bit-exact; prints restore time with and without verification. Without a GPU it checks the kernel (Triton interpreter) against the
host C loop on a few chunks and skips the restore with the reason.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import numpy as np
import torch

from flatcake.cio import ChunkBatch, RestoreEngine
from flatcake.cio.pagecopy import checksums_at
from flatcake.config import CioConfig
from flatcake.kernels.device_checksum import fcds_at
from flatcake.kernels.fcds_native import fcds_host_at
from flatcake.common.layout import KvPageLayout
from flatcake.media.directio import drop_page_cache

GB = 1e9


@contextmanager
def count_d2h():
    """Count bytes of device-to-host tensor copies made through Python while inside (a dict
    ``{"bytes", "calls"}``); the patched methods are restored on exit."""
    box = {"bytes": 0, "calls": 0, "largest": 0}
    T = torch.Tensor
    orig = {n: getattr(T, n) for n in ("cpu", "to", "copy_", "tolist", "item")}

    def note(n):
        box["bytes"] += int(n)
        box["calls"] += 1
        box["largest"] = max(box["largest"], int(n))

    def cpu(self, *a, **k):
        if self.is_cuda:
            note(self.nbytes)
        return orig["cpu"](self, *a, **k)

    def to(self, *a, **k):
        r = orig["to"](self, *a, **k)
        if self.is_cuda and not r.is_cuda:
            note(r.nbytes)
        return r

    def copy_(self, src, *a, **k):
        if src.is_cuda and not self.is_cuda:
            note(src.nbytes)
        return orig["copy_"](self, src, *a, **k)

    def tolist(self):
        if self.is_cuda:
            note(self.nbytes)
        return orig["tolist"](self)

    def item(self):
        if self.is_cuda:
            note(self.nbytes)
        return orig["item"](self)

    for n, f in (("cpu", cpu), ("to", to), ("copy_", copy_), ("tolist", tolist), ("item", item)):
        setattr(T, n, f)
    try:
        yield box
    finally:
        for n, f in orig.items():
            setattr(T, n, f)


def _with_sums(calls: list[ChunkBatch], data: np.ndarray, cb: int) -> list[ChunkBatch]:
    """The calls with every chunk's xxh3-64 and device checksum, from the host bytes (as the
    write path computes them for record v3)."""
    out = []
    for c in calls:
        out.append(ChunkBatch(c.file_index, c.offset, c.page, c.layer, c.tag, cb,
                              checksum=checksums_at(data, c.offset, cb), devsum=fcds_host_at(data, c.offset, cb),
                              has_devsum=np.ones(len(c), dtype=bool)))
    return out


def _kernel_vs_host(device: str) -> bool:
    """The kernel on ``device`` (interpreter on CPU) equals the host C loop on 6 odd chunks."""
    cb, m = 1000 + 6, 6
    host = np.random.default_rng(2).integers(0, 256, m * cb, dtype=np.uint8)
    st = np.arange(m, dtype=np.int64) * cb
    got = fcds_at(torch.from_numpy(host).to(device), torch.from_numpy(st).to(device), cb).cpu().numpy()
    return bool((got == fcds_host_at(host, st, cb).view(np.int64)).all())


def device_verify_check(device: str, workdir: str, dry: bool, *, device_kv, write_random, rounds,
                        bytes_equal) -> dict:
    """Section 7 (see the module docstring); the helpers come from ``gpu_check.py``."""
    out = {"kernel_equals_host": _kernel_vs_host(device)}
    if dry or not device.startswith("cuda"):
        out["skipped"] = ("no GPU: the HBM verify runs only with CUDA staging; on CPU the same verify "
                          "function and kernel are covered by tests/kernels/test_device_checksum.py")
        return out
    L, H, D, P, pages, round_pages = 32, 8, 128, 64, 256, 128  # 256 KiB chunks, 2 GiB
    ks, vs = device_kv(L, pages * P, H, D, False, device)
    lay = KvPageLayout.from_device_kv(ks, vs, P)
    cb = lay.geometry.chunk_bytes
    total = pages * L * cb
    path = os.path.join(workdir, "extent-verify.bin")
    write_random(path, total, seed=9)
    data = np.fromfile(path, dtype=np.uint8)
    calls = _with_sums(rounds(pages, round_pages, L, cb), data, cb)
    chunks = sum(len(c) for c in calls)
    res = {"bytes": total, "chunk_bytes": cb, "chunks": chunks}
    try:
        for verify in (False, True):
            eng = RestoreEngine(CioConfig(io_workers=8, verify_checksums=verify), lambda i: path, direct_io=True,
                                chunk_bytes=cb, max_pages_per_restore=round_pages, device=device)
            try:
                drop_page_cache(path)
                torch.cuda.synchronize()
                with count_d2h() as box:
                    t = time.perf_counter()
                    reps = [eng.restore(c, lay) for c in calls]
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t
                key = "verify" if verify else "no_verify"
                res[f"{key}_s"] = dt
                res[f"{key}_gb_per_s"] = total / dt / GB
                res[f"{key}_failed"] = sum(len(r.failed_tags) for r in reps)
                if verify:
                    res["d2h_bytes"], res["d2h_calls"], res["d2h_largest"] = box["bytes"], box["calls"], box["largest"]
                    res["engine_mask_bytes"] = eng.device_verify.d2h_bytes
                    res["bytes_equal"] = bytes_equal(calls, lay, path, device)
                    bad = calls[0]  # one wrong expected device checksum: exactly that chunk fails
                    dev = bad.devsum.copy()
                    dev[5] ^= 1
                    wrong = ChunkBatch(bad.file_index, bad.offset, bad.page, bad.layer, bad.tag, cb,
                                       checksum=bad.checksum, devsum=dev, has_devsum=bad.has_devsum)
                    res["wrong_sum_failed_tags"] = sorted(int(x) for x in eng.restore(wrong, lay).failed_tags)
                    res["wrong_sum_expected_tags"] = [int(bad.tag[5])]
            finally:
                eng.close()
    finally:
        os.unlink(path)
    res["device_check_ran"] = res["engine_mask_bytes"] == chunks and \
        res["wrong_sum_failed_tags"] == res["wrong_sum_expected_tags"]
    # the masks (one byte per chunk) and nothing of a chunk's size: no staging bytes came back
    # (plus up to 64 B of scalars per restore call, should any other step read one back)
    res["no_staging_d2h"] = res["d2h_bytes"] <= chunks + 64 * len(calls) and res["d2h_largest"] < cb
    res["ok"] = bool(res["device_check_ran"] and res["no_staging_d2h"] and res["bytes_equal"]
                     and res["verify_failed"] == 0 and out["kernel_equals_host"])
    out.update(res)
    return out


__all__ = ["count_d2h", "device_verify_check", "markdown_row"]


def markdown_row(dv: dict) -> str:
    """The ``gpu_results.md`` row of section 7."""
    if "skipped" in dv:
        return f"| device verify in HBM | skipped ({dv['skipped']}); kernel = host loop: {dv['kernel_equals_host']} |"
    if "error" in dv:
        return f"| device verify in HBM | ERROR {dv['error']} |"
    return (f"| device verify in HBM ({dv['chunks']} chunks of {dv['chunk_bytes']} B) | ok {dv['ok']}: check ran "
            f"{dv['device_check_ran']}, D2H {dv['d2h_bytes']} B in {dv['d2h_calls']} copies (largest "
            f"{dv['d2h_largest']} B), bytes equal {dv['bytes_equal']}; restore {dv['verify_gb_per_s']:.2f} GB/s "
            f"verified vs {dv['no_verify_gb_per_s']:.2f} GB/s unverified |")
