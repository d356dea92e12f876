"""Fixtures for the replay tests (imported by name; not a conftest.py, so no clash with other
test directories' ``conftest`` modules): the tiny traces in ``fixtures/`` and a tiny model
profile (16 KiB pages) so an end-to-end replay runs in about a second."""

from pathlib import Path

import pytest

from flatcake.replay.engine import ModelProfile

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def mooncake_path() -> Path:
    return FIXTURES / "mooncake_5.jsonl"


@pytest.fixture
def weka_path() -> Path:
    return FIXTURES / "weka_2sessions.tar.xz"


@pytest.fixture
def tiny_profile() -> ModelProfile:
    # 2 (K,V) x 2 layers x 1 head x 32 dims x 2 bytes = 256 B/token; 64-token page = 16 KiB
    return ModelProfile(name="tiny/mha", attention="mha", layers=2, kv_heads=1, head_dim=32,
                        dtype="bfloat16", page_size=64, layout="page_first", params=1e6,
                        q_heads=2, q_head_dim=32, gpu_tflops=100.0, mfu=0.5, pcie_gbps=10.0)
