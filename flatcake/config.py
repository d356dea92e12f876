"""FlatCake configuration: one typed, validated model (YAML -> pydantic), overridden by
SGLang's ``--hicache-storage-backend-extra-config`` JSON.

Lifecycle: ``load_config(yaml_path, overrides)`` -> :class:`FlatCakeConfig` (frozen). Bad
configuration fails at start-up with :class:`ConfigError`, whose message names the field
(``ssd.file_bytes: must be a multiple of 4096``). ``docs/configuration.md`` lists every key
with its unit and default.

Override syntax (extra-config JSON, highest precedence first):

* dotted keys: ``{"ssd.path": "/nvme/fc", "cio.gap_bytes": 65536}``
* nested objects: ``{"ssd": {"path": "/nvme/fc"}}``
* ``flatcake_config``: a YAML file to start from (instead of ``configs/default.yaml``).

Keys that SGLang itself puts into the extra config (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ``file_storage_path``, ...) are not FlatCake keys; the
SGLang adapter strips them (see :data:`SGLANG_RESERVED_KEYS`) before calling
:func:`load_config`.
"""

from __future__ import annotations

import copy
import os
import re
import string
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Tuple

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from flatcake.common.align import ALIGN

#: Keys SGLang passes through the extra config that are not FlatCake settings.
SGLANG_RESERVED_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "file_storage_path",
        "enable_metadata_cache",
        "metadata_ttl",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)

#: Pages per L3 call in SGLang 0.5.23 (``hicache_storage.STORAGE_BATCH_SIZE``): its prefetch
#: reads and backup writes carry at most this many pages, so FlatCake's rounds do too.
STORAGE_BATCH_PAGES = 128

#: The extra-config keys that select FlatCake through SGLang's ``dynamic`` backend — the one
#: definition the launcher, the replay, the benchmarks and the tests inject. SGLang's dynamic
#: factory reads the first three; ``interface_v1`` selects the zero-copy
#: ``batch_get_v1``/``batch_set_v1`` path; ``hicache_storage_pass_prefix_keys`` gives the backend
#: the key chain it derives a session scope from (paper §3.1, FC-GVA). All of them are in
#: :data:`SGLANG_RESERVED_KEYS`.
FLATCAKE_EXTRA: dict[str, Any] = {
    "backend_name": "flatcake",
    "module_path": "flatcake",
    "class_name": "FlatCakeStorage",
    "interface_v1": 1,
    "hicache_storage_pass_prefix_keys": True,
}

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


class ConfigError(ValueError):
    """Invalid FlatCake configuration; the message names the offending field."""


def default_ssd_path(environ: Mapping[str, str] | None = None) -> str:
    """The SSD pool directory used when ``ssd.path`` is not set: the per-user cache directory
    ``$XDG_CACHE_HOME/flatcake``, or ``~/.cache/flatcake`` when ``XDG_CACHE_HOME`` is unset or
    not absolute (the XDG base-directory rule). Never under ``/tmp``: ``/tmp`` is often a tmpfs
    (RAM, no ``O_DIRECT``), is emptied at reboot (no warm restart) and is shared by every user.

    Args:
        environ: the environment to read (``os.environ`` when None).

    Returns:
        An absolute path (not created here).

    Raises:
        ValueError: neither ``XDG_CACHE_HOME`` nor a home directory is known.
    """
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "flatcake")
    home = env.get("HOME") or os.path.expanduser("~")
    if not home or not os.path.isabs(home):
        raise ValueError("not set, and there is no home directory for the default ~/.cache/flatcake: set ssd.path")
    return os.path.join(home, ".cache", "flatcake")


#: placeholders ``ssd.path`` may hold, filled per rank from SGLang's ``HiCacheStorageConfig``
#: when the backend starts (:func:`flatcake.adapter.identity.expand_ssd_paths`)
PATH_PLACEHOLDERS = ("tp_rank", "pp_rank", "dp_rank")

_POOL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def path_placeholders(path: str) -> set[str]:
    """The placeholders of one ``ssd.path`` entry (``/nvme{tp_rank}/fc`` -> ``{"tp_rank"}``),
    checked: each is one of :data:`PATH_PLACEHOLDERS`, with an optional integer format spec
    (``{tp_rank:02d}``).

    Raises:
        ValueError: an unknown or positional placeholder, a conversion (``!r``), a format spec
            an integer cannot take, a stray or escaped brace (braces are for placeholders only);
            the message names ``ssd.path``.
    """
    found: set[str] = set()
    try:
        parts = list(string.Formatter().parse(path))
    except ValueError as e:
        raise ValueError(f"ssd.path {path!r}: bad template ({e}); placeholders are "
                         f"{', '.join('{' + p + '}' for p in PATH_PLACEHOLDERS)}") from None
    for literal, name, spec, conv in parts:
        if "{" in literal or "}" in literal:
            raise ValueError(f"ssd.path {path!r}: braces are for placeholders only "
                             f"({', '.join('{' + p + '}' for p in PATH_PLACEHOLDERS)})")
        if name is None:
            continue
        if name not in PATH_PLACEHOLDERS or conv:
            raise ValueError(f"ssd.path {path!r}: unknown placeholder {{{name}{'!' + conv if conv else ''}}}; "
                             f"known: {', '.join('{' + p + '}' for p in PATH_PLACEHOLDERS)}")
        try:
            format(0, spec or "")
        except ValueError:
            raise ValueError(f"ssd.path {path!r}: bad format spec {{{name}:{spec}}} for an integer rank") from None
        found.add(name)
    return found


class _Section(BaseModel):
    # strict: no silent coercion ("no" is not a bool, True is not a byte count, "8" is not 8)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _WatermarkSection(_Section):
    """A medium reclaimed between ``high_watermark`` and ``low_watermark`` (fill fractions)."""

    @field_validator("low_watermark", check_fields=False)
    @classmethod
    def _low_below_high(cls, v: float, info: ValidationInfo) -> float:
        high = info.data.get("high_watermark")
        if high is not None and v >= high:
            raise ValueError(f"must be below high_watermark ({high})")
        return v


class DramConfig(_WatermarkSection):
    """DRAM medium (paper §3.1, FC-GVA medium 0): one region allocated at start-up."""

    capacity_bytes: int = Field(1 << 30, ge=0, description="bytes of the DRAM region")
    high_watermark: float = Field(0.95, gt=0, le=1, description="reclaim above this fill fraction")
    low_watermark: float = Field(0.85, ge=0, lt=1, description="reclaim down to this fill fraction")
    pin: Literal["auto", "on", "off"] = Field(
        "off", description="page-lock the region: off (default), on (needs CUDA), auto (when CUDA is available)")

    @field_validator("capacity_bytes")
    @classmethod
    def _fits_gva(cls, v: int) -> int:
        if v >= 1 << 48:
            raise ValueError("must be below 2**48 (GVA offset field)")
        return v


class SsdConfig(_WatermarkSection):
    """SSD medium (paper §3.1/§3.3): a pool of preallocated single-extent files."""

    path: Optional[str] = Field(None, validate_default=True,
                                description="directory of the file pool (the first drive when ``ssd.path`` "
                                            "is a list); None = default_ssd_path()")
    #: every drive's pool directory, ``path`` first (``ssd.path`` given as a list: one directory
    #: per NVMe drive without RAID; a plain string gives one drive). Set through ``ssd.path``.
    paths: Tuple[str, ...] = ()
    file_bytes: int = Field(2 << 30, gt=0, description="bytes per preallocated file (one extent)")
    max_files: int = Field(8, ge=1, description="files in the pool; capacity = max_files * file_bytes")
    high_watermark: float = Field(0.90, gt=0, le=1)
    low_watermark: float = Field(0.75, ge=0, lt=1)
    direct_io: Literal["auto", "on", "off"] = "auto"
    preallocate: bool = Field(True, description="fallocate each file when it is first used")
    pool_id: Optional[str] = Field(
        None, description="fixed pool name of this server (letters, digits, '.', '_', '-'); None = a free slot")
    write_backlog_bytes: int = Field(
        1 << 30, ge=0, description="bytes of SSD rounds the write queue may hold while restores read (Tutti: reads "
                                   "first, writes in the gaps); 0 = no queue, rounds written synchronously by the put")
    write_backlog_wait_s: float = Field(
        5.0, ge=0, description="seconds a put of a non-one-shot round waits for room in a full write backlog "
                               "(DRAM full too) before it fails")
    write_defer_max_s: float = Field(
        1.0, gt=0, description="seconds the oldest queued round may be held back for restores; past it (or with the "
                               "backlog past write_urgent_fraction) writes share the disk with reads until caught up")
    write_urgent_fraction: float = Field(
        0.5, gt=0, le=1, description="backlog fill (of write_backlog_bytes) past which writes stop waiting for reads")

    @model_validator(mode="before")
    @classmethod
    def _path_list(cls, data: Any) -> Any:
        """``ssd.path`` as a list of directories -> ``path`` (the first) and ``paths`` (all)."""
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        path = data.get("path")
        derived = data.pop("paths", None)
        if derived is not None:
            # a dumped config (``model_dump()`` of an SsdConfig) carries both: keep the drive list
            # while ``path`` is still its first entry; a changed ``path`` replaces the list
            if path is None or not isinstance(derived, (list, tuple)):
                raise ValueError("ssd.paths is derived: give the drives as a list in ssd.path")
            if derived and path == derived[0]:
                path = data["path"] = list(derived)
        if isinstance(path, (list, tuple)):
            if not path:
                raise ValueError("ssd.path: an empty list (give one directory per drive, or leave it unset)")
            bad = [p for p in path if not isinstance(p, str) or not p.strip()]
            if bad:
                raise ValueError(f"ssd.path: every entry must be a non-empty directory string (got {bad[0]!r})")
            seen: dict = {}
            for p in path:  # "/d/a", "/d/a/" and "/d/./a" are one directory
                norm = os.path.normpath(os.path.abspath(p))
                if norm in seen:
                    raise ValueError(f"ssd.path: a directory is listed twice ({seen[norm]!r} and {p!r})")
                seen[norm] = p
            data["path"], data["paths"] = path[0], tuple(path)
        return data

    @model_validator(mode="after")
    def _paths_default(self) -> "SsdConfig":
        if not self.paths:
            object.__setattr__(self, "paths", (self.path,))
        for p in self.paths:
            path_placeholders(p)  # ValueError naming ssd.path
        return self

    @field_validator("pool_id")
    @classmethod
    def _pool_id_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _POOL_ID.match(v):
            raise ValueError("must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    def with_paths(self, paths: "list[str] | tuple[str, ...]") -> "SsdConfig":
        """A validated copy with these drive directories (``paths[0]`` becomes ``path``); use it
        instead of ``model_copy`` (which would leave ``paths`` stale).

        Raises:
            ConfigError: an empty or repeated entry (names ``ssd.path``).
        """
        data = self.model_dump(exclude={"path", "paths"})
        try:
            return SsdConfig.model_validate({**data, "path": list(paths)})
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e, "ssd")) from None

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, v: Optional[str]) -> str:
        if v is None:
            return default_ssd_path()
        if not v.strip():
            raise ValueError("must not be empty (leave it unset for the per-user cache directory)")
        return v

    @field_validator("file_bytes")
    @classmethod
    def _aligned(cls, v: int) -> int:
        if v % ALIGN:
            raise ValueError(f"must be a multiple of {ALIGN}")
        if v >= 1 << 48:
            raise ValueError("must be below 2**48 (GVA offset field)")
        return v

    @field_validator("max_files")
    @classmethod
    def _fits_gva(cls, v: int, info: ValidationInfo) -> int:
        fb = info.data.get("file_bytes")
        if fb is not None and fb * v >= 1 << 48:
            raise ValueError("max_files * file_bytes must be below 2**48 (GVA offset field)")
        return v


class PlacementConfig(_Section):
    """Write-time placement thresholds (paper Table 2)."""

    l_agent_tokens: int = Field(32768, ge=1, description="context >= this -> agent scope (SSD)")
    tau_tokens: int = Field(4096, ge=1, description="reply >= this -> agent scope (SSD)")
    short_reply_tokens: int = Field(1024, ge=0, description="previous reply below this is 'short'")
    shared_refcount: int = Field(2, ge=2, description="prefix reference count >= this is a shared prompt")
    requery_window_s: float = Field(30.0, ge=0, description="an identical hit query within this many seconds counts once")


class CioConfig(_Section):
    """Coalescing direct-I/O engine (paper §3.3, FC-CIO)."""

    engine: Literal["auto", "posix", "kvikio"] = "auto"
    gap_bytes: int = Field(64 << 10, ge=0, description="bridge holes smaller than this by over-reading")
    max_io_bytes: int = Field(16 << 20, ge=ALIGN, description="split merged reads larger than this")
    io_workers: int = Field(4, ge=1, le=256)
    staging_bytes: int = Field(0, ge=0, description="bytes per staging buffer (2 of them); 0 = auto")
    windows: int = Field(1, ge=1, le=64, description="double-buffered staging windows (concurrent restores)")
    scatter: Literal["auto", "triton", "torch"] = "auto"
    verify_checksums: bool = Field(True, description="check each chunk's xxh3 in staging before scatter")
    thread_policy: Literal["idle", "normal"] = Field("normal", description="C restore threads: SCHED_OTHER or SCHED_IDLE")

    @field_validator("max_io_bytes", "staging_bytes")
    @classmethod
    def _aligned(cls, v: int) -> int:
        if v % ALIGN:
            raise ValueError(f"must be a multiple of {ALIGN}")
        return v


class MasConfig(_Section):
    """Medium-aware scheduling of prefetch I/O (paper §3.2, FC-MAS). Used by the SGLang plugin
    (:mod:`flatcake.adapter.plugin`) and as the replay's default ``--scheduler``; the number of
    concurrent SSD restores is ``cio.windows``."""

    scheduler: Literal["mas", "fcfs"] = Field(
        "mas", description="mas = DRAM lane + HRRN SSD lane; fcfs = SGLang's single FIFO I/O thread")


class ClusterConfig(_Section):
    """One cache across nodes (docs/cluster.md): the etcd that holds the replicated index and the
    capacity records. Off (``etcd: []``) the node behaves exactly as a single FlatCake and never
    imports :mod:`flatcake.cluster`. The cluster node id is the top-level ``node_id`` (the GVA
    node field): one id per node, registered in etcd at start-up, where a duplicate fails."""

    etcd: list[str] = Field([], description="etcd endpoints http://host:port; [] = no cluster")
    advertise: Optional[str] = Field(None, description="host:port other nodes reach this node at (data plane)")
    prefix: str = Field("/flatcake", description="etcd key prefix of this cluster")
    lease_ttl_s: int = Field(10, ge=2, le=3600, description="seconds a dead node's records outlive it")
    capacity_interval_s: float = Field(1.0, gt=0, description="seconds between free-space publications")
    timeout_s: float = Field(2.0, gt=0, description="seconds per etcd request")
    watch_idle_s: float = Field(10.0, gt=0, description="a silent index watch is re-opened after this many seconds")
    remote_timeout_s: float = Field(2.0, gt=0, description="seconds a remote read waits for an owner (data plane)")
    staging_slots: int = Field(3, ge=2, le=64, description="slots of the ring remote SSD reads are served through")
    staging_slot_bytes: int = Field(16 << 20, ge=4096, le=1 << 30, description="bytes per staging slot")
    landing_bytes: int = Field(64 << 20, ge=8192, le=1 << 34, description="registered buffer remote reads land in")

    @field_validator("etcd")
    @classmethod
    def _endpoints(cls, v: list[str]) -> list[str]:
        import re as _re

        for ep in v:
            m = _re.match(r"^(https?://)?([^/:\s]+|\[[0-9a-fA-F:]+\]):(\d{1,5})/?$", ep)
            if not m or not 0 < int(m.group(3)) < 65536:
                raise ValueError(f"{ep!r} is not http(s)://host:port")
        if len(set(v)) != len(v):
            raise ValueError("an endpoint is listed twice")
        return v

    @field_validator("prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        import re as _re

        if not _re.match(r"^/[A-Za-z0-9._/-]*[A-Za-z0-9._-]$", v) or "//" in v:
            raise ValueError("must start with '/', not end with '/', and hold letters, digits, '.', '_', '-', '/'")
        return v

    @field_validator("advertise")
    @classmethod
    def _advertise(cls, v: Optional[str]) -> Optional[str]:
        import re as _re

        if v is not None and not _re.match(r"^([^/:\s]+|\[[0-9a-fA-F:]+\]):\d{1,5}$", v):
            raise ValueError(f"{v!r} is not host:port")
        return v

    @field_validator("staging_slot_bytes")
    @classmethod
    def _slot_bytes(cls, v: int) -> int:
        if v % 4096:
            raise ValueError(f"{v} is not a multiple of 4096 (O_DIRECT reads land in the slots)")
        return v

    @field_validator("landing_bytes")
    @classmethod
    def _landing_bytes(cls, v: int) -> int:
        if v % 8192:
            raise ValueError(f"{v} is not a multiple of 8192 (two 4 KiB-aligned halves)")
        return v

    @property
    def enabled(self) -> bool:
        """True when ``etcd`` lists at least one endpoint."""
        return bool(self.etcd)


class FlatCakeConfig(_Section):
    """All FlatCake backend settings. Unknown keys are errors (``extra='forbid'``)."""

    node_id: int = Field(0, ge=0, lt=1 << 12, description="GVA node field [59:48]")
    dram: DramConfig = DramConfig()
    ssd: SsdConfig = SsdConfig()
    placement: PlacementConfig = PlacementConfig()
    cio: CioConfig = CioConfig()
    mas: MasConfig = MasConfig()
    cluster: ClusterConfig = ClusterConfig()
    # Sections used only by scripts (replay, benchmarks); the backend ignores them.
    model: Optional[dict[str, Any]] = None
    replay: Optional[dict[str, Any]] = None


def _deep_merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v) if isinstance(v, (dict, list)) else v
    return out


def _undot(over: Mapping[str, Any]) -> dict:
    """``{"ssd.path": x}`` -> ``{"ssd": {"path": x}}``; nested dicts pass through."""
    out: dict = {}
    for key, val in over.items():
        parts = str(key).split(".")
        cur = out
        for p in parts[:-1]:
            nxt = cur.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{key}: conflicts with a non-section value for '{p}'")
            cur = nxt
        if isinstance(val, Mapping) and isinstance(cur.get(parts[-1]), dict):
            for k2, v2 in val.items():
                if k2 in cur[parts[-1]] and cur[parts[-1]][k2] != v2 and not isinstance(v2, Mapping):
                    raise ConfigError(f"{key}.{k2}: given twice with different values")
            cur[parts[-1]] = _deep_merge(cur[parts[-1]], val)
        else:
            if parts[-1] in cur and cur[parts[-1]] != val:
                raise ConfigError(f"{key}: given twice with different values")
            cur[parts[-1]] = val
    return out


def read_yaml(path: str | Path) -> dict:
    """Read one YAML mapping. Raises :class:`ConfigError` naming the file on any problem."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"flatcake_config: file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"flatcake_config: {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"flatcake_config: {p} must hold a mapping at top level")
    return data


def _format_validation_error(err: ValidationError, section: str = "") -> str:
    """One message naming every bad field; ``section`` prefixes the locations of a section
    validated on its own (``SsdConfig.with_paths``)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in ((section,) if section else ()) + tuple(e["loc"])) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        got = e.get("input")
        lines.append(f"{loc}: {msg}" + ("" if isinstance(got, dict) else f" (got {got!r})"))
    return "invalid FlatCake configuration: " + "; ".join(lines)


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> FlatCakeConfig:
    """Build the validated configuration.

    Args:
        path: YAML file; ``None`` uses ``overrides['flatcake_config']`` if present, else
            ``configs/default.yaml`` when it exists, else the built-in defaults.
        overrides: extra-config style mapping (dotted or nested keys); wins over the YAML.

    Returns:
        A frozen :class:`FlatCakeConfig`.

    Raises:
        ConfigError: unknown key, wrong type or out-of-range value; the message names the
            field, e.g. ``cio.gap_bytes: Input should be greater than or equal to 0``.
    """
    over = dict(overrides or {})
    yaml_path = over.pop("flatcake_config", None) or path
    if yaml_path is None and DEFAULT_CONFIG_PATH.exists():
        yaml_path = DEFAULT_CONFIG_PATH
    base = _undot(read_yaml(yaml_path)) if yaml_path is not None else {}
    merged = _deep_merge(base, _undot(over))
    try:
        return FlatCakeConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def config_from_extra(extra_config: Mapping[str, Any] | None) -> FlatCakeConfig:
    """Config from SGLang's extra-config dict: strip SGLang's own keys, then :func:`load_config`."""
    over = {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_RESERVED_KEYS}
    return load_config(None, over)
