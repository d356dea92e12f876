"""flatcake.media.directio.dio_alignment: the zero-copy iovec alignment of a directory's device,
from sysfs (a fake tree here) — 4096 where the device has a virtual boundary (NVMe), its logical
block size / DMA alignment otherwise, 4096 with no block device (issue 11)."""

import os

import pytest

from flatcake.media.directio import dio_alignment


def fake_sysfs(root, directory, queue, *, partition=False, link_only=False):
    """``{root}/dev/block/MAJ:MIN`` for ``directory``'s device: a disk with ``queue`` files, or
    (``partition``) a partition whose parent disk holds them."""
    dev = os.stat(directory).st_dev
    disk = root / "devices" / "virtual" / "block" / "sdz"
    node = disk / "sdz1" if partition else disk
    node.mkdir(parents=True)
    if partition:
        (node / "partition").write_text("1\n")
    (disk / "queue").mkdir()
    for name, value in queue.items():
        (disk / "queue" / name).write_text(f"{value}\n")
    (root / "dev" / "block").mkdir(parents=True)
    os.symlink(node, root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}")
    return str(root)


NVME = {"virt_boundary_mask": 4095, "logical_block_size": 512, "dma_alignment": 3}
VIRTIO = {"virt_boundary_mask": 0, "logical_block_size": 512, "dma_alignment": 511}


@pytest.mark.parametrize("queue,want", [
    (NVME, 4096),
    (VIRTIO, 512),
    ({**VIRTIO, "dma_alignment": 3}, 512),  # never below 512
    ({**VIRTIO, "logical_block_size": 4096}, 4096),  # a 4Kn disk
    ({**VIRTIO, "logical_block_size": 2048, "dma_alignment": 511}, 2048),
    ({**VIRTIO, "dma_alignment": 8191}, 4096),  # above 4096: capped
    ({"logical_block_size": 512, "dma_alignment": 511}, 4096),  # no virt_boundary_mask file
    ({**VIRTIO, "virt_boundary_mask": "x"}, 4096),  # unreadable
])
@pytest.mark.parametrize("partition", [False, True])
def test_the_alignment_follows_the_devices_queue(tmp_path, queue, want, partition):
    root = fake_sysfs(tmp_path / "sys", str(tmp_path), queue, partition=partition)
    assert dio_alignment(str(tmp_path), sysfs=root, verify=False) == want


def test_no_block_device_or_no_directory_is_4096(tmp_path):
    assert dio_alignment(str(tmp_path), sysfs=str(tmp_path / "empty-sysfs"), verify=False) == 4096
    assert dio_alignment(str(tmp_path / "missing")) == 4096
    assert dio_alignment("/proc") == 4096  # procfs: an anonymous device


def test_tmpfs_is_4096():
    tmpfs = [m.split()[1] for m in open("/proc/mounts") if m.split()[2] == "tmpfs" and os.access(m.split()[1], os.W_OK)]
    if not tmpfs:
        pytest.skip("no writable tmpfs mount")
    assert dio_alignment(tmpfs[0]) == 4096


def test_the_real_answer_is_a_divisor_of_4096(tmp_path):
    assert dio_alignment(str(tmp_path)) in (512, 1024, 2048, 4096)
