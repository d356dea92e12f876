"""Helpers the real-server tests share: waiting for backups, reading FlatCake's metrics."""

from __future__ import annotations

import time
from typing import Callable

from flatcake.testing.server import CpuServer, metric_values


def metric_sum(server: CpuServer, name: str, where: Callable[[str], bool] = lambda labels: True) -> float:
    """The sum of metric ``name`` over the samples whose label text passes ``where``."""
    return sum(v for labels, v in metric_values(server.metrics(), name) if where(labels))


def wait_metric(server: CpuServer, name: str, at_least: float, timeout_s: float = 60.0,
                where: Callable[[str], bool] = lambda labels: True) -> float:
    """Poll ``/metrics`` until ``name`` (summed) reaches ``at_least``; returns the value.

    FlatCake's metrics refresh when SGLang's scheduler drains ``get_stats()`` (every step, idle
    included), at most once a second: a backup shows within about a second of its write.

    Raises:
        AssertionError: not reached within ``timeout_s`` (the message holds the last value).
    """
    deadline = time.monotonic() + timeout_s
    value = 0.0
    while time.monotonic() < deadline:
        value = metric_sum(server, name, where)
        if value >= at_least:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{name} = {value} < {at_least} after {timeout_s} s\n{server.log_tail(20)}")


def full_page_tokens(prompt_tokens: int, page_size: int) -> int:
    """Tokens of the full pages SGLang can serve from a cache for a prompt of ``prompt_tokens``
    (it matches at most ``prompt_tokens - 1`` tokens, in whole pages)."""
    return (prompt_tokens - 1) // page_size * page_size
