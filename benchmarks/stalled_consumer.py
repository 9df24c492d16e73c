"""A stalled consumer must not slow the other requests decoded in the same AR batch.

Issue 4: "A stalled consumer (one DiT that stops reading) does not slow the other requests decoded
in the same AR batch by more than 10% tokens/s."

Set-up: the real AR and DiT processes (``mammoth_app.local.start_pipeline``, tiny checkpoint, CPU)
plus, in this process, a *stalled DiT*: a ``mammoth.v1.DiT`` server whose ``Generate`` reserves a
slot and whose ``PushConditions`` never reads its request stream (HTTP/2 flow control then stops the
AR's pushes for that request after a window's worth of bytes). This process plays the gateway:
it reserves slots and starts ``AR.Generate`` calls concurrently.

Two scenarios with the same ``n`` concurrent requests (same prompts, seeds, sizes):
  * ``baseline``: every request pushes to the real DiT;
  * ``stalled``: request 0 pushes to the stalled DiT (its AR call ends at its deadline).
For the other requests, tokens/s = generated tokens / AR decode time (``ARDone``). The result is the
ratio stalled/baseline of their mean tokens/s (target >= 0.90), per repetition, with the median.

    PYTHONPATH=. python benchmarks/stalled_consumer.py --repeat 3 [--size 512] [--n 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_core import grpc_common  # noqa: E402
from mammoth_core.pb import mammoth_pb2 as pb  # noqa: E402
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc  # noqa: E402


class StalledDiT(pb_grpc.DiTServicer):
    """A DiT that reserves and then never reads pushed conditions (the consumer under stress)."""

    def __init__(self) -> None:
        self.pushes_started = 0
        self._forever = asyncio.Event()

    async def Generate(self, request, context):
        yield pb.DiTGenerateResponse(reserved=pb.Reserved(reservation_token=f"stalled-{request.request_id}"))
        await self._forever.wait()

    async def PushConditions(self, request_iterator, context):
        self.pushes_started += 1
        await self._forever.wait()  # never reads: flow control stalls the sender
        return pb.PushConditionsResponse()


@dataclasses.dataclass
class RequestResult:
    """Outcome of one AR call: tokens/s over its decode, or the status it ended with."""

    index: int
    ok: bool
    tokens: int = 0
    decode_ms: float = 0.0
    code: str = "OK"

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.tokens / self.decode_ms if self.decode_ms > 0 else 0.0


async def _one(
    ar: pb_grpc.ARStub, dit: pb_grpc.DiTStub, dit_address: str, index: int, size: int, steps: int,
    deadline_s: float, start: asyncio.Event, metadata: tuple = (),
) -> RequestResult:
    params = pb.ImageParams(width=size, height=size, num_inference_steps=steps, text_guidance_scale=1.0,
                            cfg_range_end=1.0, seed=100 + index, output_format="png")
    gen = dit.Generate(pb.DiTGenerateRequest(request_id=f"stall-bench-{index}", params=params), timeout=deadline_s + 60,
                       metadata=metadata)
    try:
        first = await gen.read()
        token = first.reserved.reservation_token
        await start.wait()
        call = ar.Generate(
            pb.ARGenerateRequest(request_id=f"stall-bench-{index}", prompt=f"benchmark prompt {index}",
                                 width=size, height=size, seed=100 + index, dit_address=dit_address,
                                 reservation_token=token),
            timeout=deadline_s, metadata=metadata,
        )
        done = None
        try:
            async for event in call:
                if event.HasField("done"):
                    done = event.done
        except grpc.aio.AioRpcError as exc:
            return RequestResult(index, ok=False, code=exc.code().name)
        while True:  # the image, as the gateway would wait for it (frees the slot)
            event = await gen.read()
            if event is grpc.aio.EOF or event.HasField("image"):
                break
        return RequestResult(index, ok=True, tokens=done.generated_tokens, decode_ms=done.decode_ms)
    finally:
        gen.cancel()


async def run_scenario(ar_address: str, dit_address: str, *, n: int, size: int, stalled: bool,
                       steps: int = 1, deadline_s: float = 60.0, stalled_deadline_s: float | None = None,
                       metadata: tuple = (), stalled_port: int = 0) -> list[RequestResult]:
    """Run ``n`` concurrent AR requests; with ``stalled``, request 0 pushes to a stalled DiT on
    ``stalled_port`` (one the AR's ``dit_allow_list`` allows). ``metadata``: the gateway role's
    stage token (`mammoth_core.grpc_common.auth_metadata`)."""
    server = grpc.aio.server()
    servicer = StalledDiT()
    pb_grpc.add_DiTServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{stalled_port}")
    await server.start()
    stalled_address = f"127.0.0.1:{port}"
    limit = 64 * 1024 * 1024
    channels = [grpc_common.create_channel(a, limit) for a in (ar_address, dit_address, stalled_address)]
    ar, dit, stall = (pb_grpc.ARStub(channels[0]), pb_grpc.DiTStub(channels[1]), pb_grpc.DiTStub(channels[2]))
    start = asyncio.Event()
    try:
        tasks = []
        for i in range(n):
            if stalled and i == 0:
                tasks.append(_one(ar, stall, stalled_address, i, size, steps,
                                  stalled_deadline_s or deadline_s, start, metadata))
            else:
                tasks.append(_one(ar, dit, dit_address, i, size, steps, deadline_s, start, metadata))
        runner = asyncio.gather(*tasks)
        await asyncio.sleep(0.5)  # every slot reserved before the AR calls start together
        start.set()
        return list(await runner)
    finally:
        for ch in channels:
            await ch.close()
        await server.stop(0)


def measure(ar_address: str, dit_address: str, *, n: int, size: int, repeat: int, **kw) -> dict:
    """Alternate baseline and stalled scenarios ``repeat`` times; returns per-run and median ratios
    (``kw``: ``metadata`` and ``stalled_port`` of `run_scenario`)."""
    runs = []
    for _ in range(repeat):
        base = asyncio.run(run_scenario(ar_address, dit_address, n=n, size=size, stalled=False, **kw))
        stall = asyncio.run(run_scenario(ar_address, dit_address, n=n, size=size, stalled=True,
                                         stalled_deadline_s=30.0, **kw))
        others_base = [r.tokens_per_s for r in base if r.index != 0 and r.ok]
        others_stall = [r.tokens_per_s for r in stall if r.index != 0 and r.ok]
        runs.append({
            "baseline_tokens_per_s": statistics.fmean(others_base),
            "stalled_tokens_per_s": statistics.fmean(others_stall),
            "ratio": statistics.fmean(others_stall) / statistics.fmean(others_base),
            "stalled_request": stall[0].code,
            "all_others_ok": all(r.ok for r in stall if r.index != 0) and all(r.ok for r in base),
        })
    return {"runs": runs, "median_ratio": statistics.median(r["ratio"] for r in runs)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4, help="concurrent requests in the AR batch")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (grid = size/16)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from mammoth_core.grpc_common import auth_metadata
    from mammoth_app.local import free_port, start_pipeline, stop_pipeline

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="stall-bench-"))
    stalled_port = free_port()  # the stalled DiT's: the AR is allowed to push there
    comps = start_pipeline(checkpoint="builtin://tiny", gateway_port=0, slots=args.n + 1, workdir=tmp,
                           log_level="error", extra_env={"MAMMOTH_CACHE_DIR": str(tmp / "cache"),
                                                         "MAMMOTH_DIT_ALLOW_LIST": f"127.0.0.1:{stalled_port}"})
    try:
        by = {c.name: c for c in comps}
        t0 = time.time()
        metadata = auth_metadata((tmp / "tokens" / "gateway.token").read_text().strip())
        result = measure(by["ar"].address, by["dit"].address, n=args.n, size=args.size, repeat=args.repeat,
                         metadata=metadata, stalled_port=stalled_port)
        result.update({"n": args.n, "size": args.size, "seconds": time.time() - t0,
                       "date": time.strftime("%Y-%m-%d", time.gmtime())})
    finally:
        stop_pipeline(comps)
    print(json.dumps(result, indent=2))
    print(f"median ratio (stalled / baseline tokens/s of the other requests): {result['median_ratio']:.3f} "
          f"(target >= 0.90)")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
