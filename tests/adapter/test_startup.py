"""Start-up of the SGLang backend with real page sizes: pool files too small for one 128-page
round are refused naming ``ssd.file_bytes``; each rank logs one line with its capacities, I/O
engine and pool; the per-user default ``ssd.path`` (never under /tmp) is announced; a server
run without prefix keys is told once per rank that placement cannot see sessions."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from flatcake.adapter.host_pool import MHAHostPoolDouble
from flatcake.adapter.startup import check_file_bytes, min_file_bytes
from flatcake.config import FLATCAKE_EXTRA, ConfigError, load_config
from flatcake.common.layout import PageGeometry

#: Llama-3-70B at TP 1, bf16, 64-token pages: 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
#: = 320 KiB per token, 20 MiB per page; a 128-page round is 2.5 GiB
LLAMA70B_PAGE = dict(page_size=64, layer_num=80, head_num=8, head_dim=128)
#: Qwen2.5-7B at TP 1, bf16, 64-token pages: 28 layers x 4 KV heads x 128 dims x 2 x 2 bytes
#: = 56 KiB per token, 3.5 MiB per page; a 128-page round is 448 MiB
QWEN7B_PAGE = dict(page_size=64, layer_num=28, head_num=4, head_dim=128)


DYNAMIC_NO_PREFIX = {k: v for k, v in FLATCAKE_EXTRA.items() if k != "hicache_storage_pass_prefix_keys"}


def pool_of(page: dict, pages: int = 2) -> MHAHostPoolDouble:
    return MHAHostPoolDouble(size=pages * page["page_size"], **page, dtype=torch.bfloat16, layout="page_first")


def geometry_of(page: dict) -> PageGeometry:
    row = page["head_num"] * page["head_dim"] * 2  # bf16 bytes per token per layer, K and V each
    return PageGeometry(layers=page["layer_num"], page_size=page["page_size"], plane_row_bytes=(row, row))


def test_default_file_bytes_refuse_a_page_whose_round_does_not_fit_naming_the_field(make_backend):
    assert geometry_of(LLAMA70B_PAGE).page_bytes == 20 << 20
    with pytest.raises(ConfigError) as err:
        make_backend(pool=pool_of(LLAMA70B_PAGE), extra={"ssd.file_bytes": load_config().ssd.file_bytes})
    msg = str(err.value)
    assert msg.startswith("ssd.file_bytes: 2147483648 bytes cannot hold one round of 128 pages")
    assert "of 20971520 bytes each" in msg
    need = min_file_bytes(geometry_of(LLAMA70B_PAGE))
    assert f"set ssd.file_bytes to at least {need}" in msg
    assert 128 * (20 << 20) < need <= 128 * (20 << 20) + (1 << 20)


def test_the_smallest_file_bytes_named_is_accepted(make_backend):
    need = min_file_bytes(geometry_of(QWEN7B_PAGE))
    assert 448 << 20 < need <= 449 << 20
    be, _ = make_backend(pool=pool_of(QWEN7B_PAGE), extra={"ssd.file_bytes": need, "ssd.preallocate": False})
    assert be.store.max_round_pages == 128
    with pytest.raises(ConfigError, match="ssd.file_bytes: .* at least"):
        check_file_bytes(load_config(None, {"ssd.file_bytes": need - (1 << 20)}), geometry_of(QWEN7B_PAGE))
    check_file_bytes(load_config(), geometry_of(QWEN7B_PAGE))  # the default holds it


def flatcake_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flatcake"]


def test_one_start_up_line_with_capacities_engine_and_pool(make_backend, ssd_dir, caplog):
    caplog.set_level(logging.INFO, logger="flatcake")
    be, pool = make_backend(extra={"dram.capacity_bytes": 1 << 20, "ssd.file_bytes": 8 << 20, "ssd.max_files": 4,
                                   "cio.engine": "posix"})
    lines = [m for m in flatcake_lines(caplog) if "per-rank capacity" in m]
    assert len(lines) == 1
    line = lines[0]
    page = be.layout.geometry.page_bytes
    dram = (1 << 20) // page * page  # whole page slots
    assert f"DRAM {dram} bytes" in line and "not pinned" in line
    assert "SSD 33554432 bytes (32.0 MiB) = 4 x 8388608-byte files" in line
    assert "I/O engine posix" in line
    assert f"pool {be.store.ssd.prefix} in {ssd_dir}" in line
    assert "tp 0/1 pp 0/1 dp0" in line and "single" in line
    assert f"page {page} bytes" in line
    assert not any("ssd.path not set" in m for m in flatcake_lines(caplog))  # ssd.path was given


def test_default_ssd_path_is_the_user_cache_and_is_announced(make_backend, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="flatcake")
    be, _ = make_backend(extra={"ssd.path": None})
    assert be.cfg.ssd.path == str(tmp_path / "cache" / "flatcake")
    assert not be.cfg.ssd.path.startswith("/tmp/flatcake")
    warnings = [r for r in caplog.records if r.name == "flatcake" and r.levelno == logging.WARNING
                and "ssd.path not set" in r.getMessage()]
    assert len(warnings) == 1
    assert str(tmp_path / "cache" / "flatcake") in warnings[0].getMessage()
    assert be.store.dram.pinned is False  # pinning is off unless asked for


@pytest.mark.parametrize("extra, warned", [
    (None, True),  # no extra config at all: SGLang's default is off
    (json.dumps({**DYNAMIC_NO_PREFIX}), True),
    (json.dumps({**DYNAMIC_NO_PREFIX, "hicache_storage_pass_prefix_keys": False}), True),
    (json.dumps(FLATCAKE_EXTRA), False),
])
def test_server_without_prefix_keys_warns_once_per_rank(extra, warned, make_backend, monkeypatch, caplog):
    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_memory", lambda: SimpleNamespace(hicache_storage_backend="dynamic",
                                                                  hicache_storage_backend_extra_config=extra))
    caplog.set_level(logging.WARNING, logger="flatcake")
    make_backend()
    lines = [m for m in flatcake_lines(caplog) if "hicache_storage_pass_prefix_keys off" in m]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert "write-time placement cannot see sessions" in lines[0]


def test_runtime_attach_does_not_warn_about_prefix_keys(make_backend, monkeypatch, caplog):
    """``PUT /hicache/storage-backend`` on a server started without L3: SGLang's record still says
    no backend and no extra config while the backend starts (it is updated after the attach,
    ``managers/scheduler.py`` 5440-5465), whatever the attach's extra config holds."""
    import sglang.srt.runtime_context as rc
    from flatcake.adapter.startup import sglang_passes_prefix_keys

    monkeypatch.setattr(rc, "get_memory", lambda: SimpleNamespace(hicache_storage_backend=None,
                                                                  hicache_storage_backend_extra_config=None))
    assert sglang_passes_prefix_keys() is None
    caplog.set_level(logging.WARNING, logger="flatcake")
    make_backend()
    assert not [m for m in flatcake_lines(caplog) if "prefix_keys" in m]


def test_outside_an_sglang_server_the_prefix_key_setting_is_unknown(make_backend, caplog):
    from flatcake.adapter.startup import sglang_passes_prefix_keys

    assert sglang_passes_prefix_keys() is None  # SGLang's runtime context is not published here
    caplog.set_level(logging.WARNING, logger="flatcake")
    make_backend()
    assert not [m for m in flatcake_lines(caplog) if "prefix_keys" in m]
