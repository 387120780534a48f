"""`benchmarks e2e` on the CPU: the bytes of a decode step (the floor's numerator) against a
hand count and against the weights of a model as the loader builds it, in bf16 and in fp8."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.engine_steps import decode_bytes  # noqa: E402
from moeserve.config.presets import PRESETS  # noqa: E402
from moeserve.config.quant import QuantSpec  # noqa: E402
from moeserve.config.spec import load_model_spec  # noqa: E402


def test_fp8_bytes_of_a_tiny_step_by_hand():
    # preset:tiny: H 64, 2 MoE layers, 4 heads and 2 KV heads of 16, E 8, top-2, I 32,
    # vocab 512, untied; 16 x 32 blocks so that every matrix has several
    spec = load_model_spec("preset:tiny")
    quant = QuantSpec(16, 32, from_checkpoint=False)
    fp8 = 8192 + 8 * 2 * 4 + 4096 + 4 * 2 * 4  # qkv [128, 64] and o [64, 64], a scale a block
    bf16 = (2 * 16 + 2 * 64 + 8 * 64) * 2  # q/k norms, the two layer norms, the router gate
    lm_head, final_norm = 512 * 64 * 2, 64 * 2
    expert = 2 * ((64 * 64 + 4 * 2 * 4) + (64 * 32 + 4 * 1 * 4))  # gate_up, down; 2 layers
    for batch, ctx in ((1, 10), (3, 7)):
        got = decode_bytes(spec, batch, ctx, quant=quant)
        touched = 8 * (1 - (1 - 2 / 8) ** batch)
        assert got["touched_experts_per_layer"] == pytest.approx(touched)
        assert got["dense"] == 2 * (fp8 + bf16) + lm_head + final_norm + batch * 64 * 2
        assert got["experts"] == pytest.approx(touched * expert)
        assert got["kv"] == batch * ctx * 2 * (2 * 2 * 16) * 2
        assert got["total"] == pytest.approx(got["dense"] + got["experts"] + got["kv"])
        # the same step in bf16: every matrix 2 bytes a value
        plain = decode_bytes(spec, batch, ctx)
        assert plain["dense"] == 2 * ((128 + 64) * 64 * 2 + bf16) + lm_head + final_norm \
            + batch * 64 * 2
        assert plain["experts"] == pytest.approx(touched * 2 * 3 * 64 * 32 * 2)
        assert plain["kv"] == got["kv"]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_bytes_are_those_of_the_model_the_loader_builds(tmp_path, quantization):
    """Every weight of a built model (128-wide, so that 128 x 128 blocks fit; a dense layer
    among the MoE ones) is read by a step, but the embedding table (the batch's rows) and the
    routed experts (those touched)."""
    from moeserve.parallel.groups import single_process_state
    from moeserve.testing.tiny_models import load_tiny, tiny_config

    hf = {**PRESETS["tiny"], "hidden_size": 128, "head_dim": 128, "num_attention_heads": 2,
          "num_key_value_heads": 1, "moe_intermediate_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 3, "mlp_only_layers": [1], "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model, plan = load_tiny(tiny_config(tmp_path, load_format="dummy", dtype="bfloat16",
                                        quantization=quantization), single_process_state())
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    assert sum(sizes.values()) == plan.memory.weights_bytes_per_rank
    if quantization:
        assert {str(p.dtype) for p in model.parameters()} >= {"torch.float8_e4m3fn"}
    experts = sum(v for n, v in sizes.items() if ".experts." in n)
    rest = sum(v for n, v in sizes.items() if ".experts." not in n and "embed_tokens" not in n)
    spec = load_model_spec(str(tmp_path))
    for batch in (1, 5):
        got = decode_bytes(spec, batch, 4, quant=plan.quant)
        touched = got["touched_experts_per_layer"]
        assert got["dense"] == rest + batch * 128 * 2
        assert got["experts"] == pytest.approx(experts * touched / 8)
