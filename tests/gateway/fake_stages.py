"""Small stand-ins for the gateway's *dependencies* (the AR and DiT gRPC servers), gateway tests only.

They speak the real ``mammoth.v1`` contract over real sockets, so the gateway under test runs its
real code path (reservation, AR start with the DiT address and token, concurrent streams, retries,
cancellation), with knobs the real model servers do not have: step delays, a slow AR, an AR that
dies mid-push (``os._exit``), a DiT that answers RESOURCE_EXHAUSTED or refuses the first pushes, an AR
that refuses every request. Their aborts carry the stages' `mammoth_core.errors` origin. The "image" is deterministic
noise from (seed, token ids): same seed + prompt -> same bytes, whichever AR produced the tokens.

Each process writes one line per event to ``--events FILE`` (``reserved``, ``cancelled``,
``released`` ...) so tests can check what the stage saw and when.

Run: ``python tests/gateway/fake_stages.py dit|ar --port 0 --ready-file F [options]``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import pathlib
import sys
import time
import uuid
import zlib

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mammoth_core.pb import mammoth_pb2 as pb  # noqa: E402
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc  # noqa: E402
from mammoth_core import errors  # noqa: E402
from mammoth_core.errors import Reason, Stage  # noqa: E402

HIDDEN = 4


class EventLog:
    def __init__(self, path: str | None) -> None:
        self.path = path

    def write(self, kind: str, **fields) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"event": kind, "t": time.time(), **fields}) + "\n")


def check_auth(context: grpc.aio.ServicerContext, token: str | None) -> bool:
    if not token:
        return True
    md = dict(context.invocation_metadata() or ())
    return md.get("authorization") == f"Bearer {token}"


def render(params: pb.ImageParams, token_ids: list[int], partial: float = 1.0) -> bytes:
    """Noise image from (seed, token ids); ``partial`` < 1 blends towards grey (a preview)."""
    key = zlib.crc32(np.asarray(token_ids, dtype=np.int64).tobytes()) ^ (params.seed & 0xFFFFFFFF)
    rng = np.random.default_rng(key)
    pixels = rng.integers(0, 256, size=(params.height, params.width, 3), dtype=np.uint8)
    pixels = (pixels.astype(np.float32) * partial + 128 * (1 - partial)).astype(np.uint8)
    buf = io.BytesIO()
    fmt = params.output_format or "png"
    if fmt == "png":
        Image.fromarray(pixels).save(buf, format="PNG")
    else:
        Image.fromarray(pixels).save(buf, format=fmt.upper(),
                                     quality=max(1, 100 - params.output_compression))
    return buf.getvalue()


class Slot:
    def __init__(self, request_id: str, params: pb.ImageParams) -> None:
        self.request_id = request_id
        self.params = params
        self.epoch = -1
        self.token_ids: list[int] = []
        self.complete = asyncio.Event()


class FakeDiT(pb_grpc.DiTServicer):
    def __init__(self, args: argparse.Namespace, log: EventLog) -> None:
        self.args = args
        self.log = log
        self.slots: dict[str, Slot] = {}

    async def Generate(self, request, context):
        if not check_auth(context, self.args.auth_token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad stage token")
        p = request.params
        if p.width == 0 or p.height == 0 or p.width % 16 or p.height % 16:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad size")
        if self.args.always_full or len(self.slots) >= self.args.slots:
            self.log.write("exhausted", request_id=request.request_id)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free slot")
        token = uuid.uuid4().hex
        slot = Slot(request.request_id, p)
        self.slots[token] = slot
        cache = ([p.dit_cache.threshold, p.dit_cache.warmup_steps] if p.HasField("dit_cache") else None)
        self.log.write("reserved", request_id=request.request_id, token=token, dit_cache=cache)
        outcome = "cancelled"
        try:
            yield pb.DiTGenerateResponse(reserved=pb.Reserved(reservation_token=token, slot_id=token))
            await slot.complete.wait()
            await asyncio.sleep(self.args.complete_event_delay)  # a DiT slow to say so
            yield pb.DiTGenerateResponse(conditions_complete=pb.ConditionsComplete(
                epoch=slot.epoch, condition_rows=len(slot.token_ids)))
            steps = p.num_inference_steps
            marks = {round(steps * (k + 1) / (p.partial_images + 1)) for k in range(p.partial_images)}
            partial_index = 0
            for step in range(1, steps + 1):
                await asyncio.sleep(self.args.step_delay)
                yield pb.DiTGenerateResponse(progress=pb.DiTProgress(
                    phase=pb.DiTProgress.DENOISING, step=step, total_steps=steps,
                    rows_received=len(slot.token_ids)))
                if step in marks and partial_index < p.partial_images:
                    yield pb.DiTGenerateResponse(image=pb.Image(
                        data=await asyncio.to_thread(render, p, slot.token_ids, step / steps),
                        format=p.output_format,
                        width=p.width, height=p.height, partial=True, partial_index=partial_index))
                    partial_index += 1
            yield pb.DiTGenerateResponse(progress=pb.DiTProgress(phase=pb.DiTProgress.DECODING,
                                                                 step=steps, total_steps=steps))
            # rendered off the event loop, as the real DiT works in a thread: health answers go on
            data = await asyncio.to_thread(render, p, slot.token_ids)
            yield pb.DiTGenerateResponse(image=pb.Image(
                data=data, format=p.output_format, width=p.width,
                height=p.height, condition_rows=len(slot.token_ids),
                timings=pb.DiTTimings(denoise_ms=steps * self.args.step_delay * 1e3)))
            outcome = "done"
        finally:
            if outcome == "cancelled" and self.args.release_delay > 0:
                # as the real DiT: a cancelled slot is freed when its current step ends
                asyncio.get_running_loop().call_later(self.args.release_delay, self.slots.pop, token, None)
            else:
                self.slots.pop(token, None)
            self.log.write("released", request_id=request.request_id, outcome=outcome,
                           cancelled=context.cancelled())

    async def PushConditions(self, request_iterator, context):
        if not check_auth(context, self.args.auth_token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad stage token")
        rows = 0
        async for chunk in request_iterator:
            slot = self.slots.get(chunk.reservation_token)
            if slot is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "unknown reservation")
            epoch = chunk.header.epoch
            if slot.complete.is_set():
                await errors.abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                                   "conditions already complete", stage=Stage.DIT,
                                   reason=Reason.CONDITIONS_COMPLETE)
            if epoch < self.args.reject_push_epochs:
                self.log.write("push_rejected", request_id=slot.request_id, epoch=epoch)
                await errors.abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                                   f"row_offset {chunk.header.row_offset + 1} out of order",
                                   stage=Stage.DIT, reason=Reason.CHUNK_REJECTED)
            if epoch < slot.epoch:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch")
            if epoch > slot.epoch:  # a new epoch starts fresh
                slot.epoch, slot.token_ids = epoch, []
                self.log.write("epoch", request_id=slot.request_id, epoch=epoch)
            slot.token_ids.extend(chunk.header.token_ids)
            rows += len(chunk.header.token_ids)
            if chunk.HasField("end"):
                slot.complete.set()
        return pb.PushConditionsResponse(rows_accepted=rows)


class FakeAR(pb_grpc.ARServicer):
    def __init__(self, args: argparse.Namespace, log: EventLog) -> None:
        self.args = args
        self.log = log
        self.running = 0

    async def Generate(self, request, context):
        if not check_auth(context, self.args.auth_token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad stage token")
        if self.args.reject_request:
            self.log.write("rejected", request_id=request.request_id)
            await errors.abort(context, grpc.StatusCode.INVALID_ARGUMENT, self.args.reject_request,
                               stage=Stage.AR, reason=Reason.INVALID_REQUEST)
        if self.running >= self.args.max_running:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        self.running += 1
        self.log.write("started", request_id=request.request_id, epoch=request.epoch,
                       dit=request.dit_address)
        outcome = "cancelled"
        try:
            gw, gh = ((request.grid_width, request.grid_height) if request.grid_width
                      else (request.width // 16, request.height // 16))
            prompt_ids = [b for b in request.prompt.encode()][:64]
            total = gh * (gw + 1)
            rng = np.random.default_rng(request.seed)
            generated = [int(x) for x in rng.integers(1000, 2000, size=total)]
            rows = prompt_ids + generated
            md = (("authorization", f"Bearer {self.args.auth_token}"),) if self.args.auth_token else ()
            async with grpc.aio.insecure_channel(request.dit_address) as channel:
                stub = pb_grpc.DiTStub(channel)
                queue: asyncio.Queue = asyncio.Queue()

                async def chunks():
                    while (item := await queue.get()) is not None:
                        yield item

                push = stub.PushConditions(chunks(), metadata=md)
                per = 8
                for seq, start in enumerate(range(0, len(rows), per)):
                    ids = rows[start:start + per]
                    if self.args.die_at_row is not None and start >= self.args.die_at_row:
                        self.log.write("dying", request_id=request.request_id)
                        os._exit(3)
                    last = start + per >= len(rows)
                    chunk = pb.HiddenStateChunk(
                        reservation_token=request.reservation_token,
                        header=pb.ChunkHeader(request_id=request.request_id, epoch=request.epoch,
                                              sequence=seq, role=pb.CONDITION, dtype=pb.FLOAT32,
                                              shape=[len(ids), HIDDEN], row_offset=start,
                                              token_ids=ids),
                        data=bytes(4 * HIDDEN * len(ids)))
                    if last:
                        chunk.end.total_rows = len(rows)
                    await queue.put(chunk)
                    await asyncio.sleep(self.args.row_delay)
                    done_tokens = max(0, min(total, start + per - len(prompt_ids)))
                    yield pb.ARGenerateResponse(progress=pb.ARProgress(
                        prompt_tokens=len(prompt_ids), tokens_generated=done_tokens,
                        total_tokens=total, rows_sent=start + len(ids)))
                await queue.put(None)
                try:
                    await push
                except grpc.aio.AioRpcError as exc:
                    origin = errors.origin_of(exc) or errors.Origin(Stage.DIT, Reason.PUSH_FAILED)
                    await errors.abort(context, exc.code(), f"push failed: {exc.details()}",
                                       stage=origin.stage, reason=origin.reason)
                if self.args.fail_after_push:  # an AR that dies after the DiT acknowledged
                    self.log.write("failing_after_push", request_id=request.request_id)
                    await context.abort(grpc.StatusCode.ABORTED, "failed after the push")
            yield pb.ARGenerateResponse(done=pb.ARDone(prompt_tokens=len(prompt_ids),
                                                       generated_tokens=total, rows_sent=len(rows)))
            outcome = "done"
        finally:
            self.running -= 1
            self.log.write("finished", request_id=request.request_id, outcome=outcome,
                           cancelled=context.cancelled())


async def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("ar", "dit"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--events")
    parser.add_argument("--auth-token")
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--always-full", action="store_true")
    parser.add_argument("--step-delay", type=float, default=0.01)
    parser.add_argument("--row-delay", type=float, default=0.0)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--die-at-row", type=int)
    parser.add_argument("--fail-after-push", action="store_true")
    parser.add_argument("--complete-event-delay", type=float, default=0.0)
    parser.add_argument("--release-delay", type=float, default=0.0,
                        help="DiT: seconds between a cancelled call and its slot being free again")
    parser.add_argument("--reject-push-epochs", type=int, default=0,
                        help="DiT: refuse the pushes of epochs below this (INVALID_ARGUMENT)")
    parser.add_argument("--reject-request", help="AR: refuse every Generate with INVALID_ARGUMENT "
                        "and this message (the AR's own rejection)")
    args = parser.parse_args(argv)
    log = EventLog(args.events)
    server = grpc.aio.server()
    service = "mammoth.v1.DiT" if args.role == "dit" else "mammoth.v1.AR"
    if args.role == "dit":
        pb_grpc.add_DiTServicer_to_server(FakeDiT(args, log), server)
    else:
        pb_grpc.add_ARServicer_to_server(FakeAR(args, log), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"127.0.0.1:{args.port}")
    await server.start()
    await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    tmp = args.ready_file + ".tmp"
    pathlib.Path(tmp).write_text(json.dumps({"address": f"127.0.0.1:{port}", "pid": os.getpid()}))
    os.replace(tmp, args.ready_file)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
