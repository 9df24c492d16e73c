"""The bytes the AR puts on the wire for a fixed input are the golden bytes of
``tests/fixtures/chunk_stream_golden.json``, captured from the sender before the transport was
refactored into `mammoth_core.chunk_stream` (the wire contract of docs/ARCHITECTURE.md must not move).

A real ``grpc.aio`` server on 127.0.0.1 records every ``PushConditions`` message as the raw bytes
gRPC delivered; the real `HiddenStateSender` pushes a fixed stream to it (the wall clock pinned,
since every header carries ``sent_unix_ms``).

Set ``MAMMOTH_WRITE_GOLDEN=1`` to rewrite the fixture (only when the wire contract changes on purpose).
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import time

import grpc
import pytest
import torch

from mammoth_core.pb import mammoth_pb2 as pb
from stage_ar.sender import HiddenStateSender
from stage_ar.staging import StagingPool

GOLDEN = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "chunk_stream_golden.json"
HIDDEN = 8
PINNED_UNIX_S = 1_764_000_000.125


class _Recorder:
    """A DiT stand-in that keeps every pushed message as received (the thing under test is the
    sender's bytes; the receiver's rules have their own tests)."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.arrived = asyncio.Event()

    async def push(self, request_iterator, context) -> pb.PushConditionsResponse:
        async for raw in request_iterator:
            self.messages.append(raw)
            self.arrived.set()
        return pb.PushConditionsResponse(chunks_accepted=len(self.messages))


async def _serve(recorder: _Recorder) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    handler = grpc.stream_unary_rpc_method_handler(
        recorder.push, request_deserializer=None,
        response_serializer=pb.PushConditionsResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "mammoth.v1.DiT", {"PushConditions": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def _rows(n: int, dtype: torch.dtype, start: float) -> torch.Tensor:
    values = torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN) * 0.37 + start
    values[0, 0] = float("-0.0")
    return values.to(dtype)


def _sender(channel, dtype: torch.dtype, rows: int, negative: int) -> HiddenStateSender:
    return HiddenStateSender(
        channel, "golden-req", 2, "token-abc", HIDDEN, dtype, answer_start_index=3,
        expected_rows=rows, expected_negative_rows=negative, chunk_rows=4, max_message_bytes=1 << 20,
        answer_boundary="prompt_length", staging=StagingPool(4 * HIDDEN * 4, 4, pin=False))


async def _case_all_staged(channel, recorder: _Recorder) -> None:
    """CONDITION and NEGATIVE rows staged and finished before the push starts: the last block
    carries the `StreamEnd`."""
    sender = _sender(channel, torch.bfloat16, rows=10, negative=3)
    sender.put_rows(pb.CONDITION, _rows(10, torch.bfloat16, -1.5), list(range(100, 110)))
    sender.put_rows(pb.NEGATIVE, _rows(3, torch.bfloat16, 2.25), [7, 8, 9])
    sender.finish()
    await sender.run()


async def _case_end_alone(channel, recorder: _Recorder) -> None:
    """Every block sent before `finish`: the end travels in a message without rows."""
    sender = _sender(channel, torch.float32, rows=8, negative=0)
    task = asyncio.create_task(sender.run())
    sender.put_rows(pb.CONDITION, _rows(8, torch.float32, 0.5), list(range(8)))
    while len(recorder.messages) < 2:
        recorder.arrived.clear()
        await asyncio.wait_for(recorder.arrived.wait(), 20)
    sender.finish()
    await asyncio.wait_for(task, 20)


CASES = {"all_staged": _case_all_staged, "end_alone": _case_end_alone}


async def _capture(name: str) -> list[str]:
    recorder = _Recorder()
    server, port = await _serve(recorder)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await CASES[name](channel, recorder)
    finally:
        await server.stop(None)
    return [raw.hex() for raw in recorder.messages]


@pytest.mark.parametrize("name", sorted(CASES))
async def test_sender_bytes_equal_the_golden(name, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: PINNED_UNIX_S)
    captured = await _capture(name)
    if os.environ.get("MAMMOTH_WRITE_GOLDEN") == "1":
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[name] = captured
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())[name]
    assert len(captured) == len(golden)
    for index, (got, want) in enumerate(zip(captured, golden)):
        assert got == want, f"message {index} of {name!r} differs from the golden bytes"
