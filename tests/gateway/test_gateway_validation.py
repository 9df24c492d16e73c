"""Request validation, the OpenAI error envelope, auth, models, health and OpenAPI, over real HTTP.

Validation runs before any stage work, so most of these need no stage at all; the ones that check
"the service answers the next valid request" use fake stages (tests/gateway/fake_stages.py).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

GEN = "/v1/images/generations"


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory()


def assert_envelope(response: httpx.Response, status: int, param: str | None = None,
                    code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert response.headers.get("x-request-id")
    return err


@pytest.mark.parametrize("size", ["100000x10000", "1024x", "0x512", "-512x512", "abc", "100x100",
                                  "64x65", "64X64 ", "", "4096x4096", "16x0",
                                  # exactly WIDTHxHEIGHT (a break-it pass found these accepted):
                                  " 64x64", "64x64 ", "64x64\n", "064x064"])
def test_invalid_sizes_are_400_with_param_size(gw, size):
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": size})
    err = assert_envelope(r, 400, "size")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param,code", [
    ({}, "prompt", "missing_required_parameter"),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": "   "}, "prompt", None),
    ({"prompt": "x" * 201}, "prompt", "string_above_max_length"),
    ({"prompt": "p", "n": 11}, "n", None),
    ({"prompt": "p", "n": 0}, "n", None),
    ({"prompt": "p", "n": "three"}, "n", None),
    ({"prompt": "p", "response_format": "file"}, "response_format", None),
    ({"prompt": "p", "output_format": "gif"}, "output_format", None),
    ({"prompt": "p", "output_format": "png", "output_compression": 50}, "output_compression", None),
    ({"prompt": "p", "output_format": "jpeg", "output_compression": 101}, "output_compression",
     None),
    ({"prompt": "p", "quality": "ultra"}, "quality", None),
    ({"prompt": "p", "background": "transparent"}, "background", None),
    ({"prompt": "p", "style": "baroque"}, "style", None),
    ({"prompt": "p", "moderation": "low"}, "moderation", "unsupported_parameter"),
    ({"prompt": "p", "moderation": "auto"}, "moderation", "unsupported_parameter"),
    ({"prompt": "p", "complexity": "low"}, "complexity", "unsupported_parameter"),
    ({"prompt": "p", "frame_count": 4}, "frame_count", "unsupported_parameter"),
    ({"prompt": "p", "svg": {}}, "svg", "unsupported_parameter"),
    ({"prompt": "p", "partial_images": 2}, "partial_images", None),
    ({"prompt": "p", "stream": True, "partial_images": 4}, "partial_images", None),
    ({"prompt": "p", "user": "u" * 300}, "user", None),
    ({"prompt": "p", "seed": -1}, "seed", None),
    ({"prompt": "p", "num_inference_steps": 0}, "num_inference_steps", None),
    ({"prompt": "p", "num_inference_steps": 51}, "num_inference_steps", None),
    ({"prompt": "p", "text_guidance_scale": -1}, "text_guidance_scale", None),
    ({"prompt": "p", "cfg_range": [0.8, 0.2]}, "cfg_range", None),
    ({"prompt": "p", "cfg_range": [0.1]}, "cfg_range", None),
    ({"prompt": "p", "ar_guidance_scale": "high"}, "ar_guidance_scale", None),
    ({"prompt": "p", "negative_prompt": "x" * 201}, "negative_prompt", "string_above_max_length"),
    ({"prompt": "p", "quality": "low", "num_inference_steps": 3}, "quality",
     "conflicting_parameter"),
    ({"prompt": "p", "style": "natural", "text_guidance_scale": 3}, "style",
     "conflicting_parameter"),
    ({"prompt": "p", "extra_body": {"seed": -5}}, "seed", None),
    ({"prompt": "p", "extra_body": {"sed": 5}}, "extra_body", None),
    ({"prompt": "p", "seed": 1, "extra_body": {"seed": 2}}, "seed", "conflicting_parameter"),
])
def test_invalid_fields_are_400_naming_the_field(gw, body, param, code):
    r = httpx.post(gw.url + GEN, json=body)
    assert_envelope(r, 400, param, code)


def test_non_json_and_wrong_types_are_400_never_422(gw):
    r = httpx.post(gw.url + GEN, content=b"{not json", headers={"content-type": "application/json"})
    assert_envelope(r, 400, code="invalid_json")
    r = httpx.post(gw.url + GEN, json=["a", "list"])
    assert_envelope(r, 400)


def test_unknown_model_is_404_model_not_found(gw):
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "model": "dall-e-3"})
    err = assert_envelope(r, 404, "model", "model_not_found")
    assert "dall-e-3" in err["message"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(prompt="p", model="gpt-image-1")
    assert info.value.body["code"] == "model_not_found"


def test_no_backend_is_503_with_retry_after(gw):
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": "64x64"})
    assert_envelope(r, 503, code="no_backend")
    assert int(r.headers["retry-after"]) >= 1
    assert httpx.get(gw.url + "/readyz").status_code == 503
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_unknown_route_and_method_use_the_envelope(gw):
    assert_envelope(httpx.get(gw.url + "/v1/nope"), 404)
    assert_envelope(httpx.get(gw.url + GEN), 405)


def test_models_endpoint(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["mammothmoda2"]
    assert client.models.retrieve("mammothmoda2").id == "mammothmoda2"
    assert_envelope(httpx.get(gw.url + "/v1/models/other"), 404, "model", "model_not_found")


def test_api_keys_from_file(gateway_factory, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nsk-one\n\nsk-two  # trailing comment\n")
    gw = gateway_factory(api_keys_file=str(keys))
    err = assert_envelope(httpx.get(gw.url + "/v1/models"), 401, code="invalid_api_key")
    assert err["type"] == "authentication_error"
    assert_envelope(httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer nope"}), 401)
    assert httpx.get(gw.url + "/v1/models",
                     headers={"authorization": "Bearer sk-two"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0).images.generate(
            prompt="p")
    # health, readiness and metrics need no key
    assert httpx.get(gw.url + "/healthz").status_code == 200
    assert httpx.get(gw.url + "/metrics").status_code == 200
    # the file is re-read when it changes (a rotated Secret)
    import os
    import time

    keys.write_text("sk-three\n")
    os.utime(keys, (time.time() + 5, time.time() + 5))
    assert httpx.get(gw.url + "/v1/models",
                     headers={"authorization": "Bearer sk-three"}).status_code == 200
    assert httpx.get(gw.url + "/v1/models",
                     headers={"authorization": "Bearer sk-one"}).status_code == 401


def test_an_api_key_containing_a_hash_is_the_whole_key(gateway_factory, tmp_path):
    """``#`` starts a comment only at a line's start or after whitespace: a key with ``#`` inside
    (``sk-hash#part``) is the whole key, not its prefix (break-it pass: ``Bearer sk-hash`` was
    accepted and the full key refused, silently weakening it)."""
    keys = tmp_path / "keys"
    keys.write_text("sk-hash#notcomment\nsk-other # a comment\n")
    gw = gateway_factory(api_keys_file=str(keys))
    ok = {"authorization": "Bearer sk-hash#notcomment"}
    assert httpx.get(gw.url + "/v1/models", headers=ok).status_code == 200
    assert_envelope(httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer sk-hash"}), 401)
    assert httpx.get(gw.url + "/v1/models", headers={"authorization": "Bearer sk-other"}).status_code == 200


def test_health_and_metrics_answer_head(gw):
    """Load balancers' health checks may send HEAD: the health, readiness and metrics endpoints
    answer it as GET, without a body (they answered 405 before)."""
    for path in ("/healthz", "/readyz", "/metrics"):
        get, head = httpx.get(gw.url + path), httpx.head(gw.url + path)
        assert head.status_code == get.status_code != 405, (path, head.status_code)
        assert head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path


def test_request_id_header_is_echoed_or_generated(gw):
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": "abc"},
                   headers={"x-request-id": "my-id-123"})
    assert r.headers["x-request-id"] == "my-id-123"
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": "abc"},
                   headers={"x-request-id": "bad id with spaces"})
    assert r.headers["x-request-id"].startswith("img-")


def test_openapi_matches_behaviour(gw):
    doc = httpx.get(gw.url + "/openapi.json").json()
    op = doc["paths"]["/v1/images/generations"]["post"]
    assert "422" not in op["responses"]
    for status in ("400", "401", "404", "429", "502", "503", "504"):
        assert status in op["responses"], status
        ref = op["responses"][status]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    assert "text/event-stream" in op["responses"]["200"]["content"]
    schema = doc["components"]["schemas"]["ImageGenerationRequest"]
    for field in ("prompt", "model", "n", "size", "response_format", "output_format",
                  "output_compression", "quality", "background", "style", "moderation", "user",
                  "stream", "partial_images", "seed", "negative_prompt", "num_inference_steps",
                  "text_guidance_scale", "cfg_range", "ar_guidance_scale", "extra_body"):
        assert field in schema["properties"], field
        assert schema["properties"][field].get("description"), field
    assert schema["required"] == ["prompt"]
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_validation_errors_are_counted_by_outcome(gw):
    before = gw.metric("mammoth_gateway_requests_total", outcome="invalid_request")
    httpx.post(gw.url + GEN, json={"prompt": "p", "size": "abc"})
    httpx.post(gw.url + GEN, json={"prompt": "p", "n": 11})
    assert gw.metric("mammoth_gateway_requests_total", outcome="invalid_request") == before + 2



def test_empty_or_non_object_body_is_invalid_json_with_a_helpful_message(gw):
    empty = httpx.post(gw.url + GEN, headers={"content-type": "application/json"})
    err = assert_envelope(empty, 400, None)
    assert err["code"] == "invalid_json" and "empty" in err["message"]
    text = httpx.post(gw.url + GEN, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    err = assert_envelope(text, 400, None)
    assert err["code"] == "invalid_json" and "application/json" in err["message"]


@pytest.mark.parametrize("body,param,names", [
    ({"prompt": "p", "cfg_range": [0.5]}, "cfg_range", "item 1"),
    ({"prompt": "p", "dit_cache": {"warmup_steps": 1}}, "dit_cache", "threshold"),
    ({"prompt": "p", "extra_body": {"dit_cache": {}}}, "dit_cache", "threshold"),
])
def test_a_given_field_missing_a_part_is_invalid_value_not_missing_parameter(gw, body, param, names):
    """A field that was sent but lacks an element or key is not a "missing required parameter":
    the 400 says which part is missing, so the caller does not look for a field they did send."""
    r = httpx.post(gw.url + GEN, json=body)
    err = assert_envelope(r, 400, param, "invalid_value")
    assert names in err["message"], err
    assert "missing required parameter" not in err["message"], err


@pytest.mark.parametrize("body,param", [
    (b'{"prompt": "p", "text_guidance_scale": NaN}', "text_guidance_scale"),
    (b'{"prompt": "p", "ar_guidance_scale": -Infinity}', "ar_guidance_scale"),
    (b'{"prompt": "p", "cfg_range": [NaN, 0.5]}', "cfg_range"),
    (b'{"prompt": "p", "extra_body": {"text_guidance_scale": Infinity}}', "text_guidance_scale"),
    (b'{"prompt": "p", "dit_cache": {"threshold": NaN}}', "dit_cache"),
])
def test_nan_and_infinity_are_refused_as_not_finite(gw, body, param):
    """Python's JSON parser reads NaN/Infinity; the 400 says the number is not finite (not that NaN
    is above a maximum or below a minimum)."""
    r = httpx.post(gw.url + GEN, content=body, headers={"content-type": "application/json"})
    err = assert_envelope(r, 400, param, "invalid_value")
    assert "finite number" in err["message"], err


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a\udfff"}, "prompt"),
    ({"prompt": "a", "negative_prompt": "\udfff"}, "negative_prompt"),
    ({"prompt": "a", "model": "\udfff"}, "model"),
    ({"prompt": "a", "user": "\ud800x"}, "user"),
    ({"prompt": "a", "extra_body": {"negative_prompt": "\udfff"}}, "negative_prompt"),
    ({"prompt": "a", "negative_prompt": "\udfff", "stream": True}, "negative_prompt"),
])
def test_a_lone_surrogate_is_400_naming_the_field_and_the_connection_lives_on(gw, body, param):
    """JSON may escape a lone UTF-16 surrogate (``"\\udfff"``), which no UTF-8 text can hold: every
    string field refuses it up front (a break-it pass found ``negative_prompt`` and ``model`` giving
    500 and a dropped keep-alive connection), and the next request on the connection is answered."""
    raw = json.dumps(body).encode()  # ensure_ascii: the escape travels as JSON text, as a client may send it
    with httpx.Client(base_url=gw.url) as client:
        r = client.post(GEN, content=raw, headers={"content-type": "application/json"})
        err = assert_envelope(r, 400, param, "invalid_value")
        assert "surrogate" in err["message"]
        again = client.get("/v1/models")
        assert again.status_code == 200
