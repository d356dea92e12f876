"""cluster.advertise per rank: each TP/PP/DP rank of one server runs its own data plane, so its
port is the configured base + the rank's offset (flatcake.adapter.identity.rank_port_offset)."""

import dataclasses

import pytest

from flatcake.adapter.identity import expand_advertise, rank_port_offset
from flatcake.adapter.storage import FlatCakeStorage
from flatcake.config import ConfigError, FlatCakeConfig
from flatcake.replay.systems import storage_config


def _extra(tmp_path, port=7000):
    return {"ssd.path": str(tmp_path / "pool"), "cluster.etcd": ["http://127.0.0.1:2379"],
            "cluster.advertise": f"10.0.0.5:{port}", "node_id": 3}


@pytest.mark.parametrize("tp_rank,expected", [(0, 7000), (1, 7001), (3, 7003)])
def test_each_tp_rank_gets_its_own_port(tmp_path, tp_rank, expected):
    st = FlatCakeStorage(storage_config(_extra(tmp_path), tp_rank=tp_rank, tp_size=4))
    assert st.cfg.cluster.advertise == f"10.0.0.5:{expected}"
    assert st.cfg.node_id == 3


def test_pp_and_dp_ranks_come_after_the_tp_ranks(tmp_path):
    sc = dataclasses.replace(storage_config(_extra(tmp_path), tp_rank=1, tp_size=2), pp_rank=1, pp_size=2)
    values = {"tp_rank": 1, "pp_rank": 1, "dp_rank": 0}
    assert rank_port_offset(sc, values) == 3  # (0 * 2 + 1) * 2 + 1
    assert rank_port_offset(sc, dict(values, dp_rank=1)) == 7  # (1 * 2 + 1) * 2 + 1
    assert rank_port_offset(None, values) == 0


def test_mla_writer_ranks_use_the_dcp_rank(tmp_path):
    sc = storage_config(_extra(tmp_path), mla=True, tp_rank=5, tp_size=8)
    st = FlatCakeStorage(sc)
    assert st.cfg.cluster.advertise == "10.0.0.5:7000"  # dcp_rank 0: the writer's port


def test_a_port_pushed_above_65535_fails_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="cluster.advertise"):
        FlatCakeStorage(storage_config(_extra(tmp_path, port=65534), tp_rank=3, tp_size=4))


def test_single_rank_and_no_address_are_unchanged():
    cfg = FlatCakeConfig()
    assert expand_advertise(cfg, 5) is cfg  # no address set
    cfg2 = FlatCakeConfig.model_validate({"cluster": {"advertise": "h:9000"}})
    assert expand_advertise(cfg2, 0) is cfg2
    assert expand_advertise(cfg2, 2).cluster.advertise == "h:9002"
