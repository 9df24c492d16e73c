"""The gateway as the official ``openai`` client and the OpenAI API schema see it (issue 15.6, 15.7).

- A default stream carries only event types the OpenAI API defines; a client dispatching on the
  SDK's event classes never meets our ``image_generation.progress`` extension, which reaches only
  clients that opt in (``stream_progress: true``).
- ``quality`` in responses and events is a value the API's schema allows.
- Unparseable bodies get ``code: invalid_json``; ``POST .../generations/`` does not redirect; a
  prompt of control or zero-width characters is blank; the SDK's client-side timeout
  (``X-Stainless-Read-Timeout``) bounds the request's budget.
"""

from __future__ import annotations

import base64
import io
import json
import time
import typing

import httpx
import openai
import pytest
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent, ImagesResponse
from PIL import Image

GEN = "/v1/images/generations"


def client(gw, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, **kw)


@pytest.fixture
def stack(fakes, gateway_factory):
    dit = fakes("dit", "--step-delay", "0.01")
    ar = fakes("ar")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    return gw


def sse_types(response: httpx.Response) -> list[str]:
    return [json.loads(line[6:])["type"] for line in response.iter_lines() if line.startswith("data: ")]


def test_default_stream_has_only_openai_event_classes(stack):
    events = client(stack, timeout=60).images.generate(
        prompt="a lighthouse", size="32x32", stream=True, partial_images=2,
        extra_body={"num_inference_steps": 4, "seed": 3})
    seen = []
    for event in events:  # dispatch on the SDK's classes, as client code does
        if isinstance(event, ImageGenPartialImageEvent):
            assert Image.open(io.BytesIO(base64.b64decode(event.b64_json))).size == (32, 32)
            seen.append("partial")
        elif isinstance(event, ImageGenCompletedEvent):
            assert Image.open(io.BytesIO(base64.b64decode(event.b64_json))).size == (32, 32)
            seen.append("completed")
        else:
            raise AssertionError(f"unexpected event class {type(event).__name__}")
    assert seen == ["partial", "partial", "completed"]


def test_progress_events_reach_only_clients_that_opt_in(stack):
    body = {"prompt": "a lighthouse", "size": "32x32", "stream": True, "num_inference_steps": 3}
    with httpx.stream("POST", stack.url + GEN, json=body, timeout=60) as r:
        assert set(sse_types(r)) == {"image_generation.completed"}
    with httpx.stream("POST", stack.url + GEN, json={**body, "stream_progress": True}, timeout=60) as r:
        types = sse_types(r)
    assert types.count("image_generation.progress") >= 3 and types[-1] == "image_generation.completed"
    r = httpx.post(stack.url + GEN, json={**body, "stream": False, "stream_progress": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_progress"


def allowed(model: type, field: str) -> set[str]:
    hint = model.model_fields[field].annotation
    args = typing.get_args(hint)
    literal = next(a for a in args if typing.get_origin(a) is typing.Literal) if args and \
        typing.get_origin(hint) is typing.Union else hint
    return set(typing.get_args(literal))


@pytest.mark.parametrize("quality", ["auto", "standard", "hd", "low", "high", "xhigh"])
def test_quality_echoed_is_one_the_schema_allows(stack, quality):
    c = client(stack, timeout=60)
    result = c.images.generate(prompt="x", size="32x32", quality=quality, extra_body={"seed": 1})
    assert result.quality in allowed(ImagesResponse, "quality"), result.quality
    events = list(c.images.generate(prompt="x", size="32x32", quality=quality, stream=True,
                                    extra_body={"seed": 1}))
    assert events[-1].quality in allowed(ImageGenCompletedEvent, "quality"), events[-1].quality


@pytest.mark.parametrize("body,content_type", [
    (b'{"prompt": "x",', "application/json"),
    (b"\xff\xfe not utf-8", "application/json"),
    (b"prompt=x", "application/x-www-form-urlencoded"),
    (b'{"prompt": "x"}', "text/plain"),
    (b'{"a":' * 3000 + b"1" + b"}" * 3000, "application/json"),  # nested too deeply to parse
])
def test_unparseable_bodies_get_code_invalid_json(stack, body, content_type):
    r = httpx.post(stack.url + GEN, content=body, headers={"content-type": content_type}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json", r.json()


def test_trailing_slash_does_not_redirect_to_the_host_header(stack):
    r = httpx.post(stack.url + GEN + "/", json={"prompt": "x", "size": "32x32"}, timeout=10,
                   headers={"host": "evil.example"}, follow_redirects=False)
    assert r.status_code not in (301, 302, 307, 308), r.headers
    assert "evil.example" not in r.headers.get("location", "")
    assert set(r.json()) == {"error"} or r.status_code == 200


@pytest.mark.parametrize("prompt", ["\u200b\u200b", "\x00\x01\x7f", "\u200d\ufeff \u2060", "\u202e\n\t"])
def test_prompt_of_invisible_characters_is_blank(stack, prompt):
    r = httpx.post(stack.url + GEN, json={"prompt": prompt, "size": "32x32"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_the_sdk_client_timeout_bounds_the_request(fakes, gateway_factory):
    dit = fakes("dit", "--step-delay", "1.0")  # 4 steps: 4 s of denoising
    ar = fakes("ar")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address], request_timeout_seconds=60)
    gw.wait_ready()
    c = client(gw, timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:  # the gateway's 504, not a client-side timeout
        c.images.generate(prompt="x", size="32x32", extra_body={"num_inference_steps": 4})
    assert err.value.status_code == 504
    assert err.value.body["code"] == "deadline_exceeded"
    assert time.monotonic() - t0 < 2.0


def test_keep_alives_go_out_while_the_dit_denoises_without_stream_progress(fakes, gateway_factory):
    """The SSE keep-alive interval counts silence toward the client, not between the stages' events:
    a stream without ``stream_progress`` writes nothing while the DiT denoises, so it must send
    keep-alives then too (break-it pass: progress events every step, rendered to nothing, kept the
    heartbeat from ever firing, and a client with a 10 s read timeout was cut off mid-image). Here
    the DiT takes 3 s (10 steps of 0.3 s), the client's read timeout is 2 s (interval 1 s)."""
    dit = fakes("dit", "--step-delay", "0.3")
    ar = fakes("ar")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    body = {"prompt": "a lighthouse", "size": "32x32", "stream": True, "num_inference_steps": 10, "seed": 1}
    arrivals, kinds = [], []
    with httpx.stream("POST", gw.url + GEN, json=body, headers={"X-Stainless-Read-Timeout": "2"},
                      timeout=30) as response:
        assert response.status_code == 200
        start = time.monotonic()
        for line in response.iter_lines():
            if line:
                arrivals.append(time.monotonic() - start)
                kinds.append("keep-alive" if line.startswith(": keep-alive") else line.split(":", 1)[0])
    assert kinds[-1] == "data" and arrivals[-1] > 2.5, (kinds, arrivals)
    gaps = [b - a for a, b in zip([0.0, *arrivals], arrivals)]
    assert max(gaps) < 1.6, list(zip(kinds, [round(a, 2) for a in arrivals]))
    assert kinds.count("keep-alive") >= 2, kinds
