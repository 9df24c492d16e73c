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


def test_conditions_already_complete_refusal_is_not_an_ar_failure(fakes, gateway_factory):
    # the event comes 1 s late, so the gateway does retry the failed AR once; the DiT refuses that
    # push (CONDITIONS_COMPLETE): the request must finish, not burn its AR attempts into a 502
    dit = fakes("dit", "--step-delay", "0.01", "--complete-event-delay", "1.0")
    ar = fakes("ar", "--fail-after-push")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    before = gw.metric("mammoth_gateway_retries_total", stage="ar")
    r = httpx.post(gw.url + GEN, json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    epochs = [e["epoch"] for e in _started(ar)]
    # [0, 1]: epoch 0 fails after its push, its retry's push is refused. A third attempt, [0, 1, 2],
    # was seen once on a loaded 2-core host (CI with two workers, 2026-12-01; cause not established,
    # noted in docs/TESTING.md). The fault this guards: every refused push counted as an AR failure,
    # attempts until "the AR stage failed 4 times" (502).
    assert epochs in ([0, 1], [0, 1, 2]), epochs
    # one retry per real failure (every attempt but the last); the refused push counted nothing
    assert gw.metric("mammoth_gateway_retries_total", stage="ar") == before + len(epochs) - 1
