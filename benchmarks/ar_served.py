"""The served AR path: a real ``mammoth ar`` process, requests over gRPC, rows pushed to a sink DiT.

Measures what a user's request pays on the AR (issue 17, "served = benchmarked"): the process is
started from the source tree (``python -m mammoth_app.cli ar``), its readiness waited for (model
load, graph capture and warm-up all happen before it), then ``--requests`` requests are sent one
after another through ``AR.Generate`` (gRPC, the real servicer, engine, sender); the AR pushes every
hidden-state row to a sink DiT in this process (a ``DiT.PushConditions`` servicer that accepts and
counts them, so no denoising runs). Per request: wall latency, and the AR's own ``ARDone``
``prefill_ms`` / ``decode_ms``; ms/token is ``decode_ms / generated_tokens``.

Used by `benchmarks/ar_decode.py` (section "served"); alone on the GPU machine:

    PYTHONPATH=. python3 benchmarks/ar_served.py --out "$OUT" [--weights-dtype fp8]

``--smoke``: the built-in tiny checkpoint on the CPU (checks this script's logic).

``--profile-seconds N`` (needs ``py-spy`` on PATH; carried to the GPU machine as a wheel): while the
requests run, samples the AR process twice for ``N`` seconds each without pausing it
(``--nonblocking``): every thread with idle frames (``pyspy_threads.txt``), then only the thread
holding the GIL (``pyspy_gil.txt``); folded stacks in ``--out``, one line per stack and its count.
What it answers: where the decode thread's time goes between GPU steps, and who holds the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_state import snapshot  # noqa: E402 - benchmarks/gpu_state.py
from mammoth_app.local import free_port, stop_pipeline  # noqa: E402
from mammoth_core.settings import AR_WEIGHTS_DTYPES  # noqa: E402
from mammoth_core.pb import mammoth_pb2 as pb  # noqa: E402
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc  # noqa: E402


class SinkDiT(pb_grpc.DiTServicer):
    """Accepts every push and counts its rows (stands in for the DiT; nothing is denoised)."""

    def __init__(self) -> None:
        self.rows = 0

    async def PushConditions(self, request_iterator, context):  # noqa: N802 - the gRPC method name
        rows = negative = chunks = 0
        async for chunk in request_iterator:
            chunks += 1
            n = chunk.header.shape[0] if chunk.header.shape else 0
            if chunk.header.role == pb.NEGATIVE:
                negative += n
            else:
                rows += n
        self.rows += rows
        return pb.PushConditionsResponse(rows_accepted=rows, negative_rows_accepted=negative, chunks_accepted=chunks)


async def _start_sink(port: int) -> tuple[grpc.aio.Server, SinkDiT]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 * 2**20)])
    sink = SinkDiT()
    pb_grpc.add_DiTServicer_to_server(sink, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, sink


def start_ar(checkpoint: str, dit_port: int, workdir: pathlib.Path, device: str, extra: list[str]):
    """``mammoth ar`` as a process; returns (component, seconds until ready, address)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from e2e_gpu import component_env, spawn

    argv = ["ar", "--checkpoint", checkpoint, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1",
            "--device", device, "--insecure-no-auth", "true", "--dit-allow-list", f"127.0.0.1:{dit_port}",
            "--log-level", "info", *extra]
    t0 = time.perf_counter()
    ar = spawn("ar", argv, workdir, component_env(None))
    address = ar.wait_ready(900)
    return ar, time.perf_counter() - t0, address


async def one_request(stub, i: int, dit_port: int, grid: int) -> dict:
    request = pb.ARGenerateRequest(
        request_id=f"served-{i}", prompt=f"a photo of a red house number {i}", width=16 * grid, height=16 * grid,
        seed=i, grid_width=grid, grid_height=grid, dit_address=f"127.0.0.1:{dit_port}", reservation_token="sink")
    t0 = time.perf_counter()
    done = None
    async for event in stub.Generate(request, timeout=600):
        if event.WhichOneof("event") == "done":
            done = event.done
    wall_ms = (time.perf_counter() - t0) * 1e3
    return {"wall_ms": wall_ms, "prefill_ms": done.prefill_ms, "decode_ms": done.decode_ms,
            "tokens": done.generated_tokens, "ms_per_token": done.decode_ms / max(1, done.generated_tokens)}


async def _requests(address: str, dit_port: int, n: int, grid: int) -> list[dict]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ARStub(channel)
        return [await one_request(stub, i, dit_port, grid) for i in range(n)]


def _py_spy(pid: int, seconds: int, out: pathlib.Path) -> None:
    """Two py-spy recordings of ``pid`` one after another (see the module doc), folded stacks."""
    common = ["record", "--pid", str(pid), "--duration", str(seconds), "--rate", "200", "--nonblocking",
              "--threads", "--format", "raw"]
    for name, extra in (("pyspy_threads.txt", ["--idle"]), ("pyspy_gil.txt", ["--gil"])):
        subprocess.run(["py-spy", *common, *extra, "--output", str(out / name)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _logged_picks(log: str) -> dict | None:
    """The GEMV picks the AR logged after its warm-up (`stage_ar.engine`), or None."""
    marker = "GEMV picks ("
    for line in log.splitlines():
        if marker in line:
            return json.loads(line[line.index("{", line.index(marker)):])
    return None


def run(checkpoint: str, *, device: str = "cuda", requests: int = 10, grid: int = 32,
        extra: list[str] | None = None, profile_seconds: int = 0, profile_out: pathlib.Path | None = None) -> dict:
    """Start the AR, send ``requests`` requests of a ``grid`` x ``grid`` AR grid one at a time
    (``profile_seconds``: py-spy the AR process meanwhile, into ``profile_out``)."""
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ar-served-"))
    dit_port = free_port()

    async def main() -> dict:
        server, sink = await _start_sink(dit_port)
        try:
            ar, ready_s, address = await asyncio.to_thread(start_ar, checkpoint, dit_port, workdir, device,
                                                           extra or [])
            try:
                spy = None
                if profile_seconds:
                    spy = asyncio.create_task(asyncio.to_thread(_py_spy, ar.proc.pid, profile_seconds, profile_out))
                gpu_before = snapshot()
                results = await _requests(address, dit_port, requests, grid)
                gpu_after = snapshot()
                if spy is not None:
                    await spy
            finally:
                stop_pipeline([ar])
        finally:
            await server.stop(None)
        later = results[1:] or results
        return {"ready_s": ready_s, "grid": grid, "requests": results, "rows_received": sink.rows,
                "first_wall_ms": results[0]["wall_ms"], "last_wall_ms": results[-1]["wall_ms"],
                "first_over_last": results[0]["wall_ms"] / results[-1]["wall_ms"],
                "ms_per_token_median": statistics.median(r["ms_per_token"] for r in later),
                "gpu_state_before": gpu_before, "gpu_state_after": gpu_after,
                "gemv_picks": _logged_picks((workdir / "ar.log").read_text()),
                "ar_log_tail": (workdir / "ar.log").read_text()[-3000:]}

    return asyncio.run(main())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--checkpoint", default=None, help="default: the Preview-size random one in --ckpt-dir")
    parser.add_argument("--ckpt-dir", default="/tmp/mammoth-preview-ckpt")
    parser.add_argument("--weights-dtype", default="auto", choices=AR_WEIGHTS_DTYPES)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--grid", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="builtin://tiny on the CPU, a 4x4 grid, 3 requests")
    parser.add_argument("--profile-seconds", type=int, default=0,
                        help="py-spy the AR process for this many seconds twice while the requests run (module doc)")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spy = {"profile_seconds": args.profile_seconds, "profile_out": out}
    if args.smoke:
        res = run("builtin://tiny", device="cpu", requests=3, grid=4, extra=["--weights-dtype", args.weights_dtype],
                  **spy)
    else:
        checkpoint = args.checkpoint or preview_checkpoint(pathlib.Path(args.ckpt_dir))
        res = run(checkpoint, requests=args.requests, grid=args.grid, extra=["--weights-dtype", args.weights_dtype],
                  **spy)
    (out / "ar_served.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k not in ("requests", "ar_log_tail")}, indent=1))
    return 0


def preview_checkpoint(folder: pathlib.Path) -> str:
    """The Preview-size random checkpoint (`benchmarks/e2e_gpu.build_preview_checkpoint`, written once)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from e2e_gpu import build_preview_checkpoint

    seconds = build_preview_checkpoint(folder)
    print(f"checkpoint {folder} ({seconds:.0f} s to write)", flush=True)
    return str(folder)


if __name__ == "__main__":
    raise SystemExit(main())
