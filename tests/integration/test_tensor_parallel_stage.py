"""Issue 21: ``mammoth ar --tensor-parallel-size 2 --device cpu`` as a real stage (gloo, 2 ranks).

One local pipeline whose AR runs on two ranks (the stage starts its second rank itself), against
the single-process (TP 1) in-process reference on the same tiny checkpoint, float32:

- the rows and token ids the AR pushes (caught by a DiT played here) equal TP 1's: tokens exactly,
  rows within float32 summation-order error (the row-parallel products are summed in two halves);
- the image served through the gateway (official ``openai`` client) is TP 1's image: every pixel
  within 1 level of 255 (the rows' last-bit differences move a few roundings);
- a size the model cannot split is refused before any rank starts;
- a hung worker rank (SIGSTOP) fails the stage (exit status 3) within the collective timeout, not a
  hang (last: it ends the pipeline's AR). A killed worker is `test_dit_parallel_stage.py`'s case.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import time

import grpc
import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image

from pipeline_harness import rank_pids, start_local_pipeline

PROMPT = "a lighthouse on a cliff at dusk"
SIZE, SEED, STEPS, GUIDANCE = 128, 11, 2, 4.0
TIMEOUT_S = 10  # the stage's distributed_timeout_seconds here


@pytest.fixture(scope="module")
def tp_pipeline(tiny_checkpoint, tmp_path_factory):
    from mammoth_app.local import stop_pipeline

    running = start_local_pipeline(tiny_checkpoint, tmp_path_factory.mktemp("tp2"),
                                   ar_args=["--tensor-parallel-size", "2",
                                            "--distributed-timeout-seconds", str(TIMEOUT_S)])
    yield running
    stop_pipeline(list(running.components.values()))


@pytest.fixture(scope="module")
def reference(inprocess_model):
    """The TP 1 result in this process (tests/conftest.py `inprocess_model`)."""
    return inprocess_model.generate(PROMPT, width=SIZE, height=SIZE, seed=SEED, num_inference_steps=STEPS,
                                    text_guidance_scale=GUIDANCE)


class _CatchingDiT:
    """A DiT that accepts one push and keeps its CONDITION rows and token ids."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.token_ids: list[int] = []

    async def push(self, request_iterator, context):  # noqa: ANN001
        from mammoth_core.chunk_stream import split_chunk
        from mammoth_core.pb import mammoth_pb2 as pb

        rows = 0
        async for raw in request_iterator:
            msg, payload = split_chunk(raw)
            h = msg.header
            if h.role == pb.CONDITION and len(h.shape) == 2 and h.shape[0]:
                dtype = {pb.FLOAT32: torch.float32, pb.BFLOAT16: torch.bfloat16}[h.dtype]
                self.rows.append(torch.frombuffer(bytearray(payload), dtype=dtype).view(*h.shape).clone())
                self.token_ids.extend(h.token_ids)
                rows += h.shape[0]
        return pb.PushConditionsResponse(rows_accepted=rows)


async def _generate_into(pipeline, dit: _CatchingDiT) -> None:
    from mammoth_core import grpc_common
    from mammoth_core.chunk_stream import PUSH_METHOD_PATH, push_conditions_handler
    from mammoth_core.pb import mammoth_pb2 as pb
    from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc

    server = grpc_common.create_server(64 << 20, None, insecure=True)
    service, method = PUSH_METHOD_PATH.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        service, {method: push_conditions_handler(dit.push)})])
    server.add_insecure_port(f"127.0.0.1:{pipeline.spare_dit_port}")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(pipeline.components["ar"].address) as channel:
            call = pb_grpc.ARStub(channel).Generate(pb.ARGenerateRequest(
                request_id="tp-rows", prompt=PROMPT, width=SIZE, height=SIZE, seed=SEED,
                dit_address=f"127.0.0.1:{pipeline.spare_dit_port}", reservation_token="caught"),
                metadata=pipeline.auth(), timeout=120)
            async for _ in call:
                pass
    finally:
        await server.stop(None)


def test_tp2_stage_pushes_the_tp1_rows_and_tokens(tp_pipeline, reference):
    dit = _CatchingDiT()
    asyncio.run(_generate_into(tp_pipeline, dit))
    assert dit.token_ids == reference.token_ids
    torch.testing.assert_close(torch.cat(dit.rows), reference.hidden.float(), atol=2e-5, rtol=1e-5)


def test_tp2_pipeline_serves_the_tp1_image(tp_pipeline, reference):
    client = OpenAI(base_url=f"{tp_pipeline.url}/v1", api_key="unused", max_retries=0, timeout=120)
    result = client.images.generate(prompt=PROMPT, size=f"{SIZE}x{SIZE}", extra_body={
        "seed": SEED, "num_inference_steps": STEPS, "text_guidance_scale": GUIDANCE})
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))), dtype=np.int16)
    expected = np.asarray(Image.open(io.BytesIO(reference.image)), dtype=np.int16)
    assert served.shape == expected.shape
    diff = np.abs(served - expected)
    print("TP2 vs TP1 image: max", int(diff.max()), "levels,", int((diff > 0).sum()), "of", diff.size, "values differ")
    assert int(diff.max()) <= 1


def test_a_size_the_model_cannot_split_is_refused_before_any_rank_starts(tiny_checkpoint, tmp_path):
    """The tiny model has 4 query heads: 3 ranks cannot share them; the stage says so and exits."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "mammoth_app.cli", "ar", "--checkpoint", str(tiny_checkpoint),
                           "--tensor-parallel-size", "3", "--device", "cpu", "--port", "0", "--metrics-port", "-1",
                           "--insecure-no-auth", "true", "--cache-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "tensor_parallel_size 3 does not divide num_attention_heads 4" in proc.stderr
    assert "started ranks" not in proc.stderr


def test_a_hung_worker_rank_fails_the_stage_within_the_collective_timeout(tp_pipeline):
    """SIGSTOP the worker: the next request's all-reduce cannot complete; the stage exits with status 3
    within ``distributed_timeout_seconds`` (plus start-up slack), instead of hanging. (Last: it ends
    the pipeline's AR.)"""
    from mammoth_core.rank_group import EXIT_RANK_FAILED

    ar = tp_pipeline.components["ar"].proc
    workers = rank_pids(ar.pid)
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(_generate_into(tp_pipeline, _CatchingDiT()))
    assert ar.wait(timeout=TIMEOUT_S + 30) == EXIT_RANK_FAILED
    assert time.monotonic() - t0 < TIMEOUT_S + 20
