"""Write-time placement (paper Table 2): the policy row by row (the signals the store derives
from SGLang's key chain are tested in tests/gva/test_gva_scopes.py and, through SGLang's
backend interface, in tests/adapter/test_storage_placement.py)."""

import pytest

from flatcake.config import PlacementConfig
from flatcake.gva.address import MEDIUM_DRAM, MEDIUM_SSD
from flatcake.gva.placement import PlacementPolicy, PlacementSignals, ReuseScope

CFG = PlacementConfig(l_agent_tokens=1000, tau_tokens=300, short_reply_tokens=100, shared_refcount=2)


def sig(**kw):
    base = dict(prefix_refcount=1, turn=1, prev_reply_tokens=None, context_tokens=10, reply_tokens=10, dram_full=False)
    base.update(kw)
    return PlacementSignals(**base)


@pytest.mark.parametrize(
    "signals,medium,scope",
    [
        (sig(prefix_refcount=2), MEDIUM_DRAM, ReuseScope.SHARED_PROMPT),
        (sig(turn=2, prev_reply_tokens=99), MEDIUM_DRAM, ReuseScope.SHORT_CHAT),
        (sig(turn=2, prev_reply_tokens=100), MEDIUM_SSD, ReuseScope.ONE_SHOT),  # long previous reply
        (sig(context_tokens=1000), MEDIUM_SSD, ReuseScope.AGENT_SESSION),
        (sig(turn=3, prev_reply_tokens=5, context_tokens=1000), MEDIUM_SSD, ReuseScope.AGENT_SESSION),
        (sig(reply_tokens=300), MEDIUM_SSD, ReuseScope.AGENT_SESSION),
        (sig(turn=1), MEDIUM_SSD, ReuseScope.ONE_SHOT),
        (sig(prefix_refcount=5, dram_full=True), MEDIUM_SSD, ReuseScope.OVERFLOW),
        (sig(turn=2, prev_reply_tokens=1, dram_full=True), MEDIUM_SSD, ReuseScope.OVERFLOW),
        (sig(prefix_refcount=3, context_tokens=5000), MEDIUM_DRAM, ReuseScope.SHARED_PROMPT),
    ],
)
def test_table2_rows(signals, medium, scope):
    d = PlacementPolicy(CFG).decide(signals)
    assert (d.medium, d.scope) == (medium, scope)
