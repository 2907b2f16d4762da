"""One settings object for serving (:mod:`dspark_jax.serving.config`): docs/serving.md's table of
:class:`~dspark_jax.serving.config.EngineConfig` says its defaults and the serve command's flags
take theirs from it (the engine reading it: test_engine_requests.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dspark_jax.serving.config import EngineConfig

DOC = Path(__file__).resolve().parents[3] / "docs" / "serving.md"
ROW = re.compile(r"^\| `(\w+)` \| (`--[\w-]+`|-) \| `([^`]*)` \| .+ \|$")


def _doc_rows() -> dict[str, tuple[str | None, str]]:
    """``{field: (flag or None, default text)}`` of the EngineConfig table."""
    text = DOC.read_text()
    section = text.split("### Settings: `EngineConfig`", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if m := ROW.match(line):
            rows[m[1]] = (m[2].strip("`") if m[2] != "-" else None, m[3])
    return rows


def test_the_docs_table_is_the_config():
    """Every field, in order, with its default (``repr``); nothing else."""
    rows = _doc_rows()
    fields = dataclasses.fields(EngineConfig)
    assert list(rows) == [f.name for f in fields]
    assert {name: default for name, (_, default) in rows.items()} == {f.name: repr(f.default) for f in fields}


def test_the_serve_flags_default_to_the_config():
    """The flags the table names exist and parse, unset, to the config's defaults."""
    from dspark_jax.commands.serve import build_parser, engine_config

    parser = build_parser()
    args = parser.parse_args(["--target", "x"])
    flags = {opt for action in parser._actions for opt in action.option_strings}
    named = {name: flag for name, (flag, _) in _doc_rows().items() if flag}
    assert set(named.values()) <= flags
    assert engine_config(args) == EngineConfig()
    assert engine_config(parser.parse_args(["--target", "x", "--suspend-after", "-1"])).suspend_after is None


def test_the_config_is_frozen_and_resolves_the_policy():
    cfg = EngineConfig(num_slots=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_slots = 3  # type: ignore[misc]
    assert dataclasses.replace(cfg, cache_len=64).cache_len == 64 and cfg.cache_len == 1024
    assert cfg.policy_for(True) == "dspark" and cfg.policy_for(False) == "plain"
    assert EngineConfig(policy="fixed:2").policy_for(False) == "fixed:2"
