"""Page keys as SGLang would produce them, from a trace's block ids.

SGLang keys an L3 page by a 64-hex SHA-256 chained on the previous page's key
(``get_hash_str(page_tokens, prior_hash)``: digest = SHA-256(prior digest ‖ page tokens)). A
trace gives block ids, not tokens, so each page's *token content* is stood in for by a
deterministic payload naming its block: ``"<namespace>/<block id>/<page within block>"``. The
chaining is SGLang's: ``key_0 = sha256(payload_0)``, ``key_i = sha256(bytes(key_{i-1}) ‖
payload_i)``. So two requests share page keys exactly as long as they share block ids from the
start; a different namespace (WEKA conversation) gives different keys for the same local id.

Block → page mapping (``B`` tokens per block, ``P = page_size`` tokens per page):

* ``B % P == 0``: each block becomes ``B / P`` pages (a 512-token Mooncake block = 8 pages of 64).
* ``P % B == 0``: each page covers ``P / B`` consecutive blocks (payload names the last one,
  which, being a chained id, stands for all of them); a trailing group shorter than a page is
  dropped.

A request's trailing tokens that do not fill a whole block (Mooncake's partial last block:
``prompt_tokens < len(block_ids) * B``) are dropped from the page list, since SGLang never stores
partial pages; they are still counted as prompt tokens to compute.
"""

from __future__ import annotations

import hashlib
from typing import Optional

from flatcake.replay.traces import TraceRequest


class PageKeyer:
    """Chained page keys for trace requests, memoised on (previous key, block id).

    Args:
        page_size: tokens per SGLang page.
    """

    def __init__(self, page_size: int):
        if page_size <= 0:
            raise ValueError("page_size must be positive")
        self.page_size = int(page_size)
        self._memo: dict[tuple[Optional[str], str, int], tuple[str, ...]] = {}

    def full_blocks(self, req: TraceRequest) -> int:
        """Number of leading blocks that are whole (the partial last block is excluded)."""
        n = len(req.block_ids)
        if n and req.prompt_tokens < n * req.block_tokens:
            n = max(0, req.prompt_tokens // req.block_tokens)
        return n

    def keys(self, req: TraceRequest) -> list[str]:
        """Page keys of ``req``'s prompt (whole pages only), in order; each 64 hex chars."""
        B, P = req.block_tokens, self.page_size
        ids = req.block_ids[: self.full_blocks(req)]
        ns = req.namespace
        out: list[str] = []
        prev: Optional[str] = None
        if B % P == 0:
            per = B // P
            for bid in ids:
                memo_key = (prev, ns, bid)
                ks = self._memo.get(memo_key)
                if ks is None:
                    ks = _chain(prev, [f"{ns}/{bid}/{j}" for j in range(per)])
                    self._memo[memo_key] = ks
                out.extend(ks)
                prev = ks[-1]
        elif P % B == 0:
            group = P // B
            for g in range(0, len(ids) - group + 1, group):
                bid = ids[g + group - 1]
                memo_key = (prev, ns, bid)
                ks = self._memo.get(memo_key)
                if ks is None:
                    ks = _chain(prev, [f"{ns}/{bid}/g{group}"])
                    self._memo[memo_key] = ks
                out.extend(ks)
                prev = ks[-1]
        else:
            raise ValueError(f"page_size {P} and block size {B} tokens must divide one another")
        return out


def _chain(prev: Optional[str], payloads: list[str]) -> tuple[str, ...]:
    out = []
    for p in payloads:
        h = hashlib.sha256()
        if prev is not None:
            h.update(bytes.fromhex(prev))
        h.update(p.encode())
        prev = h.hexdigest()
        out.append(prev)
    return tuple(out)
