"""Hub ids as --model: resolved through huggingface_hub against a fake local hub cache
(HF_HUB_CACHE laid out as the hub writes it, HF_HUB_OFFLINE=1: no network)."""

import json
import os
import subprocess
import sys

import pytest

from moeserve.config.hub import resolve_model
from moeserve.config.spec import ModelSpecError
from moeserve.testing.tiny_models import make_hf_model, save_checkpoint

pytestmark = pytest.mark.timeout(300)
COMMIT = "0123456789abcdef0123456789abcdef01234567"
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
             intermediate_size=48, vocab_size=96, norm_topk_prob=True)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A cache holding acme/tiny-moe at COMMIT, as `hf download` leaves it."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny-moe"
    snapshot = repo / "snapshots" / COMMIT
    save_checkpoint(make_hf_model("Qwen3MoeForCausalLM", seed=0, **SHAPE), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_a_cached_hub_id_is_its_snapshot(offline):
    assert resolve_model("acme/tiny-moe") == str(offline / "models--acme--tiny-moe" /
                                                 "snapshots" / COMMIT)


def test_folders_and_presets_are_kept(offline, tmp_path):
    assert resolve_model("preset:tiny") == "preset:tiny"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("no-slash-here") == "no-slash-here"  # load_hf_config: not found


def test_an_uncached_hub_id_offline_says_so(offline):
    with pytest.raises(ModelSpecError) as e:
        resolve_model("acme/absent")
    msg = str(e.value)
    assert "\n" not in msg and "'acme/absent'" in msg
    assert "neither a folder nor in the Hugging Face cache" in msg
    assert "HF_HUB_OFFLINE" in msg and str(offline) in msg


def _cli(hub_cache, *args):
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "moeserve.cli", *args], env=env,
                          capture_output=True, text=True, timeout=240)


def test_the_cli_plans_a_hub_id_and_names_a_missing_one(hub_cache):
    ok = _cli(hub_cache, "plan", "--model", "acme/tiny-moe", "--device", "cpu", "--json")
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(ok.stdout)
    assert plan["architecture"] == "Qwen3MoeForCausalLM" and not plan["errors"]
    assert plan["model"].endswith(COMMIT)
    bad = _cli(hub_cache, "plan", "--model", "acme/absent", "--device", "cpu")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moeserve: error: model 'acme/absent' is "
                                                   "neither a folder nor in the Hugging Face")
    assert "Traceback" not in bad.stderr


def test_an_engine_runs_a_hub_id(offline):
    from moeserve.runtime.engine import Engine

    with Engine("acme/tiny-moe", in_process=True, skip_tokenizer_init=True, device="cpu",
                dtype="float32", max_total_tokens=512, context_length=64,
                disable_cuda_graph=True, disable_piecewise_cuda_graph=True) as eng:
        out = eng.generate(input_ids=[1, 2, 3], sampling_params=dict(max_new_tokens=3,
                                                                    temperature=0))
    assert out["error"] is None and len(out["token_ids"]) == 3
