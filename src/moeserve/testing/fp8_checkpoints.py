"""Tiny FP8 checkpoints in the release format (DeepSeek-V3, Qwen3 FP8), written from a saved
bf16/fp32 checkpoint, and the same weights dequantized, for transformers to run as the
reference.

    folder = save_checkpoint(hf, tmp / "fp32")
    fp8_dir, deq_dir = write_fp8_checkpoint(folder, tmp / "fp8", tmp / "deq", (16, 16))
    ref = hf_logits(load_hf(deq_dir), prompts)         # transformers on the dequantized weights

Every weight that moeserve quantizes (models/quant.py, in the architecture's naming) becomes
float8_e4m3fn beside `<name>_scale_inv` (float32, [ceil(out/bn), ceil(in/bk)]), unless a
module of `not_converted` matches it; config.json gets quantization_config {quant_method fp8,
weight_block_size, activation_scheme dynamic, fmt e4m3, modules_to_not_convert}.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve.config.quant import QuantSpec
from moeserve.kernels.fp8 import reference as fp8
from moeserve.models.build import model_class
from moeserve.models.quant import QUANTIZED, scale_of

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def quantized_names(architecture: str, names: Sequence[str], quant: QuantSpec) -> list[str]:
    """The checkpoint tensors an fp8 release of this architecture stores in fp8."""
    cls = model_class(architecture)
    return [n for n in names if QUANTIZED.fullmatch(cls.to_canonical(n))
            and quant.converts(n.removesuffix(".weight"))]


def write_fp8_checkpoint(src: Path, fp8_dir: Path, deq_dir: Path, block: tuple[int, int],
                         not_converted: Sequence[str] = ()) -> tuple[Path, Path]:
    """fp8_dir: the release format; deq_dir: the same values dequantized (float32), without
    quantization_config, for transformers."""
    src, fp8_dir, deq_dir = Path(src), Path(fp8_dir), Path(deq_dir)
    config: dict[str, Any] = json.loads((src / "config.json").read_text())
    quant = QuantSpec(*block, from_checkpoint=True, not_converted=tuple(not_converted))
    tensors = _tensors(src)
    names = quantized_names(config["architectures"][0], list(tensors), quant)
    quantized, dequantized = dict(tensors), dict(tensors)
    for name in names:
        q, scale = fp8.quantize_blocks(tensors[name], block)
        quantized[name], quantized[scale_of(name)] = q, scale
        dequantized[name] = fp8.dequantize_blocks(q, scale, block).to(tensors[name].dtype)
    for folder, values in ((fp8_dir, quantized), (deq_dir, dequantized)):
        folder.mkdir(parents=True, exist_ok=True)
        for extra in _COPIED:
            if (src / extra).exists():
                shutil.copy(src / extra, folder / extra)
        save_file({k: v.contiguous() for k, v in values.items()},
                  str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "fp8", "weight_block_size": list(block), "activation_scheme": "dynamic",
        "fmt": "e4m3", "modules_to_not_convert": list(not_converted)}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, deq_dir


def load_hf(folder: Path) -> Any:
    """transformers' model of a checkpoint folder, in fp32 with eager attention."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager").eval()


def logit_agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(fraction of rows whose argmax agrees, the mean over rows of KL(ref || got), nats)."""
    top1 = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
    log_p, log_q = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return top1, float(kl.mean())
