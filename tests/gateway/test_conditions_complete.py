"""Issue 15.1, the gateway's half: the DiT's ``ConditionsComplete`` event ends AR retries.

Against fake stages (real gRPC): an AR that fails right after the DiT acknowledged its push (what
the push-ack race looked like from the gateway), with the DiT's first denoising progress late.
"""

from __future__ import annotations

import httpx

GEN = "/v1/images/generations"
BODY = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 11}


def _started(ar) -> list[dict]:
    return [e for e in ar.events() if e["event"] == "started"]


def test_no_ar_retry_after_conditions_complete(fakes, gateway_factory):
    # first DENOISING progress 0.5 s after the conditions: only the explicit event can tell the
    # gateway in time that the AR's failure does not matter
    dit = fakes("dit", "--step-delay", "0.5")
    ar = fakes("ar", "--fail-after-push")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    before = gw.metric("mammoth_gateway_retries_total", stage="ar")
    r = httpx.post(gw.url + GEN, json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    assert len(_started(ar)) == 1, _started(ar)
    assert gw.metric("mammoth_gateway_retries_total", stage="ar") == before


#: What grpc's asyncio client reports in place of the server's status when the server ends a
#: client-streaming call before the client half-closed and a write of the client's was still queued
#: (grpc/grpc#36066, upstream fix proposed in grpc/grpc#43486): the DiT's CONDITIONS_COMPLETE refusal,
#: and its origin metadata, lost. About 1 in 200 such refusals on an idle loopback (grpcio 1.85),
#: more under load.
LOST_STATUS = "Internal error from Core"


def test_conditions_already_complete_refusal_is_not_an_ar_failure(fakes, gateway_factory, caplog):
    # the event comes 1 s late, so the gateway does retry the failed AR once; the DiT refuses that
    # push (CONDITIONS_COMPLETE): the request must finish, not burn its AR attempts into a 502
    caplog.set_level("WARNING", logger="gateway.engine_client")
    dit = fakes("dit", "--step-delay", "0.01", "--complete-event-delay", "1.0")
    ar = fakes("ar", "--fail-after-push")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    before = gw.metric("mammoth_gateway_retries_total", stage="ar")
    r = httpx.post(gw.url + GEN, json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    epochs = [e["epoch"] for e in _started(ar)]
    # [0, 1]: epoch 0 fails after its push, its retry's push is refused. The fault this guards: every
    # refused push counted as an AR failure, attempts until "the AR stage failed 4 times" (502). A
    # further attempt is allowed only where the refusal reached the fake AR as grpc's lost status
    # (`LOST_STATUS`: seen on a loaded 2-core host, [0, 1, 2] on 2026-12-01, [0, 1, 2, 3] on 2026-12-07).
    lost = sum(LOST_STATUS in r.getMessage() for r in caplog.records)
    assert epochs == list(range(len(epochs))) and 2 <= len(epochs) <= 2 + lost, (epochs, lost)
    # one retry per real failure (every attempt but the last); the refused push counted nothing
    assert gw.metric("mammoth_gateway_retries_total", stage="ar") == before + len(epochs) - 1
