"""64-bit GVA: medium [63:60], node [59:48], offset [47:0]."""

import pytest

from flatcake.gva.address import (
    MEDIUM_DRAM, MEDIUM_SSD, SSD_BOUNDARY, decode_gva, encode_gva, medium_of, needs_ssd, node_of, offset_of,
)


def test_field_edges_round_trip():
    g = encode_gva(0xF, 0xFFF, (1 << 48) - 1)
    assert g == (1 << 64) - 1
    f = decode_gva(g)
    assert (f.medium, f.node, f.offset) == (15, 4095, (1 << 48) - 1)
    assert encode_gva(0, 0, 0) == 0
    assert encode_gva(MEDIUM_SSD, 0, 0) == 1 << 60 == SSD_BOUNDARY
    assert encode_gva(MEDIUM_DRAM, 1, 0) == 1 << 48
    g = encode_gva(MEDIUM_SSD, 7, 123456789)
    assert (medium_of(g), node_of(g), offset_of(g)) == (1, 7, 123456789)


@pytest.mark.parametrize(
    "args,field",
    [((16, 0, 0), "medium"), ((-1, 0, 0), "medium"), ((0, 4096, 0), "node"), ((0, -1, 0), "node"), ((0, 0, 1 << 48), "offset"), ((0, 0, -1), "offset")],
)
def test_out_of_range_raises_naming_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        encode_gva(*args)


def test_routing_by_boundary():
    top_dram = encode_gva(MEDIUM_DRAM, 0xFFF, (1 << 48) - 1)
    assert top_dram == SSD_BOUNDARY - 1
    assert not needs_ssd([0, top_dram])
    assert needs_ssd([0, top_dram, SSD_BOUNDARY])
    assert not needs_ssd([])
