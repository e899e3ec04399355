"""Served model names (config/served.py, store/model_names.py): how PAGEDQ_SERVED_MODEL_NAME and
--served-model-name are read, and the alias records against a real redis-server."""

from __future__ import annotations

import json
import random
import string
import time
import uuid

import pytest

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.config.served import (
    canonical_name,
    default_model,
    engine_model_name,
    local_model,
    parse_served_names,
)
from pagedq.pipeline.cli import _settings, build_parser
from pagedq.pipeline.local.stack import settings_env
from pagedq.store.model_names import ServedNameTaken, register_served_names, registered_folder
from pagedq.store.registry import ModelInfo, lookup_model, register_model, served_models


def random_name() -> str:
    return "m-" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


def test_the_variable_takes_commas_a_json_list_or_one_name(monkeypatch):
    a, b, c = random_name(), random_name(), random_name()
    for value in (f"{a},{b}, {c}", json.dumps([a, b, c]), f" {a} ,{b},{c} "):
        monkeypatch.setenv("PAGEDQ_SERVED_MODEL_NAME", value)
        assert Settings().served_model_name == [a, b, c]
    monkeypatch.setenv("PAGEDQ_SERVED_MODEL_NAME", a)
    assert Settings().served_model_name == [a]
    monkeypatch.setenv("PAGEDQ_SERVED_MODEL_NAME", "")
    assert Settings().served_model_name is None
    monkeypatch.delenv("PAGEDQ_SERVED_MODEL_NAME")
    assert Settings().served_model_name is None
    assert Settings(served_model_name=[a, "org/Model-1.5"]).served_model_name == [a, "org/Model-1.5"]


@pytest.mark.parametrize(("value", "says"), [
    ("a,,b", "an empty name"),
    ("a,b,a", "'a' is given twice"),
    ("smollm2,SmolLM2", "'SmolLM2' and 'smollm2' share one Redis key"),
    ('["a", 3]', "JSON list of strings"),
    ('["a",', "not a JSON list"),
    ("---", "at least one a letter or a digit"),
    ("x" * 300, "1-256 printable characters"),
])
def test_a_bad_value_is_refused_naming_the_setting(monkeypatch, value, says):
    monkeypatch.setenv("PAGEDQ_SERVED_MODEL_NAME", value)
    with pytest.raises(ValueError, match="served_model_name") as e:
        Settings()
    assert says in str(e.value)


def test_the_flag_repeats_or_takes_several_and_a_child_process_reads_the_same_list(monkeypatch):
    monkeypatch.delenv("PAGEDQ_SERVED_MODEL_NAME", raising=False)
    assert _settings(build_parser().parse_args(["worker"])).served_model_name is None
    a, b, c = random_name(), random_name(), random_name()
    args = build_parser().parse_args(["worker", "--served-model-name", a, "--served-model-name", b, c])
    settings = _settings(args)
    assert settings.served_model_name == [a, b, c]
    env = settings_env(settings)  # what `pagedq up` gives its workers
    monkeypatch.setenv("PAGEDQ_SERVED_MODEL_NAME", env["PAGEDQ_SERVED_MODEL_NAME"])
    assert Settings().served_model_name == [a, b, c]


def test_the_first_name_is_the_models_and_unset_keeps_the_path(tmp_path):
    a, b = random_name(), random_name()
    named = Settings(model=str(tmp_path), served_model_name=[a, b])
    assert default_model(named) == a
    assert canonical_name(named, b) == a and canonical_name(named, a) == a
    assert canonical_name(named, "other") == "other"
    assert engine_model_name(named, str(tmp_path)) == a
    assert local_model(named, b) == str(tmp_path) and local_model(named, "other") == "other"
    plain = Settings(model=str(tmp_path))  # today's behaviour: the path is the name
    assert default_model(plain) == str(tmp_path) == engine_model_name(plain, str(tmp_path))
    assert canonical_name(plain, a) == a and local_model(plain, a) == a
    assert parse_served_names(None) is None


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"u{tag}:", queue_prefix=f"u{tag}.")


def info(name: str, names: Names, path: str) -> ModelInfo:
    return ModelInfo(name, uuid.uuid4().hex, 2048, 49152, names.generate_queue(name), path)


def test_an_alias_resolves_to_its_model_and_each_host_keeps_its_folder(redis, names, tmp_path):
    model, alias = random_name(), random_name()
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    register_served_names(redis, names, model, [alias], str(here), host="host-a")
    register_model(redis, names, info(model, names, str(there)))  # the last registration: another host's folder
    assert lookup_model(redis, names, alias) == lookup_model(redis, names, model)
    assert lookup_model(redis, names, alias).name == model
    assert sorted(served_models(redis, names)) == sorted([model, alias])  # what /v1/models lists
    assert registered_folder(redis, names, alias, host="host-a") == str(here)  # this host's, not the record's
    assert registered_folder(redis, names, alias, host="host-b") == ""  # neither folder is on host-b
    assert lookup_model(redis, names, random_name()) is None


def test_a_name_can_change_roles_unless_live_workers_serve_it(redis, names, tmp_path):
    old, new = random_name(), random_name()
    register_served_names(redis, names, old, [new], str(tmp_path))
    register_model(redis, names, info(old, names, str(tmp_path)))
    # later the deployment swaps the names: `new` becomes the model's name, `old` its alias
    register_served_names(redis, names, new, [old], str(tmp_path))
    register_model(redis, names, info(new, names, str(tmp_path)))
    assert lookup_model(redis, names, old).name == new == lookup_model(redis, names, new).name
    # a name a live GPU worker serves another model under is refused, naming it
    other = random_name()
    register_model(redis, names, info(other, names, str(tmp_path)))
    redis.hset(names.worker("gpu.1@h"), mapping={"role": "gpu", "model": other})
    redis.zadd(names.workers_index, {"gpu.1@h": time.time() + 60})
    with pytest.raises(ServedNameTaken, match=f"served_model_name: '{other}' already names the model '{other}'"):
        register_served_names(redis, names, new, [old, other], str(tmp_path))
    assert lookup_model(redis, names, other).name == other  # untouched
