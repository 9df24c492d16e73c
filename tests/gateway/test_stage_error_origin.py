"""The gateway classifies a stage error by the origin the stage attached (`mammoth_core.errors`:
a ``google.rpc.Status`` detail naming the stage and the reason), never by the message text.

Against fake stages (real gRPC): an AR that refuses the request itself with a message that mentions
the DiT, and a DiT that refuses the first push with a message that does not mention itself (the
AR relays it with the DiT's origin).
"""

from __future__ import annotations

import httpx

GEN = "/v1/images/generations"
BODY = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 2, "seed": 11}


def _events(stage, kind: str) -> list[dict]:
    return [e for e in stage.events() if e["event"] == kind]


def test_the_ars_own_rejection_is_400_even_when_it_mentions_the_dit(fakes, gateway_factory):
    dit = fakes("dit")
    ar = fakes("ar", "--reject-request", "a 64x64 grid does not fit the DiT's slot rows")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    r = httpx.post(gw.url + GEN, json=BODY, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == ("the AR stage rejected the request: a 64x64 grid does not fit the "
                                "DiT's slot rows")
    assert len(_events(ar, "rejected")) == 1  # not retried: no other AR can accept it either


def test_a_push_the_dit_refused_is_retried_even_when_the_message_does_not_name_it(
        fakes, gateway_factory):
    dit = fakes("dit", "--reject-push-epochs", "1")
    ar = fakes("ar")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    r = httpx.post(gw.url + GEN, json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    assert [e["epoch"] for e in _events(dit, "push_rejected")] == [0]
    assert [e["epoch"] for e in _events(ar, "started")] == [0, 1]
