"""Settings: only the configuration you asked for."""

from __future__ import annotations

import pytest

from pagedq.config import Settings


def test_an_unknown_pagedq_variable_is_an_error_naming_the_closest_setting(monkeypatch):
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQ", "8")
    with pytest.raises(ValueError, match="PAGEDQ_MAX_NUM_SEQ; did you mean PAGEDQ_MAX_NUM_SEQS"):
        Settings()


@pytest.mark.parametrize("variable", ["PAGEDQ_FAIR_SHARE", "PAGEDQ_PLACEMENT", "PAGEDQ_WORKER_MAX_INFLIGHT"])
def test_a_removed_dispatch_switch_is_accepted_with_one_deprecation_line(monkeypatch, caplog, variable):
    """The one dispatch path: the switches that chose between paths are gone; a stray one in the environment
    still starts, with one warning line per process naming it, and changes nothing."""
    from pagedq.config import settings as settings_module

    monkeypatch.setattr(settings_module, "_warned", set())
    monkeypatch.setenv(variable, "false")
    with caplog.at_level("WARNING", logger="pagedq.config.settings"):
        first, second = Settings(), Settings()
    lines = [r.getMessage() for r in caplog.records if variable in r.getMessage()]
    assert len(lines) == 1 and "deprecated" in lines[0]
    assert first == second and not hasattr(first, variable.removeprefix("PAGEDQ_").lower())


def test_a_toml_file_in_the_working_directory_is_not_read(monkeypatch, tmp_path):
    (tmp_path / "pagedq.toml").write_text('broker_url = "redis://attacker.example:6379/0"\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PAGEDQ_CONFIG_FILE", raising=False)
    monkeypatch.delenv("PAGEDQ_BROKER_URL", raising=False)
    assert Settings().broker_url is None


def test_the_toml_file_named_by_pagedq_config_file_is_read(monkeypatch, tmp_path):
    path = tmp_path / "conf.toml"
    path.write_text("max_num_seqs = 7\n")
    monkeypatch.setenv("PAGEDQ_CONFIG_FILE", str(path))
    assert Settings().max_num_seqs == 7
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQS", "9")  # the environment beats the file
    assert Settings().max_num_seqs == 9
    monkeypatch.setenv("PAGEDQ_CONFIG_FILE", str(tmp_path / "missing.toml"))
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        Settings()
