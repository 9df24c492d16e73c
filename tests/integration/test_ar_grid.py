"""Issue 23: the AR grid independent of the output size (``ar_grid``), on the whole local pipeline.

For grids other than size/16, square and non-square: the AR's prompt envelope names the grid, the
DiT receives ``len(prompt) + h*(w+1)`` rows, the served PNG is byte-identical to the in-process run
with the same grid, the seed reproduces it, ``usage`` reports it; a grid the AR cannot hold is
refused with ``param: "ar_grid"`` before any stage work.
"""

from __future__ import annotations

import base64
import io
import json
import time

import httpx
import pytest
import torch
from openai import OpenAI
from PIL import Image

PROMPT = "a lighthouse on a cliff at dusk"
STEPS = 2
GUIDANCE = 4.0
# (width, height, ar_grid, the grid it resolves to): auto would be 16x16 and 16x8
CASES = [(256, 256, "8x8", (8, 8)), (256, 128, "8x8", (11, 6))]


def _client(pipeline) -> OpenAI:
    return OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _generate(pipeline, width: int, height: int, ar_grid: str, seed: int):
    raw = _client(pipeline).images.with_raw_response.generate(
        prompt=PROMPT, size=f"{width}x{height}",
        extra_body={"seed": seed, "num_inference_steps": STEPS, "text_guidance_scale": GUIDANCE,
                    "ar_grid": ar_grid})
    body = json.loads(raw.text)
    return raw.headers["x-request-id"], base64.b64decode(body["data"][0]["b64_json"]), body["usage"]


def _dit_trace(pipeline, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        files = sorted(pipeline.trace_dir.glob(f"*{request_id}*.dit.json"))
        if files:
            return json.loads(files[-1].read_text())
        time.sleep(0.05)
    raise AssertionError(f"no DiT trace for {request_id}")


@pytest.fixture(scope="module")
def reference(inprocess_model):
    """The same model in this process (tests/conftest.py `inprocess_model`)."""
    return inprocess_model


@pytest.mark.parametrize("width,height,ar_grid,grid", CASES)
def test_grid_other_than_size_over_16_streams_the_in_process_image(pipeline, reference, width, height,
                                                                   ar_grid, grid):
    request_id, png, usage = _generate(pipeline, width, height, ar_grid, seed=5)
    assert Image.open(io.BytesIO(png)).size == (width, height)
    gw, gh = grid
    torch.set_num_threads(1)
    expected = reference.generate(PROMPT, width=width, height=height, seed=5, num_inference_steps=STEPS,
                                  text_guidance_scale=GUIDANCE, ar_grid=ar_grid)
    # the envelope names the grid the AR decodes (not the size / 16)
    tok = reference.ar.tokenizer
    assert expected.grid == grid
    assert expected.token_ids[:expected.prompt_len] == tok.encode_t2i_prompt(PROMPT, gw, gh)
    assert expected.token_ids[:expected.prompt_len] != tok.encode_t2i_prompt(PROMPT, width // 16, height // 16)
    rows = expected.prompt_len + gh * (gw + 1)
    assert len(expected.token_ids) == rows
    assert _dit_trace(pipeline, request_id)["condition_rows"] == rows
    assert png == expected.image, "served PNG differs from the in-process run with the same grid"
    assert usage["ar_grid"] == f"{gw}x{gh}"
    assert usage["output_tokens"] == gh * (gw + 1) and usage["input_tokens"] == expected.prompt_len
    # the seed reproduces it; another seed does not
    assert _generate(pipeline, width, height, ar_grid, seed=5)[1] == png
    assert _generate(pipeline, width, height, ar_grid, seed=6)[1] != png


def test_grid_the_ar_cannot_hold_is_refused_before_stage_work(pipeline):
    def stage_calls() -> tuple[float, float]:
        return (pipeline.metric("dit", "mammoth_dit_requests_total"),
                pipeline.metric("ar", "mammoth_ar_requests_total"))

    before = stage_calls()
    elapsed = []
    with httpx.Client(timeout=30) as http:
        for _ in range(3):  # the fastest of three: a busy CI host may stall any one request
            t0 = time.perf_counter()
            r = http.post(f"{pipeline.url}/v1/images/generations", json={
                "prompt": PROMPT, "size": "256x256", "ar_grid": "1000x1000"})
            elapsed.append(time.perf_counter() - t0)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "ar_grid" and "12288" in error["message"], error
    assert min(elapsed) < 0.05, elapsed
    bad = httpx.post(f"{pipeline.url}/v1/images/generations", timeout=30, json={
        "prompt": PROMPT, "size": "256x256", "ar_grid": "8 by 8"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ar_grid"
    assert stage_calls() == before


def test_bench_sweeps_ar_grids(pipeline, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mammoth_app.cli", "bench", "--url", pipeline.url, "--concurrency", "1",
         "--requests", "1", "--warmup", "0", "--size", "64x64", "--steps", "1", "--ar-grid", "auto,2x2",
         "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["ar_grids"] == ["auto", "2x2"]
    assert [(lv["ar_grid"], lv["ok"]) for lv in result["levels"]] == [("auto", 1), ("2x2", 1)]
    assert "ar_grid 2x2" in proc.stdout
