"""The ``transformers`` greedy reference for a local model: what a server's tokens must equal.

A tiny model's greedy tokens change when its prefix KV is perturbed (0.05·N(0,1) on the prefix KV
changes them: ``../shared/design/sglang-cpu-server-facts.md``), so a server's tokens after an L3
restore equal to this reference mean the restored bytes were right.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Sequence


@lru_cache(maxsize=4)
def _model(model_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    return model


def greedy(model_path: str, input_ids: Sequence[int], max_new_tokens: int = 16) -> List[int]:
    """The ``max_new_tokens`` greedy tokens ``transformers`` computes after ``input_ids`` (ids, not
    text; fp32 on the CPU; end-of-sequence ignored, as the server's requests set ``ignore_eos``)."""
    import torch

    model = _model(str(model_path))
    out: List[int] = []
    with torch.no_grad():
        step = model(input_ids=torch.tensor([list(input_ids)]), use_cache=True)
        for _ in range(max_new_tokens):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(input_ids=torch.tensor([[token]]), past_key_values=step.past_key_values, use_cache=True)
    return out
