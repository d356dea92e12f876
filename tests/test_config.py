"""FlatCake configuration: defaults, YAML and extra-config precedence, errors that name the field,
and the reference page (docs/configuration.md) and configs/default.yaml kept in step with the model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from flatcake.config import (
    DEFAULT_CONFIG_PATH,
    FLATCAKE_EXTRA,
    SGLANG_RESERVED_KEYS,
    ConfigError,
    FlatCakeConfig,
    config_from_extra,
    default_ssd_path,
    load_config,
)

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "configuration.md"


#: fields computed from others, not set by the operator (``ssd.paths`` comes from ``ssd.path``)
DERIVED = {"ssd.paths"}


def _fields(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Dotted field path -> default, recursing into sub-sections."""
    out: dict[str, object] = {}
    for name, info in model.model_fields.items():
        if f"{prefix}{name}" in DERIVED:
            continue
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_fields(ann, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = info.default
    return out


def _leaf_keys(d: dict, prefix: str = "") -> set[str]:
    keys = set()
    for k, v in d.items():
        if isinstance(v, dict):
            keys |= _leaf_keys(v, f"{prefix}{k}.")
        else:
            keys.add(f"{prefix}{k}")
    return keys


def _yaml_scalar(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fc.yaml"
    p.write_text(text)
    return p


# ---- defaults -------------------------------------------------------------------------------


def test_defaults_load_from_default_yaml_equal_model_defaults():
    assert DEFAULT_CONFIG_PATH == REPO / "configs" / "default.yaml"
    cfg = load_config()
    assert cfg == FlatCakeConfig()
    assert cfg.node_id == 0
    assert cfg.dram.capacity_bytes == 1 << 30
    assert cfg.ssd.file_bytes == 2 << 30  # one 128-page round of pages up to ~16 MiB fits
    assert cfg.ssd.max_files == 8  # 16 GiB per rank
    assert cfg.dram.pin == "off"  # pinning only when asked for
    assert cfg.cio.gap_bytes == 64 << 10
    assert cfg.cio.max_io_bytes == 16 << 20
    assert cfg.cio.engine == "auto"
    assert cfg.placement.l_agent_tokens == 32768


def test_default_ssd_path_is_the_per_user_cache_directory_not_tmp(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = load_config().ssd.path
    assert path == str(tmp_path / "home" / ".cache" / "flatcake")
    assert not path.startswith("/tmp/flatcake")
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/cache")
    assert load_config().ssd.path == "/srv/cache/flatcake"
    assert load_config(None, {"ssd.path": None}).ssd.path == "/srv/cache/flatcake"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as XDG says
    assert load_config().ssd.path == str(tmp_path / "home" / ".cache" / "flatcake")
    assert load_config(None, {"ssd.path": "/nvme/fc"}).ssd.path == "/nvme/fc"


def test_default_ssd_path_without_any_home_names_the_field():
    with pytest.raises(ValueError, match="set ssd.path"):
        default_ssd_path({"HOME": "relative"})


def test_empty_ssd_path_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="ssd.path: .*must not be empty"):
        load_config(None, {"ssd.path": " "})


def test_default_yaml_lists_every_key_with_its_default():
    data = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    fields = _fields(FlatCakeConfig)
    assert _leaf_keys(data) == set(fields)
    for key, default in fields.items():
        node = data
        for part in key.split("."):
            node = node[part]
        assert node == default, key


def test_default_yaml_has_a_comment_on_every_key_line():
    for line in DEFAULT_CONFIG_PATH.read_text().splitlines():
        if re.match(r"^\s*[a-z_]+:", line):
            assert "#" in line, line


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(Exception):
        cfg.node_id = 3  # type: ignore[misc]


# ---- precedence -----------------------------------------------------------------------------


def test_yaml_overrides_defaults_and_keeps_the_rest(tmp_path):
    p = _write(tmp_path, "ssd:\n  path: /nvme/fc\n  max_files: 8\ncio:\n  gap_bytes: 0\n")
    cfg = load_config(p)
    assert cfg.ssd.path == "/nvme/fc"
    assert cfg.ssd.max_files == 8
    assert cfg.cio.gap_bytes == 0
    assert cfg.ssd.file_bytes == 2 << 30  # untouched default
    assert cfg.dram.capacity_bytes == 1 << 30


def test_dotted_override_beats_yaml(tmp_path):
    p = _write(tmp_path, "ssd:\n  path: /from/yaml\n  max_files: 8\n")
    cfg = load_config(p, {"ssd.path": "/from/extra"})
    assert cfg.ssd.path == "/from/extra"
    assert cfg.ssd.max_files == 8  # sibling from YAML survives


def test_nested_override_beats_yaml_and_merges_siblings(tmp_path):
    p = _write(tmp_path, "ssd:\n  path: /from/yaml\n  max_files: 8\n")
    cfg = load_config(p, {"ssd": {"max_files": 16}})
    assert cfg.ssd.max_files == 16
    assert cfg.ssd.path == "/from/yaml"


def test_dotted_and_nested_overrides_combine():
    cfg = load_config(None, {"cio.io_workers": 8, "cio": {"gap_bytes": 4096}, "node_id": 7})
    assert cfg.cio.io_workers == 8
    assert cfg.cio.gap_bytes == 4096
    assert cfg.node_id == 7


def test_flatcake_config_key_selects_the_yaml(tmp_path):
    p = _write(tmp_path, "node_id: 12\n")
    cfg = load_config(None, {"flatcake_config": str(p), "dram.capacity_bytes": 4096})
    assert cfg.node_id == 12
    assert cfg.dram.capacity_bytes == 4096


def test_missing_yaml_is_config_error_naming_flatcake_config(tmp_path):
    with pytest.raises(ConfigError, match="flatcake_config: file not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_that_is_not_a_mapping_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))


# ---- errors name the field --------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, field",
    [
        ({"ssd.bogus": 1}, "ssd.bogus"),
        ({"ssd": {"bogus": 1}}, "ssd.bogus"),
        ({"bogus_top": 1}, "bogus_top"),
        ({"cio.nope": True}, "cio.nope"),
    ],
)
def test_unknown_key_is_config_error_naming_it(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, override)
    assert f"{field}: unknown key" in str(e.value)


def test_unknown_key_in_yaml_is_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"dram\.bogus: unknown key"):
        load_config(_write(tmp_path, "dram:\n  bogus: 3\n"))


def test_file_bytes_not_multiple_of_4096_names_field():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"ssd.file_bytes": 4096 * 10 + 1})
    assert "ssd.file_bytes" in str(e.value)
    assert "multiple of 4096" in str(e.value)


def test_file_bytes_multiple_of_4096_is_accepted():
    assert load_config(None, {"ssd.file_bytes": 4096 * 10}).ssd.file_bytes == 40960


@pytest.mark.parametrize("section", ["dram", "ssd"])
def test_inverted_watermarks_name_the_section_and_field(section):
    with pytest.raises(ConfigError) as e:
        load_config(None, {f"{section}.high_watermark": 0.5, f"{section}.low_watermark": 0.6})
    msg = str(e.value)
    assert f"{section}.low_watermark: " in msg
    assert "must be below high_watermark (0.5)" in msg


def test_equal_watermarks_are_rejected():
    with pytest.raises(ConfigError, match=r"ssd\.low_watermark: .*must be below high_watermark \(0\.8\)"):
        load_config(None, {"ssd.high_watermark": 0.8, "ssd.low_watermark": 0.8})


@pytest.mark.parametrize("node_id", [4096, 1 << 20, -1])
def test_node_id_outside_12_bits_names_field(node_id):
    with pytest.raises(ConfigError, match=r"node_id: "):
        load_config(None, {"node_id": node_id})


def test_node_id_4095_is_the_largest_accepted():
    assert load_config(None, {"node_id": 4095}).node_id == 4095


def test_invalid_cio_engine_names_field_and_value():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"cio.engine": "spdk"})
    assert "cio.engine" in str(e.value)
    assert "'spdk'" in str(e.value)


def test_ssd_capacity_past_gva_offset_field_is_rejected():
    with pytest.raises(ConfigError, match=r"ssd\.max_files: .*2\*\*48"):
        load_config(None, {"ssd.file_bytes": 1 << 40, "ssd.max_files": 256})


def test_all_errors_are_reported_together():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"node_id": 5000, "cio.engine": "x"})
    assert "node_id" in str(e.value) and "cio.engine" in str(e.value)


# ---- SGLang extra config ----------------------------------------------------------------------


def test_config_from_extra_strips_every_sglang_reserved_key():
    extra = {k: 1 for k in SGLANG_RESERVED_KEYS}
    extra.update(FLATCAKE_EXTRA)
    extra["ssd.path"] = "/nvme/x"
    cfg = config_from_extra(extra)
    assert cfg.ssd.path == "/nvme/x"
    assert cfg == load_config(None, {"ssd.path": "/nvme/x"})


def test_config_from_extra_contains_the_dynamic_backend_keys():
    assert set(FLATCAKE_EXTRA) <= SGLANG_RESERVED_KEYS


def test_config_from_extra_none_gives_defaults():
    assert config_from_extra(None) == FlatCakeConfig()


def test_config_from_extra_still_rejects_unknown_flatcake_keys():
    with pytest.raises(ConfigError, match=r"ssd\.bogus: unknown key"):
        config_from_extra({"backend_name": "flatcake", "ssd.bogus": 1})


def test_config_from_extra_reads_flatcake_config(tmp_path):
    p = _write(tmp_path, "cio:\n  windows: 3\n")
    cfg = config_from_extra({"backend_name": "flatcake", "flatcake_config": str(p)})
    assert cfg.cio.windows == 3


# ---- docs/configuration.md --------------------------------------------------------------------


def _doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"^\| `([a-z_.]+)` \|[^|]*\|[^|]*\| `([^`]*)` \|", line.replace("\\|", "/"))
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_docs_list_every_field_recursively():
    text = DOCS.read_text()
    fields = _fields(FlatCakeConfig)
    missing = [k for k in fields if f"`{k}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"
    rows = _doc_rows()
    assert set(fields) <= set(rows)
    assert set(rows) - set(fields) == {"flatcake_config"}  # the only documented non-field key


def test_docs_defaults_match_the_model():
    rows = _doc_rows()
    for key, default in _fields(FlatCakeConfig).items():
        assert rows[key] == _yaml_scalar(default), key


def test_dotted_keys_inside_yaml_are_accepted(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("ssd.path: /x/y\ncio:\n  gap_bytes: 8192\n")
    cfg = load_config(p)
    assert (cfg.ssd.path, cfg.cio.gap_bytes) == ("/x/y", 8192)


def test_dram_capacity_past_gva_offset_field_is_rejected():
    with pytest.raises(ConfigError, match=r"dram\.capacity_bytes: .*2\*\*48"):
        load_config(None, {"dram.capacity_bytes": 1 << 48})


@pytest.mark.parametrize(
    "over,field",
    [({"dram.capacity_bytes": True}, "dram.capacity_bytes"), ({"cio.verify_checksums": "no"}, "cio.verify_checksums"), ({"ssd.max_files": "8"}, "ssd.max_files")],
)
def test_no_silent_type_coercion(over, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, over)


def test_same_key_given_nested_and_dotted_with_different_values_is_an_error():
    with pytest.raises(ConfigError, match=r"ssd\.path: given twice"):
        load_config(None, {"ssd": {"path": "/tmp/x"}, "ssd.path": "/tmp/y"})
    assert load_config(None, {"ssd": {"path": "/tmp/x"}, "ssd.path": "/tmp/x"}).ssd.path == "/tmp/x"


def test_a_dumped_config_with_several_drives_validates_again_and_a_changed_path_replaces_the_list():
    """``model_dump()`` carries the derived ``ssd.paths``: validating it again keeps the drive
    list; a dump whose ``ssd.path`` was changed (as the replay's ``--scale`` rewrites configs)
    gets that one directory; ``ssd.paths`` alone is refused naming ``ssd.path``."""
    cfg = load_config(None, {"ssd.path": ["/nvme0/fc", "/nvme1/fc"]})
    dumped = cfg.model_dump()
    assert FlatCakeConfig.model_validate(dumped).ssd.paths == ("/nvme0/fc", "/nvme1/fc")
    dumped["ssd"]["path"] = "/elsewhere"
    again = FlatCakeConfig.model_validate(dumped).ssd
    assert (again.path, again.paths) == ("/elsewhere", ("/elsewhere",))
    with pytest.raises(ConfigError, match="give the drives as a list in ssd.path"):
        load_config(None, {"ssd": {"paths": ["/a"]}})


@pytest.mark.parametrize("drives", [["/d/a", "/d/a/"], ["/d/b", "/d/./b"], ["/d/c", "/d/x/../c"]])
def test_one_directory_written_two_ways_is_listed_twice(drives):
    """Two spellings of one directory would open one pool twice (found by a fresh-user check:
    the second drive's lock collided with the first); refused naming both spellings."""
    with pytest.raises(ConfigError, match=r"ssd.path: a directory is listed twice \('"):
        load_config(None, {"ssd.path": drives})
