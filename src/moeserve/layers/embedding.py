"""Vocab-parallel token embedding and LM head over one axis (attn_tp).

The vocabulary is padded to a multiple of the axis size; rank r holds rows
[r * V_pad/tp, (r+1) * V_pad/tp). The embedding looks up the ids it holds, zeroes the others
and all-reduces; the LM head computes its slice of the logits and all-gathers them. With tied
embeddings the LM head reads the embedding's weight.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from moeserve.layers.linear import axis_all_gather
from moeserve.layers.weights import copy_into, empty_param, expect_shape, read
from moeserve.parallel import collectives as C
from moeserve.parallel.groups import Axis


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, *, axis: Axis, dtype: torch.dtype):
        super().__init__()
        self.vocab_size, self.hidden, self.axis = vocab_size, hidden, axis
        self.vocab_local = -(-vocab_size // axis.size)
        self.vocab_start = axis.rank * self.vocab_local
        # rows of this rank that are real tokens (the last rank may hold padding rows)
        self.rows_real = max(0, min(vocab_size - self.vocab_start, self.vocab_local))
        self.weight = empty_param(self.vocab_local, hidden, dtype=dtype)

    def forward(self, ids_T: torch.Tensor) -> torch.Tensor:
        if self.axis.size == 1:
            return nn.functional.embedding(ids_T, self.weight)
        local = ids_T - self.vocab_start
        outside = (local < 0) | (local >= self.rows_real)
        x_TH = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x_TH = x_TH.masked_fill(outside[:, None], 0)
        return C.all_reduce(x_TH, self.axis)

    def load_weight(self, param_name: str, src: Any) -> None:
        expect_shape(param_name, src, (self.vocab_size, self.hidden))
        with torch.no_grad():
            self.weight[self.rows_real:].zero_()
        if self.rows_real:
            rows = (self.vocab_start, self.vocab_start + self.rows_real)
            copy_into(self.weight[:self.rows_real], read(src, rows=rows), param_name)


class ParallelLMHead(nn.Module):
    """logits_TV = h_TH @ W_VH.T, vocab split across the axis, gathered on every rank."""

    def __init__(self, vocab_size: int, hidden: int, *, axis: Axis, dtype: torch.dtype,
                 tied_to: Optional[VocabParallelEmbedding] = None):
        super().__init__()
        self.vocab_size, self.hidden, self.axis = vocab_size, hidden, axis
        self.tied = tied_to is not None
        self.embedding = tied_to if tied_to is not None else VocabParallelEmbedding(
            vocab_size, hidden, axis=axis, dtype=dtype)

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding.weight

    def forward(self, h_TH: torch.Tensor) -> torch.Tensor:
        local_TV = nn.functional.linear(h_TH, self.embedding.weight)
        return axis_all_gather(local_TV, self.axis, dim=-1)[:, :self.vocab_size]

    def load_weight(self, param_name: str, src: Any) -> None:
        assert not self.tied, "a tied LM head loads through the embedding"
        self.embedding.load_weight(param_name, src)
