"""Issue 15.3: a direct ``DiT.Generate`` call gets no more than a request through the gateway.

A real DiT servicer (tiny checkpoint) on a 127.0.0.1 gRPC port, built from its settings as
`stage_dit.server.serve` does: sizes outside the table's pixel limits and step counts above
``max_steps`` are INVALID_ARGUMENT before any slot is reserved (they used to run: 1600x1600, 1,000
steps); the largest documented size reserves a slot.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from mammoth_core import grpc_common, limits
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.settings import DiTSettings
from stage_dit.loader import load_pipeline
from stage_dit.receiver import SlotPool, SlotState, add_dit_servicer
from stage_dit.server import DiTServicer


@pytest.fixture
async def dit(tiny_checkpoint, tmp_path):
    settings = DiTSettings(checkpoint=str(tiny_checkpoint), cache_dir=str(tmp_path / "cache"), device="cpu",
                           dtype="float32", slots=1)
    pipeline = await asyncio.to_thread(load_pipeline, settings)
    pool = SlotPool(1, settings.max_rows_per_slot, int(pipeline.llm_hidden_size), torch.float32, "cpu")
    # No token here: the explicit development opt-out (stages refuse unauthenticated calls by default).
    server = grpc_common.create_server(settings.max_message_bytes, None, insecure=True)
    add_dit_servicer(DiTServicer(pipeline, pool, request_limits=limits.from_settings(settings)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.DiTStub(channel), pool
    await server.stop(0)


def _params(width: int, height: int, steps: int) -> pb.DiTGenerateRequest:
    return pb.DiTGenerateRequest(request_id="direct", params=pb.ImageParams(
        width=width, height=height, num_inference_steps=steps, text_guidance_scale=1.0, cfg_range_end=1.0,
        output_format="png"))


@pytest.mark.parametrize("width,height,steps,why", [
    (1600, 1600, 1, "pixels"), (1536, 1552, 1, "pixels"), (0, 64, 1, "multiple of 16"),
    (64, 64, 1000, "num_inference_steps"),
    (64, 64, limits.DEFAULTS.max_steps + 1, "num_inference_steps"), (72, 64, 1, "multiple of 16"),
])
async def test_direct_call_outside_the_limits_is_refused(dit, width, height, steps, why):
    stub, pool = dit
    call = stub.Generate(_params(width, height, steps), timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in err.value.details()
    assert all(slot.state is not SlotState.RESERVED for slot in pool.slots)


async def test_the_largest_documented_size_reserves_a_slot(dit):
    stub, _ = dit
    side = int(limits.DEFAULTS.max_pixels ** 0.5)
    call = stub.Generate(_params(side, side, limits.DEFAULTS.max_steps), timeout=10)
    assert (await call.read()).WhichOneof("event") == "reserved"
    call.cancel()


@pytest.mark.parametrize("request_id", ["a\n16:40:00.000 CRITICAL forged", "x" * 1_000_000, "id with space"])
async def test_a_request_id_that_could_break_a_log_line_is_refused(dit, request_id):
    """The request id goes into every log line of the request: a direct call (a gateway-token holder)
    with a newline, 1 MB or spaces in it is INVALID_ARGUMENT before any slot is reserved (a break-it
    pass wrote a forged line into the DiT's log)."""
    stub, pool = dit
    request = _params(64, 64, 1)
    request.request_id = request_id
    call = stub.Generate(request, timeout=10)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    assert all(slot.state is not SlotState.RESERVED for slot in pool.slots)
