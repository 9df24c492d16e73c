"""Small first-hour promises of the settings loader and the built-in checkpoint (issue #22, item 7)."""

from __future__ import annotations

import logging
import pathlib
import re

from mammoth_core import settings as settings_mod
from mammoth_app.make_checkpoint import ensure_builtin


def test_a_misspelt_config_key_is_a_warning_naming_it(tmp_path, caplog):
    config = tmp_path / "mammoth.yaml"
    config.write_text("slot: 3\nlog_level: warning\nmax_steps: 100\ngateway:\n  prot: 9000\n")
    with caplog.at_level(logging.DEBUG, logger="mammoth_core.settings"):
        dit = settings_mod.resolve_settings(settings_mod.DiTSettings, config_file=str(config), env={})
    assert dit.log_level == "warning" and dit.slots == settings_mod.DiTSettings().slots  # known keys apply; the misspelt one does not
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'slot'" in w and "did you mean 'slots'" in w for w in warnings), warnings
    assert any("gateway.prot" in w and "did you mean 'port'" in w for w in warnings), warnings
    # max_steps is a gateway setting: known to some component, so not a warning for the DiT
    assert not any("max_steps" in w for w in warnings), warnings


def test_the_builtin_checkpoint_log_line_names_the_folder_that_exists(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mammoth_app"):
        target = ensure_builtin("tiny", tmp_path)
    named = [pathlib.Path(p) for r in caplog.records for p in re.findall(r"(/\S+)", r.getMessage())]
    assert named, [r.getMessage() for r in caplog.records]
    assert all(p.exists() for p in named), named
    assert target in named
