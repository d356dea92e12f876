"""``flatcake-sglang``: launch an SGLang server with ``--hicache-storage-backend flatcake``.

SGLang 0.5.23 accepts only a fixed list of ``--hicache-storage-backend`` names; third-party
backends are selected with ``dynamic`` plus an extra-config JSON naming module and class
(``../shared/design/sglang-hicache-contract.md`` §2, option 1). This launcher accepts the
literal name and rewrites the command line before SGLang parses it.

Lifecycle::

    argv ──rewrite_argv──▶ merged extra config ──config_from_extra (validate)──▶ argv' (``dynamic``)
         ──▶ runpy.run_module("sglang.launch_server", run_name="__main__") with sys.argv = argv'

Accepted (in any position, each as ``--flag value`` or ``--flag=value``)::

    --hicache-storage-backend flatcake
    --flatcake-config FILE.yaml                  # launcher-only; becomes "flatcake_config": /abs/path
    --hicache-storage-backend-extra-config JSON  # inline JSON, or @file (.json, .yaml/.yml, .toml)
    --dry-run                                    # launcher-only; print argv' as a JSON array, exit 0
    --no-buffer-only                             # launcher-only; keep SGLang's host memory mode
    --no-flatcake-plugin                         # launcher-only; FLATCAKE_PLUGIN=off for SGLang
    --direct                                     # launcher-only; FlatCake as the direct L3 linker

``--direct`` selects SGLang's direct linker (``--enable-unified-cache-external-linker``, backend
``dynamic``, ``FlatCakeLinker``) instead of HiCache, and refuses HiCache flags:
:mod:`flatcake.adapter.launch_direct`.

Serving defaults with the flatcake backend (both can be turned off):

* ``--hicache-host-memory-mode buffer_only`` is appended unless the arguments as SGLang reads
  them (its parser, with its ``--config`` YAML merged) set a host memory mode, ``--no-buffer-only``
  is given, or SGLang would refuse it (:func:`buffer_only_refusal`). In buffer_only the host pool
  is a bounce buffer and FlatCake's DRAM medium is the DRAM tier: the paper's flat design.
* The FC-MAS plugin (:mod:`flatcake.adapter.plugin`) is enabled for the server's processes:
  ``FLATCAKE_PLUGIN=on``, and ``flatcake`` added to ``SGLANG_PLUGINS`` when that whitelist is set
  without it. ``--no-flatcake-plugin`` sets ``FLATCAKE_PLUGIN=off`` instead. A warning is printed
  when the plugin's entry point is not installed (FlatCake not pip-installed).

The rewritten extra config is the user's mapping plus the keys in :data:`FLATCAKE_EXTRA`
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1`` and
``hicache_storage_pass_prefix_keys``); a user value that contradicts one of them is an error.
The FlatCake part is validated with :func:`flatcake.config.config_from_extra` so that a bad
key fails here, naming the field, before SGLang starts any process.

The same keys in SGLang's ``--config`` YAML (``hicache-storage-backend: flatcake``,
``hicache-storage-backend-extra-config``, and the launcher's ``flatcake-config``) are rewritten
the same way into a new YAML file that ``--config`` then names; every other key is kept
(:mod:`flatcake.adapter.launch_config`). Warnings (stderr) when ``--enable-hierarchical-cache``
is not set, or when a ``dynamic`` extra config naming FlatCake lacks
``"hicache_storage_pass_prefix_keys": true`` (placement then cannot see sessions).

Any other backend (``file``, ``dynamic``, ...) passes through byte for byte (``--flatcake-config``
with another backend is an error).

Exit codes: 0 (dry run, or SGLang's own status), 2 (bad FlatCake arguments or configuration;
message on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from flatcake.config import FLATCAKE_EXTRA

BACKEND_FLAG = "--hicache-storage-backend"
EXTRA_FLAG = "--hicache-storage-backend-extra-config"
CONFIG_FLAG = "--flatcake-config"
DRY_RUN_FLAG = "--dry-run"
NO_BUFFER_ONLY_FLAG = "--no-buffer-only"
NO_PLUGIN_FLAG = "--no-flatcake-plugin"
DIRECT_FLAG = "--direct"
HOST_MODE_FLAG = "--hicache-host-memory-mode"
PD_MODE_FLAG = "--disaggregation-mode"
PLUGIN_NAME = "flatcake"
FLATCAKE_BACKEND = "flatcake"

_PROG = "flatcake-sglang"


class LaunchError(ValueError):
    """Bad launcher arguments or FlatCake configuration; the message names the flag or field."""


def _take_flag(argv: list[str], i: int, flag: str) -> Optional[tuple[str, int]]:
    """If ``argv[i]`` is ``flag`` (``--flag value`` or ``--flag=value``), return (value, next index).

    Returns ``None`` when ``argv[i]`` is a different option. Raises :class:`LaunchError` when the
    flag is present but its value is missing.
    """
    arg = argv[i]
    if arg == flag:
        if i + 1 >= len(argv):
            raise LaunchError(f"{flag}: expected a value")
        return argv[i + 1], i + 2
    if arg.startswith(flag + "="):
        return arg[len(flag) + 1 :], i + 1
    return None


def load_extra_config(value: str) -> dict[str, Any]:
    """Parse an extra-config value as SGLang does: inline JSON, or ``@path`` to a JSON/YAML/TOML file.

    Args:
        value: the flag's value.

    Returns:
        The mapping (a fresh dict).

    Raises:
        LaunchError: unreadable file, unsupported extension, invalid syntax, or not a mapping.
    """
    source = "inline JSON"
    try:
        if value.startswith("@"):
            path = Path(value[1:])
            source = str(path)
            ext = path.suffix.lower()
            if ext == ".json":
                data = json.loads(path.read_text())
            elif ext in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(path.read_text())
            elif ext == ".toml":
                import tomllib  # Python >= 3.11, as SGLang itself requires for .toml

                data = tomllib.loads(path.read_text())
            else:
                raise LaunchError(
                    f"{EXTRA_FLAG}: unsupported config file {path} (use .json, .yaml, .yml or .toml)"
                )
        else:
            data = json.loads(value)
    except LaunchError:
        raise
    except OSError as e:
        raise LaunchError(f"{EXTRA_FLAG}: cannot read {source}: {e}") from None
    except Exception as e:  # json/yaml/toml syntax errors have no common base class
        raise LaunchError(f"{EXTRA_FLAG}: {source} is not valid: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise LaunchError(f"{EXTRA_FLAG}: {source} must hold a mapping, got {type(data).__name__}")
    return dict(data)


def merge_extra_config(user: dict[str, Any], flatcake_config: Optional[str]) -> dict[str, Any]:
    """User extra config + :data:`FLATCAKE_EXTRA` (+ ``flatcake_config`` as an absolute path).

    Raises:
        LaunchError: the user set one of the launcher's keys to a different value, or gave a
            ``flatcake_config`` in the JSON that differs from ``--flatcake-config``.
    """
    merged = dict(user)
    for key, val in FLATCAKE_EXTRA.items():
        if key in merged and merged[key] != val:
            raise LaunchError(
                f"{EXTRA_FLAG}: {key}={merged[key]!r} conflicts with --hicache-storage-backend flatcake "
                f"(which sets {key}={val!r}); remove it"
            )
        merged[key] = val
    if "flatcake_config" in merged and merged["flatcake_config"] is not None:
        merged["flatcake_config"] = os.path.abspath(str(merged["flatcake_config"]))
    if flatcake_config is not None:
        path = os.path.abspath(flatcake_config)
        if merged.get("flatcake_config") not in (None, path):
            raise LaunchError(
                f"{CONFIG_FLAG}: {path} conflicts with flatcake_config={merged['flatcake_config']!r} "
                f"in {EXTRA_FLAG}; give one of them"
            )
        merged["flatcake_config"] = path
    return merged


@dataclass
class BackendFlags:
    """The backend flags of a command line, as argparse takes them (the last one wins).

    Attributes:
        rest: the arguments without ``--hicache-storage-backend``, its extra config and
            ``--flatcake-config`` (order kept).
        backend: the last backend name, or None.
        extra_value: the last extra-config value (inline JSON or ``@file``), or None.
        flatcake_config: the last ``--flatcake-config`` value, or None.
        backend_at: index in ``rest`` where the first backend flag stood, or None.
        extra_at: index in ``rest`` where the first extra-config flag stood, or None.
    """

    rest: list[str]
    backend: Optional[str] = None
    extra_value: Optional[str] = None
    flatcake_config: Optional[str] = None
    backend_at: Optional[int] = None
    extra_at: Optional[int] = None


def scan_backend_flags(argv: Sequence[str]) -> Optional[BackendFlags]:
    """Split the backend flags off ``argv`` (each as ``--flag value`` or ``--flag=value``; a bare
    ``--`` ends the options).

    Returns:
        The flags, or None when an SGLang backend flag has no value and the backend is not
        ``flatcake`` (SGLang's parser reports it).

    Raises:
        LaunchError: a flag without value where the backend is ``flatcake``, or a
            ``--flatcake-config`` without value.
    """
    argv = list(argv)
    out = BackendFlags(rest=[])
    i = 0
    while i < len(argv):
        if argv[i] == "--":  # everything after a bare "--" is positional; leave it alone
            out.rest.extend(argv[i:])
            break
        if argv[i] in (BACKEND_FLAG, EXTRA_FLAG) and i + 1 >= len(argv):
            if out.backend == FLATCAKE_BACKEND:
                raise LaunchError(f"{argv[i]}: expected a value")
            return None
        # EXTRA_FLAG starts with BACKEND_FLAG, so test it first; "=" separates exact matches.
        got = _take_flag(argv, i, EXTRA_FLAG)
        if got is not None:
            out.extra_value, i = got
            out.extra_at = len(out.rest) if out.extra_at is None else out.extra_at
            continue
        got = _take_flag(argv, i, CONFIG_FLAG)
        if got is not None:
            out.flatcake_config, i = got
            continue
        got = _take_flag(argv, i, BACKEND_FLAG)
        if got is not None:
            out.backend, i = got
            out.backend_at = len(out.rest) if out.backend_at is None else out.backend_at
            continue
        out.rest.append(argv[i])
        i += 1
    return out


def flatcake_extra(user: Any, flatcake_config: Optional[str]) -> dict[str, Any]:
    """The validated extra config of the ``flatcake`` backend.

    Args:
        user: the user's extra config: None, a mapping (from a ``--config`` YAML), or an
            extra-config string (inline JSON or ``@file``).
        flatcake_config: the ``--flatcake-config`` value, or None.

    Raises:
        LaunchError: as :func:`load_extra_config`, :func:`merge_extra_config` and
            :func:`validate_flatcake_extra`.
    """
    if user is None:
        user = {}
    elif isinstance(user, str):
        user = load_extra_config(user)
    elif not isinstance(user, dict):
        raise LaunchError(f"{EXTRA_FLAG}: must be a mapping, JSON or @file, got {type(user).__name__}")
    merged = merge_extra_config(dict(user), flatcake_config)
    validate_flatcake_extra(merged)
    return merged


def rewrite_argv(argv: Sequence[str]) -> list[str]:
    """Rewrite an SGLang command line that selects ``flatcake`` into one SGLang accepts.

    Args:
        argv: arguments after the program name (launcher-only ``--dry-run`` already removed).

    Returns:
        The new argument list. If the (last, as argparse takes it) ``--hicache-storage-backend``
        is not ``flatcake``, ``argv`` is returned unchanged. Otherwise the backend becomes
        ``dynamic`` at the position of its first occurrence, immediately followed by
        ``--hicache-storage-backend-extra-config <merged JSON>``; other arguments keep their order.
        (Backend keys in SGLang's ``--config`` YAML: :mod:`flatcake.adapter.launch_config`.)

    Raises:
        LaunchError: ``--flatcake-config`` without the flatcake backend, a flag without value,
            an unreadable or invalid extra config, a conflicting key, or a FlatCake setting that
            :func:`flatcake.config.config_from_extra` rejects (message names the field).
    """
    argv = list(argv)
    flags = scan_backend_flags(argv)
    if flags is None:
        return argv
    if flags.backend != FLATCAKE_BACKEND:
        if flags.flatcake_config is not None:
            raise LaunchError(f"{CONFIG_FLAG} needs {BACKEND_FLAG} {FLATCAKE_BACKEND} (got {flags.backend!r})")
        return argv
    merged = flatcake_extra(flags.extra_value, flags.flatcake_config)
    at = flags.backend_at
    new = [BACKEND_FLAG, "dynamic", EXTRA_FLAG, json.dumps(merged, sort_keys=True)]
    return flags.rest[:at] + new + flags.rest[at:]


def validate_flatcake_extra(extra: dict[str, Any]) -> None:
    """Validate the FlatCake part of a merged extra config (SGLang's own keys are skipped).

    Raises:
        LaunchError: wrapping :class:`flatcake.config.ConfigError`, whose message names the
            field (``ssd.bogus: unknown key``); also raised for a missing ``flatcake_config`` file.
    """
    from flatcake.config import ConfigError, config_from_extra

    try:
        config_from_extra(extra)
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The last value given to ``flag`` before a bare ``--`` (as argparse takes it), or None
    (also for a dangling flag without value, which SGLang's parser reports)."""
    argv = list(argv)
    value, i = None, 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == flag and i + 1 >= len(argv):
            break
        got = _take_flag(argv, i, flag)
        if got is None:
            i += 1
        else:
            value, i = got
    return value


def sglang_view(argv: Sequence[str]) -> Optional[argparse.Namespace]:
    """``argv`` as SGLang 0.5.23 will read it: its own parser (abbreviated flags resolved), its
    ``--config`` YAML merged by its ``ConfigArgumentMerger``; ``hicache_host_memory_mode`` is
    None when neither sets it. None when SGLang is not importable or rejects ``argv`` (SGLang
    then reports that itself)."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # noqa: BLE001 - no SGLang here: nothing to ask
        return None
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    for action in parser._actions:  # --model-path is required by SGLang, not by this question
        action.required = False
    parser.set_defaults(hicache_host_memory_mode=None)
    argv = list(argv)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            if "--config" in argv:
                from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

                argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
            ns, _ = parser.parse_known_args(argv)
    except (Exception, SystemExit):  # noqa: BLE001 - argparse exits on errors
        return None
    return ns


def buffer_only_refusal(ns: argparse.Namespace) -> Optional[str]:
    """Why SGLang 0.5.23 would refuse ``buffer_only`` for these arguments, or None. Checked:
    a PD decode instance (``hicache_hook.py`` 290), DCP > 1 with L3 (136-139), a tree cache other
    than the unified radix tree (``registry.py`` 240-250: ``--radix-cache-backend``,
    ``--enable-flexkv``, ``--enable-lmcache``). Not visible here: pure-SWA models and SWA models
    with the ``unified_kv`` layout (``buffer_mode/pipeline.py`` 215), which SGLang refuses at
    start-up — use ``--no-buffer-only`` for those."""
    if getattr(ns, "disaggregation_mode", None) == "decode":
        return f"{PD_MODE_FLAG} decode"
    if (getattr(ns, "dcp_size", 1) or 1) > 1:
        return "--dcp-size > 1"
    for flag in ("radix_cache_backend", "enable_flexkv", "enable_lmcache"):
        if getattr(ns, flag, None):
            return "--" + flag.replace("_", "-")
    return None


def with_buffer_only(argv: Sequence[str]) -> tuple[list[str], str]:
    """Append ``--hicache-host-memory-mode buffer_only`` where FlatCake's default applies.

    Returns:
        (argv', note): argv unchanged when the command line (or SGLang's ``--config`` file) sets
        a host memory mode itself, when SGLang would refuse ``buffer_only``
        (:func:`buffer_only_refusal`), or when SGLang's parser cannot read it; ``note`` says
        which, for the launcher's stderr line.
    """
    argv = list(argv)
    ns = sglang_view(argv)
    if ns is None:
        return argv, "host memory mode left to SGLang (its parser could not read this command line)"
    if ns.hicache_host_memory_mode is not None:
        return argv, f"{HOST_MODE_FLAG} {ns.hicache_host_memory_mode} (as given)"
    refusal = buffer_only_refusal(ns)
    if refusal is not None:
        return argv, f"SGLang's default host memory mode (SGLang refuses buffer_only with {refusal})"
    cut = argv.index("--") if "--" in argv else len(argv)
    return argv[:cut] + [HOST_MODE_FLAG, "buffer_only"] + argv[cut:], (
        f"{HOST_MODE_FLAG} buffer_only (FlatCake's DRAM medium is the DRAM tier: size dram.capacity_bytes; "
        f"{NO_BUFFER_ONLY_FLAG} keeps SGLang's host cache)")


def plugin_environment(environ: dict[str, str], enabled: bool) -> dict[str, str]:
    """The environment variables to set so that SGLang's processes load (or skip) the FC-MAS
    plugin: ``FLATCAKE_PLUGIN`` on/off, and ``SGLANG_PLUGINS`` extended with ``flatcake`` when it
    is a whitelist without it."""
    from flatcake.adapter.plugin import ENV_SWITCH

    if not enabled:
        return {ENV_SWITCH: "off"}
    changes = {ENV_SWITCH: "on"}
    allowed = [x.strip() for x in environ.get("SGLANG_PLUGINS", "").split(",") if x.strip()]
    if allowed and PLUGIN_NAME not in allowed:
        changes["SGLANG_PLUGINS"] = ",".join(allowed + [PLUGIN_NAME])
    return changes


def plugin_installed() -> bool:
    """True when the ``flatcake`` entry point of ``sglang.srt.plugins`` is installed."""
    from importlib.metadata import entry_points

    return any(ep.name == PLUGIN_NAME for ep in entry_points(group="sglang.srt.plugins"))


def _take_switches(head: list[str]) -> tuple[list[str], dict[str, bool]]:
    """Remove the launcher-only switches from ``head``; refuse them with a value."""
    switches = {}
    for flag in (DRY_RUN_FLAG, NO_BUFFER_ONLY_FLAG, NO_PLUGIN_FLAG, DIRECT_FLAG):
        if any(a.startswith(flag + "=") for a in head):
            raise LaunchError(f"{flag} takes no value")
        switches[flag] = flag in head
        head = [a for a in head if a != flag]
    return head, switches


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point (``flatcake-sglang``).

    Args:
        argv: arguments after the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        0 after ``--dry-run`` or when SGLang returns normally; 2 on a launcher error. SGLang's
        own ``SystemExit`` propagates unchanged.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    cut = args.index("--") if "--" in args else len(args)
    written = None
    try:
        head, switches = _take_switches(args[:cut])
        if switches[DIRECT_FLAG]:
            new_argv, env = _direct(head + args[cut:], switches)
        else:
            new_argv, written, env = _hicache(head + args[cut:], switches)
    except LaunchError as e:
        print(f"{_PROG}: error: {e}", file=sys.stderr)
        _remove(written)
        return 2
    except BaseException:
        _remove(written)  # an unexpected fault: no rewritten YAML left behind
        raise
    if switches[DRY_RUN_FLAG]:
        print(json.dumps(new_argv))
        return 0
    os.environ.update(env)
    sys.argv = ["sglang.launch_server", *new_argv]
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
    finally:
        _remove(written)  # SGLang read it in this process, before starting any other
    return 0


def _direct(argv: list[str], switches: dict[str, bool]) -> tuple[list[str], dict[str, str]]:
    """``--direct``: the linker flags (:func:`flatcake.adapter.launch_direct.rewrite_direct`) and
    ``FLATCAKE_PLUGIN=off`` (the plugin drives HiCache's prefetch, which the linker does not run)."""
    from flatcake.adapter.launch_direct import rewrite_direct
    from flatcake.adapter.plugin import ENV_SWITCH

    for flag in (NO_BUFFER_ONLY_FLAG, NO_PLUGIN_FLAG):
        if switches[flag]:
            raise LaunchError(f"{flag} is a HiCache option; {DIRECT_FLAG} has no host tier and no FC-MAS plugin")
    new_argv = rewrite_direct(argv)
    env = {ENV_SWITCH: "off"}
    print(f"{_PROG}: direct L3 linker (FlatCakeLinker); environment "
          + " ".join(f"{k}={v}" for k, v in env.items()), file=sys.stderr)
    return new_argv, env


def _hicache(argv: list[str], switches: dict[str, bool]) -> tuple[list[str], Optional[str], dict[str, str]]:
    """The HiCache door: ``--hicache-storage-backend flatcake`` rewritten (argv', written YAML, env)."""
    from flatcake.adapter.launch_config import effective_backend, launch_warnings, rewrite_command

    written = None
    try:
        new_argv, written = rewrite_command(argv)
        if written is not None:
            print(f"{_PROG}: --config rewritten into {written} (backend keys only)", file=sys.stderr)
        env: dict[str, str] = {}
        if effective_backend(argv) == FLATCAKE_BACKEND:
            if not switches[NO_BUFFER_ONLY_FLAG]:
                new_argv, note = with_buffer_only(new_argv)
                print(f"{_PROG}: {note}", file=sys.stderr)
            env = plugin_environment(dict(os.environ), not switches[NO_PLUGIN_FLAG])
            if not switches[NO_PLUGIN_FLAG] and not plugin_installed():
                print(f"{_PROG}: warning: the flatcake plugin is not installed (pip install FlatCake); "
                      "SGLang keeps its FIFO prefetch I/O", file=sys.stderr)
            print(f"{_PROG}: environment " + " ".join(f"{k}={v}" for k, v in env.items()), file=sys.stderr)
        elif switches[NO_BUFFER_ONLY_FLAG] or switches[NO_PLUGIN_FLAG]:
            raise LaunchError(f"{NO_BUFFER_ONLY_FLAG} and {NO_PLUGIN_FLAG} need {BACKEND_FLAG} {FLATCAKE_BACKEND}")
        for warning in launch_warnings(new_argv):
            print(f"{_PROG}: warning: {warning}", file=sys.stderr)
    except BaseException:
        _remove(written)  # a refused or failed rewrite: no rewritten YAML left behind
        raise
    return new_argv, written, env


def _remove(path: Optional[str]) -> None:
    """Remove the launcher's rewritten ``--config`` YAML, if any (already gone is fine)."""
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


if __name__ == "__main__":  # run the importable module's main: launch_config imports it by name
    from flatcake.adapter.launcher import main as _main

    sys.exit(_main())
