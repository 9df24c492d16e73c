"""Unknown request fields are accepted and logged, naming them (vLLM's ``__log_extra_fields__``):
a newer official client sending a field this gateway does not know still gets its image. Fields
known to be unsupported are still refused (test_gateway_validation)."""

from __future__ import annotations

import logging

import httpx

GEN = "/v1/images/generations"


def test_unknown_fields_are_accepted_and_logged_by_name(fakes, gateway_factory, caplog):
    dit = fakes("dit")
    ar = fakes("ar")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    caplog.set_level(logging.WARNING, logger="gateway")
    body = {"prompt": "a red fox", "size": "64x64", "seed": 3, "temperature": 0.5,
            "future_option": {"a": 1}}
    r = httpx.post(gw.url + GEN, json=body, timeout=60)
    assert r.status_code == 200, r.text
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING
                and "ignored" in rec.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'future_option'" in warnings[0] and "'temperature'" in warnings[0], warnings
