"""Settings precedence: explicit flag > environment > config file > defaults."""

from __future__ import annotations

import argparse

import pytest

from mammoth_core.settings import (
    ARSettings,
    DiTSettings,
    GatewaySettings,
    SettingsError,
    add_arguments,
    resolve_settings,
)


def _explicit(cls, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return vars(parser.parse_args(argv))


def test_defaults_without_any_source():
    s = resolve_settings(DiTSettings, cli={}, env={})
    assert s.slots == 4 and s.port == 50052 and s.chunk_rows == 64


def test_file_then_section_then_env_then_flag(tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text("chunk_rows: 32\nslots: 3\ndit:\n  slots: 5\nar:\n  max_running_sequences: 2\n")
    env = {"MAMMOTH_CONFIG": str(cfg)}
    dit = resolve_settings(DiTSettings, cli={}, env=env)
    assert (dit.chunk_rows, dit.slots) == (32, 5)  # flat key, then the dit section wins
    ar = resolve_settings(ARSettings, cli={}, env=env)
    assert (ar.chunk_rows, ar.max_running_sequences) == (32, 2)
    env["MAMMOTH_SLOTS"] = "6"
    assert resolve_settings(DiTSettings, cli={}, env=env).slots == 6  # env beats file
    flags = _explicit(DiTSettings, ["--slots", "7"])
    assert resolve_settings(DiTSettings, cli=flags, env=env).slots == 7  # flag beats env


def test_explicit_flag_equal_to_default_still_overrides_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("slots: 9\n")
    flags = _explicit(DiTSettings, ["--config", str(cfg), "--slots", "4"])  # 4 is the default
    assert resolve_settings(DiTSettings, cli=flags, env={}).slots == 4
    assert resolve_settings(DiTSettings, cli=_explicit(DiTSettings, ["--config", str(cfg)]), env={}).slots == 9


def test_lists_and_bad_values():
    s = resolve_settings(GatewaySettings, cli={}, env={"MAMMOTH_AR": "a:1, b:2", "MAMMOTH_DEFAULT_CFG_RANGE": "0,0.5"})
    assert s.ar == ["a:1", "b:2"] and s.default_cfg_range == [0.0, 0.5]
    with pytest.raises(SettingsError, match="slots"):
        resolve_settings(DiTSettings, cli={}, env={"MAMMOTH_SLOTS": "many"})
    with pytest.raises(SettingsError, match="slots"):
        resolve_settings(DiTSettings, cli={}, env={"MAMMOTH_SLOTS": "0"})

