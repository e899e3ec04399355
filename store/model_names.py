"""Served model names in Redis (``config/served.py``): aliases, and where each host keeps a model's folder.

An alias is a record of its own at ``names.model(alias)``: ``{name: alias, alias_of: model}``, listed in
``names.models_index`` like a model, so ``/v1/models`` lists it and ``lookup_model(alias)`` answers the model's
record (``store.registry``).  A GPU worker writes its aliases when it registers, and the folder it loaded the
model from under its host's name (``names.model_folders``): a CPU worker on that host reads the tokenizer from
there, wherever the other hosts keep theirs.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

import redis

from pagedq.config.names import Names
from pagedq.store.registry import gpu_workers_serving, lookup_model


class ServedNameTaken(ValueError):
    pass


def _check_free(r: redis.Redis, names: Names, name: str, model: str) -> None:
    """Refuse to take ``name`` for ``model`` while live GPU workers serve it as (or for) another model."""
    record = r.hgetall(names.model(name))
    owner = record.get("alias_of") or record.get("name")
    if not record or owner == model:  # free, or already this model's (its record, or its alias)
        return
    if gpu_workers_serving(r, names, owner):
        raise ServedNameTaken(f"served_model_name: {name!r} already names the model {owner!r}, which live GPU "
                              "workers serve; pick another name or stop them first")


def register_served_names(r: redis.Redis, names: Names, model: str, aliases: Sequence[str], folder: str,
                          host: str | None = None) -> None:
    """Before a GPU worker registers ``model`` (``register_model``): its name freed of an old alias record, a
    record for each alias, and ``folder`` as this host's.  Raises ServedNameTaken for a name another served
    model holds."""
    for name in [model, *aliases]:
        _check_free(r, names, name, model)
    pipe = r.pipeline(transaction=True)
    if r.hget(names.model(model), "alias_of"):
        pipe.delete(names.model(model))  # was an alias: register_model writes the model's record afresh
    for alias in aliases:
        pipe.delete(names.model(alias))
        pipe.hset(names.model(alias), mapping={"name": alias, "alias_of": model, "updated_at": time.time()})
        pipe.sadd(names.models_index, alias)
    pipe.hset(names.model_folders(model), host or socket.gethostname(), folder)
    pipe.execute()


def registered_folder(r: redis.Redis, names: Names, model: str, host: str | None = None) -> str:
    """The folder of ``model`` (a name or an alias) a GPU worker registered that exists on this host: this host's
    own (``names.model_folders``), else the one in the model's record; "" when neither is here."""
    info = lookup_model(r, names, model)
    if info is None:
        return ""
    for folder in (r.hget(names.model_folders(info.name), host or socket.gethostname()), info.path):
        if folder and os.path.isdir(folder):
            return folder
    return ""
