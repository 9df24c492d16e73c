"""Issue 21: ``mammoth dit --dit-parallel cfg|ulysses --device cpu`` as a real stage (gloo, 2 ranks).

For each mode, one local pipeline whose DiT runs on two ranks (the stage starts its second rank
itself): the image served through the gateway (official ``openai`` client) equals the
single-process (in-process) image of the same request, float32: the PNG bytes are identical (the
DiT's GEMM rows are padded to a row quantum, so a branch or sequence share computes the same bits
alone as batched; the exchanges are copies). The DiT really runs on two ranks: its second rank is a
child process, and without it the first rank's collectives could not complete. Killing that child
fails the stage (exit status 3) within seconds.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time

import numpy as np
import pytest
from openai import OpenAI
from PIL import Image

from pipeline_harness import rank_pids, start_local_pipeline

PROMPT = "a red house by the sea"
SIZE, SEED, STEPS, GUIDANCE = 128, 5, 3, 4.0


@pytest.fixture(scope="module")
def reference(inprocess_model):
    """The single-process image (tests/conftest.py `inprocess_model`)."""
    return inprocess_model.generate(PROMPT, width=SIZE, height=SIZE, seed=SEED, num_inference_steps=STEPS,
                                    text_guidance_scale=GUIDANCE).image


# Ulysses' stage path differs from cfg's only in `parallel_transformer`'s choice (its arithmetic is
# `tests/unit/test_dit_parallel.py`'s): its whole pipeline runs with `-m slow`.
@pytest.fixture(scope="module", params=["cfg", pytest.param("ulysses", marks=pytest.mark.slow)])
def parallel_pipeline(request, tiny_checkpoint, tmp_path_factory):
    from mammoth_app.local import stop_pipeline

    running = start_local_pipeline(tiny_checkpoint, tmp_path_factory.mktemp(f"dit-{request.param}"),
                                   dit_args=["--dit-parallel", request.param])
    yield request.param, running
    stop_pipeline(list(running.components.values()))


def test_parallel_dit_serves_the_single_process_image(parallel_pipeline, reference):
    mode, pipeline = parallel_pipeline
    client = OpenAI(base_url=f"{pipeline.url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={
        "seed": SEED, "num_inference_steps": STEPS, "text_guidance_scale": GUIDANCE})
    png = base64.b64decode(result.data[0].b64_json)
    served = np.asarray(Image.open(io.BytesIO(png)), dtype=np.int16)
    expected = np.asarray(Image.open(io.BytesIO(reference)), dtype=np.int16)
    diff = np.abs(served - expected)
    print(f"dit_parallel={mode} vs single process: max {int(diff.max())} levels, {int((diff > 0).sum())} of "
          f"{diff.size} values differ, PNG bytes identical: {png == reference}")
    assert len(rank_pids(pipeline.components["dit"].proc.pid)) == 1
    assert png == reference


def test_killing_the_worker_rank_fails_the_dit(parallel_pipeline):
    """The DiT's second rank killed: the stage exits with status 3 within seconds (rank 0 watches its
    workers), not a hang. (Last for each mode: it ends that pipeline's DiT.)"""
    from mammoth_core.rank_group import EXIT_RANK_FAILED

    _, pipeline = parallel_pipeline
    dit = pipeline.components["dit"].proc
    workers = rank_pids(dit.pid)
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    t0 = time.monotonic()
    assert dit.wait(timeout=30) == EXIT_RANK_FAILED
    assert time.monotonic() - t0 < 15

