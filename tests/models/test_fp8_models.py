"""FP8 checkpoints in the release format (tiny Qwen3-MoE and DeepSeek-V3, written by the test):
moeserve's W8A8 logits against transformers running the same weights dequantized, strict
key checks, the split-block error, --quantization fp8 at load, and the parallel layouts on
gloo against one rank.

Tolerance against transformers: W8A8 quantizes every projection's input per token per block_k
columns, a few percent of error per product, so the logits cannot match to 1e-4. Held: the
argmax agrees on at least 80% of the rows (random tiny models have near ties) and the mean
over rows of KL(transformers || moeserve) is at most 0.02 nats (a row whose top-k routing a
rounding flips may reach 0.1 alone). The same weights unquantized in moeserve
match transformers to 1e-4 (test_models.py), so the gap is the activations' quantization.
Parallel layouts must equal one rank to 1e-3 relative: the same blocks and groups, only the
order of float32 sums differs (which may move an activation across an fp8 rounding edge).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve.batch.forward_batch import ForwardMode
from moeserve.models.loader import WeightLoadError
from moeserve.parallel.groups import single_process_state
from moeserve.testing.fp8_checkpoints import (load_hf, logit_agreement, write_fp8_checkpoint)
from moeserve.testing.multiproc import run_ranks
from moeserve.testing.tiny_models import (TinyRunner, hf_logits, load_tiny, make_hf_model,
                                          rel_err, save_checkpoint, tiny_config)

torch.set_num_threads(1)
V = 97
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33], [12, 4, 55, 70], [7, 7, 31, 2, 96, 50, 13, 70]]
TOP1, KL_MEAN, PARALLEL_TOL = 0.8, 0.02, 1e-3

CASES = {
    # GQA with q/k norms, a dense layer, 16x16 blocks: every matrix has several blocks
    "qwen3": ("Qwen3MoeForCausalLM", dict(
        vocab_size=V, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_hidden_layers=3, mlp_only_layers=[1], intermediate_size=32,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        (16, 16)),
    # latent attention with q LoRA, sigmoid routing with a correction bias, a shared expert,
    # a dense layer; one group (a group choice is a jump that an fp8 rounding may flip)
    "deepseek-v3": ("DeepseekV3ForCausalLM", dict(
        vocab_size=V, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=32, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.0),
        (16, 16)),
    # the releases' 128 x 128 blocks, on 128-wide matrices
    "qwen3-block128": ("Qwen3MoeForCausalLM", dict(
        vocab_size=V, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=128, num_hidden_layers=2, intermediate_size=256, moe_intermediate_size=128,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True), (128, 128)),
}


def _checkpoints(tmp, name, not_converted=()):
    arch, hf_cfg, block = CASES[name]
    hf = make_hf_model(arch, seed=len(name), **hf_cfg)
    src = save_checkpoint(hf, tmp / "src")
    fp8_dir, deq_dir = write_fp8_checkpoint(src, tmp / "fp8", tmp / "deq", block, not_converted)
    return src, fp8_dir, deq_dir


def _logits(folder, **kw):
    state = single_process_state()
    model, plan = load_tiny(tiny_config(folder, **kw), state)
    return model, TinyRunner(model, state, plan).forward(ForwardMode.EXTEND, PROMPTS,
                                                         range(len(PROMPTS)))


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(name, tmp_path):
    _, fp8_dir, deq_dir = _checkpoints(tmp_path, name)
    ref = torch.cat(hf_logits(load_hf(deq_dir), PROMPTS))
    model, got = _logits(fp8_dir)
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert model.embed_tokens.weight.dtype == torch.float32  # kept as given
    top1, kl = logit_agreement(got, ref)
    assert top1 >= TOP1 and kl <= KL_MEAN, (top1, kl)
    assert rel_err(got, ref) > 1e-4  # the activations are quantized: not the float path


def test_quantization_fp8_at_load_matches_the_release_format(tmp_path):
    """--quantization fp8 on the bf16/fp32 checkpoint gives the fp8 checkpoint's weights
    (each block quantized alike) and the same logits."""
    src, fp8_dir, _ = _checkpoints(tmp_path, "qwen3-block128")
    _, want = _logits(fp8_dir)
    m_load, got = _logits(src, quantization="fp8")
    assert m_load.quant.block == (128, 128) and not m_load.quant.from_checkpoint
    w = m_load.layers[0].mlp.experts
    assert w.w13.dtype == torch.float8_e4m3fn and w.w13_scale_inv.shape == (4, 2, 1)
    assert rel_err(got, want) < 1e-6
    from moeserve.kernels.fp8 import reference as R
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        full = f.get_tensor("model.layers.0.mlp.experts.2.down_proj.weight")
    q, s = R.quantize_blocks(full, (128, 128))
    assert torch.equal(w.w2[2].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(w.w2_scale_inv[2], s)


def test_dummy_weights_quantized_at_load_run(tmp_path):
    src, _, _ = _checkpoints(tmp_path, "qwen3-block128")
    model, out = _logits(src, load_format="dummy", quantization="fp8")
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.isfinite(out).all() and out.std() > 0


def test_modules_to_not_convert_are_kept_as_given(tmp_path):
    keep = ["model.layers.0.self_attn.o_proj", r"model\.layers\.\d+\.mlp\.shared_experts"]
    _, fp8_dir, deq_dir = _checkpoints(tmp_path, "deepseek-v3", keep)
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.float32
        assert "model.layers.1.self_attn.o_proj.weight_scale_inv" in f.keys()
    model, got = _logits(fp8_dir)
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    assert model.layers[1].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].mlp.shared_expert.down.weight.dtype == torch.float32
    assert model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    top1, kl = logit_agreement(got, torch.cat(hf_logits(load_hf(deq_dir), PROMPTS)))
    assert top1 >= TOP1 and kl <= KL_MEAN


def _rewrite(folder, change):
    path = folder / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("case, error", [
    ("missing scale", "missing tensor.*q_proj.weight_scale_inv"),
    ("scale beside a kept weight", "unexpected tensor.*input_layernorm.weight_scale_inv"),
    ("scale of the wrong shape", "weight_scale_inv has shape"),
    ("fp8 weight without quantization_config", "float8 tensor.*without a weight_scale_inv"),
])
def test_strict_keys(case, error, tmp_path):
    _, fp8_dir, _ = _checkpoints(tmp_path, "qwen3")
    layer0 = "model.layers.0."
    if case == "missing scale":
        _rewrite(fp8_dir, lambda t: t.pop(layer0 + "self_attn.q_proj.weight_scale_inv"))
    elif case == "scale beside a kept weight":
        _rewrite(fp8_dir, lambda t: t.update(
            {layer0 + "input_layernorm.weight_scale_inv": torch.ones(1, 1)}))
    elif case == "scale of the wrong shape":
        _rewrite(fp8_dir, lambda t: t.update(
            {layer0 + "self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}))
    else:
        cfg = json.loads((fp8_dir / "config.json").read_text())
        del cfg["quantization_config"]
        (fp8_dir / "config.json").write_text(json.dumps(cfg))
        _rewrite(fp8_dir, lambda t: [t.pop(k) for k in list(t) if k.endswith("_scale_inv")])
    with pytest.raises(WeightLoadError, match=error):
        _logits(fp8_dir)


def test_unsupported_quantization_configs_are_refused(tmp_path):
    from moeserve.config.spec import ModelSpecError, load_model_spec

    _, fp8_dir, _ = _checkpoints(tmp_path, "qwen3")
    cfg = json.loads((fp8_dir / "config.json").read_text())
    for change, error in (({"weight_block_size": None}, "not per-tensor fp8"),
                          ({"activation_scheme": "static"}, "dynamic"),
                          ({"quant_method": "awq"}, "quant_method 'awq'")):
        bad = {**cfg, "quantization_config": {**cfg["quantization_config"], **change}}
        (fp8_dir / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelSpecError, match=error):
            load_model_spec(str(fp8_dir))


def test_a_shard_that_splits_a_scale_block_is_a_startup_error():
    from moeserve.layers.linear import ColumnParallelLinear, RowParallelLinear
    from moeserve.layers.weights import Fp8Source, WeightError
    from moeserve.parallel.groups import Axis
    from moeserve.config.quant import QuantSpec

    quant = QuantSpec(128, 128, True)
    two = Axis(None, 1, 2, (0, 1))
    with pytest.raises(WeightError, match="1408 split over 2 ranks is 704 per rank, which "
                                          "splits a 128-wide fp8 scale block"):
        RowParallelLinear(1408, 256, bias=False, axis=two, dtype=torch.float32, quant=quant)
    with pytest.raises(WeightError, match="576 split over 2 ranks is 288"):
        ColumnParallelLinear(256, 576, bias=False, axis=two, dtype=torch.float32, quant=quant)
    RowParallelLinear(1536, 256, bias=False, axis=two, dtype=torch.float32, quant=quant)
    # and a read of such a range from a checkpoint is refused with the sizes
    from moeserve.kernels.fp8 import reference as R
    q, s = R.quantize_blocks(torch.randn(300, 256), (128, 128))
    src = Fp8Source(q, s, (128, 128), "w")
    with pytest.raises(WeightError, match=r"rows \[150, 300\) of this rank's shard of 300 "
                                          "split a 128-wide"):
        src.read((150, 300), None)
    assert src.read((128, 300), None).scale.shape == (2, 2)


LAYOUTS = {
    "tp2": {},
    "ep2-dense-replicated": {"ep_size": 2, "moe_dense_tp_size": 1},
    "dp2-attention": {"dp_size": 2, "enable_dp_attention": True},
    "all-to-all": {"ep_size": 2, "moe_a2a_backend": "all_to_all"},
    # the one-sided exchange's layout (its peers' stores emulated over gloo on a CPU)
    "nvlink": {"ep_size": 2, "moe_a2a_backend": "nvlink"},
    "nvlink-dp2-attention": {"ep_size": 2, "moe_a2a_backend": "nvlink", "dp_size": 2,
                             "enable_dp_attention": True},
}


def _world(rank, world, folders, refs):
    from moeserve.parallel.groups import init_parallel_state
    from moeserve.parallel.layout import ParallelLayout

    out = []
    state = None
    for layout, kw in LAYOUTS.items():
        for name, folder in folders.items():
            cfg = tiny_config(folder, tp_size=world, **kw)
            lay = ParallelLayout.from_config(cfg)
            if state is None or state.layout != lay:
                state = init_parallel_state(lay)
            model, plan = load_tiny(cfg, state)
            runner = TinyRunner(model, state, plan)
            mine = list(range(len(PROMPTS)))
            if state.layout.dp > 1:  # each DP rank serves its own requests
                mine = mine[:2] if state.dp_rank == 0 else mine[2:]
            got = runner.forward(ForwardMode.EXTEND, [PROMPTS[i] for i in mine], mine)
            want = torch.cat([refs[name][i] for i in mine])
            out.append((layout, name, rel_err(got, want)))
    return out


@pytest.mark.multiproc
def test_parallel_layouts_equal_one_rank(tmp_path):
    folders, refs = {}, {}
    for name in ("qwen3", "deepseek-v3"):
        _, fp8_dir, _ = _checkpoints(tmp_path / name, name)
        _, logits = _logits(fp8_dir)
        folders[name] = str(fp8_dir)
        refs[name] = list(logits.split([len(p) for p in PROMPTS]))
    for rank_results in run_ranks(_world, 2, folders, refs, timeout=600):
        for layout, name, err in rank_results:
            assert err <= PARALLEL_TOL, (layout, name, err)


@pytest.mark.gpu
def test_fp8_decode_takes_inputs_quantized_by_the_kernels_before_on_gpu(tmp_path, monkeypatch):
    """On a GPU a decode step's fp8 projections take their inputs quantized by the kernels
    that made them, with no quantizer launch: qkv_proj's by the input norm, o_proj's by a
    split decode's combine. The decode steps' logits equal, bit for bit, those of the same
    steps with the quantizer's launches, and both fused paths were taken (a bf16 model: the
    norm quantizes 16-bit rows)."""
    from moeserve.layers import pending
    from moeserve.layers.attention import PagedAttention
    from moeserve.models.decoder import DecoderLayer

    _, fp8_dir, _ = _checkpoints(tmp_path, "qwen3-block128")
    takes, norm_quant = PagedAttention.quantizes_output, pending.add_norm_quantized
    taken, normed = [], []

    def counted(self, *args):
        taken.append(takes(self, *args))
        return taken[-1]

    def counted_norm(*args):
        out = norm_quant(*args)
        normed.append(out[2])
        return out

    def decode_logits(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(PagedAttention, "quantizes_output",
                            counted if fused else (lambda self, *a: False))
        monkeypatch.setattr("moeserve.models.decoder.add_norm_quantized", counted_norm)
        if not fused:
            monkeypatch.setattr(DecoderLayer, "_input_quant", lambda self, r: None)
        state = single_process_state(device="cuda")
        model, plan = load_tiny(tiny_config(fp8_dir, attention_backend="triton",
                                            dtype="bfloat16"), state)
        runner = TinyRunner(model, state, plan)
        runner.forward(ForwardMode.EXTEND, PROMPTS, range(len(PROMPTS)))
        return [runner.forward(ForwardMode.DECODE, [[t] for t in toks], range(len(PROMPTS)))
                for toks in ([3, 9, 27], [81, 50, 1])]

    fused = decode_logits(True)
    assert any(taken) and any(normed)
    normed.clear()
    plain = decode_logits(False)
    assert not normed
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
