"""Pool identity: which SSD pool one FlatCake process (one rank of one SGLang server) owns.

A pool is named ``fc-<digest(namespace|instance)>`` (:func:`flatcake.media.pool_dir.pool_prefix`)
and has one writer, held by an exclusive ``flock`` on its ``.lock`` file. The namespace
(:func:`flatcake.adapter.storage.make_namespace`) separates models, TP/PP/CP ranks, page sizes,
dtypes and layouts; the *instance* computed here separates processes whose namespaces are equal:

* **DP rank** ``dp{n}``: SGLang's ``HiCacheStorageConfig.dp_rank`` (the attention-DP rank), or,
  without DP attention — where SGLang passes 0 to every ``--dp-size`` replica — the replica
  index its data-parallel controller gave the process (``runtime_context.get_parallel().dp_rank``,
  :func:`sglang_replica`). Stable across restarts, shared by the TP ranks of one replica.
* **Slot** ``-s{k}`` (``k > 0``; slot 0 adds nothing, so a lone server keeps the pool name it
  always had): a writer takes the lowest-numbered slot whose pool no live process holds, so
  several servers of the same model on one ``ssd.path`` (or several ``sglang.Engine``\\ s) each get
  their own pool instead of failing on the lock. The lock is a ``flock``, so a crashed process
  frees its slot. A restarted process takes the lowest free slot again: its own pool when the
  others kept theirs, otherwise a sibling's. Either is valid warm data: a slot only ever holds
  pages of this namespace — the same model, ranks, dtype, page size and layout — and a page is
  found by its key (a hash of the token prefix), so a sibling's pages are exactly the KV this
  process would have computed. (A server that wants the same pool whatever the start order sets
  ``ssd.pool_id``.)
* **``ssd.pool_id``** (``-id={name}``): a fixed name instead of a slot. Two processes with the same
  ``pool_id``, namespace and DP rank collide, and the second fails at start-up naming
  ``ssd.pool_id``.

Why not the CUDA device index: it is stable and unique per replica, but an MLA follower rank sits
on another device than its writer rank (the pair must agree on one pool), device numbers are
relative to ``CUDA_VISIBLE_DEVICES``, and CPU processes have none.

MLA follower ranks (:mod:`flatcake.gva.mirror`) open their writer's pool read-only and take no
lock; the writer records its :func:`group_key` (the server it belongs to) in its lock file
(:func:`flatcake.media.pool_dir.write_lock_tag`), and a follower takes the lowest slot whose live
writer has its own group key, waiting for it to appear for up to :data:`FOLLOWER_WAIT_S`
(however long its writer's start-up takes: a large journal replay; a log line every
:data:`FOLLOWER_LOG_EVERY_S` while it waits). A follower never reads another server's pool: when
no writer of its group appears, it opens no pool (:data:`UNIDENTIFIED_SLOT`: every lookup a
miss) and says so in an ERROR and in its start-up line.

``ssd.path`` templates: ``{tp_rank}``, ``{pp_rank}``, ``{dp_rank}`` in each entry are filled per
rank before the directory is created (:func:`expand_ssd_paths`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Optional

from flatcake.config import ConfigError, FlatCakeConfig, path_placeholders
from flatcake.media import pool_dir
from flatcake.media.errors import SsdStartupError

log = logging.getLogger("flatcake")

#: slots a writer tries before giving up (processes of one namespace and DP rank per directory)
MAX_SLOTS = 64

#: seconds an MLA follower rank waits at start-up for the live writer of its own group (its
#: server's writer rank) to appear; then it opens no pool (:data:`UNIDENTIFIED_SLOT`). Waiting
#: cannot deadlock SGLang: every rank builds its storage backend before the controller's first
#: collective, and the writer records its group once its pool is open.
FOLLOWER_WAIT_S = 300.0
#: seconds between two "still waiting for its writer" log lines of a follower
FOLLOWER_LOG_EVERY_S = 10.0
#: the slot of a follower that found no writer of its group: a pool name no writer uses, so the
#: follower reads nothing (every lookup a miss) instead of another server's pool
UNIDENTIFIED_SLOT = -1

_POLL_S = 0.05


@dataclass(frozen=True)
class PoolIdentity:
    """The identity of one process's pool.

    Attributes:
        base: ``dp{n}``, plus ``-id={ssd.pool_id}`` when set.
        slot: the slot number (0 with ``ssd.pool_id``).
        explicit: whether ``ssd.pool_id`` named the pool.
    """

    base: str
    slot: int = 0
    explicit: bool = False

    @property
    def instance(self) -> str:
        """The pool-name component (:class:`flatcake.media.ssd.SsdFilePool`'s ``instance``);
        ``{base}-unidentified-{pid}`` for :data:`UNIDENTIFIED_SLOT` (no pool has that name)."""
        if self.slot == UNIDENTIFIED_SLOT:
            return f"{self.base}-unidentified-{os.getpid()}"
        return self.base if self.slot == 0 else f"{self.base}-s{self.slot}"

    @property
    def identified(self) -> bool:
        """False for a follower that found no writer of its server (it serves misses)."""
        return self.slot != UNIDENTIFIED_SLOT

    def describe(self) -> str:
        """For the start-up line: ``dp0 slot 1``, ``dp0-id=a (ssd.pool_id)`` or ``dp0 (no writer
        of this server found: misses)``."""
        if not self.identified:
            return f"{self.base} (no writer of this server found: misses)"
        return f"{self.base} (ssd.pool_id)" if self.explicit else f"{self.base} slot {self.slot}"


def sglang_replica() -> Optional[int]:
    """The data-parallel replica SGLang's controller spawned this process for
    (``runtime_context.get_parallel().dp_rank``), or None: no DP controller, or not inside an
    SGLang server."""
    try:
        from sglang.srt.runtime_context import get_parallel

        r = get_parallel().dp_rank
    except Exception:  # noqa: BLE001 - not published: no SGLang server in this process
        return None
    return r if isinstance(r, int) and not isinstance(r, bool) else None


def group_key() -> str:
    """What the TP ranks of one server share and other servers do not: SGLang's
    ``dist_init_addr`` when set (a server spread over hosts), else this host's name and the
    parent process id (SGLang spawns all scheduler ranks of a replica from one process)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        addr = get_server_args().dist_init_addr
    except Exception:  # noqa: BLE001 - not inside an SGLang server
        addr = None
    if addr:
        return f"dist={addr}"
    return f"host={socket.gethostname()}/ppid={os.getppid()}"


def dp_rank_of(sc, replica: Optional[int]) -> int:
    """The DP rank in pool names and ``{dp_rank}``: ``sc.dp_rank`` (attention DP) when non-zero,
    else the replica index (0 when there is none)."""
    dp = int(getattr(sc, "dp_rank", 0) or 0) if sc is not None else 0
    return dp or (replica or 0)


def rank_values(sc, replica: Optional[int]) -> dict:
    """Values of the ``ssd.path`` placeholders for this rank. For MLA (KV replicated over TP
    ranks, one writer per DCP shard) ``tp_rank`` is the writer's rank (``dcp_rank``; 0 without
    DCP), so follower ranks look where their writer writes."""
    if sc is None:
        return {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
    tp = int(getattr(sc, "dcp_rank", 0) or 0) if sc.is_mla_model else sc.tp_rank
    return {"tp_rank": tp, "pp_rank": sc.pp_rank, "dp_rank": dp_rank_of(sc, replica)}


def expand_ssd_paths(cfg: FlatCakeConfig, values: dict) -> FlatCakeConfig:
    """``cfg`` with the placeholders of every ``ssd.path`` entry filled from ``values``
    (:func:`rank_values`); ``cfg`` itself when no entry has one.

    Raises:
        ConfigError: a bad template, or two entries that become the same directory (names
            ``ssd.path``).
    """
    paths = cfg.ssd.paths
    try:
        if not any(path_placeholders(p) for p in paths):
            return cfg
        expanded = [p.format(**values) for p in paths]
    except (ValueError, KeyError, IndexError) as e:
        raise ConfigError(f"ssd.path: {e}") from None
    return cfg.model_copy(update={"ssd": cfg.ssd.with_paths(expanded)})


def rank_port_offset(sc, values: dict) -> int:
    """This rank's offset from ``cluster.advertise``'s port: ``(dp_rank * pp_size + pp_rank) *
    tp_size + tp_rank`` with the ranks of :func:`rank_values` (0 without an SGLang config), so
    the TP/PP/DP ranks of one server, each a FlatCake with its own data plane, listen on distinct
    ports of one host (docs/cluster.md, "Backend wiring")."""
    if sc is None:
        return 0
    tp_size, pp_size = max(1, int(sc.tp_size or 1)), max(1, int(sc.pp_size or 1))
    return (values["dp_rank"] * pp_size + values["pp_rank"]) * tp_size + values["tp_rank"]


def expand_advertise(cfg: FlatCakeConfig, offset: int) -> FlatCakeConfig:
    """``cfg`` with ``cluster.advertise``'s port raised by ``offset`` (:func:`rank_port_offset`);
    ``cfg`` itself when the offset is 0 or no address is set.

    Raises:
        ConfigError: the port would pass 65535 (names ``cluster.advertise``).
    """
    adv = cfg.cluster.advertise
    if not offset or not adv:
        return cfg
    host, _, port = adv.rpartition(":")
    new_port = int(port) + offset
    if new_port > 65535:
        raise ConfigError(f"cluster.advertise: port {port} + rank offset {offset} is above 65535; "
                          "choose a lower base port")
    return cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"advertise": f"{host}:{new_port}"})})


def base_identity(sc, cfg: FlatCakeConfig, replica: Optional[int]) -> PoolIdentity:
    """Slot 0 of this process's identity (``ssd.pool_id`` when set)."""
    base = f"dp{dp_rank_of(sc, replica)}"
    if cfg.ssd.pool_id:
        return PoolIdentity(f"{base}-id={cfg.ssd.pool_id}", 0, True)
    return PoolIdentity(base)


def open_writer(open_store, cfg: FlatCakeConfig, namespace: str, ident: PoolIdentity, group: str):
    """Open the pool of the lowest free slot (``ssd.pool_id``: its one pool) as its writer.

    Args:
        open_store: ``instance -> PageStore`` (raises :class:`~flatcake.media.pool_dir.PoolInUse`
            when another process holds that pool).
        cfg: the configuration (``ssd.path`` expanded).
        namespace: the pool namespace.
        ident: :func:`base_identity`.
        group: :func:`group_key`, recorded in the lock file for the follower ranks.

    Returns:
        ``(store, identity)``.

    Raises:
        SsdStartupError: the ``ssd.pool_id`` pool is held by another process (names
            ``ssd.pool_id``), or all :data:`MAX_SLOTS` slots are (names ``ssd.path``).
    """
    directory = cfg.ssd.path
    for slot in range(1 if ident.explicit else MAX_SLOTS):
        cand = PoolIdentity(ident.base, slot, ident.explicit)
        if not ident.explicit and pool_dir.is_live(directory, pool_dir.pool_prefix(namespace, cand.instance)):
            continue
        try:
            store = open_store(cand.instance)
        except pool_dir.PoolInUse as e:
            if ident.explicit:
                raise SsdStartupError(f"ssd.pool_id {cfg.ssd.pool_id!r}: {e}") from None
            continue  # taken between the probe and the lock: try the next slot
        try:
            pool_dir.write_lock_tag(directory, store.ssd.prefix, group)
        except OSError as e:
            store.errors("pool lock tag", e)
        if slot:
            log.info("flatcake: pool slot %d of %s in %s (slots below it are held by other processes)",
                     slot, ident.base, directory)
        return store, cand
    raise SsdStartupError(f"ssd.path {directory!r}: all {MAX_SLOTS} pool slots of this namespace and DP rank "
                          "are held by other FlatCake processes; give servers their own ssd.path")


def find_writer_slot(directory: str, namespace: str, ident: PoolIdentity, group: str, wait_s: float) -> Optional[int]:
    """The slot of the live writer pool whose lock records ``group`` (an MLA follower's own
    server), polling every 50 ms for up to ``wait_s`` seconds and logging every
    :data:`FOLLOWER_LOG_EVERY_S` while none has appeared; ``None`` when none appeared (the
    follower must then read no pool: slot 0 may be another server's)."""
    start = last_log = time.monotonic()
    while True:
        present = pool_dir.scan(directory)
        for slot in range(MAX_SLOTS):
            prefix = pool_dir.pool_prefix(namespace, PoolIdentity(ident.base, slot).instance)
            if prefix in present and pool_dir.is_live(directory, prefix) and pool_dir.read_lock_tag(directory, prefix) == group:
                return slot
        now = time.monotonic()
        if now - start >= wait_s:
            return None
        if now - last_log >= FOLLOWER_LOG_EVERY_S:
            last_log = now
            log.info("flatcake: follower rank (%s) waiting %.0f s so far for its writer rank's pool in %s "
                     "(group %s)", ident.base, now - start, directory, group)
        time.sleep(_POLL_S)


def open_pool(open_store, cfg: FlatCakeConfig, namespace: str, ident: PoolIdentity, role: str,
              group: Optional[str] = None):
    """Open this process's pool: a writer (``single``/``writer``) takes a slot
    (:func:`open_writer`); a ``follower`` finds its writer's (:func:`find_writer_slot`).

    Returns:
        ``(store, identity)``.

    Raises:
        SsdStartupError: see :func:`open_writer`.
    """
    group = group_key() if group is None else group
    if role != "follower":
        return open_writer(open_store, cfg, namespace, ident, group)
    if not ident.explicit:
        slot = find_writer_slot(cfg.ssd.path, namespace, ident, group, FOLLOWER_WAIT_S)
        if slot is None:
            log.error("flatcake: follower rank (%s) found no writer pool of its server (group %s) in %s after %.0f s; "
                      "it reads no pool and answers every lookup with a miss (never another server's pool). "
                      "Set ssd.pool_id on every rank to name the pool", ident.base, group, cfg.ssd.path,
                      FOLLOWER_WAIT_S)
            slot = UNIDENTIFIED_SLOT
        ident = PoolIdentity(ident.base, slot)
    return open_store(ident.instance), ident
