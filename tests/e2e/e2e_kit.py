"""Helpers the real-server tests share: waiting for backups, reading metrics, the storage check."""

from __future__ import annotations

import time
from typing import List

from flatcake.replay.engine import reusable_pages
from flatcake.testing.server import CpuServer, Generation, metric_total


def metric_sum(server: CpuServer, name: str, **labels: str) -> float:
    """The sum of metric ``name`` over the samples whose labels include ``labels``."""
    return metric_total(server.metrics(), name, **labels)


def wait_metric(server: CpuServer, name: str, at_least: float, timeout_s: float = 60.0, **labels: str) -> float:
    """Poll ``/metrics`` until ``name`` (summed over the samples with ``labels``) reaches
    ``at_least``; returns the value.

    FlatCake's metrics refresh when SGLang's scheduler drains ``get_stats()`` (every step, idle
    included), at most once a second: a backup shows within about a second of its write.

    Raises:
        AssertionError: not reached within ``timeout_s`` (the message holds the last value).
    """
    deadline = time.monotonic() + timeout_s
    value = 0.0
    while time.monotonic() < deadline:
        value = metric_sum(server, name, **labels)
        if value >= at_least:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{name} = {value} < {at_least} after {timeout_s} s\n{server.log_tail(20)}")


def full_page_tokens(prompt_tokens: int, page_size: int) -> int:
    """Tokens of the full pages SGLang can serve from a cache for a prompt of ``prompt_tokens``
    (it matches at most ``prompt_tokens - 1`` tokens, in whole pages)."""
    return reusable_pages(prompt_tokens // page_size, prompt_tokens, page_size) * page_size


def assert_from_storage(g: Generation, page: int, expected: List[int], what: str = "") -> None:
    """After a flush (or eviction from both tiers): every full page of the prompt from storage,
    nothing from device or host, and the reference tokens."""
    stored = full_page_tokens(g.prompt_tokens, page)
    assert (g.device_tokens, g.host_tokens, g.storage_tokens) == (0, 0, stored), f"{what}: {g.meta}"
    assert g.cached_tokens == stored, f"{what}: {g.meta}"
    assert g.output_ids == expected, f"{what}: tokens differ from the transformers reference"


def backup_flush_again(server: CpuServer, ids: List[int], expected: List[int], page: int) -> Generation:
    """The storage round trip: the prompt computed (reference tokens, nothing from storage), its
    full pages indexed by FlatCake, ``/flush_cache``, the prompt again: every full page from
    storage with the reference tokens (:func:`assert_from_storage`). Returns the second answer."""
    first = server.generate(ids)
    assert first.output_ids == expected
    assert first.storage_tokens == 0
    wait_metric(server, "flatcake_pages_indexed", full_page_tokens(len(ids), page) // page)
    server.flush()
    again = server.generate(ids)
    assert_from_storage(again, page, expected, "after /flush_cache")
    return again
