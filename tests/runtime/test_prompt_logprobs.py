"""Prompt logprobs, logit_bias and min_tokens through a real Engine, against transformers.

Prompt logprobs must cover every prompt token after the first whatever the prefix cache holds
and however the prompt is chunked (max_running_requests bounds the scored rows of a step)."""

import pytest
import torch

from moeserve.runtime.engine import Engine
from moeserve.runtime.sampling import SamplingParams
from moeserve.testing.tiny_models import make_hf_model, save_checkpoint

pytestmark = pytest.mark.timeout(300)
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             intermediate_size=48, vocab_size=96, norm_topk_prob=True)
BASE = dict(dtype="float32", max_total_tokens=2048, context_length=128, skip_tokenizer_init=True,
            disable_cuda_graph=True, disable_piecewise_cuda_graph=True, device="cpu",
            in_process=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.manual_seed(0)
    hf = make_hf_model("Qwen3MoeForCausalLM", seed=3, **SHAPE)
    folder = save_checkpoint(hf, tmp_path_factory.mktemp("qwen3"))
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, SHAPE["vocab_size"], (23,), generator=g).tolist()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)
    return str(folder), prompt, ref


@pytest.fixture(scope="module")
def engine(model):
    # at most 3 running requests: a prompt is scored 3 positions a step, with a cached prefix
    eng = Engine(model[0], max_running_requests=3, chunked_prefill_size=8, **BASE)
    yield eng
    eng.shutdown()


def _check_against(ref, prompt, got, top):
    assert len(got) == len(prompt) - 1
    for p, e in enumerate(got):
        row = ref[p]
        assert e["token_id"] == prompt[p + 1]
        assert e["logprob"] == pytest.approx(row[prompt[p + 1]].item(), abs=2e-4)
        assert e["rank"] == 1 + int((row > row[prompt[p + 1]] + 1e-6).sum())
        want = row.topk(top)
        assert [t for t, _ in e["top"]] == want.indices.tolist()
        assert [v for _, v in e["top"]] == pytest.approx(want.values.tolist(), abs=2e-4)


def test_prompt_logprobs_every_token_despite_the_prefix_cache(engine, model):
    _, prompt, ref = model
    greedy = dict(max_new_tokens=2, temperature=0)
    warm = engine.generate(input_ids=prompt, sampling_params=greedy)
    again = engine.generate(input_ids=prompt, sampling_params=greedy)
    assert again["usage"]["cached_tokens"] > 0 and warm["prompt_logprobs"] is None
    out = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=2, temperature=0, prompt_logprobs=4))
    assert out["usage"]["cached_tokens"] == 0
    _check_against(ref, prompt, out["prompt_logprobs"], 4)
    assert out["token_ids"] == warm["token_ids"] == again["token_ids"]


def test_prompt_logprobs_in_a_batch_with_others(engine, model):
    """Requests with and without prompt logprobs, different top counts, in one batch."""
    _, prompt, ref = model
    outs = engine.generate(input_ids=[prompt, prompt[:5], prompt], sampling_params=[
        dict(max_new_tokens=3, prompt_logprobs=0), dict(max_new_tokens=3),
        dict(max_new_tokens=3, prompt_logprobs=2, logprobs=True)])
    _check_against(ref, prompt, outs[0]["prompt_logprobs"], 0)
    _check_against(ref, prompt, outs[2]["prompt_logprobs"], 2)
    assert outs[1]["prompt_logprobs"] is None
    one = engine.generate(input_ids=prompt[:1], sampling_params=dict(max_new_tokens=1,
                                                                     prompt_logprobs=1))
    assert one["prompt_logprobs"] is None and one["error"] is None  # nothing to score


def test_logit_bias_moves_greedy_tokens(engine, model):
    _, prompt, _ = model
    plain = engine.generate(input_ids=prompt, sampling_params=dict(max_new_tokens=6,
                                                                   temperature=0))["token_ids"]
    forced = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=6, temperature=0, logit_bias={57: 100.0}))["token_ids"]
    assert forced == [57] * 6
    banned = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=6, temperature=0, logit_bias={t: -100.0 for t in set(plain)}))
    assert not set(banned["token_ids"]) & set(plain)
    sampled = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=8, temperature=1.0, seed=5, logit_bias={7: 100.0, 8: 100.0}))
    assert set(sampled["token_ids"]) <= {7, 8}


def test_min_tokens_holds_back_stop_tokens(engine, model):
    _, prompt, _ = model
    first = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=6, temperature=0, ignore_eos=True))["token_ids"][0]
    ended = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=6, temperature=0, stop_token_ids=[first]))
    assert ended["token_ids"] == [first] and ended["finish_reason"] == "stop"
    held = engine.generate(input_ids=prompt, sampling_params=dict(
        max_new_tokens=6, temperature=0, stop_token_ids=[first], min_tokens=4))
    assert len(held["token_ids"]) >= 4 and first not in held["token_ids"][:4]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=2, min_tokens=3)
