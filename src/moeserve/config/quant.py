"""Weight quantization: block-scaled FP8 (float8_e4m3fn weights, one float32 scale per
block_n x block_k block, activations quantized per token per block_k columns at run time).

Two sources give the same in-memory format:
  - a checkpoint whose config.json has `quantization_config` {"quant_method": "fp8",
    "weight_block_size": [bn, bk], "activation_scheme": "dynamic", "modules_to_not_convert"
    (or "ignored_layers"): [...]}: the layout of the DeepSeek-V3 and Qwen3 FP8 releases, each
    quantized `W.weight` beside its `W.weight_scale_inv` [ceil(out/bn), ceil(in/bk)];
  - `--quantization fp8`: a bf16/fp16/fp32 checkpoint (or dummy weights) quantized at load,
    per 128 x 128 block (scale = block amax / 448).

Which weights are quantized (the projections of attention, dense MLPs, shared and routed
experts) is the models' choice (models/quant.py); norms, the router gate, embeddings and the LM
head stay as given. `modules_to_not_convert` names modules in the checkpoint's naming, matched
as transformers matches them: a prefix up to a module boundary, a regex with the same
boundary, or a suffix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


class QuantizationError(ValueError):
    """A quantization config moeserve cannot serve; the message says what to change."""


@dataclass(frozen=True)
class QuantSpec:
    block_n: int  # output rows per scale block
    block_k: int  # input columns per scale block, and the activations' group size
    from_checkpoint: bool  # the weights arrive quantized with their scales (else: at load)
    not_converted: tuple[str, ...] = ()

    @property
    def block(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    def converts(self, module: str) -> bool:
        """Whether `module` (a name in the checkpoint's naming, without `.weight`) is quantized,
        unless the model keeps it as given anyway."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        for key in self.not_converted:
            try:
                if re.match(rf"(?:{key}){boundary}", module):
                    return False
            except re.error:
                pass
            if module.endswith(key):
                return False
        return True

    def describe(self) -> str:
        source = "checkpoint" if self.from_checkpoint else "quantized at load"
        return f"fp8 e4m3, {self.block_n}x{self.block_k} block scales ({source})"


def checkpoint_quant(hf_config: dict[str, Any]) -> Optional[QuantSpec]:
    """The QuantSpec of a config.json's `quantization_config` (None without one)."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"quantization_config has quant_method {method!r}; moeserve serves block-scaled "
            "fp8 checkpoints (quant_method fp8 with weight_block_size) and unquantized ones")
    block = q.get("weight_block_size")
    if not block or len(block) != 2 or min(int(b) for b in block) < 1:
        raise QuantizationError(
            f"quantization_config has weight_block_size {block!r}; moeserve serves fp8 with "
            "block scales ([128, 128] as DeepSeek-V3 and Qwen3 ship them), not per-tensor fp8: "
            "convert the checkpoint to bf16 and serve it with --quantization fp8")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(
            f"quantization_config has activation_scheme {scheme!r}; moeserve quantizes "
            "activations per token at run time (dynamic) and has no static activation scales")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"quantization_config has fmt {fmt!r}; moeserve serves "
                                "float8_e4m3fn weights")
    skip = tuple(q.get("modules_to_not_convert") or ()) + tuple(q.get("ignored_layers") or ())
    return QuantSpec(int(block[0]), int(block[1]), True, skip)


QUANTIZATIONS = ("fp8",)


def resolve_quant(quantization: Optional[str], checkpoint: Optional[QuantSpec]
                  ) -> Optional[QuantSpec]:
    """The weights' quantization: the checkpoint's own, or --quantization's (applied at load)."""
    if quantization is None:
        return checkpoint
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"--quantization {quantization!r} is not supported; moeserve "
                                f"supports {', '.join(QUANTIZATIONS)}")
    if checkpoint is not None:
        return checkpoint  # already fp8 with its own blocks
    return QuantSpec(*DEFAULT_BLOCK, from_checkpoint=False)
