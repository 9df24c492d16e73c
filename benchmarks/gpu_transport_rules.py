"""The GPU-only transport rules, checked on a CUDA machine (they skip in CI).

Run from the source tree on the GPU machine:
    ``PYTHONPATH=. python benchmarks/gpu_transport_rules.py [--out DIR]``

The sender's framed messages are handed to the receiver in-process (parsed from their wire bytes,
as gRPC would deliver them), so only torch, grpcio, protobuf and prometheus_client are needed.

- D2H-ready (rule 4): rows produced by a long kernel on the decode stream are put right away; the
  decode thread does not wait, and the bytes that leave equal the finished rows bit for bit.
- H2D-complete (rule 5): after the final chunk's `Slot.finish`, the last H2D event has completed
  and the conditions on the device equal the source rows.
- In-flight buffers (rule 6): a slot released while its H2D copy is in flight returns to the pool
  only after the copy's event completed.
- Pageable fallback (rule 7): with the pinned pool exhausted, blocks are pageable, counted, exact.
- Bit-exactness (rule 8): all 65,536 bfloat16/float16 patterns through the CUDA path.
Prints one JSON object (also written to DIR/gpu_transport_rules.json with ``--out``); exits 1 if a
rule fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_core.pb import mammoth_pb2 as pb  # noqa: E402
from stage_ar.sender import HiddenStateSender  # noqa: E402
from stage_ar.staging import StagingPool  # noqa: E402
from stage_dit.receiver import SlotPool  # noqa: E402


async def transfer(hidden: torch.Tensor, ids: list[int], pool: SlotPool, *, staging=None, chunk_rows=64,
                   put_rows=None):
    """Sender (rows on any device) -> wire bytes -> receiver slot; returns (slot, sender, put_s)."""
    slot = await pool.reserve("gpu-rules")
    sender = HiddenStateSender(_NoChannel(), "gpu-rules", 0, slot.token, hidden.shape[1], hidden.dtype,
                               0, hidden.shape[0], 0, chunk_rows, 64 << 20, staging=staging)
    t0 = time.perf_counter()
    step = put_rows or hidden.shape[0]
    for i in range(0, hidden.shape[0], step):
        sender.put_rows(pb.CONDITION, hidden[i : i + step], ids[i : i + step])
    put_s = time.perf_counter() - t0
    sender.finish()
    async for raw in sender.framed_messages():
        result = slot.accept(pb.HiddenStateChunk.FromString(raw))
        if result.complete:
            await slot.finish()
    return slot, sender, put_s


class _NoChannel:
    """Placeholder target: the script feeds the receiver in-process instead of over gRPC."""

    def stream_unary(self, *args, **kwargs):
        return None


async def main(out: pathlib.Path | None) -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    dev = torch.device("cuda")
    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    ok = True

    # Rule 4: D2H-ready. A long kernel chain produces the rows on the decode stream.
    H, rows = 4096, 1824
    pool = SlotPool(2, 8192, H, torch.bfloat16, dev)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    x = a
    for _ in range(20):
        x = x @ a * 1e-2
    hidden = x[:rows, :H].contiguous()
    enqueue_s = time.perf_counter() - t0
    ids = list(range(rows))
    slot, sender, put_s = await transfer(hidden, ids, pool)
    torch.cuda.synchronize()
    kernel_s = time.perf_counter() - t0
    exact = torch.equal(slot.conditions().hidden.view(torch.int16), hidden.view(torch.int16))
    report["d2h_ready"] = {"put_ms": 1e3 * put_s, "enqueue_ms": 1e3 * enqueue_s, "total_ms": 1e3 * kernel_s,
                           "bit_exact": exact, "pinned_blocks": sender._staging.pinned}
    ok &= exact and sender._staging.pinned

    # Rule 5: H2D-complete.
    event = slot._last_event
    report["h2d_complete"] = {"event_done_at_finish": event is None or event.query(), "complete": slot.complete}
    ok &= report["h2d_complete"]["event_done_at_finish"] and slot.complete
    slot.release("completed")

    # Rule 6: a copy in flight delays the return of the slot's buffers.
    big = torch.randn(8000, H, device=dev).to(torch.bfloat16)
    slot2 = await pool.reserve("inflight")
    sender2 = HiddenStateSender(_NoChannel(), "inflight", 0, slot2.token, H, torch.bfloat16, 0, 8000, 0,
                                8000, 1 << 30)
    sender2.put_rows(pb.CONDITION, big, list(range(8000)))
    sender2.finish()
    async for raw in sender2.framed_messages():
        slot2.accept(pb.HiddenStateChunk.FromString(raw))
    in_flight = slot2._last_event is not None and not slot2._last_event.query()
    slot2.release("cancelled")
    held_while_in_flight = pool.in_use == 1 if in_flight else None
    for _ in range(1000):
        if pool.in_use == 0:
            break
        await asyncio.sleep(0.001)
    report["in_flight_release"] = {"copy_was_in_flight": in_flight, "held_until_copy_done": held_while_in_flight,
                                   "returned_after": pool.in_use == 0}
    ok &= pool.in_use == 0 and held_while_in_flight is not False

    # Rule 7: pinned pool exhausted -> pageable, counted, exact.
    tiny = StagingPool(64 * H * 2, blocks=1, pin=True)
    held = tiny.acquire()
    slot3, sender3, _ = await transfer(hidden, ids, pool, staging=tiny)
    tiny.release(held)
    exact3 = torch.equal(slot3.conditions().hidden.view(torch.int16), hidden.view(torch.int16))
    report["pageable_fallback"] = {"fallbacks": sender3.pageable_fallbacks, "bit_exact": exact3}
    ok &= sender3.pageable_fallbacks == (rows + 63) // 64 and exact3
    slot3.release("completed")

    # Rule 8: every 16-bit pattern through the CUDA path.
    for dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).reshape(-1, 256)
        p16 = SlotPool(1, 256, 256, dtype, dev)
        s16, _, _ = await transfer(bits.view(dtype).to(dev), list(range(256)), p16, put_rows=37)
        same = torch.equal(s16.conditions().hidden.view(torch.int16).cpu(), bits)
        report[f"bit_exact_{str(dtype).split('.')[-1]}"] = same
        ok &= same
        s16.release("completed")

    # Throughput of the device paths (staging D2H + codec + H2D), for reference.
    t0 = time.perf_counter()
    slot4, _, _ = await transfer(hidden, ids, pool)
    report["in_process_gbps"] = hidden.numel() * 2 / (time.perf_counter() - t0) / 1e9
    slot4.release("completed")

    report["ok"] = bool(ok)
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_transport_rules.json").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="GPU-only hidden-state transport rules")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.out)))
