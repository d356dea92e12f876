"""FC-CIO: coalescing direct I/O for SSD restores (paper §3.3).

Restore lifecycle: plan (:func:`plan_reads`) → read (POSIX ``preadv``/O_DIRECT workers or kvikio
``CuFile.pread`` futures) into a fixed double-buffered staging window → scatter into KV page
slots (``flatcake.kernels.scatter``: torch or Triton) → release the window.
"""

from flatcake.cio.engines import EngineUnavailableError
from flatcake.cio.plan import ChunkBatch, ChunkRead, MergedRead, PlannedChunk, ReadPlan, batch_reads, plan_reads
from flatcake.cio.restore import RestoreEngine, RestoreReport, auto_staging_bytes

__all__ = [
    "ChunkBatch",
    "ChunkRead",
    "EngineUnavailableError",
    "MergedRead",
    "PlannedChunk",
    "ReadPlan",
    "RestoreEngine",
    "RestoreReport",
    "auto_staging_bytes",
    "batch_reads",
    "plan_reads",
]
