"""Cases for the device checksum kernel (tests/kernels/test_device_checksum.py): run in a process
with ``TRITON_INTERPRET=1`` set before Triton is imported; prints ``RESULT <json>``."""

from __future__ import annotations

import json
import logging

import numpy as np
import torch

from flatcake.cio.batch import verify_chunks_device
from flatcake.cio.pagecopy import chunk_checksums
from flatcake.cio.plan import ChunkBatch
from flatcake.common.errorlog import ErrorLog
from flatcake.kernels import device_checksum as dc
from flatcake.kernels.fcds_native import fcds_host_at

#: (chunk_bytes, chunks, start shift): word-aligned, odd sizes, unaligned starts, > one BLOCK
SIZES = [(4096, 6, 0), (2048, 5, 3), (13, 7, 0), (1, 4, 1), (6, 5, 2), (4100, 3, 0), (8192 + 12, 2, 4)]


def equal_cases() -> list[dict]:
    """Per size: whether Triton (interpreter), torch, numpy and the C loop agree bit for bit."""
    rng = np.random.default_rng(7)
    out = []
    for cb, m, shift in SIZES:
        host = rng.integers(0, 256, m * cb + shift + 5, dtype=np.uint8)
        st = np.arange(m, dtype=np.int64) * cb + shift
        t, ts = torch.from_numpy(host), torch.from_numpy(st)
        ref = dc.fcds_torch(t, ts, cb).numpy()
        tri = dc.fcds_triton(t, ts, cb).numpy()
        npy = dc.fcds_numpy(host, st, cb).view(np.int64)
        nat = fcds_host_at(host, st, cb).view(np.int64)
        out.append({"cb": cb, "triton": bool((tri == ref).all()), "numpy": bool((npy == ref).all()),
                    "native": bool((nat == ref).all()), "distinct": int(len(set(ref.tolist())))})
    return out


def verify_case(impl: str) -> dict:
    """A staging buffer of 8 chunks (record v3) + 2 chunks of a record-v2 round, then corrupted:
    a flipped byte, two swapped chunks, a stale chunk (an earlier round's bytes), an old chunk
    flipped. Returns the masks verify_chunks_device produced."""
    rng = np.random.default_rng(11)
    cb, n = 1024 + 8, 10
    good = rng.integers(0, 256, n * cb, dtype=np.uint8)
    dev = dc.fcds_numpy(good, np.arange(n) * cb, cb)
    xxh = chunk_checksums(good, cb)
    has_dev = np.arange(n) < 8
    batch = ChunkBatch(np.zeros(n), np.arange(n) * cb, np.arange(n), np.zeros(n), np.arange(n), cb,
                       checksum=xxh, devsum=np.where(has_dev, dev, 0), has_devsum=has_dev)
    b0, idx = np.arange(n, dtype=np.int64) * cb, np.arange(n, dtype=np.int64)
    bad = good.copy()
    bad[1 * cb + 517] ^= 0x40  # one flipped bit in chunk 1
    bad[3 * cb: 4 * cb], bad[4 * cb: 5 * cb] = good[4 * cb: 5 * cb], good[3 * cb: 4 * cb]  # swapped
    bad[6 * cb + 100: 7 * cb] = rng.integers(0, 256, cb - 100, dtype=np.uint8)  # torn / stale tail
    bad[9 * cb + 3] ^= 1  # record-v2 chunk: caught by the xxh3 fallback
    errs = ErrorLog(logging.getLogger("fcds-cases"))
    clean = verify_chunks_device(torch.from_numpy(good.copy()), b0, idx, batch, cb, errs, impl)
    mask = verify_chunks_device(torch.from_numpy(bad), b0, idx, batch, cb, errs, impl)
    flips = good.copy()  # two flips of bit 31 of two words: cancel in lane A, not in lane B
    flips[2 * cb + 3] ^= 0x80
    flips[2 * cb + 11] ^= 0x80
    two = verify_chunks_device(torch.from_numpy(flips), b0, idx, batch, cb, errs, impl)
    return {"clean": clean.tolist(), "bad": mask.tolist(), "two_bit31": two.tolist()}


def run_all() -> dict:
    """Every case (needs the Triton interpreter or a GPU for the Triton parts)."""
    return {"equal": equal_cases(), "verify_triton": verify_case("triton"), "verify_torch": verify_case("torch")}


if __name__ == "__main__":
    print("RESULT " + json.dumps(run_all()))
