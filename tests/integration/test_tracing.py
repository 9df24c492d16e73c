"""Tracing and request-id logging across real processes (gateway, AR, DiT on loopback).

One pipeline runs with ``--trace-export jsonl:<file>`` (one file per component, spans written as
they end) and ``--log-format json`` (the components' stderr goes to one file). After one request
with two images, the spans of the three processes form one trace with the documented parent links
(`mammoth_core.tracing`), and the JSON log lines about the request carry its id: the gateway's id,
``<id>-<image index>`` on the DiT, ``<id>-<image index>/<epoch>`` on the AR. Images are identical
to those of a pipeline without tracing.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import re
import time

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the 'tracing' extra is not installed")

COMPONENTS = ("gateway", "ar", "dit")
BODY = {"prompt": "a lighthouse", "size": "64x64", "n": 2, "seed": 11, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def traced(tiny_checkpoint, tmp_path_factory):
    """A pipeline exporting spans to ``<tmp>/<component>.spans.jsonl``, logging JSON to
    ``<tmp>/components.log``."""
    from mammoth_app.local import start_pipeline, stop_pipeline

    tmp = tmp_path_factory.mktemp("traced")
    spans = {c: tmp / f"{c}.spans.jsonl" for c in COMPONENTS}
    flags = {c: ["--trace-export", f"jsonl:{spans[c]}", "--log-format", "json"] for c in COMPONENTS}
    log = tmp / "components.log"
    # the components inherit stderr: point fd 2 at the log file while they are spawned
    with log.open("w") as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            components = start_pipeline(
                checkpoint=str(tiny_checkpoint), gateway_port=0, workdir=tmp, log_level="info",
                extra_env={"MAMMOTH_CACHE_DIR": str(tmp / "cache")}, ready_timeout=120,
                ar_args=flags["ar"], dit_args=flags["dit"], gateway_args=flags["gateway"])
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    try:
        yield Traced(f"http://{components[-1].address}"), spans, log
    finally:
        stop_pipeline(components)


class Traced:
    """Where the traced pipeline's gateway listens (``url``, as `RunningPipeline.url`)."""

    def __init__(self, url: str) -> None:
        self.url = url


def read_spans(spans: dict[str, pathlib.Path]) -> list[dict]:
    out = []
    for path in spans.values():
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def wait_for_trace(spans: dict[str, pathlib.Path], request_id: str, count: int) -> list[dict]:
    """The spans of the trace whose HTTP span carries ``request_id``, once ``count`` arrived."""
    deadline = time.monotonic() + 30  # spans are written as they end; CI machines are slow
    found: list[dict] = []
    while time.monotonic() < deadline:
        every = read_spans(spans)
        roots = [s for s in every if s["attributes"].get("mammoth.request_id") == request_id
                 and s["service"] == "mammoth-gateway"]
        if roots:
            found = [s for s in every if s["trace_id"] == roots[0]["trace_id"]]
            if len(found) >= count:
                return found
        time.sleep(0.1)
    raise AssertionError(f"{len(found)} of {count} spans of {request_id} arrived: "
                         f"{sorted((s['service'], s['name']) for s in found)}")


def one(spans: list[dict], **match) -> dict:
    hits = [s for s in spans if all(s.get(k) == v for k, v in match.items())]
    assert len(hits) == 1, (match, hits)
    return hits[0]


def children(spans: list[dict], parent: dict, **match) -> list[dict]:
    return [s for s in spans if s["parent_span_id"] == parent["span_id"]
            and all(s.get(k) == v for k, v in match.items())]


# per image: gateway.image, AR client, AR server, prefill, decode, push client, DiT push server,
# DiT Generate, receive, denoise, vae, encode
SPANS_PER_IMAGE = 12


def test_one_trace_spans_gateway_ar_and_dit_with_parent_links(traced):
    running, spans, _ = traced
    rid = "trace-test-1"
    r = httpx.post(running.url + "/v1/images/generations", json=BODY, timeout=120,
                   headers={"x-request-id": rid})
    assert r.status_code == 200, r.text
    trace = wait_for_trace(spans, rid, 1 + 2 * SPANS_PER_IMAGE)
    assert {s["service"] for s in trace} == {"mammoth-gateway", "mammoth-ar", "mammoth-dit"}

    http = one(trace, name="POST /v1/images/generations")
    assert http["parent_span_id"] is None and http["kind"] == "SERVER"
    assert http["attributes"]["http.response.status_code"] == 200
    images = children(trace, http, name="gateway.image")
    assert sorted(s["attributes"]["mammoth.image_index"] for s in images) == [0, 1]
    for image in images:
        index = image["attributes"]["mammoth.image_index"]
        # gateway -> DiT.Generate (parent: the image) with the model stages under it
        [dit] = children(trace, image, name="mammoth.v1.DiT/Generate", service="mammoth-dit")
        assert dit["kind"] == "SERVER" and dit["status"] == "UNSET"
        assert dit["attributes"]["mammoth.request_id"] == f"{rid}-{index}"
        stages = {s["name"]: s for s in children(trace, dit)}
        assert set(stages) == {"dit.receive", "dit.denoise", "dit.vae", "dit.encode"}
        assert stages["dit.receive"]["end_ns"] <= stages["dit.denoise"]["start_ns"] + 5_000_000
        assert stages["dit.denoise"]["end_ns"] <= stages["dit.vae"]["start_ns"]
        assert stages["dit.vae"]["end_ns"] <= stages["dit.encode"]["start_ns"]
        # gateway AR client span -> AR server span -> prefill, decode, push -> DiT push server
        [ar_client] = children(trace, image, name="mammoth.v1.AR/Generate", service="mammoth-gateway")
        assert ar_client["kind"] == "CLIENT" and ar_client["attributes"]["mammoth.epoch"] == 0
        [ar] = children(trace, ar_client, name="mammoth.v1.AR/Generate", service="mammoth-ar")
        assert ar["kind"] == "SERVER" and ar["attributes"]["mammoth.request_id"] == f"{rid}-{index}"
        [prefill] = children(trace, ar, name="ar.prefill")
        [decode] = children(trace, ar, name="ar.decode")
        assert prefill["end_ns"] == decode["start_ns"] and decode["end_ns"] <= ar["end_ns"]
        assert decode["attributes"]["mammoth.generated_tokens"] == 4 * (4 + 1)
        [push] = children(trace, ar, name="mammoth.v1.DiT/PushConditions", service="mammoth-ar")
        [received] = children(trace, push, name="mammoth.v1.DiT/PushConditions", service="mammoth-dit")
        assert push["kind"] == "CLIENT" and received["kind"] == "SERVER"
        assert received["attributes"]["mammoth.request_id"] == f"{rid}-{index}"
        # the stage calls start inside the gateway's image span (wall clocks of one machine; their
        # servers' spans end when the gateway closes the streams, which may be just after it)
        for s in (dit, ar_client, ar):
            assert image["start_ns"] <= s["start_ns"] <= image["end_ns"]
        assert decode["end_ns"] <= image["end_ns"] and stages["dit.encode"]["end_ns"] <= image["end_ns"]


def test_client_traceparent_is_continued(traced):
    running, spans, _ = traced
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(running.url + "/v1/images/generations", timeout=120,
                   json={**BODY, "n": 1}, headers={"x-request-id": "trace-test-2",
                                                  "traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert r.status_code == 200, r.text
    trace = wait_for_trace(spans, "trace-test-2", 1 + SPANS_PER_IMAGE)
    http = one(trace, name="POST /v1/images/generations")
    assert http["trace_id"] == trace_id and http["parent_span_id"] == parent_id


def request_lines(log: pathlib.Path, rid: str) -> list[dict]:
    """The JSON log lines whose request id starts with ``rid`` (lines that are not JSON: skipped,
    a library writing to stderr by itself)."""
    lines = []
    for text in log.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if str(line.get("request_id", "")).startswith(rid):
            lines.append(line)
    return lines


def wait_for_log_lines(log: pathlib.Path, rid: str, timeout: float = 10.0) -> list[dict]:
    """`request_lines` once the last lines of ``rid`` arrived: both images' ``image done`` (DiT)
    and ``done:`` (AR) lines, which the stages log after their last message (or as they are at
    ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        mine = request_lines(log, rid)
        done = [line for line in mine if (line["component"] == "dit" and line["msg"].startswith("image done"))
                or (line["component"] == "ar" and line["msg"].startswith("done:"))]
        if len(done) >= 4 or time.monotonic() > deadline:
            return mine
        time.sleep(0.05)


def test_json_log_lines_carry_the_request_id_in_every_component(traced):
    running, _, log = traced
    rid = "log-test-1"
    r = httpx.post(running.url + "/v1/images/generations", json=BODY, timeout=120,
                   headers={"x-request-id": rid})
    assert r.status_code == 200, r.text
    mine = wait_for_log_lines(log, rid)
    by_component = {c: [line for line in mine if line["component"] == c] for c in COMPONENTS}
    assert all(line["request_id"] == rid for line in by_component["gateway"])
    assert any(line["msg"].startswith(f"request {rid}:") for line in by_component["gateway"])
    dit_ids = sorted(line["request_id"] for line in by_component["dit"]
                     if line["msg"].startswith("image done"))
    assert dit_ids == [f"{rid}-0", f"{rid}-1"]
    ar_ids = sorted(line["request_id"] for line in by_component["ar"] if line["msg"].startswith("done:"))
    assert ar_ids == [f"{rid}-0/0", f"{rid}-1/0"]
    assert all(re.fullmatch(rf"{rid}(-\d+(/\d+)?)?", line["request_id"]) for line in mine)


def test_images_are_identical_with_tracing_off(traced, pipeline):
    """Tracing adds spans, never changes an image (``pipeline``: the shared untraced one)."""
    traced_running, _, _ = traced
    images = []
    for running in (traced_running, pipeline):
        r = httpx.post(running.url + "/v1/images/generations", json=BODY, timeout=120)
        assert r.status_code == 200, r.text
        images.append([base64.b64decode(d["b64_json"]) for d in r.json()["data"]])
    assert images[0] == images[1]
