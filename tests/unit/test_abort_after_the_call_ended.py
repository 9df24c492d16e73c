"""`mammoth_core.errors.abort` on a call that gRPC already ended (its deadline passed first): the
handler is told the call is over (``asyncio.CancelledError``), as when the client cancels, instead
of an internal grpcio error. Before, the DiT's own condition-wait timeout racing the client's
deadline raised ``ExecuteBatchError`` from ``context.abort``: the request was logged as "DiT
generation failed" with a traceback, counted as ``failed`` instead of ``deadline``, and a second
abort raised grpcio's ``UsageError`` (a fresh-clone CI run, 2026-12-03). Real grpc.aio server and
client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mammoth_core import errors

METHOD = "/test.Late/Call"


async def test_an_abort_after_the_deadline_ended_the_call_is_a_cancellation():
    seen: list[BaseException] = []

    async def late(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        time.sleep(0.6)  # busy past the 0.2 s deadline (as a loaded loop): gRPC has ended the call
        try:
            await errors.abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "too late",
                               stage=errors.Stage.DIT, reason=errors.Reason.DEADLINE)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            seen.append(exc)
            raise
        return b""

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Late", {"Call": grpc.unary_unary_rpc_method_handler(late)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(METHOD)(b"", timeout=0.2)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(50):
            if seen:
                break
            await asyncio.sleep(0.05)
    finally:
        await server.stop(0)
    assert seen and isinstance(seen[0], asyncio.CancelledError), [type(e).__name__ for e in seen]
