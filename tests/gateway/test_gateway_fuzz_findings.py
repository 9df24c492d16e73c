"""Regressions found by schemathesis (tests/chaos/test_api_fuzz.py), pinned as fast tests.

- JSON types are checked strictly: ``false`` is not a number, ``"2"`` not an integer, ``1`` not a
  boolean (the OpenAPI document says integer/number/boolean; the lax parser used to coerce them).
- Non-JSON responses declare their real content type in the OpenAPI document (``/metrics`` is
  ``text/plain``, image files are ``image/*``).
- A framework HTTP error (e.g. FastAPI's "error parsing the body" 400) is counted as
  ``invalid_request``, not as an ``internal_error``.
"""

from __future__ import annotations

import httpx
import pytest

GEN = "/v1/images/generations"


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory()


@pytest.mark.parametrize("field,value", [
    ("ar_guidance_scale", False), ("text_guidance_scale", True), ("n", "2"), ("n", True),
    ("seed", "7"), ("num_inference_steps", 2.5), ("stream", 1), ("stream", "true"),
    ("partial_images", False), ("output_compression", "50"), ("cfg_range", [False, 1]),
])
def test_mistyped_fields_are_400_naming_the_field(gw, field, value):
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": "64x64", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_numbers_still_accept_integers(gw):
    # an integer is a valid JSON number: no 400 for the type (503: no stage behind this gateway)
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": "64x64", "text_guidance_scale": 4,
                                       "cfg_range": [0, 1]})
    assert r.status_code == 503, r.text


def test_openapi_declares_non_json_content_types(gw):
    doc = httpx.get(gw.url + "/openapi.json").json()
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    files = doc["paths"]["/v1/images/files/{image_id}"]["get"]["responses"]["200"]["content"]
    assert set(files) == {"image/png", "image/jpeg", "image/webp"}
    assert httpx.get(gw.url + "/metrics").headers["content-type"].startswith("text/plain")
    # an SSE answer is described event by event ({event, data}), not as one string
    sse = doc["paths"][GEN]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    assert sse["type"] == "object" and set(sse["properties"]) == {"event", "data"}


def test_framework_http_errors_are_not_counted_as_internal_errors():
    from starlette.exceptions import HTTPException

    from gateway.errors import outcome_of

    assert outcome_of(HTTPException(400, "There was an error parsing the body")) == "invalid_request"
    assert outcome_of(HTTPException(404)) == "not_found"
    assert outcome_of(HTTPException(503)) == "internal_error"


def test_request_bodies_over_the_limit_are_413(gateway_factory):
    gw = gateway_factory(max_body_bytes=4096)
    big = {"prompt": "x" * 5000, "size": "64x64"}
    r = httpx.post(gw.url + GEN, json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert r.headers.get("x-request-id")

    def chunked():  # no Content-Length: the body is counted as it streams in
        for _ in range(100):
            yield b" " * 1000

    r = httpx.post(gw.url + GEN, content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and set(r.json()) == {"error"}
    # a small chunked body still reaches the app (400 here: it is not a valid request)
    r = httpx.post(gw.url + GEN, content=iter([b'{"prompt": ', b'""}']), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
