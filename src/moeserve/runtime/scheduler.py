"""The scheduler of one DP rank: waiting queue, running batch, continuous batching, chunked
prefill, admission under the plan's token budget and free KV, and preemption.

It decides; the model runner executes. Its decisions depend only on its inputs, so the attn_tp
ranks of a DP group, fed the same requests, take the same decisions without talking.

Overlap schedule: a step may be scheduled before the tokens of the step in flight are read
back. A request then holds an unresolved token (`Req.unresolved`), and its decode input is a
placeholder, -(j + 1), for row j of the sampled tokens of the step in flight, which the runner
resolves on the device. A request that that token will end by length is left out of the
step; one that it ends by a stop token runs one row more, whose token `process` drops. A
retraction needs the tokens themselves and waits for them (`needs_tokens`); penalties count
the token in flight on the device (SamplingBatch.build's `pending`).

Mixed chunks (--enable-mixed-chunk): a prefill step also carries the decode token of each
running request that a decode step would take, so that admitting a request does not stall the
running ones for a step. The decodes come last in the batch (an extend of one token each, on
its prefix of kv_len - 1) and take their tokens out of the step's extend budget. A step mixes
only when the KV cache holds every decode token without a retraction (under KV pressure the
running requests decode alone, retracting as a decode step does), and only when a token of
the budget is left for the prefill.

Prompt logprobs: a request that asks for them takes no cached prefix, and each step's chunk
of its prompt gets logits at every position (`PromptLogprobRows`), not only at the last; those
rows are at most max_running_requests a step, so that the step's logits stay within twice a
full batch's: a longer prompt is prefilled in chunks of that many tokens.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from moeserve.plan.budget import TokenBudget
from moeserve.batch.forward_batch import ForwardMode
from moeserve.runtime.grammar import GrammarBackend, GrammarError, allows_no_token
from moeserve.runtime.kv_manager import KVManager
from moeserve.runtime.limits import PromptError, check_prompt
from moeserve.runtime.request import Req, ReqState, RequestInput, TokenOutput
from moeserve.runtime.sampling import Finish
from moeserve.runtime.tokenizer import TokenizerError


@dataclass(frozen=True)
class PromptLogprobRows:
    """The rows of a step (indices into its tokens) whose logits score a prompt token, that
    token, and how many of the rows belong to each request of the batch, in order."""

    rows: list[int]
    targets: list[int]
    counts: list[int]
    top: int  # the most top tokens one of those requests asks for


@dataclass
class ScheduledBatch:
    """One forward of this DP rank: requests, and for each the tokens it computes now."""

    mode: ForwardMode
    reqs: list[Req]
    new_tokens: list[list[int]]
    prefix_lens: list[int]  # kv_len of each request before this forward
    out_cache_loc: torch.Tensor  # [T] slots of the new tokens
    samples: list[bool]  # whether each request samples a token after this forward
    rows: list[int]  # each request's row of the request table (a request ended by the step
    # before this one's launch has given its row back, but the forward still reads it)
    has_futures: bool = False  # some new token is a placeholder (see the module's doc)
    prompt_logprobs: Optional[PromptLogprobRows] = None

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)


class Scheduler:
    def __init__(self, budget: TokenBudget, kv: KVManager,
                 eos_token_ids: Sequence[int] = (),
                 grammars: Optional[Callable[[], GrammarBackend]] = None,
                 mixed_chunk: bool = False) -> None:
        """`grammars` gives the rank's GrammarBackend (built on first use) for requests with
        a grammar; `mixed_chunk`: prefill steps carry the running requests' decodes."""
        self.grammars = grammars
        self.mixed_chunk = mixed_chunk
        self.budget = budget
        self.kv = kv
        self.eos = frozenset(eos_token_ids)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.chunked: Optional[Req] = None
        self._arrivals = 0
        self.num_retracted = 0
        self.rejected: list[TokenOutput] = []

    # --- input ----------------------------------------------------------------------------
    def add(self, inp: RequestInput) -> None:
        ctx = self.budget.context_length
        try:
            check_prompt(len(inp.input_ids), ctx, "shorten the prompt or raise --context-length")
        except PromptError as exc:
            self.rejected.append(TokenOutput(inp.rid, [], Finish("error"), error=str(exc),
                                             invalid_request=True))
            return
        req = Req(inp, self.eos, self._arrivals, ctx)
        if inp.grammar is not None:
            # compiled here, at the same point of the same iteration on every rank of the DP
            # group, so that their decisions stay the same (a cached grammar costs nothing)
            try:
                if self.grammars is None:
                    raise GrammarError("this scheduler has no grammar backend")
                req.matcher = self.grammars().matcher(inp.grammar)
            except (GrammarError, TokenizerError) as exc:
                self.rejected.append(TokenOutput(inp.rid, [], Finish("error"), error=str(exc),
                                                 invalid_request=True))
                return
        self._arrivals += 1
        self.waiting.append(req)

    def abort(self, rid: str) -> Optional[TokenOutput]:
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.rid == rid:
                    queue.remove(req)
                    return self._finish(req, Finish("abort"))
        if self.chunked is not None and self.chunked.rid == rid:
            req, self.chunked = self.chunked, None
            return self._finish(req, Finish("abort"))
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def needs_tokens(self) -> bool:
        """Whether the next schedule needs the tokens of the step in flight: a retraction
        recomputes from them. (Penalties do not: the sampler counts a token in flight on the
        device, from the placeholder's row.)"""
        if not any(r.unresolved for r in self.running):
            return False
        return self.kv.available_slots < len(self.running) + self._page_slack()

    # --- decisions ------------------------------------------------------------------------
    def schedule(self) -> Optional[ScheduledBatch]:
        """The next forward: a prefill when requests wait and fit, else a decode of the
        running batch; None when there is nothing to run."""
        decoding = self._mixable()
        batch = self._schedule_prefill(decoding)
        if batch is None and self.running:
            batch = self._schedule_decode()
        if batch is None:
            return None
        limit = self.budget.extend if batch.mode is ForwardMode.EXTEND else self.budget.decode
        assert batch.num_tokens <= limit, (batch.mode, batch.num_tokens, self.budget)
        j = 0
        for req, samples in zip(batch.reqs, batch.samples):
            if samples:  # its next token is row j of this step's sampled tokens
                req.unresolved += 1
                req.future_row, j = j, j + 1
                if req.state is not ReqState.RUNNING:  # its prefill ends with this step
                    req.state = ReqState.RUNNING
                    self.running.append(req)
        return batch

    def _mixable(self) -> list[Req]:
        """The running requests whose decodes a prefill step carries: none without
        --enable-mixed-chunk, when the KV cache is short of their tokens (a decode step
        retracts then), or when they would leave the prefill no token of the budget."""
        if not self.mixed_chunk or not (self.waiting or self.chunked):
            return []
        if self.kv.available_slots < len(self.running) + self._page_slack():
            return []
        want = self._decoding()
        return want if len(want) < self.budget.extend else []

    def _decoding(self) -> list[Req]:
        # a request whose token in flight ends it by length sits this step out
        return [r for r in self.running if not r.unresolved or r.num_output < r.stop.max_output]

    def _schedule_prefill(self, decoding: Sequence[Req] = ()) -> Optional[ScheduledBatch]:
        """A prefill step, and with it the decodes of `decoding` (running requests) when they
        fit beside it."""
        b = self.budget
        left = b.extend - len(decoding)
        room = b.max_running_requests - len(self.running)
        reqs: list[Req] = []
        takes: list[int] = []
        lp_left = b.max_running_requests  # prompt logprob rows of this step
        chunked, self.chunked = self.chunked, None
        for req in ([chunked] if chunked else []) + list(self.waiting):
            scores = req.needs_prompt_logprobs
            if (left <= 0 or room <= 0 or (scores and lp_left <= 0)
                    or not self.kv.admit(req)):
                break
            if req.first_run:
                req.prompt_cached_tokens, req.first_run = req.cached_len, False
            take = req.pending
            if b.chunk_tokens is not None:
                take = min(take, left)
            elif take > left and reqs:
                break
            if scores:
                take = min(take, lp_left)
            # leave room for the next decode step of everything already running
            # (and for this step's decodes)
            reserve = (len(self.running) + len(decoding) + len(reqs) + 1
                       + self._page_slack())
            if self.kv.available_slots < take + reserve or not self.kv.claim(req, take):
                if reqs or self.running:
                    if req is not chunked:
                        self.kv.release(req)  # holds no computed K/V: drop row and lock
                    break  # wait for running requests to free their KV
                self._drop_unfittable(req)  # nothing else holds KV: it can never fit
                continue
            if req is not chunked:
                self.waiting.remove(req)
            reqs.append(req)
            takes.append(take)
            left -= take
            lp_left -= take if scores else 0
            room -= 1
            if req.pending > 0:
                self.chunked = req
                req.state = ReqState.PREFILLING
                break
        if chunked is not None and chunked not in reqs and chunked.state is not ReqState.FINISHED:
            self.chunked = chunked  # its next chunk did not fit this step
        if not reqs:
            return None
        if decoding and sum(takes) + len(decoding) <= b.extend:  # (a whole prompt may not)
            got = self.kv.claim_next(list(decoding))
            reqs += got  # (one the cache could not hold a slot for sits this step out)
            takes += [1] * len(got)
        return self._batch(ForwardMode.EXTEND, reqs, takes, self.kv.record(reqs, takes))

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        if self.needs_tokens():
            return None  # no step until the tokens in flight are back (the worker's rule too)
        while self.kv.available_slots < len(self.running) + self._page_slack():
            if self.chunked is not None:  # a half-prefilled request yields first
                req, self.chunked = self.chunked, None
            elif len(self.running) > 1:
                req = max(self.running, key=lambda r: r.arrival)
                self.running.remove(req)
            else:
                break  # one request left: claim() below decides
            self._retract(req)
        want = self._decoding()
        reqs = self.kv.claim_next(want)
        got = set(reqs)
        for req in [r for r in want if r not in got]:
            self.running.remove(req)
            self.rejected.append(self._finish(req, Finish("error"), error=(
                "the KV cache is full even after preempting every other request; raise "
                "--max-total-tokens / --mem-fraction-static or lower max_new_tokens")))
        if not reqs:
            return None
        return self._batch(ForwardMode.DECODE, reqs, [1] * len(reqs),
                           self.kv.record(reqs, [1] * len(reqs)))

    def _page_slack(self) -> int:
        # with pages, each request may need a fresh page for its next token
        return 0 if self.kv.page_size == 1 else len(self.running) * (self.kv.page_size - 1)

    def _batch(self, mode: ForwardMode, reqs: list[Req], takes: list[int],
               loc: torch.Tensor) -> ScheduledBatch:
        """Requests have reserved their slots already (kv_len moved by `take`) and written
        them into the request table; `loc` are those slots in batch order (int64, as
        KVManager.record returns them)."""
        prefix = [r.kv_len - t for r, t in zip(reqs, takes)]
        # an unresolved token (only ever a decode's one new token) is a placeholder
        new = [[-1 - r.future_row] if r.unresolved else r.ids(p, p + t)
               for r, p, t in zip(reqs, prefix, takes)]
        samples = [r.kv_len == r.seq_len + r.unresolved for r in reqs]
        return ScheduledBatch(mode, reqs, new, prefix, loc, samples,
                              [r.row for r in reqs], any(r.unresolved for r in reqs),
                              _prompt_logprob_rows(reqs, prefix, takes))

    def _retract(self, req: Req) -> None:
        """Preempt a request: its K/V goes to the prefix cache (or is freed), and it waits at
        the front of the queue to be computed again from prompt + output so far."""
        self.kv.release(req)
        req.state = ReqState.WAITING
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def _drop_unfittable(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req, cache=False)
        self.rejected.append(self._finish(req, Finish("error"), error=(
            f"the request needs {req.seq_len} KV slots and the cache can hold "
            f"{self.kv.available_slots}; raise --max-total-tokens / --mem-fraction-static")))

    def drain_rejected(self) -> list[TokenOutput]:
        """Requests that ended without a forward (bad input, no room): report them once."""
        out, self.rejected = self.rejected, []
        return out

    def fail(self, batch: ScheduledBatch, error: str) -> list[TokenOutput]:
        """End every request of a batch that could not run (the runtime guard refused it)."""
        outs = []
        for req in batch.reqs:
            if req.state is ReqState.FINISHED:
                continue
            if req in self.running:
                self.running.remove(req)
            if self.chunked is req:
                self.chunked = None
            outs.append(self._finish(req, Finish("error"), error=error))
        return outs

    # --- results --------------------------------------------------------------------------
    def process(self, batch: ScheduledBatch, token_ids: Sequence[int],
                logprobs: Optional[Sequence[dict[str, Any]]] = None,
                prompt_logprobs: Optional[Sequence[list[dict[str, Any]]]] = None,
                failed: Optional[dict[int, str]] = None) -> list[TokenOutput]:
        """Apply one forward's sampled tokens (one per request of the batch; ignored where the
        request did not sample) and prompt logprobs, and return the news for the engine.
        `failed`: the batch's requests whose own sampling failed (row -> why): they end with
        that error, the others go on."""
        outputs: list[TokenOutput] = []
        for i, req in enumerate(batch.reqs):
            if prompt_logprobs is not None and req.state is not ReqState.FINISHED:
                req.prompt_logprobs += prompt_logprobs[i]
            if not batch.samples[i]:
                continue
            req.unresolved -= 1
            if req.state is ReqState.FINISHED:
                continue  # aborted, or ended by a token before this one, while it ran
            assert req.state is ReqState.RUNNING, req  # (never retracted with a token away)
            if failed and i in failed:
                self.running.remove(req)
                outputs.append(self._finish(req, Finish("error"), error=failed[i]))
                continue
            token = int(token_ids[i])
            req.output_ids.append(token)
            if logprobs is not None and req.params.logprobs:
                req.logprobs.append(logprobs[i])
            if req.matcher is not None and not req.matcher.accept_token(token):
                self.running.remove(req)
                outputs.append(self._grammar_failed(req, token))
                continue
            finish = req.stop.check_token(token, len(req.output_ids))
            if finish is None and req.matcher is not None and req.matcher.is_terminated():
                finish = Finish("stop")  # the grammar has ended: nothing may follow
            if finish is not None:
                self.running.remove(req)
                outputs.append(self._finish(req, finish))
            elif req.stream:
                outputs.append(self._delta(req))
        return outputs

    def _delta(self, req: Req) -> TokenOutput:
        out = TokenOutput(req.rid, req.output_ids[req.sent_tokens:],
                          logprobs=req.logprobs[req.sent_logprobs:],
                          prompt_tokens=len(req.prompt_ids),
                          cached_tokens=req.prompt_cached_tokens,
                          prompt_logprobs=req.prompt_logprobs[req.sent_prompt_logprobs:])
        req.sent_tokens, req.sent_logprobs = len(req.output_ids), len(req.logprobs)
        req.sent_prompt_logprobs = len(req.prompt_logprobs)
        return out

    def _finish(self, req: Req, finish: Finish, error: Optional[str] = None,
                invalid_request: bool = False) -> TokenOutput:
        self.kv.release(req)
        req.state = ReqState.FINISHED
        req.finish = finish
        out = self._delta(req)
        out.finish, out.error, out.invalid_request = finish, error, invalid_request
        return out

    def _grammar_failed(self, req: Req, token: int) -> TokenOutput:
        """The end of a request whose sampled `token` (its last output id) its grammar
        refuses: a dead end of the grammar, where its mask allowed no token of this vocabulary
        (the request's fault), or else a mask that was not applied (ours). The token stays in
        output_ids (a step in flight may hold its K/V slot) but is not sent."""
        n = len(req.output_ids) - 1
        if allows_no_token(req.matcher, self.grammars().vocab_size):
            out = self._finish(req, Finish("error"), invalid_request=True, error=(
                f"the request's grammar allows no token after {n} output token"
                f"{'' if n == 1 else 's'}: no text that this model's vocabulary can write "
                "continues it"))
        else:
            out = self._finish(req, Finish("error"), error=(
                f"the sampled token {token} does not follow the request's grammar"))
        if len(out.logprobs) == len(out.token_ids):
            out.logprobs = out.logprobs[:-1]
        out.token_ids = out.token_ids[:-1]
        return out


def _prompt_logprob_rows(reqs: list[Req], prefix: list[int],
                         takes: list[int]) -> Optional[PromptLogprobRows]:
    """The rows of a step whose logits score prompt tokens not yet scheduled for scoring:
    position p (row start + p - prefix of its request) scores prompt token p + 1."""
    rows: list[int] = []
    targets: list[int] = []
    counts: list[int] = []
    start = 0
    for req, p, t in zip(reqs, prefix, takes):
        n = 0
        if req.needs_prompt_logprobs:
            lo, hi = max(p, req.prompt_lp_scheduled), min(p + t, len(req.prompt_ids) - 1)
            n = max(0, hi - lo)
            rows += range(start + lo - p, start + hi - p)
            targets += req.prompt_ids[lo + 1:hi + 1]
            req.prompt_lp_scheduled = max(req.prompt_lp_scheduled, hi)
        counts.append(n)
        start += t
    if not rows:
        return None
    top = max(r.params.prompt_logprobs or 0 for r, n in zip(reqs, counts) if n)
    return PromptLogprobRows(rows, targets, counts, top)
