"""``flatcake-sglang --direct``: FlatCake as SGLang's direct L3 linker instead of a HiCache backend.

SGLang 0.5.23 links its ``UnifiedRadixCache`` straight to an external KV store with no host tier
(``mem_cache/unified_cache/unified_cache_linker.py``): loads land in device slots layer by layer,
offloads read device pages and carry the inserting request's session id. A third-party linker is
selected with three flags (``arg_groups/fields/memory.py`` 209-235)::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "FlatCakeLinker", "linker_module_path":
                                             "flatcake.linker", "linker_extra_config": {...}}'

:func:`rewrite_direct` writes them. FlatCake's own settings go into ``linker_extra_config``, from
(last wins, as for the HiCache door): ``--flatcake-config FILE.yaml`` (becomes
``"flatcake_config": /abs/path``) and the ``linker_extra_config`` of a user's
``--unified-cache-external-linker-config`` (inline JSON or ``@file``: ``.json``, ``.yaml``,
``.toml``). The FlatCake part is validated with :func:`flatcake.config.config_from_extra` (a bad
key fails here, naming the field), the whole value with SGLang's own
``UnifiedCacheLinkerConfig.from_dict`` when SGLang is importable.

Refused at start-up, naming every conflicting flag at once (SGLang 0.5.23 refuses the same
combinations one at a time in ``arg_groups/hicache_hook.py`` 44-60):

* ``--enable-hierarchical-cache`` and ``--hicache-storage-backend`` (on the command line or in
  SGLang's ``--config`` YAML): the linker replaces HiCache; there is no host tier;
* ``--unified-cache-external-linker-backend`` other than ``dynamic``, and a user config naming
  another ``linker`` / ``linker_module_path``.

The FC-MAS plugin (:mod:`flatcake.adapter.plugin`) drives HiCache's prefetch I/O, which the linker
path does not run: ``--direct`` sets ``FLATCAKE_PLUGIN=off``; the linker orders its own loads.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

from flatcake.adapter.launcher import (BACKEND_FLAG, CONFIG_FLAG, LaunchError, _take_flag, flag_value,
                                       load_extra_config, sglang_view)

DIRECT_FLAG = "--direct"
ENABLE_LINKER_FLAG = "--enable-unified-cache-external-linker"
LINKER_BACKEND_FLAG = "--unified-cache-external-linker-backend"
LINKER_CONFIG_FLAG = "--unified-cache-external-linker-config"
HICACHE_FLAG = "--enable-hierarchical-cache"

#: FlatCake's linker class as SGLang's ``dynamic`` linker backend imports it (``linker_factory.py``)
FLATCAKE_LINKER = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker"}


def hicache_conflicts(argv: Sequence[str]) -> list[str]:
    """The HiCache flags of ``argv`` that ``--direct`` refuses (in the order checked): given on
    the command line (before a bare ``--``), or set as SGLang reads the command line (its parser,
    abbreviations resolved, its ``--config`` YAML merged)."""
    argv = list(argv)
    head = argv[:argv.index("--")] if "--" in argv else argv
    found = []
    ns = sglang_view(argv)
    if HICACHE_FLAG in head or (ns is not None and ns.enable_hierarchical_cache):
        found.append(HICACHE_FLAG)
    from flatcake.adapter.launch_config import effective_backend

    if any(a == BACKEND_FLAG or a.startswith(BACKEND_FLAG + "=") for a in head) or effective_backend(argv) \
            or (ns is not None and ns.hicache_storage_backend is not None):
        found.append(BACKEND_FLAG)
    return found


def _split_linker_flags(argv: Sequence[str]) -> tuple[list[str], Optional[str], Optional[str]]:
    """``argv`` without the three linker flags; the last backend value and config value given."""
    rest, backend, config = [], None, None
    argv = list(argv)
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            rest.extend(argv[i:])
            break
        if argv[i] == ENABLE_LINKER_FLAG:
            i += 1
            continue
        got = _take_flag(argv, i, LINKER_CONFIG_FLAG)
        if got is not None:
            config, i = got
            continue
        got = _take_flag(argv, i, LINKER_BACKEND_FLAG)
        if got is not None:
            backend, i = got
            continue
        rest.append(argv[i])
        i += 1
    return rest, backend, config


def linker_config(user: Optional[str], flatcake_config: Optional[str]) -> dict[str, Any]:
    """The validated ``--unified-cache-external-linker-config`` mapping.

    Args:
        user: the user's ``--unified-cache-external-linker-config`` value (inline JSON or
            ``@file``), or None.
        flatcake_config: the ``--flatcake-config`` value, or None.

    Returns:
        ``{"linker": "FlatCakeLinker", "linker_module_path": "flatcake.linker",
        "linker_extra_config": {...FlatCake keys..., "flatcake_config": /abs/path}}``.

    Raises:
        LaunchError: unreadable or invalid JSON, a ``linker`` / ``linker_module_path`` other than
            FlatCake's, an unknown top-level field, conflicting ``flatcake_config`` sources, or a
            FlatCake setting :func:`flatcake.config.config_from_extra` rejects (field named).
    """
    given: dict[str, Any] = {}
    if user is not None:
        try:
            given = load_extra_config(user)
        except LaunchError as e:
            raise LaunchError(str(e).replace("--hicache-storage-backend-extra-config", LINKER_CONFIG_FLAG)) from None
    for key, value in FLATCAKE_LINKER.items():
        if key in given and given[key] != value:
            raise LaunchError(f"{LINKER_CONFIG_FLAG}: {key}={given[key]!r} conflicts with {DIRECT_FLAG} "
                              f"(which sets {key}={value!r}); remove it")
    unknown = set(given) - set(FLATCAKE_LINKER) - {"linker_extra_config"}
    if unknown:
        raise LaunchError(f"{LINKER_CONFIG_FLAG}: unknown fields {sorted(unknown)} (FlatCake's settings go in "
                          "linker_extra_config)")
    extra = given.get("linker_extra_config") or {}
    if not isinstance(extra, dict):
        raise LaunchError(f"{LINKER_CONFIG_FLAG}: linker_extra_config must be a mapping, got {type(extra).__name__}")
    extra = dict(extra)
    if extra.get("flatcake_config") is not None:
        extra["flatcake_config"] = os.path.abspath(str(extra["flatcake_config"]))
    if flatcake_config is not None:
        path = os.path.abspath(flatcake_config)
        if extra.get("flatcake_config") not in (None, path):
            raise LaunchError(f"{CONFIG_FLAG}: {path} conflicts with flatcake_config={extra['flatcake_config']!r} "
                              f"in {LINKER_CONFIG_FLAG}; give one of them")
        extra["flatcake_config"] = path
    from flatcake.config import ConfigError, config_from_extra

    try:
        config_from_extra(extra)
    except ConfigError as e:
        raise LaunchError(str(e)) from None
    value = {**FLATCAKE_LINKER, "linker_extra_config": extra}
    _sglang_accepts(value)
    return value


def _sglang_accepts(value: dict[str, Any]) -> None:
    """SGLang's own frontend validation of the linker config (``linker_config.py``), when SGLang
    is importable (it imports no backend and no device code)."""
    try:
        from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig
    except ImportError:
        return
    try:
        UnifiedCacheLinkerConfig.from_dict(value)
    except ValueError as e:
        raise LaunchError(str(e)) from None


def rewrite_direct(argv: Sequence[str]) -> list[str]:
    """Rewrite a command line for ``flatcake-sglang --direct`` (``--direct`` already removed).

    Args:
        argv: SGLang's arguments plus the launcher's ``--flatcake-config``.

    Returns:
        ``argv`` without ``--flatcake-config`` and the three linker flags, followed (before a bare
        ``--``, if any) by ``--enable-unified-cache-external-linker
        --unified-cache-external-linker-backend dynamic --unified-cache-external-linker-config
        <JSON>`` (:func:`linker_config`, keys sorted); other arguments keep their order.

    Raises:
        LaunchError: HiCache flags (:func:`hicache_conflicts`, all of them named), a linker backend
            other than ``dynamic``, or as :func:`linker_config`.
    """
    argv = list(argv)
    conflicts = hicache_conflicts(argv)
    if conflicts:
        raise LaunchError(f"{DIRECT_FLAG} links FlatCake to SGLang's radix cache with no host tier; remove "
                          f"{' and '.join(conflicts)} (HiCache) or drop {DIRECT_FLAG}")
    fc_config = flag_value(argv, CONFIG_FLAG)
    rest, i = [], 0
    while i < len(argv):  # drop --flatcake-config (launcher-only)
        if argv[i] == "--":
            rest.extend(argv[i:])
            break
        if argv[i] == CONFIG_FLAG and i + 1 >= len(argv):
            raise LaunchError(f"{CONFIG_FLAG}: expected a value")
        got = _take_flag(argv, i, CONFIG_FLAG)
        if got is not None:
            i = got[1]
            continue
        rest.append(argv[i])
        i += 1
    rest, backend, user = _split_linker_flags(rest)
    if backend is not None and backend != "dynamic":
        raise LaunchError(f"{LINKER_BACKEND_FLAG} {backend}: {DIRECT_FLAG} uses SGLang's 'dynamic' linker backend "
                          "(FlatCakeLinker); remove it")
    value = linker_config(user, fc_config)
    new = [ENABLE_LINKER_FLAG, LINKER_BACKEND_FLAG, "dynamic", LINKER_CONFIG_FLAG, json.dumps(value, sort_keys=True)]
    cut = rest.index("--") if "--" in rest else len(rest)
    return rest[:cut] + new + rest[cut:]
