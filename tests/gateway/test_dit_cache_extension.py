"""The ``dit_cache`` extension: validated by the gateway (400 naming ``dit_cache``) and carried to the
DiT as ``ImageParams.dit_cache`` (observed by a fake DiT stage); absent means off (field unset)."""

from __future__ import annotations

import httpx
import openai
import pytest

GEN = "/v1/images/generations"


@pytest.mark.parametrize("value", [{"threshold": 1.5}, {"threshold": -0.1}, {"threshold": 0.1, "warmup_steps": -1},
                                   {"threshold": 0.1, "extra": 1}, {"threshold": 0.1, "warmup_steps": 9},
                                   "fast"])
def test_bad_dit_cache_is_400_naming_it(gateway_factory, value):
    gw = gateway_factory()
    r = httpx.post(gw.url + GEN, json={"prompt": "p", "size": "32x32", "num_inference_steps": 4,
                                       "dit_cache": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("dit_cache"), r.json()


def test_dit_cache_reaches_the_dit(fakes, gateway_factory):
    dit, ar = fakes("dit"), fakes("ar")
    gw = gateway_factory(ar=[ar.address], dit=[dit.address])
    gw.wait_ready()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    client.images.generate(prompt="p", size="32x32", extra_body={"dit_cache": {"threshold": 0.25, "warmup_steps": 3}})
    client.images.generate(prompt="p", size="32x32")
    reserved = [e["dit_cache"] for e in dit.events() if e["event"] == "reserved"]
    assert reserved == [[0.25, 3], None]
