"""The gateway against the real ``mammoth ar`` / ``mammoth dit`` processes (tiny checkpoint on CPU),
through the official ``openai`` client (sync and streaming) and raw HTTP.

One DiT and one AR serve every test of the module (started side by side, once); each test gets a
gateway of its own, so gateway metrics start at zero. The stages must be idle before and after
each test (no DiT slot, DiT request or AR sequence left), and the tests read stage counters as
deltas, so no test sees another's traffic. The AR-kill test adds a second AR and kills the one
decoding (a test after it would get a new shared AR).
"""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import openai
import pytest
from PIL import Image
from pipeline_harness import metric_samples

GEN = "/v1/images/generations"
STEPS = 2
IDLE = ("mammoth_dit_slots_in_use", "mammoth_dit_active_requests", "mammoth_ar_running_sequences")


class SharedStages:
    """The module's DiT (2 slots) and AR (`StageFactory`, tests/gateway/conftest.py), started side
    by side once. The AR-kill test may kill the AR: `ar` starts a new one for a test after it."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.dit, self._ar = factory.together(("dit", "--slots", "2"), ("ar",))

    def ar(self):
        """The shared AR, serving."""
        if self._ar.proc.poll() is not None:
            self._ar = self.factory("ar")
        return self._ar


@pytest.fixture(scope="module")
def stages(module_stages):
    return SharedStages(module_stages)


def wait_idle(*stages, timeout: float = 10.0) -> None:
    """Wait until each of the stages' ``IDLE`` gauges reads 0; AssertionError naming the first
    that is not exposed, or not 0 within ``timeout`` s (0: it must read 0 now)."""
    deadline = time.monotonic() + timeout
    for stage in stages:
        for name in (n for n in IDLE if n.startswith(f"mammoth_{stage.role}_")):
            while (values := metric_samples(stage.metrics_url, name)) != [0]:
                assert values and time.monotonic() < deadline, f"{stage.role} not idle: {name} = {values}"
                time.sleep(0.05)


@pytest.fixture
def real(stages, gateway_factory):
    """A fresh gateway on the shared stages, which are idle before the test and again after it."""
    dit, ar = stages.dit, stages.ar()
    wait_idle(dit, ar, timeout=0)  # nothing left over from an earlier test
    gw = gateway_factory(ar=[ar.address], dit=[dit.address], request_timeout_seconds=120,
                         gateway_token_file=stages.factory.gateway_token_file)
    gw.wait_ready(60)
    yield gw, ar, dit
    wait_idle(dit, ar)


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_fields_and_errors_against_real_stages(real):
    gw, ar, dit = real
    c = client(gw)
    ext = {"seed": 21, "num_inference_steps": STEPS}
    # n=3: distinct images in order, reproducible with the seed; size is honoured (W x H)
    three = c.images.generate(prompt="a cat", n=3, size="64x32", extra_body=ext)
    images = [d.b64_json for d in three.data]
    assert len(set(images)) == 3
    assert [d.model_extra.get("seed") for d in three.data] == [21, 22, 23]
    assert all(png(b).size == (64, 32) for b in images)
    again = c.images.generate(prompt="a cat", size="64x32", extra_body={**ext, "seed": 22})
    assert again.data[0].b64_json == images[1]
    assert three.usage.output_tokens == 3 * 2 * (4 + 1)
    assert three.usage.input_tokens > 0
    # extensions change the image
    neg = c.images.generate(prompt="a cat", size="64x32",
                            extra_body={**ext, "negative_prompt": "blurry"})
    assert neg.data[0].b64_json != images[0]
    guided = c.images.generate(prompt="a cat", size="64x32",
                               extra_body={**ext, "text_guidance_scale": 2.0, "cfg_range": [0, 0.5]})
    assert guided.data[0].b64_json != images[0]
    # output formats and compression
    jpeg_sizes = []
    for compression in (0, 90):
        r = c.images.generate(prompt="a cat", size="64x64", output_format="jpeg",
                              output_compression=compression, extra_body=ext)
        data = base64.b64decode(r.data[0].b64_json)
        assert data[:3] == b"\xff\xd8\xff"
        jpeg_sizes.append(len(data))
    assert jpeg_sizes[0] > jpeg_sizes[1]
    webp = c.images.generate(prompt="a cat", size="32x32", output_format="webp", extra_body=ext)
    assert base64.b64decode(webp.data[0].b64_json)[:4] == b"RIFF"
    # url
    u = c.images.generate(prompt="a cat", size="32x32", response_format="url", extra_body=ext)
    got = httpx.get(u.data[0].url)
    assert got.status_code == 200 and got.content[:8] == b"\x89PNG\r\n\x1a\n"
    # invalid sizes -> 400 param size, then the next valid request works
    for size in ("100000x10000", "1024x", "0x512", "-512x512", "abc", "40x40"):
        r = httpx.post(gw.url + GEN, json={"prompt": "a cat", "size": size})
        assert r.status_code == 400 and r.json()["error"]["param"] == "size", size
    with pytest.raises(openai.BadRequestError):
        c.images.generate(prompt="a cat", n=11)
    with pytest.raises(openai.NotFoundError):
        c.images.generate(prompt="a cat", model="dall-e-2")
    ok = c.images.generate(prompt="a cat", size="32x32", extra_body=ext)
    assert png(ok.data[0].b64_json).size == (32, 32)


def test_a_prompt_too_long_for_the_dits_caption_positions_names_the_prompt(stages, gateway_factory):
    """The tiny checkpoint's DiT (``text_image`` conditions: the prompt's text rows are part of the
    condition) refuses a condition longer than its caption positions. The refusal travels from the
    DiT as INVALID_ARGUMENT naming the field (a ``google.rpc.BadRequest`` detail), so the client's
    400 names ``prompt`` (a break-it pass got ``param: null``)."""
    dit, ar = stages.dit, stages.ar()
    wait_idle(dit, ar, timeout=0)
    gw = gateway_factory(ar=[ar.address], dit=[dit.address], request_timeout_seconds=120, max_prompt_chars=4000,
                         gateway_token_file=stages.factory.gateway_token_file)
    gw.wait_ready(60)
    r = httpx.post(gw.url + GEN, json={"prompt": "\U0001F600" * 2490, "size": "32x32", "seed": 1,
                                       "num_inference_steps": 1}, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "caption positions" in err["message"], err
    wait_idle(dit, ar)


def test_stream_one_progress_event_per_step_completed_last(real):
    gw, _, _ = real
    steps = 3
    events = list(client(gw).images.generate(
        prompt="a boat", size="32x32", stream=True, partial_images=1,
        extra_body={"seed": 4, "num_inference_steps": steps, "stream_progress": True}))
    assert events[-1].type == "image_generation.completed"
    dit_steps = [e.step for e in events if e.type == "image_generation.progress"
                 and e.stage == "dit" and e.phase == "denoising"]
    assert dit_steps == list(range(1, steps + 1))
    assert any(e.type == "image_generation.progress" and e.stage == "ar" for e in events)
    partial = [e for e in events if e.type == "image_generation.partial_image"]
    assert len(partial) == 1 and partial[0].partial_image_index == 0  # a real preview, before the end
    assert png(partial[0].b64_json).size == (32, 32)
    assert events.index(partial[0]) < len(events) - 1
    final = events[-1]
    assert partial[0].b64_json != final.b64_json  # decoded mid-denoising, not the final image
    plain = client(gw).images.generate(prompt="a boat", size="32x32",
                                       extra_body={"seed": 4, "num_inference_steps": steps})
    assert plain.data[0].b64_json == final.b64_json
    # the completed event carries the Server-Timing breakdown (ms) of its image, plus total
    timings = final.model_extra["timings"]
    assert list(timings) == ["queue", "ar_prefill", "ar_decode", "transfer", "dit_denoise",
                             "dit_vae", "dit_encode", "total"]
    assert all(v >= 0 for v in timings.values())
    assert timings["dit_denoise"] > 0 and timings["ar_decode"] > 0
    stages = sum(v for k, v in timings.items() if k != "total")
    assert stages <= timings["total"] * 1.05 + 5


def test_disconnect_frees_both_stages_within_a_second(real):
    gw, ar, dit = real

    def ar_stopped() -> float:  # AR Generate calls that ended without finishing
        return sum(ar.metric("mammoth_ar_requests_total", outcome=o)
                   for o in ("cancelled", "push_failed"))

    stopped0, ok0 = ar_stopped(), ar.metric("mammoth_ar_requests_total", outcome="ok")
    with httpx.stream("POST", gw.url + GEN, json={"prompt": "a long one", "size": "256x256",
                                                   "stream": True, "num_inference_steps": 50,
                                                   "seed": 1, "stream_progress": True}, timeout=60) as r:
        for line in r.iter_lines():
            if '"stage":"ar"' in line:
                break
    t_close = time.monotonic()
    while time.monotonic() - t_close < 1.0:
        if dit.metric("mammoth_dit_slots_in_use") == 0 and ar_stopped() - stopped0 == 1:
            break
        time.sleep(0.05)
    took = time.monotonic() - t_close
    assert dit.metric("mammoth_dit_slots_in_use") == 0
    assert ar_stopped() - stopped0 == 1
    assert ar.metric("mammoth_ar_requests_total", outcome="ok") == ok0
    assert took < 1.0
    for name in ("mammoth_gateway_active_requests", "mammoth_gateway_active_pipelines",
                 "mammoth_gateway_slots_in_use", "mammoth_gateway_queue_depth",
                 "mammoth_gateway_backend_in_flight"):
        assert gw.metric(name) == 0, name
    # and the service answers the next request
    assert client(gw).images.generate(prompt="x", size="32x32",
                                      extra_body={"num_inference_steps": 1}).data


def test_ar_killed_mid_decode_is_retried_and_image_is_identical(stages, gateway_factory):
    dit, ar1 = stages.dit, stages.ar()
    wait_idle(dit, ar1, timeout=0)
    ar2 = stages.factory("ar")  # the one of the two that is not decoding goes on with the request
    try:
        gw = gateway_factory(ar=[ar1.address, ar2.address], dit=[dit.address], request_timeout_seconds=120,
                             gateway_token_file=stages.factory.gateway_token_file)
        gw.wait_ready(60)
        killed, completed, reference = kill_one_ar_mid_decode(gw, (ar1, ar2))
    finally:
        stages.factory.kill(ar2)
    assert killed is not None, "no AR progress seen before the DiT started denoising"
    assert completed is not None
    assert gw.metric("mammoth_gateway_retries_total", stage="ar") == 1
    assert completed["b64_json"] == reference
    wait_idle(dit)  # the shared DiT let go of the killed AR's request


def kill_one_ar_mid_decode(gw, ars) -> tuple:
    """One reference image, then the same request streamed, killing the AR decoding it at its first
    token progress; returns (the killed AR or None, the completed event or None, the reference)."""
    body = {"prompt": "a lighthouse", "size": "512x512", "seed": 8, "num_inference_steps": 1}
    reference = httpx.post(gw.url + GEN, json=body, timeout=120).json()["data"][0]["b64_json"]
    killed = None
    with httpx.stream("POST", gw.url + GEN, json={**body, "stream": True, "stream_progress": True},
                      timeout=120) as r:
        completed = None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if killed is None and event.get("stage") == "ar" and event.get("tokens_generated"):
                for stage in ars:
                    if gw.metric("mammoth_gateway_backend_in_flight", stage="ar",
                                 backend=stage.address):
                        stage.proc.kill()
                        killed = stage
            if event.get("stage") == "dit" and event.get("phase") == "denoising":
                assert killed is not None
            if event.get("type") == "image_generation.completed":
                completed = event
    return killed, completed, reference


def test_the_ar_builds_its_staging_pool_before_it_is_ready(stages, gateway_factory):
    """A fresh AR process holds its sender's host staging blocks when it reports ready, and its
    first request takes them from that pool (no second pool, no pageable fallback): built on first
    use they cost the first request 0.5 s of its decode on the H200 (issue 17, first vs tenth)."""
    from stage_ar.staging import DEFAULT_STAGING_BLOCKS

    dit = stages.dit
    ar = stages.factory("ar")  # fresh: no request has reached it
    try:
        assert ar.metric("mammoth_ar_staging_blocks", state="capacity") == DEFAULT_STAGING_BLOCKS
        assert ar.metric("mammoth_ar_staging_blocks", state="free") == DEFAULT_STAGING_BLOCKS
        gw = gateway_factory(ar=[ar.address], dit=[dit.address], request_timeout_seconds=120,
                             gateway_token_file=stages.factory.gateway_token_file)
        gw.wait_ready(60)
        image = client(gw).images.generate(prompt="a pool", size="256x256", extra_body={"num_inference_steps": STEPS})
        assert image.data[0].b64_json
        wait_idle(dit, ar)
        assert ar.metric("mammoth_ar_staging_blocks", state="capacity") == DEFAULT_STAGING_BLOCKS
        assert ar.metric("mammoth_ar_staging_blocks", state="free") == DEFAULT_STAGING_BLOCKS
        assert ar.metric("mammoth_transport_pageable_fallback_total", side="send") == 0
    finally:
        stages.factory.kill(ar)


def test_each_stage_exports_only_its_own_series(stages):
    """An AR pod's /metrics carries no DiT series and a DiT pod's no AR series, and each carries its
    own side of the transport's (break-it passes found the AR exporting `mammoth_dit_slots_capacity
    0` — a dashboard's min or mean over pods read a DiT pool of zero slots — and both stages the
    other side's transport series at zero)."""
    receive_only = ("mammoth_transport_slot_outcomes_total", "mammoth_transport_rejected_chunks_total",
                    "mammoth_transport_discarded_rows_total", "mammoth_transport_tail_seconds")
    for stage, foreign, other_side in ((stages.ar(), ("mammoth_dit_", *receive_only), 'side="receive"'),
                                       (stages.dit, ("mammoth_ar_",), 'side="send"')):
        text = httpx.get(stage.metrics_url, timeout=10).text
        names = sorted({line.split()[2] if line.startswith("#") else line.split("{")[0].split()[0]
                        for line in text.splitlines()
                        if any(f in line.split("{")[0] for f in foreign) or other_side in line})
        assert names == [], (stage.role, names)
