"""The architectures pagedq serves: config.json's ``architectures`` -> the family module that runs it.

A contract, read on both sides of the queue: the engine's registry
(``workers/model/registry.py``) imports the family class from here, and a
producer refuses a request naming a local model folder of any other
architecture before anything is enqueued.  Adding a family is one module under
``workers/model/`` and one line here.
"""

from __future__ import annotations

import json
from pathlib import Path

# architecture -> (module under pagedq.workers.model, class name)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES = frozenset(MODELS)


def unsupported_message(architectures: list[str] | set[str], name: str | None = None) -> str:
    """One line: what the model is, and what pagedq serves."""
    what = f"model {name!r} has" if name else "the model has"
    shown = ", ".join(sorted(architectures)) or "no architectures in its config.json"
    return f"{what} architecture {shown}, which pagedq does not serve; served: {', '.join(sorted(MODELS))}"


def folder_architectures(name: str) -> set[str] | None:
    """The ``architectures`` of the config.json in the local folder ``name``; None when ``name`` is no such folder."""
    config = Path(name).expanduser() / "config.json"
    try:
        return set(json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError, AttributeError):
        return None


def refusal(folder: str | Path, name: str | None = None) -> str | None:
    """The one-line refusal of the local folder ``folder`` (called ``name``) when its architecture is not served;
    None when it is, or when ``folder`` is no folder with a config.json."""
    architectures = folder_architectures(str(folder))
    if architectures is None or architectures & SUPPORTED_ARCHITECTURES:
        return None
    return unsupported_message(architectures, name)
