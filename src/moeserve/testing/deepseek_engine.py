"""A small DeepSeek engine case (latent attention with V2-Lite's dims, 2 layers, dummy fp32
weights, reference experts) and its greedy requests: what tests/layers/test_mla_gpu.py's
engine tests run.

    folder = write_config(tmp_path, "v3")
    prompts, params = greedy_requests()
    with Engine(str(folder), attention_backend="triton", **ENGINE_FLAGS) as engine: ...
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SMALL = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
             moe_intermediate_size=64, n_routed_experts=8, vocab_size=512, torch_dtype="float32")
CASES = {
    "v2-lite": ("deepseek-v2-lite", {}),
    # q LoRA, sigmoid routing over groups, 8 heads, rope not interleaved (neox)
    "v3": ("deepseek-v3", dict(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64,
                               n_group=2, topk_group=1, num_experts_per_tok=2,
                               first_k_dense_replace=1, rope_interleave=False)),
}
ENGINE_FLAGS = dict(load_format="dummy", dtype="float32", device="cuda",
                    skip_tokenizer_init=True, max_running_requests=8, max_total_tokens=4096,
                    context_length=256, moe_runner_backend="reference")
PROMPT_LENS, NEW_TOKENS = (1, 9, 33, 70, 17), (20, 9, 14, 3, 25)


def write_config(folder: Path, case: str) -> Path:
    """The case's config.json in `folder` (a model path for the Engine)."""
    from moeserve.config.presets import PRESETS

    preset, extra = CASES[case]
    (folder / "config.json").write_text(json.dumps({**PRESETS[preset], **SMALL, **extra}))
    return folder


def greedy_requests() -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Five prompts of 1-70 random tokens and their greedy sampling params (3-25 tokens)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENS]
    params = [{"max_new_tokens": m, "temperature": 0.0, "ignore_eos": True} for m in NEW_TOKENS]
    return prompts, params
