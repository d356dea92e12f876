"""FC-MAS order of a linker batch (paper §3.2): DRAM-ready loads first in queue order, then loads
with SSD pages by HRRN priority ``1 + wait_s / ssd_bytes``."""

from flatcake.linker.layer_loads import QueuedLoad, mas_order


def test_dram_ready_loads_go_first_and_ssd_loads_by_hrrn():
    loads = [
        QueuedLoad("ssd-big-old", ("b",), (1,), queued_s=0.0),
        QueuedLoad("dram-late", ("d2",), (2,), queued_s=5.0),
        QueuedLoad("ssd-small", ("s",), (3,), queued_s=9.0),
        QueuedLoad("dram-early", ("d1",), (4,), queued_s=1.0),
    ]
    ssd_bytes = {"b": 1 << 20, "s": 4096, "d1": 0, "d2": 0}
    order = mas_order(loads, lambda keys: ssd_bytes[keys[0]], now_s=10.0)
    # HRRN: ssd-small 1 + 1/4096 > ssd-big-old 1 + 10/2**20
    assert [ld.rid for ld in order] == ["dram-early", "dram-late", "ssd-small", "ssd-big-old"]
    # a big restore's priority grows with its wait: it goes before a small one that has not waited
    order = mas_order(loads, lambda keys: ssd_bytes[keys[0]], now_s=9.0)
    assert [ld.rid for ld in order][2:] == ["ssd-big-old", "ssd-small"]
