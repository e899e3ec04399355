"""Served model names, as vLLM's ``--served-model-name``: the names requests call a model by.

A GPU worker started with ``PAGEDQ_SERVED_MODEL_NAME=smollm2,default-chat`` (or ``--served-model-name smollm2
--served-model-name default-chat``) serves its folder as ``smollm2``: the first name is the model's name
everywhere (its queue, registry record, result cache, prefix-cache block names, the ``model`` of its answers),
and the others are aliases a request may use instead.  So each host keeps its folder wherever it likes, and
two folders holding the same weights are one model.  Unset, the model's name is ``PAGEDQ_MODEL`` itself, as it
always was.  The Redis side (alias records, each host's folder) is ``store/model_names.py``.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedq.config.settings import Settings

MAX_NAME_CHARS = 256


def parse_served_names(value: object) -> list[str] | None:
    """``PAGEDQ_SERVED_MODEL_NAME``'s value as a list of names, or None (unset).

    Accepts a JSON list (``["smollm2", "default-chat"]``), names separated by commas (``smollm2,default-chat``),
    one name, or a list (keyword arguments, a TOML array, the CLI's repeated flag).  Names are stripped; an
    empty one, a duplicate, or two that would share one Redis key (they differ only in case or punctuation)
    are refused, naming the name."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not a JSON list of names: {e.msg}") from None
        else:
            value = text.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError("must be names separated by commas, or a JSON list of strings")
    names = [n.strip() for n in value]
    _check_names(names)
    return names or None


def _check_names(names: list[str]) -> None:
    from pagedq.config.names import model_slug  # names imports settings, which imports this module

    slugs: dict[str, str] = {}
    for name in names:
        if not name:
            raise ValueError("an empty name (two commas in a row, or one at an end?)")
        if len(name) > MAX_NAME_CHARS or not re.search(r"[A-Za-z0-9]", name) or re.search(r"[\x00-\x1f\x7f]", name):
            raise ValueError(f"{name[:40]!r}: a name is 1-{MAX_NAME_CHARS} printable characters, at least one "
                             "a letter or a digit")
        slug = model_slug(name)
        if slug in slugs:
            same = "is given twice" if slugs[slug] == name else f"and {slugs[slug]!r} share one Redis key ({slug})"
            raise ValueError(f"{name!r} {same}")
        slugs[slug] = name


def served_names(settings: Settings) -> list[str]:
    """This process's served names ([] when unset)."""
    return list(settings.served_model_name or [])


def default_model(settings: Settings) -> str:
    """The name of the model a request without ``model`` gets: the first served name, else ``PAGEDQ_MODEL``."""
    served = served_names(settings)
    return served[0] if served else settings.model


def canonical_name(settings: Settings, model: str) -> str:
    """``model`` as the model's own name, when it is one of this process's served names; else as it is (the
    registry resolves the aliases other hosts registered: ``store.registry.lookup_model``)."""
    served = served_names(settings)
    return served[0] if model in served else model


def engine_model_name(settings: Settings, resolved: str) -> str:
    """The name a GPU worker's engine serves its model under: the first served name, else the model's
    (``resolved``, its ``PAGEDQ_MODEL`` / ``--model``)."""
    served = served_names(settings)
    return served[0] if served else resolved


def local_model(settings: Settings, model: str) -> str:
    """What to load a served model's files from on this host: ``PAGEDQ_MODEL`` for one of this process's served
    names (a CPU worker on a host without the GPU worker's folder tokenizes from its own copy), else ``model``."""
    return settings.model if model in served_names(settings) else model
