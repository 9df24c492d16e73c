"""Stage-to-stage security through real processes: per-role tokens and mutual TLS.

One local pipeline (``mammoth dit``, ``mammoth ar``, ``mammoth gateway`` on loopback) runs with a
gateway token, an AR token and mutual TLS (a throw-away CA made with the ``openssl`` CLI). The test
checks that a request goes through, then plays an intruder against the stages: no token, a token of
the wrong role for the RPC, a plaintext client, a TLS client without a client certificate.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import subprocess

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mammoth_core import grpc_common
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc

GATEWAY_TOKEN = "gw-token-7f3a"
AR_TOKEN = "ar-token-91c2"
SERVER_NAME = "mammoth-stage.test"
LIMIT = 64 << 20

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def make_pki(d: pathlib.Path) -> dict[str, pathlib.Path]:
    """A CA and one leaf certificate (server and client usage) for ``SERVER_NAME``."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=mammoth-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "leaf.key", "-out", "leaf.csr",
        "-subj", f"/CN={SERVER_NAME}")
    (d / "ext.cnf").write_text(
        f"subjectAltName=DNS:{SERVER_NAME}\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "leaf.pem", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": d / "ca.pem", "cert": d / "leaf.pem", "key": d / "leaf.key"}


class SecurePipeline:
    def __init__(self, components: dict, pki: dict):
        self.components, self.pki = components, pki
        self.url = f"http://{components['gateway'].address}"


@pytest.fixture(scope="module")
def secure_pipeline(tiny_checkpoint, tmp_path_factory):
    from mammoth_app.local import start_pipeline, stop_pipeline

    tmp = tmp_path_factory.mktemp("secure")
    pki = make_pki(tmp)
    (tmp / "gateway.token").write_text(GATEWAY_TOKEN + "\n")
    (tmp / "ar.token").write_text(AR_TOKEN + "\n")
    env = {
        "MAMMOTH_GATEWAY_TOKEN_FILE": str(tmp / "gateway.token"),
        "MAMMOTH_AR_TOKEN_FILE": str(tmp / "ar.token"),
        "MAMMOTH_TLS_CERT_FILE": str(pki["cert"]),
        "MAMMOTH_TLS_KEY_FILE": str(pki["key"]),
        "MAMMOTH_TLS_CA_FILE": str(pki["ca"]),
        "MAMMOTH_TLS_SERVER_NAME": SERVER_NAME,
    }
    env["MAMMOTH_CACHE_DIR"] = str(tmp / "cache")
    components = start_pipeline(checkpoint=str(tiny_checkpoint), gateway_port=0, slots=2, extra_env=env,
                                workdir=tmp, log_level="warning", ready_timeout=120)
    running = SecurePipeline({c.name: c for c in components}, pki)
    yield running
    stop_pipeline(components)


def tls_channel(address: str, pki: dict, client_cert: bool = True) -> grpc.aio.Channel:
    creds = grpc_common.channel_credentials(
        str(pki["ca"]), str(pki["cert"]) if client_cert else None, str(pki["key"]) if client_cert else None)
    return grpc_common.create_channel(address, LIMIT, creds, SERVER_NAME)


def dit_request(request_id: str) -> pb.DiTGenerateRequest:
    return pb.DiTGenerateRequest(request_id=request_id, params=pb.ImageParams(
        width=32, height=32, num_inference_steps=1, text_guidance_scale=1.0, cfg_range_end=1.0,
        output_format="png"))


async def first_event_code(call) -> grpc.StatusCode:
    try:
        await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    finally:
        call.cancel()
    return grpc.StatusCode.OK


def test_request_succeeds_with_per_role_tokens_over_mutual_tls(secure_pipeline):
    r = httpx.post(f"{secure_pipeline.url}/v1/images/generations", timeout=120, json={
        "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["b64_json"]


async def test_dit_enforces_which_role_calls_which_rpc(secure_pipeline):
    dit = secure_pipeline.components["dit"].address
    async with tls_channel(dit, secure_pipeline.pki) as ch:
        stub = pb_grpc.DiTStub(ch)
        # the gateway's token reserves a slot ...
        call = stub.Generate(dit_request("sec-ok"), timeout=10,
                             metadata=grpc_common.auth_metadata(GATEWAY_TOKEN))
        first = await call.read()
        assert first.WhichOneof("event") == "reserved"
        token = first.reserved.reservation_token
        # ... but may not push conditions into it (only the AR role may)
        chunk = pb.HiddenStateChunk(reservation_token=token)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PushConditions(iter([chunk]), timeout=10,
                                      metadata=grpc_common.auth_metadata(GATEWAY_TOKEN))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        call.cancel()
        # the AR's token may not reserve slots
        code = await first_event_code(stub.Generate(
            dit_request("sec-ar"), timeout=10, metadata=grpc_common.auth_metadata(AR_TOKEN)))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # no token, or an unknown one: UNAUTHENTICATED, on both RPCs
        for md in ((), grpc_common.auth_metadata("guess"), (("authorization", "Basic Z3c="),)):
            code = await first_event_code(stub.Generate(dit_request("sec-anon"), timeout=10, metadata=md))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.PushConditions(iter([chunk]), timeout=10, metadata=md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health stays open (kubelet probes carry no token)
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="mammoth.v1.DiT"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_ar_accepts_only_the_gateway_role(secure_pipeline):
    ar = secure_pipeline.components["ar"].address
    request = pb.ARGenerateRequest(request_id="sec-ar", prompt="x", width=32, height=32,
                                   dit_address=secure_pipeline.components["dit"].address,
                                   reservation_token="t")
    async with tls_channel(ar, secure_pipeline.pki) as ch:
        stub = pb_grpc.ARStub(ch)
        for md, want in ((grpc_common.auth_metadata(AR_TOKEN), grpc.StatusCode.PERMISSION_DENIED),
                         ((), grpc.StatusCode.UNAUTHENTICATED)):
            code = await first_event_code(stub.Generate(request, timeout=10, metadata=md))
            assert code == want


async def test_stages_refuse_plaintext_and_clients_without_a_certificate(secure_pipeline):
    for name in ("ar", "dit"):
        address = secure_pipeline.components[name].address
        for ch in (grpc.aio.insecure_channel(address),
                   tls_channel(address, secure_pipeline.pki, client_cert=False)):
            async with ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=3)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        await asyncio.sleep(0)
