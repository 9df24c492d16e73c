"""The gateway's request rules, in process: the request model's validators (rendered as the 400
envelope the client gets, through the real `gateway.errors.error_info`) and
``to_image_job(settings)`` (every settings rule and every default), branch by branch."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from gateway.errors import GatewayError, InvalidRequestError, NotFoundError, error_info
from gateway.protocol import INT64_MAX, ImageGenerationRequest
from mammoth_core.settings import GatewaySettings

SETTINGS = GatewaySettings(default_steps=8, default_size="64x64", min_pixels=16 * 16,
                           max_pixels=512 * 512, max_steps=12, max_prompt_chars=40,
                           default_guidance_scale=4.0, default_cfg_range=(0.0, 1.0),
                           default_ar_grid="auto")


def refusal(body: dict) -> tuple[int, str | None, str | None, str]:
    """``(status, param, code, message)`` of the 400 the gateway answers ``body`` with."""
    try:
        ImageGenerationRequest.model_validate(body).to_image_job(SETTINGS, "r")
    except (ValidationError, GatewayError) as exc:
        status, info, _ = error_info(exc)
        return status, info.param, info.code, info.message
    raise AssertionError(f"{body} was accepted")


def job(**fields):
    return ImageGenerationRequest.model_validate({"prompt": "a fox", **fields}).to_image_job(
        SETTINGS, "req-1")


# ---------------------------------------------------------------- validators (no settings)

@pytest.mark.parametrize("body,param,code,message", [
    ({"prompt": "p", "moderation": "low"}, "moderation", "unsupported_parameter",
     "'moderation' is not supported: this deployment runs no content moderation model, so it "
     "cannot apply a moderation level; omit the field"),
    ({"prompt": "p", "svg": {}}, "svg", "unsupported_parameter", None),
    ({"prompt": "p", "seed": 1, "extra_body": {"seed": 2}}, "seed", "conflicting_parameter",
     "extra_body.seed=2 conflicts with seed=1 given at the top level"),
    ({"prompt": "p", "cfg_range": [0.1, 0.5], "extra_body": {"cfg_range": [0.1, 0.6]}},
     "cfg_range", "conflicting_parameter", None),
    ({"prompt": "\u200b \u2800"}, "prompt", "invalid_value",
     "prompt must not be blank (it has no visible character)"),
    ({"prompt": "p", "output_compression": 10}, "output_compression", "invalid_value",
     "output_compression applies to jpeg and webp only (png is lossless)"),
    ({"prompt": "p", "background": "transparent"}, "background", "invalid_value", None),
    ({"prompt": "p", "quality": "low", "num_inference_steps": 3}, "quality",
     "conflicting_parameter", "give either quality or num_inference_steps, not both"),
    ({"prompt": "p", "style": "natural", "text_guidance_scale": 3.0}, "style",
     "conflicting_parameter", "give either style or text_guidance_scale, not both"),
    ({"prompt": "p", "partial_images": 1}, "partial_images", "invalid_value",
     "partial_images needs stream=true"),
    ({"prompt": "p", "stream_progress": True}, "stream_progress", "invalid_value",
     "stream_progress needs stream=true"),
    ({"prompt": "p", "seed": INT64_MAX, "n": 2}, "seed", "invalid_value",
     "seed + n - 1 must fit in a signed 64-bit integer"),
    ({"prompt": "p", "extra_body": {"sed": 5}}, "extra_body", "invalid_value", None),
])
def test_a_rule_without_settings_is_a_validator_refusal_naming_its_param(body, param, code,
                                                                         message):
    with pytest.raises(ValidationError):
        ImageGenerationRequest.model_validate(body)
    status, got_param, got_code, got_message = refusal(body)
    assert (status, got_param, got_code) == (400, param, code)
    if message is not None:
        assert got_message == message


def test_the_same_fields_pass_when_they_agree():
    assert job(seed=5, extra_body={"seed": 5}).seed == 5
    assert job(cfg_range=[0.1, 0.5], extra_body={"cfg_range": [0.1, 0.5]}).cfg_range == (0.1, 0.5)
    assert job(extra_body={"negative_prompt": "blur"}).negative_prompt == "blur"  # lifted
    assert job(output_format="jpeg", output_compression=10).output_compression == 10
    assert job(quality="auto", num_inference_steps=3).num_inference_steps == 3
    assert job(stream=True, partial_images=1, stream_progress=True).partial_images == 1
    assert job(seed=INT64_MAX, n=1).seed == INT64_MAX


def test_unknown_fields_are_accepted_and_logged_once_naming_them(caplog):
    caplog.set_level(logging.WARNING, logger="gateway.protocol")
    req = ImageGenerationRequest.model_validate({"prompt": "p", "temperature": 0.5, "top_k": 3})
    assert req.model_extra == {"temperature": 0.5, "top_k": 3}
    messages = [r.getMessage() for r in caplog.records if r.name == "gateway.protocol"]
    assert messages == ["ignored request fields not in this API (2 fields): 'temperature', 'top_k'"]
    caplog.clear()
    ImageGenerationRequest.model_validate({"prompt": "p"})
    assert not [r for r in caplog.records if r.name == "gateway.protocol"]


# ---------------------------------------------------------------- to_image_job (settings)

@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "p", "model": "dall-e-3"}, "model", "model_not_found"),
    ({"prompt": "p" * 41}, "prompt", "string_above_max_length"),
    ({"prompt": "p", "negative_prompt": "n" * 41}, "negative_prompt", "string_above_max_length"),
    ({"prompt": "p", "size": "64x"}, "size", "invalid_size"),
    ({"prompt": "p", "size": "8x8"}, "size", None),
    ({"prompt": "p", "size": "1024x1024"}, "size", None),
    ({"prompt": "p", "ar_grid": "nonsense"}, "ar_grid", None),
    ({"prompt": "p", "num_inference_steps": 13}, "num_inference_steps", None),
    ({"prompt": "p", "stream": True, "partial_images": 3, "num_inference_steps": 2},
     "partial_images", "invalid_value"),
])
def test_a_settings_rule_is_the_400_or_404_naming_its_param(body, param, code):
    status, got_param, got_code, _ = refusal(body)
    assert status == (404 if param == "model" else 400)
    assert got_param == param
    if code is not None:
        assert got_code == code


def test_settings_rules_raise_gateway_errors():
    req = ImageGenerationRequest.model_validate({"prompt": "p", "model": "other"})
    with pytest.raises(NotFoundError):
        req.to_image_job(SETTINGS, "r")
    req = ImageGenerationRequest.model_validate({"prompt": "p", "size": "17x17"})
    with pytest.raises(InvalidRequestError):
        req.to_image_job(SETTINGS, "r")


def test_defaults_are_filled_from_the_settings():
    j = job()
    assert (j.request_id, j.width, j.height, j.n) == ("req-1", 64, 64, 1)
    assert (j.ar_grid, j.num_inference_steps, j.text_guidance_scale) == ((4, 4), 8, 4.0)
    assert (j.cfg_range, j.output_format, j.output_compression) == ((0.0, 1.0), "png", 0)
    assert (j.response_format, j.stream, j.quality, j.partial_images) == ("b64_json", False,
                                                                          "high", 0)
    assert 0 <= j.seed < 2**32 and j.safety_identifier is None and j.negative_prompt == ""
    assert job(size="auto").size == "64x64"
    assert job(model=SETTINGS.model_name).n == 1


@pytest.mark.parametrize("quality,steps,echo", [
    ("low", 2, "low"), ("medium", 4, "medium"), ("auto", 8, "high"), ("standard", 8, "high"),
    ("high", 8, "high"), ("hd", 12, "xhigh"), ("xhigh", 12, "xhigh"), ("max", 12, "max"),
])
def test_quality_scales_the_default_steps_capped_by_max_steps(quality, steps, echo):
    j = job(quality=quality)
    assert (j.num_inference_steps, j.quality) == (steps, echo)


def test_style_guidance_and_compression_defaults():
    assert job(style="natural").text_guidance_scale == 2.0  # half the default, at least 1
    assert job(style="vivid").text_guidance_scale == 4.0
    assert job(text_guidance_scale=1.5).text_guidance_scale == 1.5
    assert job(output_format="webp").output_compression == 25
    assert job(user="u1").safety_identifier == "u1"
    assert job(user="u1", safety_identifier="s1").safety_identifier == "s1"
    assert job(ar_grid="2x2").ar_grid == (2, 2)
    assert job(ar_guidance_scale=3.0).ar_guidance_scale == 3.0
