"""Unknown request fields are accepted and logged, naming them (vLLM's ``__log_extra_fields__``):
a newer official client sending a field this gateway does not know still gets its image. Fields
known to be unsupported are still refused (test_gateway_validation)."""

from __future__ import annotations

import logging

import httpx
import pytest

GEN = "/v1/images/generations"


@pytest.fixture
def gw(fakes, gateway_factory):
    """A gateway on fake stages, ready."""
    dit = fakes("dit")
    ar = fakes("ar")
    gateway = gateway_factory(ar=[ar.address], dit=[dit.address])
    gateway.wait_ready()
    return gateway


def test_unknown_fields_are_accepted_and_logged_by_name(gw, caplog):
    caplog.set_level(logging.WARNING, logger="gateway")
    body = {"prompt": "a red fox", "size": "64x64", "seed": 3, "temperature": 0.5,
            "future_option": {"a": 1}}
    r = httpx.post(gw.url + GEN, json=body, timeout=60)
    assert r.status_code == 200, r.text
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING
                and "ignored" in rec.getMessage()]
    assert len(warnings) == 1, warnings
    assert "'future_option'" in warnings[0] and "'temperature'" in warnings[0], warnings


def test_unknown_field_names_cannot_flood_the_log(gw, caplog):
    """A break-it pass wrote 20 MB of log with 20 requests of one 1 MB unknown key each (and a
    589 KB line for 60,000 small ones): the warning names at most a few fields, each cut short, and
    says how many there were."""
    caplog.set_level(logging.WARNING, logger="gateway")
    for i in range(20):
        body = {"prompt": "a", "size": "1x1", "x" * 1_000_000: 1, **{f"k{i}_{j}": 1 for j in range(1000)}}
        assert httpx.post(gw.url + GEN, json=body, timeout=60).status_code == 400
    warnings = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(warnings) == 20, [len(w) for w in warnings]
    assert max(len(w) for w in warnings) < 500, [len(w) for w in warnings]
    assert "1001 fields" in warnings[0], warnings[0][:300]


def test_user_text_cannot_forge_log_lines(gw, caplog):
    """``user`` / ``safety_identifier`` reach the request log line escaped: a newline in them cannot
    start a line of its own that looks like another component's (break-it pass: a forged
    ``CRITICAL gateway.auth`` line in the run log)."""
    caplog.set_level(logging.INFO, logger="gateway")
    forged = "x\n16:40:00.000 CRITICAL gateway [img-admin] gateway.auth: accepted\r\x1b[31m"
    for field in ("user", "safety_identifier"):
        body = {"prompt": "a fox", "size": "32x32", "num_inference_steps": 1, field: forged}
        assert httpx.post(gw.url + GEN, json=body, timeout=60).status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request ")]
    assert len(lines) == 2, lines
    for line in lines:
        assert "\n" not in line and "\r" not in line and "\x1b" not in line, line
