"""FC-MAS: medium-aware scheduling of requests by where their cached KV lives (paper §3.2).

See :mod:`flatcake.mas.scheduler`.
"""

from flatcake.mas.scheduler import (
    SSD_BOUNDARY,
    Dispatch,
    MasRequest,
    MediumAwareScheduler,
    QueueKind,
    RestoreStart,
    hrrn_priority,
)

__all__ = [
    "SSD_BOUNDARY",
    "Dispatch",
    "MasRequest",
    "MediumAwareScheduler",
    "QueueKind",
    "RestoreStart",
    "hrrn_priority",
]
