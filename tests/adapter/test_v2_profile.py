"""The DeepSeek-V4-Flash replay profile: its numbers follow from SGLang 0.5.23's DeepSeek-V4
pool classes and config, and it loads as a replay model."""

from __future__ import annotations

from pathlib import Path

import yaml

from flatcake.replay.engine import ModelProfile

PROFILE = Path(__file__).resolve().parents[2] / "configs" / "model-deepseek-v4-flash.yaml"


def test_deepseek_v4_flash_profile_matches_sglangs_pool_geometry():
    from flatcake.replay.sglang_cpu import ensure_importable

    ensure_importable()
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import get_dsv4_indexer_bytes_per_token

    fields = DeepSeekV4Config.__dataclass_fields__  # the class defaults (DeepSeek-V4-Flash's shape)
    c = type("Defaults", (), {k: fields[k].default for k in (
        "qk_nope_head_dim", "qk_rope_head_dim", "index_head_dim", "num_hidden_layers", "num_attention_heads")})
    kv_row = c.qk_nope_head_dim + c.qk_rope_head_dim * 2 + c.qk_nope_head_dim // 64 + 1  # fp8 nope, bf16 rope, scales, pad
    assert kv_row == 584
    idx_row = get_dsv4_indexer_bytes_per_token(c.index_head_dim, False)
    assert idx_row == 132
    p = ModelProfile.from_dict(yaml.safe_load(PROFILE.read_text())["model"])
    assert p.layers == c.num_hidden_layers == 43
    assert p.kv_cache_dim * 4 == kv_row + idx_row  # one C4 KV row + one C4 indexer row per 4 tokens
    assert p.bytes_per_token == 7697 and abs(p.bytes_per_token / 1024 - 7.5) < 0.03  # ~7.5 KiB
    assert (p.page_size, p.page_bytes) == (256, 1970432)
    assert p.q_heads == c.num_attention_heads and p.q_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim
