"""Settings values are validated (pydantic) with errors naming the key, the bad value and its source;
keys no component reads are warnings naming them."""

from __future__ import annotations

import logging

import pytest

from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings, SettingsError, resolve_settings


def _error(cls, **kw) -> str:
    with pytest.raises(SettingsError) as err:
        resolve_settings(cls, **kw)
    return str(err.value)


def test_a_bad_type_names_the_key_the_value_and_the_source(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("slots: many\n")
    msg = _error(DiTSettings, cli={}, env={}, config_file=str(cfg))
    assert "'slots'" in msg and "'many'" in msg and str(cfg) in msg and "integer" in msg
    msg = _error(DiTSettings, cli={"slots": "many"}, env={})
    assert "'slots'" in msg and "'many'" in msg and "--slots" in msg
    msg = _error(GatewaySettings, cli={}, env={"MAMMOTH_HEALTH_TIMEOUT_SECONDS": "soon"})
    assert "'health_timeout_seconds'" in msg and "'soon'" in msg and "env MAMMOTH_HEALTH_TIMEOUT_SECONDS" in msg


def test_an_out_of_range_value_names_the_key_the_value_and_the_source():
    msg = _error(DiTSettings, cli={}, env={"MAMMOTH_SLOTS": "0"})
    assert "'slots'" in msg and "'0'" in msg and "env MAMMOTH_SLOTS" in msg and "greater than or equal to 1" in msg
    msg = _error(GatewaySettings, cli={}, env={"MAMMOTH_TRACE_SAMPLE_RATIO": "1.5"})
    assert "'trace_sample_ratio'" in msg and "'1.5'" in msg and "less than or equal to 1" in msg


@pytest.mark.parametrize("cls", [ARSettings, DiTSettings, GatewaySettings])
def test_a_port_outside_0_to_65535_is_refused_naming_the_key(cls):
    """A typo'd port is a settings error at start, not an OverflowError from the socket bind (the
    break-it pass of 2026-12-07); the metrics port also takes -1 (off), nothing below."""
    msg = _error(cls, cli={"port": "70000"}, env={})
    assert "'port'" in msg and "from --port:" in msg  # the flag as typed (was --metrics_port for metrics_port)
    if hasattr(cls, "metrics_port"):
        assert "from --metrics-port:" in _error(cls, cli={"metrics_port": "-2"}, env={})
    msg = _error(cls, cli={}, env={"MAMMOTH_PORT": "70000"})
    assert "'port'" in msg and "'70000'" in msg and "less than or equal to 65535" in msg
    msg = _error(cls, cli={}, env={"MAMMOTH_PORT": "-1"})
    assert "'port'" in msg and "greater than or equal to 0" in msg
    assert resolve_settings(cls, cli={}, env={"MAMMOTH_PORT": "65535"}).port == 65535
    if hasattr(cls, "metrics_port"):
        msg = _error(cls, cli={}, env={"MAMMOTH_METRICS_PORT": "65536"})
        assert "'metrics_port'" in msg and "less than or equal to 65535" in msg
        msg = _error(cls, cli={}, env={"MAMMOTH_METRICS_PORT": "-2"})
        assert "'metrics_port'" in msg and "greater than or equal to -1" in msg
        assert resolve_settings(cls, cli={}, env={"MAMMOTH_METRICS_PORT": "-1"}).metrics_port == -1


@pytest.mark.parametrize("size,words", [("banana", "WIDTHxHEIGHT"), ("7x7", "multiple of 16"),
                                        ("auto", "WIDTHxHEIGHT"), ("16384x16384", "pixels")])
def test_a_default_size_requests_could_never_use_is_refused_at_start(size, words):
    """The gateway's ``default_size`` (what ``size`` omitted or ``auto`` means) is checked by the same
    rules as a request's size when the settings load (break-it pass, 2026-12-07: ``banana`` started a
    gateway whose every request without a size got 400 "invalid size None")."""
    msg = _error(GatewaySettings, cli={}, env={"MAMMOTH_DEFAULT_SIZE": size})
    assert "default_size" in msg and size in msg and words in msg, msg
    assert "from env MAMMOTH_DEFAULT_SIZE:" in msg, msg  # where the value came from, as a bad type's error says
    assert "from --default-size:" in _error(GatewaySettings, cli={"default_size": size}, env={})
    assert resolve_settings(GatewaySettings, cli={}, env={"MAMMOTH_DEFAULT_SIZE": "512x256"}).default_size == "512x256"


def test_a_value_outside_the_choices_is_refused():
    msg = _error(ARSettings, cli={}, env={"MAMMOTH_DEVICE": "gpu"})
    assert "'device'" in msg and "'gpu'" in msg and "'cuda'" in msg


def test_every_bad_value_is_named_at_once(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dit:\n  slots: -1\n  chunk_rows: x\n")
    msg = _error(DiTSettings, cli={}, env={}, config_file=str(cfg))
    assert "'slots'" in msg and "'chunk_rows'" in msg


def test_a_boolean_is_not_an_integer(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("slots: true\n")
    assert "'slots'" in _error(DiTSettings, cli={}, env={}, config_file=str(cfg))


def test_strings_from_flags_and_the_environment_become_typed_values():
    s = resolve_settings(GatewaySettings, cli={"insecure_no_auth": "yes", "port": "0"},
                         env={"MAMMOTH_AR": "a:1, b:2", "MAMMOTH_DEFAULT_CFG_RANGE": "0,0.5",
                              "MAMMOTH_PUBLIC_BASE_URL": "none", "MAMMOTH_IMAGE_TTL_SECONDS": "1e3"})
    assert s.insecure_no_auth is True and s.port == 0 and s.ar == ["a:1", "b:2"]
    assert s.default_cfg_range == [0.0, 0.5] and s.public_base_url is None and s.image_ttl_seconds == 1000.0


def test_defaults_are_unchanged_by_resolution():
    for cls in (ARSettings, DiTSettings, GatewaySettings):
        assert resolve_settings(cls, cli={}, env={}) == cls()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_unknown_key_is_a_warning_naming_it(tmp_path, caplog):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("slot: 3\ngateway:\n  prot: 1\n")
    with caplog.at_level(logging.DEBUG, logger="mammoth_core.settings"):
        resolve_settings(GatewaySettings, cli={}, env={}, config_file=str(cfg))
    warnings = _warnings(caplog)
    assert any("'slot'" in w and "did you mean 'slots'" in w for w in warnings), warnings
    assert any("gateway.prot" in w and "did you mean 'port'" in w for w in warnings), warnings


def test_keys_under_an_operator_section_are_unknown_keys(tmp_path, caplog):
    """No component reads an ``operator:`` section (the operator takes flags and MAMMOTH_OPERATOR_*
    variables): its keys are ignored, so each is a warning naming it."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("operator:\n  image_tag: v2\n")
    with caplog.at_level(logging.DEBUG, logger="mammoth_core.settings"):
        resolve_settings(ARSettings, cli={}, env={}, config_file=str(cfg))
    assert any("operator.image_tag" in w for w in _warnings(caplog)), caplog.text
