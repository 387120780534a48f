"""`--model org/name`: a Hugging Face hub id, resolved to a folder of the local hub cache.

A model that is a folder (or a config.json path, or preset:NAME) is used as it is. An
`org/name` that is not a folder goes through huggingface_hub's `snapshot_download`, which
honours HF_HUB_OFFLINE, HF_HUB_CACHE / HF_HOME and HF_TOKEN, returns the cached snapshot when
the hub cannot be asked, and fetches only what moeserve reads (HUB_FILES). When neither the
cache nor the hub has it, one line says so and what to do.
"""

from __future__ import annotations

import re
from pathlib import Path

from moeserve.config.spec import ModelSpecError

# what moeserve reads of a checkpoint: configs, tokenizer, chat templates, safetensors weights
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str) -> str:
    """The folder (or preset) that `model` names: itself, or a hub id's cached snapshot."""
    if model.startswith("preset:") or Path(model).exists() or not _HUB_ID.fullmatch(model):
        return model  # (what is not there is load_hf_config's "not found")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        return str(snapshot_download(model, allow_patterns=HUB_FILES))
    except GatedRepoError:
        raise ModelSpecError(f"model {model!r} is gated on the Hugging Face hub: accept its "
                             "terms on huggingface.co and set HF_TOKEN") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ModelSpecError(f"model {model!r} is neither a folder nor a model on the Hugging "
                             "Face hub (a private one needs HF_TOKEN); give a checkpoint folder "
                             "or a hub id such as Qwen/Qwen3-30B-A3B") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else _first_line(exc) or type(exc).__name__)
        raise ModelSpecError(
            f"model {model!r} is neither a folder nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the hub cannot be reached ({why}); download it "
            f"where the hub is reachable (`hf download {model}`) or give a checkpoint "
            "folder") from None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().split("\n", 1)[0][:160]
