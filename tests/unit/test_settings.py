"""Settings: only the configuration you asked for."""

from __future__ import annotations

import pytest

from pagedq.config import Settings


def test_an_unknown_pagedq_variable_is_an_error_naming_the_closest_setting(monkeypatch):
    monkeypatch.setenv("PAGEDQ_MAX_NUM_SEQ", "8")
    with pytest.raises(ValueError, match="PAGEDQ_MAX_NUM_SEQ; did you mean PAGEDQ_MAX_NUM_SEQS"):
        Settings()


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
