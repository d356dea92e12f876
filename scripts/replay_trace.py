#!/usr/bin/env python3
"""Replay a real trace through FlatCake and SGLang's file backend (same as ``flatcake-replay``).

    python scripts/replay_trace.py --config configs/demo.yaml --out runs/demo

See ``docs/replay.md``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flatcake.replay.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
