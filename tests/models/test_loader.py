"""Weight loading: strict names, broken files, fused experts, EP filtering, dtype conversion,
dummy weights, and the architecture registry."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.models.loader import WeightLoadError, load_weights
from moeserve.models.build import build_model, model_class
from moeserve.config.spec import ModelSpecError, load_model_spec
from moeserve.parallel.groups import single_process_state
from moeserve.plan.capacity import build_plan
from moeserve.batch.forward_batch import ForwardMode
from moeserve.testing.tiny_models import (TinyRunner, hf_logits, load_tiny, make_hf_model,
                                          rel_err, save_checkpoint, tiny_config)
from test_models import CASES, PROMPTS

STATE = single_process_state()


def checkpoint(tmp_path, case, shard=None, seed=1):
    arch, hf_cfg, _ = CASES[case]
    hf = make_hf_model(arch, seed=seed, **hf_cfg)
    return hf, save_checkpoint(hf, tmp_path / case, shard)


def empty_model(folder, **cfg):
    cfg = tiny_config(folder, **cfg)
    spec = load_model_spec(cfg.model)
    return build_model(cfg, spec, STATE, build_plan(cfg, spec)), cfg


def rewrite(path, change):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def extend_logits(model, cfg):
    plan = build_plan(cfg, model.spec)
    return TinyRunner(model, STATE, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("ckpt"), "mixtral-odd-heads")


# --- strict names and broken files ------------------------------------------------------------

def test_missing_tensor_is_named_in_the_checkpoints_own_naming(mixtral, tmp_path):
    folder = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    rewrite(folder / "model.safetensors",
            lambda t: t.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    model, cfg = empty_model(folder)
    with pytest.raises(WeightLoadError,
                       match=r"missing tensor.*model\.layers\.1\.block_sparse_moe\.experts\.2\.w3"):
        load_weights(model, cfg)


def test_unexpected_tensor_is_named(mixtral, tmp_path):
    folder = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    rewrite(folder / "model.safetensors",
            lambda t: t.update({"model.layers.0.self_attn.extra_proj.weight": torch.ones(2)}))
    model, cfg = empty_model(folder)
    with pytest.raises(WeightLoadError, match=r"unexpected.*model\.layers\.0\.self_attn\."
                                              r"extra_proj\.weight \(in model\.safetensors\)"):
        load_weights(model, cfg)


def test_experts_beyond_config_are_unexpected(mixtral, tmp_path):
    folder = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    rewrite(folder / "model.safetensors", lambda t: t.update(
        {"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.ones(20, 40)}))
    model, cfg = empty_model(folder)
    with pytest.raises(WeightLoadError, match=r"block_sparse_moe\.experts\.4\.w1\.weight"):
        load_weights(model, cfg)


def test_wrong_shape_names_the_tensor_and_file(mixtral, tmp_path):
    folder = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    rewrite(folder / "model.safetensors", lambda t: t.update(
        {"model.layers.1.self_attn.k_proj.weight": torch.ones(8, 40)}))
    model, cfg = empty_model(folder)
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight "
                                              r"from model\.safetensors.*\[8, 40\]"):
        load_weights(model, cfg)


def test_truncated_shard_is_named(tmp_path):
    _, folder = checkpoint(tmp_path, "qwen2-dense-first", shard="24KB")
    shard = sorted(folder.glob("model-*.safetensors"))[2]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    model, cfg = empty_model(folder)
    with pytest.raises(WeightLoadError, match=re.escape(shard.name) + ".*truncated"):
        load_weights(model, cfg)


def test_garbage_file_and_missing_shard_are_named(mixtral, tmp_path):
    folder = shutil.copytree(mixtral[1], tmp_path / "ckpt")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    model, cfg = empty_model(folder)
    with pytest.raises(WeightLoadError, match=r"model\.safetensors is truncated or not a "
                                              "safetensors file"):
        load_weights(model, cfg)
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="lists model-00002-of-00002.safetensors"):
        load_weights(model, cfg)


def test_folder_without_weights_and_preset_without_dummy(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CASES["olmoe-clip"][1] | {
        "architectures": ["OlmoeForCausalLM"]}))
    model, cfg = empty_model(tmp_path)
    with pytest.raises(WeightLoadError, match="no safetensors weights.*--load-format dummy"):
        load_weights(model, cfg)
    model, cfg = empty_model("preset:tiny")
    with pytest.raises(WeightLoadError, match="add --load-format dummy"):
        load_weights(model, cfg)


# --- layouts of the expert tensors, EP filtering, dtype ------------------------------------

def fuse_experts(path, num_experts, prefix="mlp"):
    """Rewrite per-expert tensors as transformers 5 keeps them in memory: gate_up [E, 2I, H]
    (gate rows first) and down [E, H, I]."""
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    if prefix == "block_sparse_moe":
        names = {"gate": "w1", "up": "w3", "down": "w2"}

    def change(t):
        layers = {int(k.split(".")[2]) for k in t if ".experts." in k}
        for i in layers:
            p = f"model.layers.{i}.{prefix}.experts"
            take = lambda w: [t.pop(f"{p}.{e}.{names[w]}.weight")  # noqa: E731
                              for e in range(num_experts)]
            gate, up, down = take("gate"), take("up"), take("down")
            q = f"model.layers.{i}.mlp.experts"
            t[f"{q}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(gate, up)])
            t[f"{q}.down_proj"] = torch.stack(down)
    rewrite(path, change)


@pytest.mark.parametrize("case,prefix,experts", [("qwen3-odd-heads", "mlp", 6),
                                                  ("mixtral-odd-heads", "block_sparse_moe", 4)])
def test_fused_expert_tensors_load(case, prefix, experts, tmp_path):
    hf, folder = checkpoint(tmp_path, case)
    fuse_experts(folder / "model.safetensors", experts, prefix)
    model, plan = load_tiny(tiny_config(folder), STATE)
    got = TinyRunner(model, STATE, plan).forward(ForwardMode.EXTEND, PROMPTS, range(4))
    ref = torch.cat(hf_logits(hf, PROMPTS))
    assert rel_err(got, ref) <= 1e-4


def test_expert_view_reads_the_slices_a_sharded_expert_asks_for(tmp_path):
    from safetensors import safe_open

    from moeserve.layers.weights import ExpertView

    fused = torch.randn(3, 8, 5)  # [E, 2I, H]: gate rows 0-3, up rows 4-7
    save_file({"w": fused}, str(tmp_path / "f.safetensors"))
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:
        up = ExpertView(f.get_slice("w"), 2, 4, 4, 5)
        assert up.get_shape() == [4, 5]
        assert torch.equal(up[:], fused[2, 4:])
        assert torch.equal(up[1:3], fused[2, 5:7])
        assert torch.equal(up[1:3, 2:4], fused[2, 5:7, 2:4])
        assert torch.equal(up[:, 3:], fused[2, 4:, 3:])


def test_experts_this_rank_does_not_need_are_never_read(mixtral, monkeypatch):
    model, cfg = empty_model(mixtral[1])
    other_rank = lambda n: ".experts.1." not in n and ".experts.3." not in n  # noqa: E731
    monkeypatch.setattr(model, "needs", other_rank)
    loaded = []
    real = model.load_weight
    monkeypatch.setattr(model, "load_weight", lambda n, s: (loaded.append(n), real(n, s)))
    count = load_weights(model, cfg, progress=False)
    assert count == len(loaded) == len(model.checkpoint_names()) - 2 * 2 * 3
    assert not [n for n in loaded if ".experts.1." in n or ".experts.3." in n]


def test_dtype_conversion_and_progress_bar(mixtral, capsys):
    hf, folder = mixtral
    model, cfg = empty_model(folder, dtype="bfloat16")
    assert load_weights(model, cfg, progress=True) == len(model.checkpoint_names())
    assert "Loading weights" in capsys.readouterr().err
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    emb = hf.model.embed_tokens.weight
    assert torch.equal(model.embed_tokens.weight, emb.to(torch.bfloat16))
    got = extend_logits(model, cfg)
    # bf16 rounding (and the routing choices it flips) moves logits by a few percent; a wrong
    # conversion would be unrelated noise (relative error ~1.4)
    assert torch.isfinite(got).all() and rel_err(got, torch.cat(hf_logits(hf, PROMPTS))) < 0.25


# --- dummy weights ------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["qwen2-shared-expert", "mixtral-tied-window", "olmoe-clip",
                                  "qwen3-tied-yarn"])
def test_dummy_weights_are_deterministic_and_finite(case, tmp_path):
    arch, hf_cfg, _ = CASES[case]
    cfg_json = {"architectures": [arch], **hf_cfg}
    if "rope_parameters" in cfg_json:
        cfg_json["rope_scaling"] = cfg_json.pop("rope_parameters")
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    runs = []
    for _ in range(2):
        model, cfg = empty_model(tmp_path, load_format="dummy")
        assert load_weights(model, cfg) == len(model.checkpoint_names())
        runs.append(extend_logits(model, cfg))
    assert torch.isfinite(runs[0]).all() and runs[0].std() > 0.1
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen1.5-moe-a2.7b", "mixtral-8x7b",
                                    "olmoe-1b-7b", "deepseek-v2-lite", "deepseek-v3"])
def test_every_tensor_of_a_real_preset_has_its_checkpoint_shape(preset):
    """Full-size presets, built on the meta device (no memory): the dummy loader's shape for
    every checkpoint name is one the layers accept, as a real checkpoint's would be."""
    cfg = tiny_config(f"preset:{preset}", load_format="dummy", dtype="bfloat16",
                      context_length=None, max_total_tokens=None, gpu_memory_gb=1000.0)
    spec = load_model_spec(cfg.model)
    model = build_model(cfg, spec, single_process_state(device="meta"), build_plan(cfg, spec))
    names = model.checkpoint_names()
    assert len(names) == len(set(names))
    for name in names:
        model.load_weight(name, torch.empty(model.checkpoint_shape(name), device="meta"))
    assert model.checkpoint_shape("model.embed_tokens.weight") == (spec.vocab_size,
                                                                   spec.hidden_size)
    cos, _ = model.rotary.cos_sin(torch.arange(3))  # rope tables stay real under meta
    assert torch.isfinite(cos).all()


# --- registry -----------------------------------------------------------------------------

def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    with pytest.raises(ModelSpecError, match="LlamaForCausalLM.*moeserve implements: "
                                             "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, "
                                             "MixtralForCausalLM, OlmoeForCausalLM, "
                                             "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"):
        model_class("LlamaForCausalLM")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelSpecError, match="LlamaForCausalLM.*supports: Qwen3MoeForCausalLM"):
        load_model_spec(str(tmp_path))
