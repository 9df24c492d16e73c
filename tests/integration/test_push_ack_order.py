"""Issue 15.1: the DiT's acknowledgement of the push may arrive before the engine says it is done.

A real AR servicer (tiny checkpoint, real decode engine) and a real DiT servicer on 127.0.0.1 gRPC
ports, in this process so the test can force the race deterministically: the engine thread, right
after it finished the push (`HiddenStateSender.finish`), is held until the push call has returned,
i.e. until the DiT's acknowledgement reached the AR. The AR must still answer ``ARDone`` (it used to
answer ABORTED "the DiT closed the condition stream early", which the gateway retried into a 502).
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch

from mammoth_core import grpc_common
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.settings import ARSettings, DiTSettings
from stage_ar.engine import DecodeEngine
from stage_ar.loader import load_ar
from stage_ar.sender import HiddenStateSender
from stage_ar.server import ARServicer
from stage_dit.loader import load_pipeline
from stage_dit.receiver import SlotPool, add_dit_servicer
from stage_dit.server import DiTServicer

MiB = 1 << 20


@pytest.fixture
def ack_before_done(monkeypatch):
    """Hold the engine thread after `finish` until the push call has returned (acknowledged)."""
    pushed: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def event_of(sender) -> threading.Event:
        with lock:
            return pushed.setdefault(id(sender), threading.Event())

    original_run, original_finish = HiddenStateSender.run, HiddenStateSender.finish

    async def run(self):
        try:
            return await original_run(self)
        finally:
            event_of(self).set()

    def finish(self):
        original_finish(self)
        assert event_of(self).wait(30), "the push never returned"

    monkeypatch.setattr(HiddenStateSender, "run", run)
    monkeypatch.setattr(HiddenStateSender, "finish", finish)
    return pushed


async def _start_stages(checkpoint, cache_dir):
    dit_settings = DiTSettings(checkpoint=str(checkpoint), cache_dir=str(cache_dir), device="cpu",
                               dtype="float32", slots=2)
    pipeline = await asyncio.to_thread(load_pipeline, dit_settings)
    pool = SlotPool(2, dit_settings.max_rows_per_slot, int(pipeline.llm_hidden_size), torch.float32, "cpu")
    # In-process stages with no token: the explicit development opt-out (stages refuse by default).
    dit_server = grpc_common.create_server(64 * MiB, None, insecure=True)
    add_dit_servicer(DiTServicer(pipeline, pool), dit_server)
    dit_port = dit_server.add_insecure_port("127.0.0.1:0")
    await dit_server.start()

    ar_settings = ARSettings(checkpoint=str(checkpoint), cache_dir=str(cache_dir), device="cpu",
                             dtype="float32", max_running_sequences=2,
                             dit_allow_list=[f"127.0.0.1:{dit_port}"])
    bundle = await asyncio.to_thread(load_ar, str(checkpoint), str(cache_dir), "cpu", torch.float32)
    gen = bundle.generation_config
    engine = DecodeEngine(bundle.new_sequence, 2, model=bundle.model,
                          grid_ids=(gen.eol_token_id, gen.visual_token_start_id, gen.visual_token_end_id),
                          max_sequence_length=ar_settings.max_sequence_length)
    engine.start()
    await asyncio.to_thread(engine.ready.wait, 60)
    servicer = ARServicer(bundle, engine, ar_settings, None)
    ar_server = grpc_common.create_server(64 * MiB, None, insecure=True)
    pb_grpc.add_ARServicer_to_server(servicer, ar_server)
    ar_port = ar_server.add_insecure_port("127.0.0.1:0")
    await ar_server.start()
    return (dit_server, f"127.0.0.1:{dit_port}"), (ar_server, f"127.0.0.1:{ar_port}", engine, servicer)


async def test_ar_reports_done_when_the_push_ack_wins(tiny_checkpoint, tmp_path, ack_before_done):
    (dit_server, dit_addr), (ar_server, ar_addr, engine, servicer) = await _start_stages(
        tiny_checkpoint, tmp_path / "cache")
    try:
        async with grpc.aio.insecure_channel(dit_addr) as dit_ch, grpc.aio.insecure_channel(ar_addr) as ar_ch:
            params = pb.ImageParams(width=64, height=64, num_inference_steps=1, text_guidance_scale=1.0,
                                    cfg_range_end=1.0, seed=3, output_format="png")
            dit_call = pb_grpc.DiTStub(dit_ch).Generate(
                pb.DiTGenerateRequest(request_id="order-0", params=params), timeout=120)
            reserved = (await dit_call.read()).reserved
            ar_call = pb_grpc.ARStub(ar_ch).Generate(pb.ARGenerateRequest(
                request_id="order-0", epoch=0, prompt="a red fox", width=64, height=64, seed=3,
                dit_address=dit_addr, reservation_token=reserved.reservation_token), timeout=120)
            events = [m.WhichOneof("event") async for m in ar_call]
            assert events[-1] == "done"
            assert ack_before_done, "the forced ordering never happened"
            kinds = []
            while (msg := await dit_call.read()) is not grpc.aio.EOF:
                kinds.append(msg.WhichOneof("event"))
            assert kinds[-1] == "image" and kinds.count("conditions_complete") == 1
    finally:
        await ar_server.stop(0)
        engine.stop()
        await servicer.close()
        await dit_server.stop(0)
