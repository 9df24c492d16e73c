"""The one table of request defaults and limits (`mammoth_core.limits`) and everything derived
from it: the CRD's ``spec.requestDefaults`` schema, the operator's spec parser and config file, the
component settings, and the token bounds the gateway admits by (checked against the real tokenizer).
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from mammoth_core import limits
from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings, resolve_settings
from mammoth_operator import builders
from mammoth_operator.config import OperatorConfig
from mammoth_operator.crd import load_crd, openapi_schema
from mammoth_operator.spec import InvalidSpec, parse_spec
from stage_ar import tokenization_mammoth as tm

IMAGES = OperatorConfig.from_env({}).images


def _request_defaults_schema() -> dict:
    return openapi_schema(load_crd())["properties"]["spec"]["properties"]["requestDefaults"]["properties"]


@pytest.mark.parametrize("name,crd", sorted(limits.crd_keys().items()))
def test_crd_request_defaults_equal_the_table(name, crd):
    prop = _request_defaults_schema()[crd]
    meta = limits.RequestLimits.__dataclass_fields__[name].metadata
    assert prop["default"] == limits.field_default(name)
    if meta["minimum"] is not None:
        assert (prop["minimum"], prop["maximum"]) == (meta["minimum"], meta["maximum"])


def test_every_crd_request_default_is_in_the_table():
    assert set(_request_defaults_schema()) == set(limits.crd_keys().values())


@pytest.mark.parametrize("cls", [GatewaySettings, DiTSettings, ARSettings])
def test_settings_defaults_equal_the_table(cls):
    table = {f.name for f in limits.limit_fields()}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name in table}
    assert fields, cls
    for name, f in fields.items():
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        assert default == limits.field_default(name), (cls.__name__, name)


def test_the_operator_config_gives_gateway_and_dit_the_same_limits_as_mammoth_up(tmp_path):
    """An empty spec -> the pipeline.yaml every container reads -> the same table as the defaults
    `mammoth up` runs with (the drift that made a request work locally and fail on Kubernetes)."""
    spec = parse_spec("p", "default", {"model": {"source": "builtin://tiny"}}, IMAGES)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(builders.pipeline_config(spec)))
    for cls in (GatewaySettings, DiTSettings):
        settings = resolve_settings(cls, env={}, config_file=str(path))
        assert limits.from_settings(settings) == limits.from_settings(cls()), cls.__name__
    assert limits.from_settings(resolve_settings(GatewaySettings, env={}, config_file=str(path))) \
        == limits.DEFAULTS


def test_operator_rejects_a_malformed_ar_grid():
    with pytest.raises(InvalidSpec) as err:
        parse_spec("p", "default", {"model": {"source": "builtin://tiny"},
                                    "requestDefaults": {"arGrid": "2000x2000"}}, IMAGES)
    assert "arGrid" in str(err.value)


def test_table_defaults_are_valid_and_the_largest_size_fits():
    limits.validate(limits.DEFAULTS)
    side = int(limits.DEFAULTS.max_pixels ** 0.5)
    grid = limits.resolve_grid(side, side, "auto")
    limits.check_positions("a lighthouse at dusk", "", side, side, grid, "size", limits.DEFAULTS)


def test_resolve_grid_keeps_the_aspect_ratio_at_a_fixed_area():
    assert limits.resolve_grid(1024, 1024, "auto") == (64, 64)
    assert limits.resolve_grid(1536, 1024, "auto") == (96, 64)
    assert limits.resolve_grid(1024, 1024, "32x32") == (32, 32)
    assert limits.resolve_grid(1536, 1024, "48x32") == (48, 32)  # W:H equals the image's
    assert limits.resolve_grid(1536, 1024, "32x32") == (39, 26)
    assert limits.resolve_grid(1024, 512, "32x32") == (45, 23)
    assert limits.resolve_grid(512, 1024, "32x32") == (23, 45)
    for text in ("0x4", "32", "32x", "x32", "2000x2", "auto ", "32X32"):
        with pytest.raises(limits.LimitError) as err:
            limits.resolve_grid(64, 64, text)
        assert err.value.param == "ar_grid"


def test_envelope_bounds_are_the_envelope_bytes():
    """The constants are the byte counts of the AR's own envelope text plus its special tokens."""
    ordinary = len(f"system\n{tm.SYSTEM_PROMPT}".encode()) + len(b"\n") + len(b"user\n") + len(b"\n") \
        + len(b"assistant\n")
    assert limits.ENVELOPE_TOKEN_BOUND == ordinary + 7
    assert limits.NEGATIVE_ENVELOPE_TOKEN_BOUND == ordinary - len(b"assistant\n") + 4


PROMPTS = ["a red fox", "", "🦊" * 300, "東京の夜景、雨上がり" * 20, "e\u0301" * 50, "\u0344" * 40,
           "<|im_start|><|image start|> tricky", "x" * 1000, " \n\t " * 30]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_token_bounds_hold_for_the_real_tokenizer(tokenizer, prompt):
    for gw, gh in ((64, 64), (4, 2), (39, 26)):
        ids = tokenizer.encode_t2i_prompt(prompt, gw, gh)
        assert len(ids) + limits.grid_tokens(gw, gh) <= limits.positions_needed(prompt, gw, gh)
    neg = tokenizer.encode_negative_prompt(prompt)
    assert len(neg) <= limits.NEGATIVE_ENVELOPE_TOKEN_BOUND + limits.text_token_bound(prompt)


def test_check_positions_names_the_field():
    table = limits.DEFAULTS
    with pytest.raises(limits.LimitError) as err:  # the auto grid of 1792x1792 alone is too long
        limits.check_positions("x", "", 1792, 1792, limits.resolve_grid(1792, 1792, "auto"), "size", table)
    assert err.value.param == "size" and "12288" in err.value.message
    with pytest.raises(limits.LimitError) as err:
        limits.check_positions("x", "", 64, 64, (200, 200), "ar_grid", table)
    assert err.value.param == "ar_grid"
    with pytest.raises(limits.LimitError) as err:
        limits.check_positions("🦊" * 4000, "", 1024, 1024, (64, 64), "size", table)
    assert err.value.param == "prompt" and "12288" in err.value.message
    with pytest.raises(limits.LimitError) as err:
        limits.check_positions("x", "🦊" * 4000, 1024, 1024, (64, 64), "size", table)
    assert err.value.param == "negative_prompt"


def test_settings_validation_applies_the_table_rules():
    from mammoth_core.settings import SettingsError

    DiTSettings(max_rows_per_slot=8192).validate()  # the DiT has no max_sequence_length to compare
    for bad in ({"max_rows_per_slot": 8192}, {"min_pixels": 4096, "max_pixels": 1024},
                {"default_ar_grid": "32 x 32"}, {"max_steps": 1001}, {"default_steps": 60, "max_steps": 50}):
        with pytest.raises(SettingsError):
            GatewaySettings(**bad).validate()
