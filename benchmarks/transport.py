"""Hidden-state transport on CPU loopback: throughput vs raw TCP, and the transfer tail vs a
request-end baseline.

Run (from the repository root):  ``PYTHONPATH=. python benchmarks/transport.py [--write-docs]``

One receiver process serves, per payload width, a real ``DiT`` gRPC server (`stage_dit.server.
DiTServicer` over a real `SlotPool`; the image model is a stand-in that returns a blank image at
once, so only the transport is timed) and a raw TCP sink. This process is the AR: a producer
thread calls `HiddenStateSender.put_rows` as a decode loop would, the sender streams on asyncio.

(a) Throughput: all rows available at once, pushed as fast as possible; time from the first
    ``put_rows`` to the DiT's acknowledgement (sent only once every row is resident), vs the raw
    TCP ceiling: the same number of bytes through one loopback socket into a receiver that reads
    them into a preallocated buffer and answers one byte.
(b) Tail: rows produced at a simulated decode rate (``--row-ms`` per row, bursts of ``--burst``
    rows, i.e. the ~19 ms/token rate scaled down so a run takes seconds); tail = last row produced
    -> conditions resident on the DiT (receiver clock, same machine). Streamed (``chunk_rows``
    rows per message, overlapping production) vs request-end (the same codec and sender, one
    message sent after the producer finished).
Payloads: ``1824 x 4096`` and ``4221 x 3584`` bfloat16.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import grpc
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_core import grpc_common  # noqa: E402
from mammoth_core.pb import mammoth_pb2 as pb  # noqa: E402
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc  # noqa: E402

PAYLOADS = [(1824, 4096), (4221, 3584)]
LIMIT = 64 << 20
PROMPT = 24


# ------------------------------------------------------------------------------------------------
# Receiver process
# ------------------------------------------------------------------------------------------------


class _BlankImageModel:
    """Stand-in image model for the benchmark: returns a blank image immediately."""

    dtype = torch.bfloat16

    def prepare_conditions(self, hidden, token_ids, answer_start_index):
        return hidden

    def generate(self, condition, negative, *, width, height, num_inference_steps, text_guidance_scale,
                 cfg_range=(0.0, 1.0), seed, callback=None):
        if callback is not None:
            callback(0, 1, None)
        return torch.zeros(3, height, width)


def _tcp_sink(sock: socket.socket) -> None:
    buf = bytearray(64 << 20)
    view = memoryview(buf)
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            header = conn.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                continue
            want = int.from_bytes(header, "little")
            got = 0
            while got < want:
                n = conn.recv_into(view[got % len(buf):], min(want - got, len(buf) - got % len(buf)))
                if not n:
                    break
                got += n
            conn.sendall(b"k")


async def _sink(request_iterator, context) -> bytes:
    n = 0
    async for message in request_iterator:
        n += len(message)
    return n.to_bytes(8, "little")


async def _receiver(ready_file: str) -> None:
    from stage_dit.receiver import SlotPool, add_dit_servicer
    from stage_dit.server import DiTServicer

    info = {}
    servers = []
    for _, hidden in PAYLOADS:
        server = grpc_common.create_server(LIMIT, None, insecure=True)  # loopback benchmark
        pool = SlotPool(2, 8192, hidden, torch.bfloat16, "cpu")
        add_dit_servicer(DiTServicer(_BlankImageModel(), pool), server)
        # Bare gRPC ceiling: the same server options, raw bytes in, nothing done with them.
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "mammoth.bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(_sink)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        info[str(hidden)] = f"127.0.0.1:{port}"
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    threading.Thread(target=_tcp_sink, args=(sock,), daemon=True).start()
    info["tcp"] = sock.getsockname()[1]
    info["pid"] = os.getpid()
    pathlib.Path(ready_file).write_text(json.dumps(info))
    await asyncio.Event().wait()


# ------------------------------------------------------------------------------------------------
# Producer side
# ------------------------------------------------------------------------------------------------


def tcp_ceiling(port: int, payload: bytes) -> float:
    """Seconds to move ``payload`` through one loopback TCP connection (send -> 1-byte answer)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(len(payload).to_bytes(8, "little"))
        s.sendall(payload)
        assert s.recv(1) == b"k"
        return time.perf_counter() - t0


async def push_once(channel: grpc.aio.Channel, hidden: torch.Tensor, chunk_rows: int, *, row_ms: float,
                    burst: int, request_id: str) -> dict:
    """Reserve a slot, produce ``hidden`` from a producer thread, stream it over ``channel`` (the
    AR keeps one channel per DiT, so the connection is reused); returns timings."""
    from stage_ar.sender import HiddenStateSender

    rows = hidden.shape[0]
    ids = list(range(PROMPT)) + [1 << 20] * (rows - PROMPT)
    stub = pb_grpc.DiTStub(channel)
    call = stub.Generate(pb.DiTGenerateRequest(request_id=request_id, params=pb.ImageParams(
        width=16, height=16, num_inference_steps=1, output_format="png")), timeout=120)
    token = (await call.read()).reserved.reservation_token
    sender = HiddenStateSender(channel, request_id, 0, token, hidden.shape[1], hidden.dtype, PROMPT,
                               rows, 0, chunk_rows, LIMIT, (), 120.0)
    marks: dict[str, float] = {}

    def produce() -> None:  # the "decode thread"
        marks["start"] = time.time()
        next_t = time.perf_counter()
        for i in range(0, rows, burst):
            if row_ms:
                next_t += row_ms * burst / 1000.0
                delay = next_t - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            sender.put_rows(pb.CONDITION, hidden[i : i + burst], ids[i : i + burst])
        marks["last_row"] = time.time()
        sender.finish()

    thread = threading.Thread(target=produce)
    run = asyncio.ensure_future(sender.run())
    thread.start()
    response = await run
    acked = time.time()
    thread.join()
    image = None
    while (msg := await call.read()) is not grpc_aio_eof():
        if msg.WhichOneof("event") == "image":
            image = msg.image
    assert response.rows_accepted == rows, response
    resident = sender.last_sent_unix_ms + image.timings.transfer_tail_ms
    return {
        "total_s": acked - marks["start"],
        "tail_ms": resident - marks["last_row"] * 1000.0,
        "chunks": sender.chunks_sent,
    }


def grpc_aio_eof():
    return grpc.aio.EOF


async def grpc_ceiling(channel: grpc.aio.Channel, payload: bytes, message_bytes: int) -> float:
    """Seconds to push ``payload`` as raw ``message_bytes`` messages through gRPC on ``channel`` (no
    codec, no checks, nothing done on arrival): what grpcio itself costs on this machine."""
    push = channel.stream_unary("/mammoth.bench.Sink/Push")
    view = memoryview(payload)
    pieces = [bytes(view[i : i + message_bytes]) for i in range(0, len(payload), message_bytes)]

    async def gen():
        for piece in pieces:
            yield piece

    t0 = time.perf_counter()
    await push(gen(), timeout=60)
    return time.perf_counter() - t0


def median(xs):
    return statistics.median(xs)


async def measure(info: dict, args) -> list[dict]:
    results = []
    for rows, hidden_size in PAYLOADS:
        async with grpc_common.create_channel(info[str(hidden_size)], LIMIT) as channel:
            results.append(await measure_payload(channel, info["tcp"], info["pid"], rows, hidden_size, args))
            print(json.dumps(results[-1]), flush=True)
    return results


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``; NaN elsewhere)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


async def _cpu_ms(receiver_pid: int, run) -> tuple[object, float]:
    """(result of awaiting ``run``, sender + receiver CPU milliseconds it cost)."""
    s0, r0 = time.process_time(), _process_cpu_s(receiver_pid)
    result = await run
    return result, 1e3 * (time.process_time() - s0 + _process_cpu_s(receiver_pid) - r0)


async def measure_payload(channel: grpc.aio.Channel, tcp_port: int, receiver_pid: int, rows: int,
                          hidden_size: int, args) -> dict:
    """All measurements of one payload. TCP, bare gRPC and stream runs are interleaved (one of each
    per repetition) so that load from other processes hits the three alike; the throughput ratio
    is the median of the per-repetition ratios stream / TCP. CPU: sender + receiver process CPU
    time of each run (the receiver's at the kernel's clock-tick resolution, 10 ms)."""
    hidden = torch.randn(rows, hidden_size).to(torch.bfloat16)
    nbytes = hidden.numel() * 2
    payload = hidden.view(torch.uint8).numpy().tobytes()
    message_bytes = args.chunk_rows * hidden_size * 2
    await push_once(channel, hidden, args.chunk_rows, row_ms=0, burst=rows, request_id="warm")
    await grpc_ceiling(channel, payload, message_bytes)
    tcp, bare, stream = [], [], []
    cpu: dict[str, list[float]] = {"tcp": [], "bare": [], "stream": []}
    for i in range(args.repeat):
        s0, r0 = time.process_time(), _process_cpu_s(receiver_pid)
        tcp.append(tcp_ceiling(tcp_port, payload))
        cpu["tcp"].append(1e3 * (time.process_time() - s0 + _process_cpu_s(receiver_pid) - r0))
        seconds, ms = await _cpu_ms(receiver_pid, grpc_ceiling(channel, payload, message_bytes))
        bare.append(seconds)
        cpu["bare"].append(ms)
        timings, ms = await _cpu_ms(receiver_pid, push_once(channel, hidden, args.chunk_rows, row_ms=0,
                                                            burst=rows, request_id=f"tp-{i}"))
        stream.append(timings)
        cpu["stream"].append(ms)
    streamed = [await push_once(channel, hidden, args.chunk_rows, row_ms=args.row_ms, burst=args.burst,
                                request_id=f"tail-{i}") for i in range(args.repeat)]
    request_end = [await push_once(channel, hidden, rows, row_ms=args.row_ms, burst=args.burst,
                                   request_id=f"end-{i}") for i in range(args.repeat)]
    stream_s = [s["total_s"] for s in stream]
    r = {
        "rows": rows, "hidden": hidden_size, "mib": nbytes / (1 << 20),
        "tcp_gbps": nbytes / median(tcp) / 1e9,
        "grpc_gbps": nbytes / median(bare) / 1e9,
        "stream_gbps": nbytes / median(stream_s) / 1e9,
        "stream_chunks": stream[0]["chunks"],
        "tail_stream_ms": median([s["tail_ms"] for s in streamed]),
        "tail_request_end_ms": median([s["tail_ms"] for s in request_end]),
        "production_s": rows * args.row_ms / 1000.0,
        "throughput_ratio": median([t / s for t, s in zip(tcp, stream_s)]),
        "throughput_ratios": sorted(round(t / s, 3) for t, s in zip(tcp, stream_s)),
        "grpc_ratio": median([t / b for t, b in zip(tcp, bare)]),
        "cpu_ms": {k: sum(v) / len(v) for k, v in cpu.items()},
    }
    r["tail_ratio"] = r["tail_stream_ms"] / r["tail_request_end_ms"]
    return r


def table(results: list[dict], args, command: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    lines = [
        "## Transport (CPU loopback)",
        "",
        f"**Setup.** {datetime.date.today().isoformat()}, {os.cpu_count()} CPU cores ({cpu}), "
        f"Python {platform.python_version()}, torch {torch.__version__}, grpcio "
        f"{__import__('grpc').__version__}; sender and receiver are separate processes on 127.0.0.1.",
        f"Command: `{command}`. {args.repeat} repetitions after one warm-up push; each repetition runs "
        "TCP, bare gRPC and the stream back to back (load from other jobs hits the three alike); "
        "GB/s are medians, ratios are medians of the per-repetition ratios (range in brackets). One "
        "gRPC channel per DiT, reused across pushes, as the AR keeps it.",
        "",
        "Throughput: every row available at once, first `put_rows` -> DiT acknowledgement (rows resident), "
        f"`chunk_rows={args.chunk_rows}`, vs the raw TCP ceiling (same bytes, one socket, measured by the "
        "same script). Bare gRPC: the same bytes in messages of the chunk size through the same grpcio "
        "server options with no codec and no checks (what grpcio itself costs here). Tail: rows produced by a thread at "
        f"{args.row_ms} ms/row in bursts of {args.burst} (the ~19 ms/token decode rate scaled down), "
        "last row produced -> conditions resident on the DiT; streamed vs request-end (same codec and "
        "sender, one message after the producer finished).",
        "",
        "| payload (bf16) | MiB | TCP ceiling GB/s | bare gRPC GB/s | bare gRPC / TCP | stream GB/s "
        "| stream / TCP | messages | production s | tail streamed ms | tail request-end ms "
        "| streamed / request-end |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['rows']} x {r['hidden']} | {r['mib']:.1f} | {r['tcp_gbps']:.2f} | {r['grpc_gbps']:.2f} "
            f"| {100 * r['grpc_ratio']:.0f}% | {r['stream_gbps']:.2f} "
            f"| {100 * r['throughput_ratio']:.0f}% ({100 * min(r['throughput_ratios']):.0f}-"
            f"{100 * max(r['throughput_ratios']):.0f}%) | {r['stream_chunks']} | {r['production_s']:.2f} "
            f"| {r['tail_stream_ms']:.1f} | {r['tail_request_end_ms']:.1f} | {r['tail_ratio']:.3f} |"
        )
    lines += [
        "",
        "CPU per push (sender + receiver process CPU time, mean of the repetitions; the cores are shared, "
        "so these add up even when wall times overlap):",
        "",
        "| payload (bf16) | TCP ms | bare gRPC ms | stream ms |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        c = r["cpu_ms"]
        lines.append(f"| {r['rows']} x {r['hidden']} | {c['tcp']:.0f} | {c['bare']:.0f} | {c['stream']:.0f} |")
    ok_tp = all(r["throughput_ratio"] >= 0.5 for r in results)
    ok_tail = all(r["tail_ratio"] <= 0.1 for r in results)
    lines += [
        "",
        f"Targets: throughput >= 50% of the TCP ceiling ({'met' if ok_tp else 'NOT met'}); "
        f"tail <= 1/10 of the request-end baseline ({'met' if ok_tail else 'NOT met'}).",
        "",
        "Reading: the tail is what streaming buys: when the last row is produced, all earlier chunks "
        "are already resident, so only the last chunk (<= `chunk_rows` rows) is left to move. "
        "Throughput is bounded by CPU on 2 shared cores (sender, receiver, the producer thread and "
        "other jobs on the host; single runs vary by 2x). Moving the bytes costs the TCP ceiling two "
        "kernel copies; bare gRPC adds its own copies and HTTP/2 framing and costs about twice the "
        "TCP CPU before anything is done with the bytes, so 50% of TCP means a stream as cheap as "
        "bare gRPC. The stream adds, per byte: the staging copy (the host side of the D2H copy), "
        "CRC-32C on both ends (hardware CRC via google-crc32c), one framing copy from staging into "
        "the message bytes (grpcio's Python API takes only `bytes`), and the receiver's copy into "
        "the slot (PushConditions messages arrive as raw bytes; the payload is sliced out without a "
        "copy, `chunk_stream.split_chunk`); plus per message ~0.15 ms of Python on each side. Per-process "
        "accounting of a 29 MiB push (separate run, 20 pushes each): bare gRPC costs the sender 35 "
        "ms and the receiver 18 ms of CPU; the stream 54-60 ms and 42-44 ms: ~45 ms more, on two "
        "cores that already run bare gRPC at full use. Tried, with the numbers unchanged: framing on "
        "a separate thread up to two messages ahead of the write (same wall time, ~8 ms more sender "
        "CPU per push for the hand-offs; removed), larger or smaller chunks (16-512 rows), HTTP/2 windows and frame sizes "
        "(`grpc.http2.lookahead_bytes`, `max_frame_size`, `write_buffer_size`, TCP read chunk "
        "sizes), glibc malloc thresholds (fresh mmaps of each message cost page faults in a "
        "micro-benchmark, not in the stream). The CPU table is the bound: with "
        "2 cores, a stream at 50% of the TCP ceiling must cost at most 4x the TCP wall time in CPU "
        "with perfect overlap, about what bare gRPC alone costs. Sustained rates "
        "well above the AR's production rate (~0.4 MB/s of rows per request at 19 ms/token, "
        "hidden 3584 bf16) are what the pipeline needs; the GPU machine numbers come from "
        "`benchmarks/gpu_transport_rules.py`.",
        "",
    ]
    return "\n".join(lines)


def write_docs(section: str) -> None:
    path = ROOT / "docs" / "PERFORMANCE.md"
    text = path.read_text() if path.exists() else "# Performance\n\n"
    head = "## Transport (CPU loopback)"
    if head in text:
        before, _, rest = text.partition(head)
        nxt = rest.find("\n## ")
        after = rest[nxt + 1 :] if nxt >= 0 else ""
        text = before + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--receiver", help=argparse.SUPPRESS)
    p.add_argument("--chunk-rows", type=int, default=64)
    p.add_argument("--row-ms", type=float, default=0.5, help="simulated production time per row")
    p.add_argument("--burst", type=int, default=32, help="rows per put_rows call")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--write-docs", action="store_true", help="write the table into docs/PERFORMANCE.md")
    args = p.parse_args()
    if args.receiver:
        asyncio.run(_receiver(args.receiver))
        return 0
    ready = pathlib.Path(f"/tmp/mammoth-transport-bench-{os.getpid()}.json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, os.environ.get("BENCH_RECEIVER", __file__), "--receiver", str(ready)], env=env)
    try:
        while not ready.exists():
            if proc.poll() is not None:
                raise SystemExit("receiver exited")
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        results = asyncio.run(measure(info, args))
    finally:
        proc.terminate()
        proc.wait()
        ready.unlink(missing_ok=True)
    command = "PYTHONPATH=. python benchmarks/transport.py " + " ".join(
        a for a in sys.argv[1:] if a != "--write-docs") + " --write-docs"
    section = table(results, args, command.replace("  ", " ").strip())
    print(section)
    if args.write_docs:
        write_docs(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
