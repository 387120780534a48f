"""Weight loading: safetensors checkpoints (one file, or shards with an index) and dummy weights.

Loading is strict and streaming:
  1. every file's header is read first: a truncated or corrupt file fails here, naming the file,
     before any tensor is read; the names are checked against the model's: an unexpected or a
     missing tensor fails with its name;
  2. then tensor by tensor, each rank reads only the slices it keeps (safetensors get_slice: TP
     shards, its own experts; other ranks' experts are never read), converting the dtype.

Names go through the architecture's `to_canonical` (Mixtral's w1/w2/w3). Experts stored fused,
as transformers 5 keeps them in memory (`experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I]), are read as per-expert views of the fused tensor.

FP8 checkpoints (config/quant.py): the model lists `W.weight_scale_inv` beside every weight it
quantizes, so a scale that is missing, or one beside a weight kept as given, fails the name
check; a float8 weight without a scale fails too. Each quantized weight is read together with
its scale (layers/weights.Fp8Source, from whichever files hold them), so a rank reads the
scale blocks of its own shard only. Fused experts carry their scales fused the same way
(`experts.gate_up_proj_scale_inv` [E, 2I/bn, H/bk]).

`--load-format dummy` fills every weight with deterministic uniform noise, generated per tensor
from its name at full size and sharded like a checkpoint tensor, so every layout of one model
gets the same weights. Scales keep activations finite at any depth: fan-in scaling for
matrices, 1 +- 0.1 for norms.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from moeserve.config import EngineConfig
from moeserve.layers.weights import ExpertView, Fp8Source
from moeserve.models import quant as Q

INDEX_FILE = "model.safetensors.index.json"
# tensors some checkpoints carry that are not weights of the model
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?")
FP8_HEADER_DTYPES = ("F8_E4M3",)


class WeightLoadError(RuntimeError):
    """The checkpoint cannot be loaded into the model; the message names the tensor or file."""


@dataclass(frozen=True)
class Entry:
    """One canonical tensor of the checkpoint: where it is and how to read it."""

    file: Path
    key: str  # the name in the file
    canonical: str
    view: Optional[Callable[[Any], Any]] = None  # from the file's slice to this tensor


# ------------------------------------------------------------------------------------------

def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise WeightLoadError(f"{index} is not a safetensors index ({exc})") from exc
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise WeightLoadError(f"{index.name} lists {f.name}, which is not in {folder}")
        return files
    single = folder / "model.safetensors"
    files = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors weights in {folder}; give a checkpoint folder "
                              "with model.safetensors (or shards and "
                              f"{INDEX_FILE}), or use --load-format dummy")
    return files


def _read_header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, safetensors dtype) of every tensor of the file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return [(k, tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                    for k in f.keys()]
    except (SafetensorError, OSError) as exc:
        raise WeightLoadError(f"{path} is truncated or not a safetensors file: {exc}") from exc


def canonical_name(model: Any, key: str) -> str:
    """The canonical name of checkpoint tensor `key` (a scale's: its weight's, + _scale_inv)."""
    if Q.is_scale(key):
        return Q.scale_of(model.to_canonical(Q.weight_of(key)))
    return model.to_canonical(key)


def _expand(model: Any, path: Path, key: str, shape: tuple[int, ...]) -> list[Entry]:
    canonical = canonical_name(model, key)
    m = _FUSED.fullmatch(canonical)
    if m is None:
        return [Entry(path, key, canonical)]
    prefix, kind, scale = m.groups()
    suffix = "weight" + (scale or "")
    if len(shape) != 3:
        raise WeightLoadError(f"fused expert tensor {key} in {path.name} has shape "
                              f"{list(shape)}, expected [experts, rows, cols]")
    e_count, rows, cols = shape
    if kind == "down_proj":
        return [Entry(path, key, f"{prefix}.{e}.down_proj.{suffix}",
                      lambda s, e=e: ExpertView(s, e, 0, rows, cols)) for e in range(e_count)]
    if rows % 2:  # a scale block holding the last gate rows and the first up rows
        raise WeightLoadError(f"fused expert tensor {key} in {path.name} has {rows} rows: its "
                              "gate and up halves share a scale block, which moeserve cannot "
                              "split (the expert width must be a multiple of the block)")
    half = rows // 2  # gate rows first, then up rows
    return [Entry(path, key, f"{prefix}.{e}.{proj}.{suffix}",
                  lambda s, e=e, r0=r0: ExpertView(s, e, r0, half, cols))
            for e in range(e_count) for proj, r0 in (("gate_proj", 0), ("up_proj", half))]


def _names(model: Any, names: list[str], limit: int = 5) -> str:
    shown = ", ".join(model.from_canonical(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan_checkpoint(model: Any, folder: Path) -> list[Entry]:
    """Every tensor to load, after the strict name checks (headers only, no tensor data)."""
    expected = set(model.checkpoint_names())
    tied = model.spec.tie_word_embeddings
    entries: dict[str, Entry] = {}
    unexpected: list[str] = []
    fp8_keys: dict[str, str] = {}  # canonical name of each float8 tensor -> its key
    for path in checkpoint_files(folder):
        for key, shape, dtype in _read_header(path):
            if (_IGNORED.fullmatch(key) or (tied and key == "lm_head.weight")
                    or model.ignores_checkpoint_tensor(key)):
                continue
            if dtype in FP8_HEADER_DTYPES:
                fp8_keys.update((e.canonical, key) for e in _expand(model, path, key, shape))
            for entry in _expand(model, path, key, shape):
                if entry.canonical not in expected:
                    unexpected.append(f"{key} (in {path.name})")
                elif entry.canonical in entries:
                    raise WeightLoadError(
                        f"tensor {key} appears twice: in {entries[entry.canonical].file.name} "
                        f"and {path.name}")
                else:
                    entries[entry.canonical] = entry
    if unexpected:
        raise WeightLoadError(f"unexpected tensor(s) in the checkpoint, which the "
                              f"{model.architecture} model has no place for: "
                              f"{', '.join(sorted(set(unexpected))[:5])}"
                              + (f" and {len(set(unexpected)) - 5} more"
                                 if len(set(unexpected)) > 5 else "")
                              + "; check that config.json matches the weights")
    missing = sorted(expected - set(entries))
    if missing:
        raise WeightLoadError(f"missing tensor(s) in {folder}: {_names(model, missing)}; the "
                              "checkpoint is incomplete or does not match config.json")
    unscaled = sorted(fp8_keys[n] for n in fp8_keys if Q.scale_of(n) not in entries)
    if unscaled:
        raise WeightLoadError(f"float8 tensor(s) without a weight_scale_inv: "
                              f"{', '.join(unscaled[:5])}; an fp8 checkpoint needs "
                              "quantization_config (quant_method fp8, weight_block_size) in "
                              "config.json and a scale beside each quantized weight")
    return list(entries.values())


def _slice(entry: Entry, f: Any) -> Any:
    src = f.get_slice(entry.key)
    return entry.view(src) if entry.view else src


def _load_one(model: Any, entry: Entry, src: Any, scale: Any = None) -> None:
    """Load `src` (with its scale: as one Fp8Source) into the model."""
    try:
        if scale is not None:
            src = Fp8Source(src, scale, model.quant.block, entry.key)
        model.load_weight(entry.canonical, src)
    except (ValueError, AssertionError) as exc:
        raise WeightLoadError(f"cannot load tensor {entry.key} from {entry.file.name}: "
                              f"{exc}") from exc


def load_safetensors(model: Any, folder: str | Path, *, progress: bool = True) -> int:
    """Stream `folder`'s tensors into `model`; returns how many this rank read (a quantized
    weight and its scale count once)."""
    planned = [e for e in plan_checkpoint(model, Path(folder)) if model.needs(e.canonical)]
    scales = {Q.weight_of(e.canonical): e for e in planned if Q.is_scale(e.canonical)}
    entries = [e for e in planned if not Q.is_scale(e.canonical)]
    by_file: dict[Path, list[Entry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    with contextlib.ExitStack() as stack, tqdm(total=len(entries), desc="Loading weights",
                                               unit="tensor", disable=not progress) as bar:
        opened: dict[Path, Any] = {}

        def open_file(path: Path) -> Any:
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(str(path), framework="pt",
                                                             device="cpu"))
            return opened[path]

        for path, file_entries in by_file.items():
            try:
                f = open_file(path)
                for entry in file_entries:
                    src = _slice(entry, f)
                    scale = scales.get(entry.canonical)
                    _load_one(model, entry, src, scale and _slice(scale, open_file(scale.file)))
                    bar.update()
            except SafetensorError as exc:
                raise WeightLoadError(f"{path} could not be read (truncated or corrupt): "
                                      f"{exc}") from exc
    return len(entries)


# ------------------------------------------------------------------------------------------

def dummy_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> torch.Tensor:
    """Deterministic U(-1, 1) noise for `name`, scaled: norm weights 1 +- 0.1, biases +- 0.1,
    matrices +- 1/sqrt(fan_in)."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    u = torch.rand(shape, generator=gen, device=device, dtype=torch.float32) * 2 - 1
    if name.endswith("norm.weight"):
        u = 1 + 0.1 * u
    elif len(shape) == 1:
        u = 0.1 * u
    else:
        u = u / shape[-1] ** 0.5
    return u.to(dtype)


def init_dummy_weights(model: Any, seed: int = 0, *, progress: bool = False) -> int:
    names = [n for n in model.checkpoint_names() if model.needs(n) and not Q.is_scale(n)]
    device = next(model.parameters()).device
    for name in tqdm(names, desc="Dummy weights", unit="tensor", disable=not progress):
        model.load_weight(name, dummy_tensor(name, model.checkpoint_shape(name), model.dtype,
                                             device, seed))
    return len(names)


def load_weights(model: Any, cfg: EngineConfig, *, progress: Optional[bool] = None) -> int:
    """Fill `model` per cfg.load_format from cfg.model; returns the tensors this rank read.
    The progress bar shows on rank 0 unless `progress` says otherwise."""
    if progress is None:
        progress = model.state.rank == 0
    if cfg.load_format == "dummy":
        return init_dummy_weights(model, progress=progress)
    if cfg.model.startswith("preset:"):
        raise WeightLoadError(f"{cfg.model} is a shape without weights; add --load-format "
                              "dummy, or give a checkpoint folder as --model")
    folder = Path(cfg.model)
    if folder.is_file():
        folder = folder.parent
    return load_safetensors(model, folder, progress=progress)
