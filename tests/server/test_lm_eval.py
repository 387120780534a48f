"""lm-evaluation-harness's `local-completions` model against a real `moeserve serve`: a
loglikelihood (multiple-choice) task and a generate_until task, both defined here over local
JSON files; nothing comes from the hub. The checkpoint is a tiny Qwen3-MoE with random weights
and a byte-level BPE tokenizer trained here, which lm-eval loads with transformers. The
loglikelihoods lm-eval computes from the server's echoed prompt logprobs must equal those of
transformers' forward on the same tokens."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moeserve.testing.tiny_models import make_hf_model, save_checkpoint
from server_proc import ServerProcess

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(600)
CORPUS = ["The cat sat on the mat.", "A dog ran in the park.", "Two plus two is four.",
          "The sky is blue and the grass is green.", "Paris is the capital of France."] * 20
MC = [{"question": "The cat sat on the", "choices": ["mat", "dog", "sky"], "answer": 0},
      {"question": "Two plus two is", "choices": ["four", "blue"], "answer": 0},
      {"question": "Paris is the capital of", "choices": ["France", "the park"], "answer": 0}]
GEN = [{"question": "The sky is", "answer": " blue"}, {"question": "A dog ran", "answer": " in"}]
TASKS = """
task: moeserve_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
doc_to_target: {target}
{extra}
"""
MC_EXTRA = """doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc"""
GEN_EXTRA = """generation_kwargs:
  until: ["."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path_factory.mktemp("lm_eval_ckpt")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    model = make_hf_model("Qwen3MoeForCausalLM", seed=5, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                          intermediate_size=48, vocab_size=tok.get_vocab_size(),
                          max_position_embeddings=512, norm_topk_prob=True,
                          eos_token_id=tok.token_to_id("<|endoftext|>"))
    save_checkpoint(model, folder)
    hf_tok.save_pretrained(str(folder))
    return folder, model, hf_tok


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, rows, output_type, target, extra in [
            ("mc", MC, "multiple_choice", '"{{answer}}"', MC_EXTRA),
            ("gen", GEN, "generate_until", '"{{answer}}"', GEN_EXTRA)]:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(TASKS.format(
            name=name, data=data, output_type=output_type, target=target, extra=extra))
    return folder


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("lm_eval") / "server.log",
                         "--model", str(checkpoint[0]), "--load-format", "auto",
                         "--served-model-name", "tiny-eval", "--dtype", "float32")
    yield proc
    assert proc.terminate() == 0, proc.log()


def _reference_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """As lm-eval splits a pair: trailing spaces go to the continuation, the whole is
    encoded and the context's tokens are cut off it."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n = len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    return sum(lp[i - 1, whole[i]].item() for i in range(n, len(whole)))


def test_lm_eval_local_completions(server, checkpoint, tasks, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    folder, model, tok = checkpoint
    out = simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny-eval", "base_url": server.url + "/v1/completions",
                    "tokenizer": str(folder), "tokenizer_backend": "huggingface",
                    "num_concurrent": 2, "max_retries": 1, "max_length": 256},
        tasks=["moeserve_mc", "moeserve_gen"], task_manager=TaskManager(
            include_path=str(tasks), include_defaults=False),
        log_samples=True, num_fewshot=0)
    results = out["results"]
    assert 0.0 <= results["moeserve_mc"]["acc,none"] <= 1.0
    assert 0.0 <= results["moeserve_gen"]["exact_match,none"] <= 1.0

    mc = out["samples"]["moeserve_mc"]
    assert len(mc) == len(MC)
    for sample in mc:
        for (context, continuation), (resp,) in zip(
                [a[:2] for a in sample["arguments"]], sample["resps"]):
            ll, _greedy = resp
            want = _reference_loglikelihood(model, tok, context, continuation)
            assert ll == pytest.approx(want, abs=2e-3), (context, continuation)
    gen = out["samples"]["moeserve_gen"]
    assert len(gen) == len(GEN)
    for sample in gen:
        text = sample["resps"][0][0]
        assert isinstance(text, str) and "." not in text  # `until` ended it
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
