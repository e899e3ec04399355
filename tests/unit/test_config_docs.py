"""docs/configuration.md's settings tables are what scripts/gen_config_docs.py renders from Settings: a setting
added, removed or changed in config/settings.py without rerunning the script fails here."""

from __future__ import annotations

import re
from pathlib import Path

import gen_config_docs
import pytest

from pagedq.config.settings import DEPRECATED_VARIABLES, OTHER_VARIABLES, Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_checked_in_reference_is_the_rendered_one():
    current = gen_config_docs.DOC.read_text()
    assert gen_config_docs.render(current) == current, (
        "docs/configuration.md is stale: run `.venv/bin/python scripts/gen_config_docs.py` and commit it")


def test_every_setting_and_deprecated_variable_has_a_row():
    text = gen_config_docs.DOC.read_text()
    block = text[text.index(gen_config_docs.BEGIN):text.index(gen_config_docs.END)]
    for name in Settings.model_fields:
        assert f"| `PAGEDQ_{name.upper()}` |" in block, name
    for var in DEPRECATED_VARIABLES:
        assert f"- `{var}`:" in block, var
    for var in OTHER_VARIABLES:  # read by something other than Settings: in the hand-written table
        assert f"`{var}`" in text[text.index(gen_config_docs.END):], var


def test_the_scripts_own_descriptions_are_only_for_fields_without_one():
    for name in gen_config_docs.NOTES:
        assert name in Settings.model_fields, f"NOTES[{name!r}]: no such setting any more"
        assert not Settings.model_fields[name].description, (
            f"{name} has a description in config/settings.py now: drop NOTES[{name!r}] from the script")
    for name in (*gen_config_docs.SEE_ALSO, *gen_config_docs.FACTORY_DEFAULTS):
        assert name in Settings.model_fields, name


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["configuration.md", "deploy.md"])
def test_its_links_reach_a_file_and_a_heading(page):
    text = (DOCS / page).read_text()
    for target, anchor in re.findall(r"\]\(([\w./-]*)(?:#([\w-]+))?\)", text):
        path = DOCS / target if target else DOCS / page
        assert path.is_file(), target
        if anchor:
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in headings, f"{target}#{anchor}"
