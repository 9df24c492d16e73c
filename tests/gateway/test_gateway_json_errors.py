"""Bodies that are not JSON, or JSON not sent as JSON: the 400 says where and what to do (#22)."""

from __future__ import annotations

import httpx
import pytest

GEN = "/v1/images/generations"


@pytest.fixture
def gw(gateway_factory):
    return gateway_factory()


def test_a_json_syntax_error_gives_its_position(gw):
    r = httpx.post(gw.url + GEN, content=b'{"prompt": "x",}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json"
    assert "at character 15" in err["message"] and "double quotes" in err["message"], err


@pytest.mark.parametrize("headers", [{"content-type": "application/x-www-form-urlencoded"}, {}],
                         ids=["curl-d-form-content-type", "no-content-type"])
def test_a_json_object_not_sent_as_json_is_told_to_add_the_header(gw, headers):
    r = httpx.post(gw.url + GEN, content=b'{"prompt": "a fox"}', headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json"
    assert "content-type: application/json" in err["message"] and "must be a JSON object" not in err["message"], err
