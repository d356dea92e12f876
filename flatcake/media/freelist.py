"""Free byte ranges of one SSD pool file (the extent allocator's bookkeeping, paper §3.1).

Ranges are kept as two sorted parallel lists (starts, lengths) and coalesced when given back,
so whole-scope reclaim merges neighbouring holes into one range again.
"""

from __future__ import annotations

import bisect


class FreeRanges:
    """Free byte ranges of one file: sorted starts + lengths, coalesced on give."""

    def __init__(self, nbytes: int, empty: bool = False):
        self.starts = [] if empty else [0]
        self.lens = [] if empty else [nbytes]

    def best_fit(self, n: int) -> tuple[int, int] | None:
        """``(start, length)`` of the smallest free range of at least ``n`` bytes (lowest
        address on ties), or None."""
        best = None
        for s, ln in zip(self.starts, self.lens):
            if ln >= n and (best is None or ln < best[1]):
                best = (s, ln)
                if ln == n:
                    break
        return best

    def largest(self) -> int:
        """Length of the largest free range (0 if none)."""
        return max(self.lens, default=0)

    def take(self, start: int, n: int) -> bool:
        """Mark ``[start, start + n)`` used; False (and nothing changed) unless all of it is free."""
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0:
            return False
        s, ln = self.starts[i], self.lens[i]
        if not (s <= start and start + n <= s + ln):
            return False
        del self.starts[i], self.lens[i]
        if start + n < s + ln:
            self.starts.insert(i, start + n)
            self.lens.insert(i, s + ln - start - n)
        if start > s:
            self.starts.insert(i, s)
            self.lens.insert(i, start - s)
        return True

    def free_at(self, start: int) -> int:
        """Length of the free range beginning exactly at ``start`` (0 if none)."""
        i = bisect.bisect_left(self.starts, start)
        return self.lens[i] if i < len(self.starts) and self.starts[i] == start else 0

    def give(self, start: int, n: int) -> None:
        """Mark ``[start, start + n)`` free, merging with its neighbours."""
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.lens.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:  # merge right
            self.lens[i] += self.lens.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lens[i - 1] == start:  # merge left
            self.lens[i - 1] += self.lens.pop(i)
            self.starts.pop(i)

    def fits_with(self, n: int, extra: "list[tuple[int, int]] | tuple" = ()) -> bool:
        """Whether a free run of ``n`` bytes exists once the ``(start, length)`` ranges in
        ``extra`` (used now, about to be freed) are free too (admission before eviction)."""
        run_start, run_end = None, None
        for s, ln in sorted(list(zip(self.starts, self.lens)) + list(extra)):
            if run_end is not None and s == run_end:
                run_end = s + ln
            else:
                run_start, run_end = s, s + ln
            if run_end - run_start >= n:
                return True
        return False

    @property
    def free_bytes(self) -> int:
        return sum(self.lens)
