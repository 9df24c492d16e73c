"""Issue 15.2: admission by what the AR can hold, before any stage work.

Every size of the openai SDK's own ``size`` list either works or is refused in under 50 ms with
``param: "size"`` and no stage metric moved; an over-long prompt likewise with ``param: "prompt"``.
Against real ``mammoth ar``/``mammoth dit`` processes whose AR holds only 400 positions (so that the
CPU run stays short and some SDK sizes do not fit), and against fake stages with the default table
(every SDK size and the largest documented one are servable by default).
"""

from __future__ import annotations

import base64
import io
import time
import typing

import httpx
import pytest
from openai.types import image_generate_params
from PIL import Image

from mammoth_core import limits

GEN = "/v1/images/generations"
POSITIONS = 400
SDK_SIZES = next(typing.get_args(arg) for arg in typing.get_args(
    typing.get_type_hints(image_generate_params.ImageGenerateParamsBase)["size"])
    if typing.get_origin(arg) is typing.Literal)


def _fastest_refusal(http: httpx.Client, url: str, body: dict) -> tuple[float, dict]:
    """The fastest of three identical requests (a busy CI host may stall one) and its error."""
    times, error = [], {}
    for _ in range(3):
        t0 = time.perf_counter()
        r = http.post(url + GEN, json=body)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    return min(times), error


def test_sdk_sizes_work_or_are_refused_before_stage_work(real_stages, gateway_factory):
    assert "1792x1024" in SDK_SIZES and "auto" in SDK_SIZES
    dit, ar = real_stages.together(("dit", "--slots", "2"), ("ar", "--max-sequence-length", str(POSITIONS)))
    gw = gateway_factory(ar=[ar.address], dit=[dit.address], request_timeout_seconds=120,
                         gateway_token_file=real_stages.gateway_token_file, max_sequence_length=POSITIONS, max_pixels=limits.DEFAULTS.max_pixels,
                         min_pixels=limits.DEFAULTS.min_pixels,
                         max_prompt_chars=limits.DEFAULTS.max_prompt_chars)
    gw.wait_ready(60)

    def stage_calls() -> tuple[float, float]:
        return dit.metric("mammoth_dit_requests_total"), ar.metric("mammoth_ar_requests_total")

    worked, refused = [], []
    with httpx.Client(timeout=120) as http:
        for size in SDK_SIZES:
            body = {"prompt": "a red fox", "size": size, "num_inference_steps": 1, "seed": 1}
            before = stage_calls()
            r = http.post(gw.url + GEN, json=body)
            if r.status_code == 200:
                image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
                assert size == "auto" or image.size == tuple(int(v) for v in size.split("x"))
                worked.append(size)
                continue
            elapsed, error = _fastest_refusal(http, gw.url, body)
            assert error["param"] == "size" and str(POSITIONS) in error["message"], (size, error)
            assert elapsed < 0.05, (size, elapsed)
            assert stage_calls() == before, size
            refused.append(size)
        assert set(worked) == {"auto", "256x256"} and len(refused) == len(SDK_SIZES) - 2
        # a prompt within max_prompt_chars that the AR cannot hold next to the grid
        before = stage_calls()
        elapsed, error = _fastest_refusal(http, gw.url, {"prompt": "🦊" * 4000, "size": "256x256"})
        assert error["param"] == "prompt" and str(POSITIONS) in error["message"], error
        assert elapsed < 0.05 and stage_calls() == before


@pytest.mark.parametrize("size", [*SDK_SIZES, "1536x1536"])
def test_every_sdk_size_and_the_largest_documented_one_are_servable_by_default(fakes, gateway_factory, size):
    dit, ar = fakes("dit", "--step-delay", "0"), fakes("ar")
    defaults = {f.name: limits.field_default(f.name) for f in limits.limit_fields()}
    gw = gateway_factory(ar=[ar.address], dit=[dit.address], **defaults)
    gw.wait_ready()
    r = httpx.post(gw.url + GEN, json={"prompt": "a red fox", "size": size, "num_inference_steps": 1},
                   timeout=120)
    assert r.status_code == 200, r.text
