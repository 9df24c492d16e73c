"""The hidden-state stream's lifecycle rules (DESIGN.md, "The hidden-state stream"), one test each,
through real gRPC between real processes: the DiT runs as ``mammoth dit`` (tiny checkpoint, CPU)
in a subprocess on 127.0.0.1, this process plays the gateway (``DiT.Generate``) and the AR
(``HiddenStateSender`` / hand-built chunks). GPU-only rules skip here; see
``benchmarks/gpu_transport_rules.py`` for the device run.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pipeline_harness import metric_samples, until_health

from mammoth_core import errors, grpc_common, wire
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from stage_ar.sender import HiddenStateSender
from stage_ar.staging import StagingPool

ROOT = pathlib.Path(__file__).resolve().parents[2]
HIDDEN = 64  # the tiny checkpoint's llm_config.hidden_size
LIMIT = 1 << 20  # max_message_bytes on both sides (the smallest allowed)
TOKEN = "stage-secret"
AUTH = grpc_common.auth_metadata(TOKEN)
PROMPT = 10  # prompt rows; image rows follow with ids >= gen_vocab_start_index (512)
IMAGE_ROWS = 12
START_BUDGET_S = 180


class DiTProcess:
    def __init__(self, proc: subprocess.Popen, info: dict):
        self.proc, self.info = proc, info
        self.address = info["address"]

    def metric(self, name: str, **labels: str) -> float:
        return sum(metric_samples(f"http://127.0.0.1:{self.info['metrics_port']}/metrics", name, labels))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_dit(checkpoint: pathlib.Path, tmp: pathlib.Path, *extra: str,
              first_on_path: pathlib.Path | None = None) -> DiTProcess:
    """A `mammoth dit` process on the tiny checkpoint (CPU, loopback, 2 slots), once it wrote its
    ready file. ``first_on_path``: a directory put before the repository on the child's PYTHONPATH
    (a ``sitecustomize.py`` there runs at the child's start: fault injection from outside)."""
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    ready = tmp / f"dit-{time.monotonic_ns()}.ready.json"
    cmd = [
        sys.executable, "-m", "mammoth_app.cli", "dit", "--checkpoint", str(checkpoint),
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu",
        "--slots", "2", "--max-message-bytes", str(LIMIT), "--auth-token-file", str(token_file),
        "--log-level", "warning", "--cache-dir", str(tmp / "cache"), "--ready-file", str(ready), *extra,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (first_on_path, ROOT) if p))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    # a budget for work, not a bound: the DiT's start took over 60 s on the loaded 2-core host
    deadline = time.monotonic() + START_BUDGET_S
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"DiT exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"DiT not ready after {START_BUDGET_S} s")
        time.sleep(0.05)
    return DiTProcess(proc, json.loads(ready.read_text()))


class SharedDiT:
    """The module's DiT process: started on first use, and again when a test stopped it (the drain
    test, last, stops it), so every test gets a serving one and the module starts one DiT."""

    def __init__(self, checkpoint: pathlib.Path, tmp: pathlib.Path) -> None:
        self.checkpoint, self.tmp = checkpoint, tmp
        self.server: DiTProcess | None = None

    def get(self) -> DiTProcess:
        if self.server is None or self.server.proc.poll() is not None:
            self.server = start_dit(self.checkpoint, self.tmp)
        return self.server


@pytest.fixture(scope="module")
def shared_dit(tiny_checkpoint, tmp_path_factory):
    holder = SharedDiT(tiny_checkpoint, tmp_path_factory.mktemp("dit"))
    yield holder
    if holder.server is not None and holder.server.proc.poll() is None:
        assert holder.server.stop() == 0


@pytest.fixture
def dit(shared_dit):
    """The module's DiT, serving (`SharedDiT`)."""
    return shared_dit.get()


@pytest.fixture(autouse=True)
def no_slot_outlives_its_test(request):
    """After every test that used the shared DiT (and left it running), every slot has been retired."""
    yield
    if "dit" not in request.fixturenames:
        return
    server = request.getfixturevalue("shared_dit").server
    deadline = time.monotonic() + 5.0
    while server.proc.poll() is None and server.metric("mammoth_dit_slots_in_use") != 0:
        assert time.monotonic() < deadline, "a slot outlived its request"
        time.sleep(0.05)


def params(steps: int = 2, has_negative: bool = False, guidance: float = 2.0) -> pb.ImageParams:
    return pb.ImageParams(width=32, height=32, num_inference_steps=steps, text_guidance_scale=guidance,
                          cfg_range_end=1.0, seed=7, output_format="png", has_negative=has_negative)


def rows(n: int = PROMPT + IMAGE_ROWS, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, HIDDEN, generator=g).to(dtype)
    ids = list(range(PROMPT)) + [512 + i for i in range(n - PROMPT)]
    return hidden, ids


async def reserve(stub, request_id: str, timeout: float = 30.0, wait_s: float = 5.0, **kw):
    """Open DiT.Generate and read its Reserved event. Slots of streams the previous steps cancelled
    are retired asynchronously on the server: retry RESOURCE_EXHAUSTED for up to ``wait_s``."""
    give_up = time.monotonic() + wait_s
    while True:
        call = stub.Generate(pb.DiTGenerateRequest(request_id=request_id, params=params(**kw)),
                             metadata=AUTH, timeout=timeout)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > give_up:
                raise
            await asyncio.sleep(0.05)
            continue
        assert first.WhichOneof("event") == "reserved"
        return call, first.reserved.reservation_token


async def read_all(call) -> list[pb.DiTGenerateResponse]:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


def make_sender(channel, request_id, token, n, *, epoch=0, dtype=torch.float32, negative=0, **kw):
    return HiddenStateSender(channel, request_id, epoch, token, HIDDEN, dtype, PROMPT, n, negative,
                             kw.pop("chunk_rows", 4), LIMIT, AUTH, 20.0, **kw)


async def push_rows(sender: HiddenStateSender, hidden, ids, *, role=pb.CONDITION, per_put: int = 3,
                    finish: bool = True):
    async def produce():
        for i in range(0, hidden.shape[0], per_put):
            assert sender.put_rows(role, hidden[i : i + per_put], ids[i : i + per_put])
            await asyncio.sleep(0)
        if finish:
            sender.finish()

    response, _ = await asyncio.gather(sender.run(), produce())
    return response


def chunk(token, request_id, epoch, seq, hidden, ids, offset, *, role=pb.CONDITION, metadata=None,
          end=None) -> pb.HiddenStateChunk:
    msg = pb.HiddenStateChunk(
        reservation_token=token,
        header=pb.ChunkHeader(request_id=request_id, epoch=epoch, sequence=seq, role=role,
                              dtype=wire.dtype_to_proto(hidden.dtype), shape=list(hidden.shape),
                              row_offset=offset, token_ids=ids),
        data=wire.encode_rows(hidden),
    )
    if metadata is not None:
        msg.metadata.CopyFrom(metadata)
    if end is not None:
        msg.end.CopyFrom(end)
    return msg


def metadata(n: int, dtype=pb.FLOAT32, major: int = wire.PROTOCOL_MAJOR, **kw) -> pb.StreamMetadata:
    return pb.StreamMetadata(protocol_major=major, protocol_minor=0, hidden_size=HIDDEN, dtype=dtype,
                             answer_start_index=PROMPT, expected_rows=n, **kw)


async def push_raw(stub, messages) -> pb.PushConditionsResponse:
    async def gen():
        for m in messages:
            yield m

    return await stub.PushConditions(gen(), metadata=AUTH, timeout=10)


async def expect_code(coro, code: grpc.StatusCode, fragment: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await coro
    assert exc.value.code() == code, exc.value.details()
    assert fragment in (exc.value.details() or "")
    return exc.value.details()


def channel(dit: DiTProcess, limit: int = LIMIT) -> grpc.aio.Channel:
    return grpc_common.create_channel(dit.address, limit)


# -- 1. identity ---------------------------------------------------------------------------------


async def test_identity_epochs_sequences_and_reused_request_id(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "identity")
        n = PROMPT + IMAGE_ROWS
        hidden, ids = rows(n)
        # Epoch 1 starts (partial rows), then its producer "dies" (stream closed without end).
        await expect_code(push_raw(stub, [chunk(token, "identity", 1, 0, hidden[:4], ids[:4], 0,
                                                metadata=metadata(n))]),
                          grpc.StatusCode.DATA_LOSS, "StreamEnd")
        # A late chunk of an older epoch is rejected; it must not disturb the slot.
        await expect_code(push_raw(stub, [chunk(token, "identity", 0, 0, hidden[:4], ids[:4], 0,
                                                metadata=metadata(n))]),
                          grpc.StatusCode.INVALID_ARGUMENT, "stale epoch")
        # Epoch 2 (the AR retry): duplicate sequence, then a gap: rejected (and the epoch poisoned).
        first = chunk(token, "identity", 2, 0, hidden[:4], ids[:4], 0, metadata=metadata(n))
        await expect_code(push_raw(stub, [first, first]), grpc.StatusCode.INVALID_ARGUMENT, "duplicate")
        gap = chunk(token, "identity", 3, 0, hidden[:4], ids[:4], 0, metadata=metadata(n))
        skip = chunk(token, "identity", 3, 2, hidden[4:8], ids[4:8], 4)
        await expect_code(push_raw(stub, [gap, skip]), grpc.StatusCode.INVALID_ARGUMENT, "gap")
        # Another request id with this token: not its reservation.
        await expect_code(push_raw(stub, [chunk(token, "intruder", 9, 0, hidden[:4], ids[:4], 0,
                                                metadata=metadata(n))]),
                          grpc.StatusCode.INVALID_ARGUMENT, "does not own")
        # Epoch 4 completes: the old epochs' partial rows are discarded, the image comes.
        response = await push_rows(make_sender(ch, "identity", token, n, epoch=4), hidden, ids)
        assert response.rows_accepted == n
        events = await read_all(call)
        image = events[-1].image
        assert image.data.startswith(b"\x89PNG") and image.condition_rows == n
        # After the final chunk nothing more is accepted (the slot is gone with the stream).
        await expect_code(push_raw(stub, [chunk(token, "identity", 5, 0, hidden[:4], ids[:4], 0,
                                                metadata=metadata(n))]), grpc.StatusCode.NOT_FOUND)
        # The same request id reserves afresh: new token, nothing inherited.
        call2, token2 = await reserve(stub, "identity")
        assert token2 != token
        response = await push_rows(make_sender(ch, "identity", token2, n), hidden, ids)
        assert response.rows_accepted == n and response.chunks_accepted == (n + 3) // 4
        assert (await read_all(call2))[-1].image.data == image.data  # same rows, same seed


# -- 2. bounded admission ------------------------------------------------------------------------


async def test_admission_fails_fast_when_full_and_never_blocks_the_producer(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        held = [await reserve(stub, f"hold-{i}") for i in range(2)]
        t0 = time.monotonic()
        await expect_code(reserve(stub, "third", wait_s=0), grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        assert time.monotonic() - t0 < 2.0
        # A producer whose consumer is not reading (run() not even started) never blocks.
        hidden, ids = rows(2000)
        sender = make_sender(ch, "hold-0", held[0][1], 2000, chunk_rows=8,
                             staging=StagingPool(8 * HIDDEN * 4, 2, pin=False))
        t0 = time.monotonic()
        for i in range(2000):
            assert sender.put_rows(pb.CONDITION, hidden[i : i + 1], ids[i : i + 1])
        assert time.monotonic() - t0 < 2.0
        sender.abort()
        # Freeing one slot admits the next request.
        held[0][0].cancel()
        call, _ = await reserve(stub, "third")
        call.cancel()
        held[1][0].cancel()


# -- 3. slot ownership ---------------------------------------------------------------------------


async def test_slot_lives_exactly_as_long_as_the_generate_stream(dit):
    released = dit.metric("mammoth_transport_slot_outcomes_total", outcome="cancelled")
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "owner")
        assert dit.metric("mammoth_dit_slots_in_use") >= 1
        call.cancel()
        await asyncio.sleep(0.3)
        n = PROMPT + IMAGE_ROWS
        hidden, ids = rows(n)
        msg = chunk(token, "owner", 0, 0, hidden, ids, 0, metadata=metadata(n))
        await expect_code(push_raw(stub, [msg]), grpc.StatusCode.NOT_FOUND, "reservation token")
    assert dit.metric("mammoth_transport_slot_outcomes_total", outcome="cancelled") == released + 1
    assert dit.metric("mammoth_dit_slots_in_use") == 0


# -- 4. D2H-ready and 5. H2D-complete ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (see benchmarks/gpu_transport_rules.py)")
async def test_d2h_ready_rows_from_cuda(dit):  # pragma: no cover - GPU machine only
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "d2h")
        hidden, ids = rows()
        sender = make_sender(ch, "d2h", token, hidden.shape[0])
        response = await push_rows(sender, hidden.cuda(), ids)  # CRC proves the bytes were final
        assert response.rows_accepted == hidden.shape[0]
        assert (await read_all(call))[-1].image.data


async def test_h2d_complete_ack_means_conditions_resident(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "h2d", steps=1)
        hidden, ids = rows()
        sender = make_sender(ch, "h2d", token, hidden.shape[0])
        response = await push_rows(sender, hidden, ids)
        # The acknowledgement comes after the conditions are resident: the consumer needs no more
        # rows, its next events are the denoising steps.
        assert response.rows_accepted == hidden.shape[0]
        events = await read_all(call)
        phases = [e.progress.phase for e in events if e.WhichOneof("event") == "progress"]
        assert pb.DiTProgress.DENOISING in phases
        timings = events[-1].image.timings
        assert 0.0 <= timings.transfer_tail_ms < 5000.0
        assert sender.last_sent_unix_ms is not None


# -- 6. cancellation and failure -----------------------------------------------------------------


PRODUCER = textwrap.dedent(
    """
    import asyncio, os, sys, torch
    from mammoth_core import grpc_common
    from mammoth_core.pb import mammoth_pb2 as pb
    from stage_ar.sender import HiddenStateSender
    address, token = sys.argv[1], sys.argv[2]
    async def main():
        ch = grpc_common.create_channel(address, 1 << 20)
        s = HiddenStateSender(ch, "dies", 0, token, 64, torch.float32, 10, 22, 0, 4, 1 << 20,
                              grpc_common.auth_metadata("stage-secret"), 30.0)
        task = asyncio.ensure_future(s.run())
        s.put_rows(pb.CONDITION, torch.zeros(8, 64), list(range(8)))
        await asyncio.sleep(60)  # until killed
    asyncio.run(main())
    """
)


async def until_rows_received(call, rows: int) -> None:
    """Read ``call``'s events until a RECEIVING progress says the DiT holds ``rows`` rows."""
    while True:
        msg = await call.read()
        assert msg is not grpc.aio.EOF, f"the call ended before {rows} rows arrived"
        if msg.WhichOneof("event") == "progress" and msg.progress.rows_received >= rows:
            return


async def until_counted(dit: DiTProcess, before: dict[str, float], want: dict[str, int],
                        timeout: float = 10.0) -> dict[str, float]:
    """Slot outcome counts once they reach ``before`` + ``want`` (or as they are at ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        now = {o: dit.metric("mammoth_transport_slot_outcomes_total", outcome=o) for o in before}
        if all(now[o] - before[o] >= n for o, n in want.items()) or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.05)


async def test_producer_death_deadline_and_consumer_cancel_retire_the_slot(dit):
    before = {o: dit.metric("mammoth_transport_slot_outcomes_total", outcome=o)
              for o in ("producer_lost", "deadline", "cancelled")}
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        # Producer death: a real AR-like process pushes 8 rows and is killed with SIGKILL. The DiT
        # retires the slot once no newer epoch began within the producer grace (1 s by default),
        # long before the call's deadline, and says why (ABORTED).
        # The call's deadline leaves room for the producer's start (importing torch alone takes
        # over 10 s on a loaded 2-core CI host); the ABORTED must come long before it.
        call, token = await reserve(stub, "dies", timeout=60.0)
        producer = subprocess.Popen([sys.executable, "-c", PRODUCER, dit.address, token],
                                    cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        # Killed only once the DiT holds its 8 rows. Killed after a fixed wait instead (0.5 s), on a
        # loaded host the first chunk had not arrived yet: the producer's stream never
        # reached the slot, no producer was lost, and the call ran to its deadline.
        await until_rows_received(call, 8)
        producer.kill()
        producer.wait()
        killed = time.monotonic()
        await expect_code(read_all(call), grpc.StatusCode.ABORTED, "producer")
        assert time.monotonic() - killed < 1.0 + 0.5
        # Deadline with no producer at all (2 s: the Reserved event itself must come within it).
        call, _ = await reserve(stub, "late", timeout=2.0)
        await expect_code(read_all(call), grpc.StatusCode.DEADLINE_EXCEEDED)
        # Consumer cancels mid-push: the push fails, the slot is retired.
        call, token = await reserve(stub, "cancel")
        hidden, ids = rows()
        sender = make_sender(ch, "cancel", token, hidden.shape[0])
        run = asyncio.ensure_future(sender.run())
        sender.put_rows(pb.CONDITION, hidden[:8], ids[:8])
        await asyncio.sleep(0.2)
        call.cancel()
        await asyncio.sleep(0.2)
        sender.put_rows(pb.CONDITION, hidden[8:], ids[8:])
        sender.finish()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await run
        # NOT_FOUND from the DiT; grpcio reports INTERNAL instead when the abort races a write
        # still in flight on the client. Either way the push failed and the AR stops.
        assert exc.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL)
    # The outcomes are counted when the server's handlers end (the cancelled one asynchronously):
    # poll for them instead of a fixed sleep.
    want = {"producer_lost": 1, "deadline": 1, "cancelled": 1}
    after = await until_counted(dit, before, want)
    assert {o: after[o] - before[o] for o in want} == want
    assert dit.metric("mammoth_dit_slots_in_use") == 0


# -- 7. pageable fallback ------------------------------------------------------------------------


async def test_pageable_fallback_is_counted_and_still_exact(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "pageable", steps=1)
        hidden, ids = rows()
        tiny_pool = StagingPool(4 * HIDDEN * 4, blocks=1, pin=False)
        sender = make_sender(ch, "pageable", token, hidden.shape[0], staging=tiny_pool)
        # Hold the pool's only block so every block of this request must fall back.
        held = tiny_pool.acquire()
        response = await push_rows(sender, hidden, ids, per_put=hidden.shape[0])
        tiny_pool.release(held)
        assert sender.pageable_fallbacks == (hidden.shape[0] + 3) // 4
        assert response.rows_accepted == hidden.shape[0]  # CRC matched: bytes intact
        assert (await read_all(call))[-1].image.data


# -- 8. bit-exactness ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
async def test_every_16bit_pattern_crosses_bit_exact(dit, dtype):
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    # Every finite pattern: ±0, subnormals, beyond-fp16 bf16 values (NaN and ±inf cross the wire
    # codec bit-exact too, tests/unit/test_wire.py, but the DiT refuses them as conditions).
    hidden = values[torch.isfinite(values)].reshape(-1, HIDDEN)
    n = hidden.shape[0]
    # The patterns travel as the NEGATIVE rows (unused by the model at guidance 1.0, so the image
    # model's work stays small); the receiver's CRC-32 over what arrived must equal the sender's.
    cond, cond_ids = rows(PROMPT + IMAGE_ROWS, dtype=dtype)
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, f"bits-{dtype}", steps=1, has_negative=True, guidance=1.0)
        sender = make_sender(ch, f"bits-{dtype}", token, cond.shape[0], dtype=dtype, negative=n,
                             chunk_rows=100)
        run = asyncio.ensure_future(sender.run())
        assert sender.put_rows(pb.CONDITION, cond, cond_ids)
        for i in range(0, n, 37):
            assert sender.put_rows(pb.NEGATIVE, hidden[i : i + 37], list(range(i, min(n, i + 37))))
        sender.finish()
        response = await run
        assert response.rows_accepted == cond.shape[0] and response.negative_rows_accepted == n
        image = (await read_all(call))[-1].image
        assert image.negative_rows == n and image.condition_rows == cond.shape[0]
        # Negative control: one flipped bit in a payload is caught.
        call, token = await reserve(stub, f"flip-{dtype}")
        k = PROMPT + 2
        ids = list(range(k))
        msgs = [chunk(token, f"flip-{dtype}", 0, 0, hidden[:k], ids, 0,
                      metadata=metadata(k, dtype=wire.dtype_to_proto(dtype)))]
        crc = wire.crc32c(msgs[0].data)
        data = bytearray(msgs[0].data)
        data[5] ^= 0x10
        msgs[0].data = bytes(data)
        msgs[0].end.CopyFrom(pb.StreamEnd(total_rows=k, crc32c=crc))
        await expect_code(push_raw(stub, msgs), grpc.StatusCode.DATA_LOSS, "CRC")
        call.cancel()


@pytest.mark.parametrize("bad", ["all-nan", "one-inf", "one-nan-negative"])
async def test_non_finite_rows_are_refused(dit, bad):
    """A condition of NaN or infinite values would denoise into a blank image without a word:
    the DiT refuses such rows with INVALID_ARGUMENT (and the epoch, so a retry must resend)."""
    n = PROMPT + IMAGE_ROWS
    hidden, ids = rows(n)
    role, negative = pb.CONDITION, None
    if bad == "all-nan":
        hidden[:] = float("nan")
    elif bad == "one-inf":
        hidden[PROMPT + 3, 5] = float("inf")
    else:
        negative = torch.zeros(4, HIDDEN)
        negative[2, 7] = float("nan")
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, f"nonfinite-{bad}", has_negative=negative is not None)
        md = metadata(n, expected_negative_rows=0 if negative is None else 4)
        msgs = [chunk(token, f"nonfinite-{bad}", 0, 0, hidden, ids, 0, role=role, metadata=md)]
        if negative is not None:
            msgs.append(chunk(token, f"nonfinite-{bad}", 0, 1, negative, [0, 1, 2, 3], 0, role=pb.NEGATIVE))
        end = pb.StreamEnd(total_rows=n, crc32c=wire.crc32c(msgs[0].data))  # otherwise a valid stream
        if negative is not None:
            end.total_negative_rows, end.negative_crc32c = 4, wire.crc32c(msgs[1].data)
        msgs[-1].end.CopyFrom(end)
        await expect_code(push_raw(stub, msgs), grpc.StatusCode.INVALID_ARGUMENT, "non-finite")
        call.cancel()


# -- versions, unknown fields, limits, auth ------------------------------------------------------


async def test_unknown_fields_are_ignored_and_minor_versions_mix(dit):
    n = PROMPT + IMAGE_ROWS
    hidden, ids = rows(n)
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "future", steps=1)
        md = metadata(n)
        md.protocol_minor = 7  # a newer sender
        msg = chunk(token, "future", 0, 0, hidden, ids, 0, metadata=md,
                    end=pb.StreamEnd(total_rows=n, crc32c=wire.crc32c(wire.encode_rows(hidden))))
        # Field 99 (varint 42) and field 100 (bytes) do not exist in this DiT's schema.
        raw = msg.SerializeToString() + b"\x98\x06\x2a" + b"\xa2\x06\x03abc"
        assert pb.HiddenStateChunk.FromString(raw).UnknownFields is not None
        push = ch.stream_unary("/mammoth.v1.DiT/PushConditions", request_serializer=lambda b: b,
                               response_deserializer=pb.PushConditionsResponse.FromString)

        async def gen():
            yield raw

        response = await push(gen(), metadata=AUTH, timeout=10)
        assert response.rows_accepted == n
        assert (await read_all(call))[-1].image.condition_rows == n


async def test_unsupported_major_version_is_failed_precondition(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "v2")
        hidden, ids = rows(4)
        msg = chunk(token, "v2", 0, 0, hidden, ids, 0, metadata=metadata(22, major=2))
        await expect_code(push_raw(stub, [msg]), grpc.StatusCode.FAILED_PRECONDITION, "major version 2")
        call.cancel()


async def test_message_over_the_limit_is_a_clear_error_not_a_hang(dit):
    big = pb.HiddenStateChunk(reservation_token="x", data=b"\0" * (LIMIT + 1024))
    t0 = time.monotonic()
    # Same limit on the client: refused before it leaves.
    async with channel(dit) as ch:
        await expect_code(push_raw(pb_grpc.DiTStub(ch), [big]), grpc.StatusCode.RESOURCE_EXHAUSTED)
    # A client with a larger limit: the DiT refuses it.
    async with channel(dit, limit=4 * LIMIT) as ch:
        details = await expect_code(push_raw(pb_grpc.DiTStub(ch), [big]), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "larger than max" in details
    assert time.monotonic() - t0 < 5.0
    # The sender itself never builds an over-limit message: chunks shrink to fit.
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "big", steps=1)
        n = 6000
        hidden, ids = rows(n)
        sender = make_sender(ch, "big", token, n, chunk_rows=100_000)
        assert sender.rows_per_chunk * HIDDEN * 4 < LIMIT
        response = await push_rows(sender, hidden, ids, per_put=1000)
        assert response.rows_accepted == n and response.chunks_accepted >= 2
        call.cancel()


async def test_stage_token_required_except_for_health(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call = stub.Generate(pb.DiTGenerateRequest(request_id="anon", params=params()), timeout=5)
        await expect_code(read_all(call), grpc.StatusCode.UNAUTHENTICATED)
        health = health_pb2_grpc.HealthStub(ch)
        for service in ("", "mammoth.v1.DiT"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_bad_image_params_are_invalid_argument(dit):
    async with channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        bad = params()
        bad.width = 30
        call = stub.Generate(pb.DiTGenerateRequest(request_id="bad", params=bad), metadata=AUTH, timeout=5)
        await expect_code(read_all(call), grpc.StatusCode.INVALID_ARGUMENT, "multiple of 16")


# -- a dead engine loop --------------------------------------------------------------------------

#: Run at the start of the DiT process of `test_a_dead_engine_loop_...` (its ``sitecustomize``): the
#: worker loop's step raises, as a bug or a device fault inside the loop would.
LOOP_FAULT = """
import stage_dit.engine

def _step(self):
    raise RuntimeError("injected fault in the DiT worker loop")

stage_dit.engine.DiTEngine.step = _step
"""


DIT_SERVICES = ("", "mammoth.v1.DiT")


async def test_a_dead_engine_loop_fails_its_request_and_refuses_new_work(tiny_checkpoint, tmp_path):
    """A real DiT process whose worker loop dies at its first step (injected from outside the code
    under test: a ``sitecustomize`` in the child replaces `DiTEngine.step`). The request in flight
    ends INTERNAL, not a hang; health turns NOT_SERVING on every service; a new Generate is refused
    UNAVAILABLE before any work (no slot reserved, nothing pushed); SIGTERM still stops the process."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LOOP_FAULT)
    server = start_dit(tiny_checkpoint, tmp_path, first_on_path=hook)
    try:
        async with channel(server) as ch:
            stub = pb_grpc.DiTStub(ch)
            await until_health(ch, health_pb2.HealthCheckResponse.SERVING, DIT_SERVICES)
            call, token = await reserve(stub, "doomed", steps=2)
            hidden, ids = rows()
            await push_rows(make_sender(ch, "doomed", token, hidden.shape[0]), hidden, ids)
            await expect_code(read_all(call), grpc.StatusCode.INTERNAL)
            await until_health(ch, health_pb2.HealthCheckResponse.NOT_SERVING, DIT_SERVICES)
            late = stub.Generate(pb.DiTGenerateRequest(request_id="late", params=params()), metadata=AUTH, timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await late.read()
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
            assert errors.origin_of(refused.value) == errors.Origin(errors.Stage.DIT, errors.Reason.ENGINE_FAILED)
            assert server.metric("mammoth_dit_slots_in_use") == 0
            # counted as a failure, not as a consumer that went away (a break-it pass saw the latter)
            assert server.metric("mammoth_dit_requests_total", outcome="failed") == 1
            assert server.metric("mammoth_dit_requests_total", outcome="consumer_lost") == 0
    finally:
        assert server.stop() == 0


# -- drain ---------------------------------------------------------------------------------------


async def test_sigterm_drains_in_flight_work_and_refuses_new(dit):
    """(Last: it stops the module's DiT; a test after it would get a new one.)"""
    server = dit
    try:
        async with channel(server) as ch:
            stub = pb_grpc.DiTStub(ch)
            call, token = await reserve(stub, "inflight", steps=2)
            server.proc.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(ch)
            for _ in range(50):
                reply = await health.Check(health_pb2.HealthCheckRequest(service="mammoth.v1.DiT"), timeout=5)
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            hidden, ids = rows()
            await push_rows(make_sender(ch, "inflight", token, hidden.shape[0]), hidden, ids)
            assert (await read_all(call))[-1].image.data  # in-flight work finished
        assert server.proc.wait(20) == 0
    finally:
        server.stop()


async def test_a_negative_prompt_too_long_for_the_dit_is_refused_as_the_requests_own_fault(dit):
    """A negative condition with more rows than the DiT's caption positions (``gen_axes_lens[0] - 1``;
    the tiny checkpoint's 9,999) cannot be denoised. Found by a break-it pass: the forward raised
    inside the step, the DiT answered INTERNAL, and the gateway re-ran the whole request three times
    before a 502. Now it is INVALID_ARGUMENT with reason INVALID_REQUEST before any step (the
    gateway's 400, no retry), naming the field to shorten."""
    from gateway.stage_errors import classify

    n = PROMPT + IMAGE_ROWS
    hidden, ids = rows(n)
    negative = torch.randn(10_000, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.1
    async with channel(dit, limit=8 << 20) as ch:
        stub = pb_grpc.DiTStub(ch)
        call, token = await reserve(stub, "long-negative", steps=1, has_negative=True)
        sender = make_sender(ch, "long-negative", token, n, negative=negative.shape[0], chunk_rows=512)
        run = asyncio.ensure_future(sender.run())
        assert sender.put_rows(pb.CONDITION, hidden, ids)
        for i in range(0, negative.shape[0], 2000):
            assert sender.put_rows(pb.NEGATIVE, negative[i : i + 2000], list(range(i, i + 2000)))
        sender.finish()
        await run
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await read_all(call)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert "shorten negative_prompt" in exc.value.details() and "9999" in exc.value.details()
    origin = errors.origin_of(exc.value)
    assert origin is not None and origin.reason == errors.Reason.INVALID_REQUEST
    verdict = classify(exc.value, errors.Stage.DIT, "dit:1", "while denoising")
    assert type(verdict).__name__ == "InvalidRequestError"  # a 400 at once, not a retried failure
    assert errors.field_of(exc.value) == "negative_prompt" and verdict.param == "negative_prompt"
