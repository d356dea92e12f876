"""Tiny models and tokenizers built locally (no downloads), for a real SGLang server on the CPU.

Random weights (std 0.5, so greedy tokens vary with the prompt and with the KV), a byte-level BPE
tokenizer trained in a few seconds on a synthetic corpus, a chat template. The compute is tiny
(2 layers, hidden 128) but the **KV geometry is chosen**: ``num_key_value_heads`` × ``head_dim``
set the bytes per token independently of the compute, so pages are as large as a real model's
per layer (the default MHA: 4 KV heads × head_dim 128 × fp32 = 2 KiB per layer for K and again for V,
8 KiB per token over 2 layers; a 16-token page is 128 KiB).

Kinds (``build(path, TinyModelSpec(kind=...))``):

* ``llama`` — MHA (``LlamaForCausalLM``);
* ``qwen2`` — MHA (``Qwen2ForCausalLM``, biases on q/k/v);
* ``deepseek_v2`` — MLA (``DeepseekV2ForCausalLM``: ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64,
  one 576-wide latent per token per layer; every layer dense, ``first_k_dense_replace`` = layers, so
  no MoE; RoPE as ``yarn`` with factor 1, i.e. plain RoPE, because SGLang's CPU engine builds MLA
  RoPE only as ``deepseek_yarn``: ``rotary_embedding/factory.py`` ``get_rope_cpu``). SGLang serves
  it on the CPU engine with CPU shim 6 (:mod:`flatcake.testing.cpu_shims`), also over TP 2;
* ``mellum`` — a sliding-window hybrid (``MellumForCausalLM``: layer types alternate sliding /
  full attention, the last full; ``sliding_window`` 64; dense MLPs). SGLang builds an
  ``SWAKVPool`` for it, so HiCache drives FlatCake's v2 interface for the SWA pool. On the CPU
  engine SGLang's ``torch_native`` backend reads SWA layers with untranslated indices, so its
  tokens do not match ``transformers`` unless ``--disable-hybrid-swa-memory``
  (``tests/e2e/test_server_models.py``).

The helper writes ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json`` into ``path``, and
a ``flatcake-tiny-model.json`` stamp: a second call with the same arguments reuses the directory.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

#: the stamp file whose contents (the spec) mark a finished build
STAMP = "flatcake-tiny-model.json"

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

_WORDS = ("cache page prefix layer token session agent restore extent medium write read scope hit "
          "latency throughput memory disk kernel scheduler request reply turn context window drive "
          "the a of to and in is for on with as by at from that this it be are was were").split()


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build. ``kind``: ``llama``, ``qwen2``, ``deepseek_v2`` or ``mellum``; ``kv_heads`` ×
    ``head_dim`` (MHA, Mellum) set the KV bytes per token per layer; ``sliding_window``: Mellum's
    window (tokens); ``seed`` fixes weights and tokenizer."""

    kind: str = "llama"
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 512
    max_positions: int = 8192
    seed: int = 0
    std: float = 0.5
    sliding_window: int = 64


def synthetic_corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Lines of pseudo-English (fixed by ``seed``) to train the tokenizer on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) + rng.choice(".?!,;:0123456789")
            for _ in range(lines)]


def prompt_text(words: int, seed: int) -> str:
    """A deterministic prompt of ``words`` pseudo-English words (about 1.3 tokens a word)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def prompt_ids(tokens: int, seed: int, vocab: int = 400, first_id: int = len(SPECIAL_TOKENS)) -> list[int]:
    """``tokens`` deterministic token ids in ``[first_id, vocab)`` (no special tokens): prompts are
    sent as ids, so the server and the reference see exactly the same tokens."""
    rng = random.Random(seed)
    return [rng.randrange(first_id, vocab) for _ in range(tokens)]


def _build_tokenizer(spec: TinyModelSpec, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(synthetic_corpus(seed=spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", model_max_length=spec.max_positions)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _yarn_rope(spec: TinyModelSpec) -> dict:
    """DeepSeek's YaRN RoPE with factor 1 (the same rotation as plain RoPE, in ``transformers`` and
    in SGLang's ``DeepseekScalingRotaryEmbedding``, the only MLA RoPE SGLang's CPU engine builds)."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0,
            "original_max_position_embeddings": spec.max_positions, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}


def _config(spec: TinyModelSpec, vocab: int, bos: int, eos: int):
    common = dict(vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=2 * spec.hidden,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                  max_position_embeddings=spec.max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=bos, eos_token_id=eos, dtype="float32")
    if spec.kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, **common)
    if spec.kind == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, **common)
    if spec.kind == "deepseek_v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(num_key_value_heads=spec.heads, kv_lora_rank=512, q_lora_rank=None,
                                qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                                # n_routed_experts must be an int; no layer reaches first_k_dense_replace
                                n_routed_experts=1, first_k_dense_replace=spec.layers,
                                moe_intermediate_size=spec.hidden, rope_parameters=_yarn_rope(spec),
                                moe_layer_freq=1,  # SGLang reads it for the layer after the last one
                                **common)
    if spec.kind == "mellum":
        from transformers import MellumConfig

        return MellumConfig(num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, sliding_window=spec.sliding_window,
                            layer_types=_mellum_layer_types(spec.layers), mlp_layer_types=["dense"] * spec.layers,
                            **common)
    raise ValueError(f"tiny model kind {spec.kind!r}: use llama, qwen2, deepseek_v2 or mellum")


def _mellum_layer_types(layers: int) -> list:
    """Sliding-window layers with a full-attention layer last (every other layer full)."""
    return ["full_attention" if (layers - 1 - i) % 2 == 0 else "sliding_attention" for i in range(layers)]


def build(path: str | Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build (or reuse) the tiny model ``spec`` in ``path``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, ready for ``--model-path``.
    Raises:
        ValueError: an unknown ``spec.kind``.
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return path
    path.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(spec, path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    config = _config(spec, len(tok), tok.bos_token_id, tok.eos_token_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, spec.std)
    model.generation_config.do_sample = False
    model.save_pretrained(str(path))
    stamp.write_text(json.dumps(asdict(spec)))
    return path


def kv_bytes_per_token(spec: TinyModelSpec, dtype_bytes: int = 4) -> int:
    """KV bytes per token over all layers, as SGLang's host pool stores them."""
    if spec.kind == "deepseek_v2":
        return spec.layers * (512 + 64) * dtype_bytes
    return spec.layers * 2 * spec.kv_heads * spec.head_dim * dtype_bytes
