"""Backend keys in SGLang's ``--config`` YAML, and the launcher's warnings.

SGLang 0.5.23 (``server_args.prepare_server_args`` + ``utils/server_args_config_parser.py``,
``ConfigArgumentMerger``) reads ``--config FILE`` (exactly that token, given once; the file
must end in ``.yaml``/``.yml``) with ``yaml.safe_load`` and turns each top-level key ``K`` into
``--K value`` in front of the command line, so the command line wins over the file; a mapping
value becomes its JSON. A key therefore names a flag only when ``--K`` is the flag: the keys
``hicache-storage-backend``, ``hicache-storage-backend-extra-config`` and the launcher's own
``flatcake-config`` (underscore spellings are not flags to SGLang either).

:func:`rewrite_command` rewrites those keys the way :func:`flatcake.adapter.launcher.rewrite_argv`
rewrites the flags: when the backend in effect (command line first, then the file) is
``flatcake``, the file's backend key becomes ``dynamic``, its extra-config key the merged and
validated mapping, and ``flatcake-config`` is folded into it; every other key is kept as it was
(same value; comments are not kept). The result is written to a new YAML file
(``flatcake-sglang-*.yaml`` in the temporary directory) and ``--config`` points to it; backend
flags on the command line get the same merged value, so which one SGLang reads does not matter.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from flatcake.adapter.launcher import (BACKEND_FLAG, CONFIG_FLAG, EXTRA_FLAG, FLATCAKE_BACKEND, LaunchError,
                                       flatcake_extra, load_extra_config, rewrite_argv, scan_backend_flags,
                                       sglang_view)

SGLANG_CONFIG_FLAG = "--config"
_FLAGS = (BACKEND_FLAG, EXTRA_FLAG, CONFIG_FLAG)


@dataclass
class ServerConfig:
    """SGLang's ``--config`` YAML as SGLang reads it.

    Attributes:
        path: the file named after ``--config``.
        data: its top-level mapping.
        keys: for each of the launcher's flags found in it, the key spelling used.
    """

    path: str
    data: dict
    keys: dict

    def value(self, flag: str) -> Any:
        """The file's value for ``flag`` (None when absent)."""
        return self.data.get(self.keys[flag]) if flag in self.keys else None


def load_server_config(argv: Sequence[str]) -> Optional[ServerConfig]:
    """The ``--config`` YAML of ``argv``, or None when there is none or SGLang would refuse it
    (given twice, no path, not ``.yaml``/``.yml``, unreadable or not UTF-8, not a mapping:
    SGLang then reports it)."""
    argv = list(argv)
    at = [i for i, a in enumerate(argv) if a == SGLANG_CONFIG_FLAG]
    if len(at) != 1 or at[0] + 1 >= len(argv):
        return None
    path = argv[at[0] + 1]
    if Path(path).suffix.lower() not in (".yaml", ".yml"):
        return None
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):  # ValueError: not UTF-8 (UnicodeDecodeError)
        return None
    data = {} if data is None else data
    if not isinstance(data, dict):
        return None
    keys = {"--" + str(k): k for k in data if "--" + str(k) in _FLAGS}
    return ServerConfig(path, data, keys)


def effective_backend(argv: Sequence[str]) -> Optional[str]:
    """The storage backend SGLang will use: the command line's last ``--hicache-storage-backend``,
    else the ``--config`` file's key, else None."""
    flags = scan_backend_flags(argv)
    if flags is not None and flags.backend is not None:
        return flags.backend
    sc = load_server_config(argv)
    value = sc.value(BACKEND_FLAG) if sc is not None else None
    return None if value is None else str(value)


def _write_yaml(data: dict) -> str:
    fd, path = tempfile.mkstemp(prefix="flatcake-sglang-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def _rewritten_data(sc: ServerConfig, flatcake: bool, merged: Optional[dict]) -> dict:
    """The file's mapping with the launcher's keys rewritten (order kept)."""
    out = {}
    for key, value in sc.data.items():
        flag = "--" + str(key)
        if flag == CONFIG_FLAG:
            continue  # folded into the extra config
        if flag == BACKEND_FLAG and str(value) == FLATCAKE_BACKEND:
            if not flatcake:
                continue  # the command line names another backend and wins
            value = "dynamic"
        elif flag == EXTRA_FLAG and flatcake:
            value = merged
        out[key] = value
    if flatcake and BACKEND_FLAG in sc.keys and EXTRA_FLAG not in sc.keys:
        out["hicache-storage-backend-extra-config"] = merged
    return out


def rewrite_command(argv: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """Rewrite the backend flags of ``argv`` and of its ``--config`` YAML.

    Args:
        argv: arguments after the program name (launcher switches removed).

    Returns:
        ``(argv', written)``: ``written`` is the path of the rewritten YAML (``argv'`` names it
        after ``--config``), or None when the file needs no rewrite (``argv'`` is then
        :func:`~flatcake.adapter.launcher.rewrite_argv` of ``argv``).

    Raises:
        LaunchError: as :func:`~flatcake.adapter.launcher.rewrite_argv`; also a
            ``flatcake-config`` key in the file while the backend in effect is not ``flatcake``
            (the message names the file and key).
    """
    argv = list(argv)
    sc = load_server_config(argv)
    cli = scan_backend_flags(argv)
    if sc is None or cli is None or not sc.keys:
        return rewrite_argv(argv), None
    backend = cli.backend if cli.backend is not None else str(sc.value(BACKEND_FLAG))
    flatcake = backend == FLATCAKE_BACKEND
    if not (flatcake or CONFIG_FLAG in sc.keys or str(sc.value(BACKEND_FLAG)) == FLATCAKE_BACKEND):
        return rewrite_argv(argv), None
    if not flatcake and (CONFIG_FLAG in sc.keys or cli.flatcake_config is not None):
        raise LaunchError(f"{SGLANG_CONFIG_FLAG} {sc.path}: {sc.keys.get(CONFIG_FLAG, CONFIG_FLAG)} needs "
                          f"{BACKEND_FLAG} {FLATCAKE_BACKEND} (got {backend!r})")
    merged = None
    if flatcake:
        user = cli.extra_value if cli.extra_value is not None else sc.value(EXTRA_FLAG)
        fc_config = cli.flatcake_config if cli.flatcake_config is not None else sc.value(CONFIG_FLAG)
        merged = flatcake_extra(user, None if fc_config is None else str(fc_config))
    written = _write_yaml(_rewritten_data(sc, flatcake, merged))
    rest = list(cli.rest) if flatcake else list(argv)
    rest[rest.index(SGLANG_CONFIG_FLAG) + 1] = written
    if flatcake:
        text = json.dumps(merged, sort_keys=True)
        if cli.backend_at is not None:
            rest[cli.backend_at:cli.backend_at] = [BACKEND_FLAG, "dynamic", EXTRA_FLAG, text]
        elif cli.extra_at is not None:
            rest[cli.extra_at:cli.extra_at] = [EXTRA_FLAG, text]
    return rest, written


def _names_flatcake(extra: dict) -> bool:
    """True when a ``dynamic`` extra config selects FlatCake's backend class."""
    return str(extra.get("class_name")) == "FlatCakeStorage" and str(extra.get("module_path", "")).split(".")[0] == "flatcake"


def _dynamic_extra(argv: Sequence[str]) -> dict:
    """The extra config in effect (command line, else ``--config`` file) as a mapping; {} when
    absent or unreadable (SGLang reports that)."""
    flags = scan_backend_flags(argv)
    value: Any = flags.extra_value if flags is not None else None
    if value is None:
        sc = load_server_config(argv)
        value = sc.value(EXTRA_FLAG) if sc is not None else None
    if isinstance(value, dict):
        return value
    try:
        return load_extra_config(value) if isinstance(value, str) else {}
    except LaunchError:
        return {}


def launch_warnings(argv: Sequence[str]) -> list[str]:
    """Warnings for a command line that SGLang will run with FlatCake as its L3 backend.

    Args:
        argv: the final (rewritten) arguments.

    Returns:
        Messages (possibly none): ``--enable-hierarchical-cache`` not set (SGLang then builds
        no host pool and never calls the backend; a PD decode instance with
        ``--disaggregation-decode-enable-offload-kvcache`` is exempt), and, for the ``dynamic``
        form naming FlatCake, ``hicache_storage_pass_prefix_keys`` not true (placement then
        cannot see sessions). Empty when the backend in effect is not FlatCake's.
    """
    backend = effective_backend(argv)
    if backend not in ("dynamic", FLATCAKE_BACKEND):
        return []
    extra = _dynamic_extra(argv)
    if backend == "dynamic" and not _names_flatcake(extra):
        return []
    out = []
    if extra.get("hicache_storage_pass_prefix_keys") is not True:
        out.append("hicache_storage_pass_prefix_keys is not true in the extra config: SGLang passes FlatCake no "
                   "prefix keys and write-time placement cannot see sessions; add "
                   '"hicache_storage_pass_prefix_keys": true')
    ns = sglang_view(argv)
    if ns is not None and not ns.enable_hierarchical_cache and not getattr(
            ns, "disaggregation_decode_enable_offload_kvcache", False):
        out.append("--enable-hierarchical-cache is not set: SGLang ignores --hicache-storage-backend without it "
                   "and FlatCake is never used")
    return out
