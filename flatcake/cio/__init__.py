"""FC-CIO: coalescing direct I/O for SSD restores (paper §3.3).

Restore lifecycle: plan (:func:`plan_reads` over one :class:`ChunkBatch`) → read (POSIX
``preadv``/O_DIRECT workers or kvikio ``CuFile.pread`` futures) into a fixed double-buffered
staging window → verify and scatter into KV page slots (``flatcake.kernels.scatter``: torch or
Triton) → release the window.
"""

from flatcake.cio.engines import EngineUnavailableError
from flatcake.cio.plan import ChunkBatch, MergedRead, ReadPlan, batch_reads, plan_reads
from flatcake.cio.restore import RestoreEngine, RestoreReport, auto_staging_bytes

__all__ = [
    "ChunkBatch",
    "EngineUnavailableError",
    "MergedRead",
    "ReadPlan",
    "RestoreEngine",
    "RestoreReport",
    "auto_staging_bytes",
    "batch_reads",
    "plan_reads",
]
