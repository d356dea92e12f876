"""The device checksum (paper §3.3 integrity on the GPU restore path): the Triton kernel (under
``TRITON_INTERPRET=1`` on CPU) equals the torch reference, numpy and the C loop bit for bit; the
GPU path's verify function catches corrupted, swapped and stale chunks; record v3 carries the
device checksums and record v2 (older pools) still parses and verifies with xxh3.

The Triton interpreter must be enabled before Triton is first imported; when it is not, the
Triton cases run in one subprocess that sets it first (as tests/kernels/test_scatter_kernel.py).
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from flatcake.cio.pagecopy import chunk_checksums
from flatcake.cio.plan import ChunkBatch
from flatcake.common.errorlog import ErrorLog
from flatcake.kernels import device_checksum as dc
from flatcake.kernels.fcds_native import fcds_host_chunks
from flatcake.media import extent as fmt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import device_checksum_cases as cases  # noqa: E402

#: chunk 1 flipped, 3/4 swapped, 6 torn, 9 (record v2) flipped; chunk 2 for the bit-31 pair
BAD_MASK = [True, False, True, False, False, True, False, True, True, False]


@pytest.fixture(scope="module")
def results():
    if dc.triton_available(torch.device("cpu")):
        return cases.run_all()
    if not dc.HAVE_TRITON:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(HERE / "device_checksum_cases.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_triton_kernel_equals_torch_numpy_and_c_on_random_data_with_odd_sizes(results):
    got = {r["cb"]: (r["triton"], r["numpy"], r["native"]) for r in results["equal"]}
    assert got == {cb: (True, True, True) for cb, _, _ in cases.SIZES}
    assert [r["distinct"] for r in results["equal"]] == [m for _, m, _ in cases.SIZES]  # no collisions


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_gpu_verify_function_catches_flipped_swapped_and_stale_chunks(results, impl):
    r = results[f"verify_{impl}"]
    assert r["clean"] == [True] * 10
    assert r["bad"] == BAD_MASK
    assert r["two_bit31"] == [True, True, False] + [True] * 7


def test_torch_verify_in_process_matches_the_interpreter_results():
    assert cases.verify_case("torch")["bad"] == BAD_MASK


def test_known_values_pin_the_definition():
    """The checksum of fixed inputs, computed from the definition by hand in Python ints: a
    change of the arithmetic is a change of the on-disk format (record v3)."""
    def by_hand(b: bytes) -> int:
        b = b + b"\0" * (-len(b) % 4)
        a = s = 0
        for i in range(len(b) // 4):
            w = int.from_bytes(b[4 * i: 4 * i + 4], "little")
            a = (a + w * (2 * i + 1)) & 0xFFFFFFFF
            x = (w ^ (i * dc.K_POS)) & 0xFFFFFFFF
            x = (x * dc.K_M1) & 0xFFFFFFFF
            x ^= x >> 15
            x = (x * dc.K_M2) & 0xFFFFFFFF
            s = (s + x) & 0xFFFFFFFF
        return (s << 32) | a
    for data in (b"flatcake", bytes(range(256)) * 3 + b"xyz", b"\xff" * 4096):
        arr = np.frombuffer(data, dtype=np.uint8)
        want = by_hand(data)
        assert int(fcds_host_chunks(arr, len(data))[0]) == want
        assert int(dc.fcds_numpy(arr, [0], len(data))[0]) == want
        t = dc.fcds_torch(torch.from_numpy(arr.copy()), torch.tensor([0]), len(data))
        assert int(t.numpy().view(np.uint64)[0]) == want


def test_record_v3_carries_device_checksums_and_v2_still_parses():
    keys = ["a", "bb", "ccc"]
    rng = np.random.default_rng(3)
    sums = rng.integers(0, 2**63, (2, 3), dtype=np.uint64)
    dev = rng.integers(0, 2**63, (2, 3), dtype=np.uint64)
    v3 = fmt.pack_record("ns", keys, 2, 512, sums, 7, 3, 0xABC, dev)
    assert v3[:8] == fmt.RECORD_MAGIC == b"FCRECRD3" and len(v3) == fmt.record_size(keys, 2)
    r = fmt.unpack_record(v3 + b"\0" * 64)
    assert np.array_equal(r.checksums, sums) and np.array_equal(r.devsums, dev)
    assert r.page_checksums(1).tolist() == [int(sums[0, 1]), int(sums[1, 1]), int(dev[0, 1]), int(dev[1, 1])]
    v2 = fmt.pack_record("ns", keys, 2, 512, sums, 7, 3, 0xABC)
    assert v2[:8] == fmt.RECORD_MAGIC_V2 and len(v2) == fmt.record_size(keys, 2, device_sums=False)
    r2 = fmt.unpack_record(v2)
    assert r2.devsums is None and np.array_equal(r2.checksums, sums)
    assert r2.page_checksums(2).tolist() == [int(sums[0, 2]), int(sums[1, 2])]
    torn = bytearray(v3)
    torn[-20] ^= 1  # a device checksum byte: the record's own xxh3 no longer matches
    assert fmt.unpack_record(bytes(torn)) is None


def test_old_format_chunks_verify_with_xxh3_through_the_device_verify_function():
    """A batch of record-v2 chunks only (no device checksums): verify_chunks_device checks them
    with xxh3-64 (a host copy of those chunks), mismatch -> False; never served unverified."""
    from flatcake.cio.batch import verify_chunks_device

    cb, n = 700, 4
    data = np.random.default_rng(5).integers(0, 256, n * cb, dtype=np.uint8)
    xxh = chunk_checksums(data, cb)
    assert int(xxh[2]) == xxhash.xxh3_64_intdigest(data[2 * cb: 3 * cb].tobytes())
    batch = ChunkBatch(np.zeros(n), np.arange(n) * cb, np.arange(n), np.zeros(n), np.arange(n), cb, checksum=xxh)
    assert not batch.has_devsum.any()
    buf = torch.from_numpy(data.copy())
    buf[2 * cb + 9] ^= 0xFF
    b0 = np.arange(n, dtype=np.int64) * cb
    ok = verify_chunks_device(buf, b0, np.arange(n), batch, cb, ErrorLog(logging.getLogger("t")), "torch")
    assert ok.tolist() == [True, True, False, True]


def test_gpu_check_d2h_counter_counts_nothing_on_cpu_and_restores_torch():
    """The GPU check's copy counter (scripts/gpu_check_verify.py) patches Tensor methods only
    inside its block and counts device-to-host copies only (CPU tensors: none)."""
    sys.path.insert(0, str(HERE.parents[1] / "scripts"))
    from gpu_check_verify import count_d2h

    before = torch.Tensor.cpu
    t = torch.arange(10)
    with count_d2h() as box:
        assert torch.Tensor.cpu is not before
        assert t.cpu().tolist() == list(range(10)) and t.to("cpu").sum().item() == 45
    assert torch.Tensor.cpu is before and box == {"bytes": 0, "calls": 0, "largest": 0}


def test_torch_reference_in_groups_equals_numpy_across_group_boundaries():
    """fcds_torch works in groups of ~4 MiB of chunks: 2,100 chunks of 4,100 B span three."""
    cb, m = 4100, 2100
    host = np.random.default_rng(9).integers(0, 256, m * cb, dtype=np.uint8)
    st = np.arange(m, dtype=np.int64) * cb
    got = dc.fcds_torch(torch.from_numpy(host), torch.from_numpy(st), cb).numpy()
    assert got.shape == (m,) and (got == dc.fcds_numpy(host, st, cb).view(np.int64)).all()
