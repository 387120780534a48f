"""The tokenizer: a byte-level BPE trained here, saved as transformers saves tokenizers, loaded
by moeserve; incremental detokenization one token at a time, chat templates as transformers
renders them, EOS ids from the checkpoint's files."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from moeserve.runtime.tokenizer import REPLACEMENT, TokenizerError, load_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Mixture-of-experts models route every token to a few experts.",
    "你好，世界！今天天气很好。我们一起去公园散步吧。",
    "東京は日本の首都です。カタカナとひらがな。",
    "Emoji: 😀 😃 🎉 🚀 and flags 🇯🇵 🇫🇷, a wave 👋🏽.",
    "Numbers 1234567890 and symbols #$%&*()[]{}<>.",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# characters the corpus never shows, whose bytes must span several tokens
TEXT = ("Hello 世界! 你好，朋友 🙂🧑‍🚀 — naïve café; 한국어 텍스트, Ünïcödé 𝔘𝔫𝔦 "
        "and 🇯🇵 done.")

QWEN_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0]['content'] if messages[0]['role'] == "
    "'system' else 'You are helpful.' }}\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{% endgeneration %}{% else %}"
    "{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")

MESSAGES = [
    {"role": "system", "content": "Answer in \"quotes\" & <tags>."},
    {"role": "user", "content": "你好 👋"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo <now>",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def trained():
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def checkpoint(trained, tmp_path_factory):
    """The tokenizer saved by transformers, plus a generation_config.json with two EOS ids."""
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tok")
    hf = PreTrainedTokenizerFast(tokenizer_object=trained, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", chat_template=QWEN_TEMPLATE)
    hf.save_pretrained(str(folder))
    eos = [trained.token_to_id("<|endoftext|>"), trained.token_to_id("<|im_end|>")]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder, hf


def test_incremental_detokenization_one_token_at_a_time(checkpoint):
    tok = load_tokenizer(str(checkpoint[0]))
    ids = tok.encode(TEXT)
    dec = tok.detokenizer()
    pieces = [dec.add(i) for i in ids]
    assert "".join(pieces) + dec.flush() == TEXT == tok.decode(ids)
    assert not any(REPLACEMENT in p for p in pieces)
    # the test means something: some characters' bytes span several tokens
    split = [i for i in ids if REPLACEMENT in tok.decode([i])]
    assert len(split) > 10 and pieces.count("") > 5


def test_detokenizer_after_a_prompt_skips_special_tokens(checkpoint):
    tok = load_tokenizer(str(checkpoint[0]))
    prompt = tok.encode("你好 ")
    end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("世界 🙂 ok") + [end] + tok.encode(" 🧑‍🚀")
    dec = tok.detokenizer(prompt_ids=prompt)
    text = "".join(dec.add(i) for i in ids) + dec.flush()
    assert text == "世界 🙂 ok 🧑‍🚀" and dec.text == text
    raw = tok.detokenizer(skip_special_tokens=False)
    assert "".join(raw.add(i) for i in ids) + raw.flush() == "世界 🙂 ok<|im_end|> 🧑‍🚀"


def test_flush_hands_out_an_unfinished_character(checkpoint):
    tok = load_tokenizer(str(checkpoint[0]))
    ids = tok.encode("a🧑")
    dec = tok.detokenizer()
    held = "".join(dec.add(i) for i in ids[:-1])
    assert held == "a" and dec.flush().startswith(REPLACEMENT)


def test_encoding_and_chat_template_match_transformers(checkpoint):
    folder, hf = checkpoint
    tok = load_tokenizer(str(folder))
    assert tok.encode(TEXT) == hf.encode(TEXT)
    for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
        ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, **kwargs)
        ref = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True,
                                     **kwargs)
        assert ours == ref
    assert "Météo <now>" in tok.apply_chat_template(MESSAGES, tools=TOOLS)  # no escaping
    ref_ids = hf.apply_chat_template(MESSAGES[1:], tokenize=True, add_generation_prompt=True)
    ref_ids = ref_ids["input_ids"] if isinstance(ref_ids, dict) or hasattr(ref_ids, "keys") \
        else ref_ids
    assert tok.encode_chat(MESSAGES[1:]) == list(ref_ids)
    with pytest.raises(Exception, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_special_tokens_and_eos_ids(checkpoint):
    folder, _ = checkpoint
    tok = load_tokenizer(str(folder))
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    assert tok.eos_token_ids == {ids["<|endoftext|>"], ids["<|im_end|>"]}
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert set(ids.values()) <= tok.special_token_ids


def test_template_in_tokenizer_config_and_eos_from_config(trained, tmp_path):
    trained.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                           "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"},
                          {"name": "tool_use", "template": "unused"}],
        "bos_token": {"content": "<|im_start|>", "special": True}}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 400}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>[user]hi"
    assert tok.eos_token_ids == {2} and tok.bos_token_id == tok.token_to_id("<|im_start|>")


def test_missing_tokenizer_and_template_errors(trained, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    trained.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="no chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_preset_models_get_a_byte_level_stand_in():
    tok = load_tokenizer("preset:tiny")
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.eos_token_ids == {256} and tok.vocab_size == 257
    dec = tok.detokenizer()
    assert "".join(dec.add(i) for i in ids) + dec.flush() == TEXT


def _wrap(hf: HFTokenizer):
    from moeserve.runtime.tokenizer import Tokenizer

    return Tokenizer(hf)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(list(TEXT) + SPECIAL + [" ", "the ", "\u0301"]),
                max_size=400).map("".join))
def test_min_tokens_never_exceeds_the_tokens_of_a_text(trained, text):
    """The bound that refuses a huge prompt untokenized is a true lower bound, with the
    special tokens (the longest entries) and with a composing normalizer (NFC)."""
    import copy

    from tokenizers import normalizers

    nfc = copy.deepcopy(trained)
    nfc.normalizer = normalizers.NFC()
    for hf in (trained, nfc):
        tok = _wrap(hf)
        assert tok.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False))
    assert _wrap(trained).min_tokens("ab " * 10_000) > 0


def test_min_tokens_is_zero_where_a_normalizer_may_shrink_a_text_without_bound(trained):
    import copy

    from tokenizers import normalizers

    strip = copy.deepcopy(trained)
    strip.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    assert _wrap(strip).min_tokens(" " * 100_000) == 0
