"""Issue 18: ``ar_decoding: "jacobi"`` through the whole local pipeline (gateway -> AR -> DiT).

The official client sends the extension fields; the served PNG is byte-identical to the in-process
run with the same decoding options and seed, the seed reproduces it; a window outside [2, 64] is a
400 naming ``jacobi_window`` before any stage work; the deployment default
(``default_ar_decoding``) applies to requests that give none.
"""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch
from openai import OpenAI

from gateway.protocol import ImageGenerationRequest
from mammoth_core.decoding import ARDecoding, DecodingOptions
from mammoth_core.settings import GatewaySettings

PROMPT = "a lighthouse on a cliff at dusk"
JACOBI = {"ar_decoding": "jacobi", "jacobi_window": 4, "jacobi_spatial_init": True}


@pytest.fixture(scope="module")
def reference(inprocess_model):
    """The same model in this process (tests/conftest.py `inprocess_model`)."""
    return inprocess_model


def _generate(pipeline, seed: int, extra: dict) -> bytes:
    client = OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.images.with_raw_response.generate(
        prompt=PROMPT, size="64x64",
        extra_body={"seed": seed, "num_inference_steps": 2, "text_guidance_scale": 4.0, **extra})
    return base64.b64decode(json.loads(raw.text)["data"][0]["b64_json"])


def test_jacobi_request_streams_the_in_process_image_and_the_seed_reproduces_it(pipeline, reference):
    png = _generate(pipeline, 5, JACOBI)
    torch.set_num_threads(1)
    options = DecodingOptions(ARDecoding.JACOBI, window=4, spatial_init=True)
    expected = reference.generate(PROMPT, width=64, height=64, seed=5, num_inference_steps=2,
                                  text_guidance_scale=4.0, decoding=options)
    assert png == expected.image, "served PNG differs from the in-process Jacobi run"
    assert _generate(pipeline, 5, JACOBI) == png
    sequential = reference.generate(PROMPT, width=64, height=64, seed=5, num_inference_steps=2,
                                    text_guidance_scale=4.0)
    assert sequential.token_ids != expected.token_ids  # the same law, not the same draws
    assert _generate(pipeline, 5, {}) == sequential.image  # default: sequential, as before


def test_bad_window_is_refused_naming_the_field(pipeline):
    for body in ({"jacobi_window": 1}, {"jacobi_window": 65}, {"ar_decoding": "parallel"}):
        r = httpx.post(f"{pipeline.url}/v1/images/generations", timeout=30,
                       json={"prompt": PROMPT, "size": "64x64", **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == next(iter(body)), r.json()


def test_deployment_default_applies_to_requests_without_the_field():
    settings = GatewaySettings(default_ar_decoding="jacobi", default_jacobi_window=8)
    job = ImageGenerationRequest(prompt="x", size="64x64").to_image_job(settings, "r")
    assert job.decoding == DecodingOptions(ARDecoding.JACOBI, window=8)
    job = ImageGenerationRequest(prompt="x", size="64x64", ar_decoding="sequential").to_image_job(settings, "r")
    assert not job.decoding.jacobi
    assert ImageGenerationRequest(prompt="x", size="64x64").to_image_job(GatewaySettings(), "r").decoding \
        == DecodingOptions()
