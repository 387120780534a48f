"""Tiny random Hugging Face MoE checkpoints and a minimal runner, for tests that compare
moeserve with transformers.

    hf = make_hf_model("MixtralForCausalLM", seed=0, hidden_size=32, ...)
    save_checkpoint(hf, folder, max_shard_size="20KB")
    ref = hf_logits(hf, prompts)                       # list of [len, V] fp32
    model, state, plan = load_tiny(folder, state)      # moeserve, on this rank's layout
    got = TinyRunner(model, state, plan).extend(prompts)

Weights are redrawn after transformers' init (std 0.02 would make every block a small
perturbation of the residual, hiding errors): matrices with fan-in scaling, norms 1 +- 0.3,
biases +- 0.3, so attention, routing and experts all move the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from moeserve.config import EngineConfig
from moeserve.config.spec import load_model_spec
from moeserve.parallel.groups import ParallelState
from moeserve.batch.step import StepContext, gather_ints, step_from_counts
from moeserve.plan.capacity import CapacityPlan, build_plan
from moeserve.batch.forward_batch import ForwardMode, prepare_batch
from moeserve.runtime.buffers import bind_buffers

HF_CLASSES = {
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
    "OlmoeForCausalLM": ("OlmoeConfig", "OlmoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def make_hf_model(architecture: str, seed: int, **config: Any) -> Any:
    """A transformers model of `architecture` in fp32 with eager attention and redrawn
    weights."""
    import transformers

    cfg_name, cls_name = HF_CLASSES[architecture]
    hf_cfg = getattr(transformers, cfg_name)(**config)
    model = getattr(transformers, cls_name)._from_config(hf_cfg, attn_implementation="eager",
                                                        dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=gen) * 2 - 1
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * u)
            elif p.dim() == 1:
                p.copy_(0.3 * u)
            else:
                p.copy_(u * 3 ** 0.5 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():  # DeepSeek-V3's routing bias, zeros at init
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * (torch.rand(b.shape, generator=gen) * 2 - 1))
    return model.eval()


def save_checkpoint(model: Any, folder: str | Path, max_shard_size: Optional[str] = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return Path(folder)


@torch.no_grad()
def hf_logits(model: Any, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Logits [len, V] of each prompt, run alone (no padding)."""
    return [model(torch.tensor([list(p)])).logits[0].float() for p in prompts]


def tiny_config(folder: str | Path, **overrides: Any) -> EngineConfig:
    """An engine config for a tiny checkpoint: fp32, small KV cache, eager."""
    base = dict(model=str(folder), dtype="float32", max_total_tokens=1024, context_length=128,
                max_running_requests=32, disable_cuda_graph=True,
                disable_piecewise_cuda_graph=True, gpu_memory_gb=1.0)
    return EngineConfig(**{**base, **overrides})


def exchange_step(num_tokens: int, state: ParallelState, plan: CapacityPlan,
                  num_padding: int = 0) -> StepContext:
    """The step of a forward of `num_tokens` rows on this rank (the last `num_padding` of
    them padding), as the rank loop makes it: every rank's count in one exchange, then the
    same geometry on every rank (every rank calls it, also with zero tokens)."""
    counts = [c[0] for c in gather_ints([num_tokens], state)]
    return step_from_counts(counts, state.layout, state.rank, plan, num_padding)


def load_tiny(cfg: EngineConfig, state: ParallelState) -> tuple[torch.nn.Module, CapacityPlan]:
    """The model of cfg on this rank, with the plan for the state's device (so that its
    records are the buffers of what the rank runs there)."""
    from moeserve.models.loader import load_weights
    from moeserve.models.build import build_model

    spec = load_model_spec(cfg.model)
    cfg = cfg.replace(device=state.device.type)
    plan = build_plan(cfg, spec)
    if not plan.ok:
        raise ValueError("; ".join(str(e) for e in plan.errors))
    model = build_model(cfg, spec, state, plan)
    load_weights(model, cfg, progress=False)
    return model, plan


class TinyRunner:
    """Runs whole batches through the model with the plan's buffers (its own KV pool and
    request table, and the model's, which it binds as the engine's model runner does)."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, plan: CapacityPlan):
        self.model, self.state, self.plan = model, state, plan
        self.buffers = bind_buffers(plan, state.device)
        model.bind_buffers(self.buffers.model)
        self.kv, self.rows = self.buffers.kv_pool, self.buffers.req_pool
        self.req_rows: dict[int, int] = {}  # request id -> row of the request table
        self.lens: dict[int, int] = {}  # request id -> tokens in the cache

    @torch.no_grad()
    def forward(self, mode: ForwardMode, new_tokens: Sequence[Sequence[int]],
                req_indices: Sequence[int], all_logits: bool = True) -> torch.Tensor:
        """One forward of `new_tokens` for requests `req_indices` (new ones get a row);
        logits of every new token (or each request's last) in order."""
        for i in req_indices:
            if i not in self.req_rows:
                row = self.rows.alloc()
                if row is None:
                    raise RuntimeError("the request table is full: raise max_running_requests")
                self.req_rows[i], self.lens[i] = row, 0
        prefix = [self.lens[i] for i in req_indices]
        fb = prepare_batch(mode, new_tokens, prefix, [self.req_rows[i] for i in req_indices],
                           self.rows, self.kv, return_all_logits=all_logits)
        for i, toks in zip(req_indices, new_tokens):
            self.lens[i] += len(toks)
        step = exchange_step(fb.num_tokens, self.state, self.plan)
        return self.model(fb.input_ids, fb.positions, fb, step)

    def idle(self) -> torch.Tensor:
        """A zero-token forward: this rank still joins the step's collectives."""
        from moeserve.batch.forward_batch import ForwardBatch

        fb = ForwardBatch.idle(self.rows.table, self.kv)
        step = exchange_step(0, self.state, self.plan)
        with torch.no_grad():
            return self.model(fb.input_ids, fb.positions, fb, step)


def compare_three_ways(runner: TinyRunner, prompts: Sequence[Sequence[int]],
                       decode: Sequence[Sequence[int]], ref: Sequence[torch.Tensor],
                       first: Sequence[int], base: int = 0) -> list[tuple[str, float]]:
    """Relative errors against `ref` (logits [len(prompt + decode), V] of each full sequence)
    of: whole prompts in one extend; the prompts again as new requests, in two chunks (the
    second after the first `first[i]` tokens are cached); then one decode step per token of
    `decode` (teacher-forced). Request ids start at `base` and use 2 x len(prompts) ids."""
    n = len(prompts)
    errs = []
    whole = split_rows(runner.forward(ForwardMode.EXTEND, prompts, range(base, base + n)),
                       [len(p) for p in prompts])
    errs += [(f"extend prompt {i}", rel_err(g, r[:len(p)]))
             for i, (g, r, p) in enumerate(zip(whole, ref, prompts))]
    ids = range(base + n, base + 2 * n)
    runner.forward(ForwardMode.EXTEND, [p[:k] for p, k in zip(prompts, first)], ids)
    rest = [p[k:] for p, k in zip(prompts, first)]
    keep = [i for i, r in enumerate(rest) if r]
    if keep:
        got = split_rows(runner.forward(ForwardMode.EXTEND, [rest[i] for i in keep],
                                        [ids[i] for i in keep]), [len(rest[i]) for i in keep])
        errs += [(f"chunk after prefix {i}", rel_err(g, ref[i][first[i]:len(prompts[i])]))
                 for g, i in zip(got, keep)]
    for s in range(len(decode[0])):
        got = runner.forward(ForwardMode.DECODE, [[d[s]] for d in decode], ids)
        errs += [(f"decode {s} of request {i}", rel_err(got[i], ref[i][len(prompts[i]) + s]))
                 for i in range(n)]
    return errs


def split_rows(logits: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return list(logits.split(list(lengths)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
