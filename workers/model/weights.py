"""Reading a folder's safetensors: one file, or the shards ``model.safetensors.index.json`` lists."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The files holding the model's weights.

    With an index, exactly the shards it names (a folder may also hold other
    safetensors, e.g. Mistral's ``consolidated.safetensors`` beside the shards).
    """
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor by name, in the checkpoint's dtype (the model casts each to the served dtype)."""
    weights: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        weights.update(load_file(f))
    return weights
