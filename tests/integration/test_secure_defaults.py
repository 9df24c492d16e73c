"""Secure by default, through real processes (issue 15.4).

- A stage started with no token configuration refuses every stage RPC (UNAUTHENTICATED) unless it
  was started with ``--insecure-no-auth true``; health stays open.
- ``mammoth up`` (`mammoth_app.local.start_pipeline`) generates per-role tokens for every run.
- The AR dials only the DiT addresses it was configured to reach (``dit_allow_list``): any other
  ``dit_address`` is refused before any work, no connection is opened to it.
- A DiT reservation lives no longer than its caller's deadline; a call without one is refused.
- The DiT profiler endpoint on the metrics port is behind the same tokens.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import socket
import stat
import subprocess
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pipeline_harness import launch_stage, wait_all

from mammoth_core import grpc_common
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 64 << 20
AUTH_ENV = ("MAMMOTH_AUTH_TOKEN_FILE", "MAMMOTH_GATEWAY_TOKEN_FILE", "MAMMOTH_AR_TOKEN_FILE",
            "MAMMOTH_INSECURE_NO_AUTH", "MAMMOTH_DIT_ALLOW_LIST")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in AUTH_ENV}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def spawn_all(checkpoint: pathlib.Path, tmp: pathlib.Path,
              *specs: tuple[str, ...]) -> list[tuple[subprocess.Popen, dict]]:
    """Start one stage per ``(role, *args)`` without any token configuration, all at once
    (`pipeline_harness.launch_stage`); ``(process, ready-file JSON)`` each once all serve."""
    launched = [launch_stage(role, checkpoint, tmp, *args, env=clean_env()) for role, *args in specs]
    return list(zip((one.proc for one in launched), wait_all(launched)))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def dit_request(request_id: str) -> pb.DiTGenerateRequest:
    return pb.DiTGenerateRequest(request_id=request_id, params=pb.ImageParams(
        width=32, height=32, num_inference_steps=1, text_guidance_scale=1.0, cfg_range_end=1.0,
        output_format="png"))


async def first_event(call) -> tuple[grpc.StatusCode, pb.DiTGenerateResponse | None]:
    """The call's first message (OK) or its error code."""
    try:
        return grpc.StatusCode.OK, await call.read()
    except grpc.aio.AioRpcError as exc:
        return exc.code(), None


@pytest.fixture(scope="module")
def bare_stages(tiny_checkpoint, tmp_path_factory):
    """A DiT and an AR started without any token configuration, and a DiT with the opt-out."""
    from mammoth_app.local import free_port

    tmp = tmp_path_factory.mktemp("bare")
    dit_address = f"127.0.0.1:{free_port()}"  # chosen up front: the AR starts alongside the DiT
    stages = spawn_all(tiny_checkpoint, tmp, ("dit", "--port", dit_address.rsplit(":", 1)[1]),
                       ("ar", "--dit-allow-list", dit_address), ("dit", "--insecure-no-auth", "true"))
    try:
        yield dict(zip(("dit", "ar", "open_dit"), (info for _, info in stages)))
    finally:
        for proc, _ in stages:
            stop(proc)


async def test_stage_without_tokens_refuses_every_stage_rpc(bare_stages):
    dit, ar = bare_stages["dit"]["address"], bare_stages["ar"]["address"]
    async with grpc.aio.insecure_channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call = stub.Generate(dit_request("anon"), timeout=10)
        code, _ = await first_event(call)
        call.cancel()
        assert code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PushConditions(iter([pb.HiddenStateChunk(reservation_token="t")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "insecure-no-auth" in err.value.details()  # the message says what to configure
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes carry no token
    async with grpc.aio.insecure_channel(ar) as ch:
        call = pb_grpc.ARStub(ch).Generate(pb.ARGenerateRequest(
            request_id="anon", prompt="x", width=32, height=32, dit_address=dit,
            reservation_token="t"), timeout=10)
        code, _ = await first_event(call)
        assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_insecure_opt_out_serves_without_a_token(bare_stages):
    async with grpc.aio.insecure_channel(bare_stages["open_dit"]["address"]) as ch:
        call = pb_grpc.DiTStub(ch).Generate(dit_request("open"), timeout=10)
        code, first = await first_event(call)
        call.cancel()
        assert code == grpc.StatusCode.OK and first.WhichOneof("event") == "reserved"


# -- mammoth up ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def up(pipeline):
    """The session's pipeline: `start_pipeline` as ``mammoth up`` runs it, with no token configured
    by the caller (`pipeline_harness.start_local_pipeline`), so the tokens are the generated ones."""
    assert not any(k in os.environ for k in AUTH_ENV), "the session's pipeline was started with tokens"
    tokens = {role: (pipeline.workdir / "tokens" / f"{role}.token") for role in ("gateway", "ar")}
    return pipeline.components, tokens


def test_mammoth_up_generates_per_role_tokens(up):
    components, tokens = up
    values = {}
    for role, path in tokens.items():
        assert path.is_file(), f"no {role} token generated"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        values[role] = path.read_text().strip()
        assert len(values[role]) >= 32
    assert values["gateway"] != values["ar"]
    r = httpx.post(f"http://{components['gateway'].address}/v1/images/generations", timeout=120,
                   json={"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 1, "seed": 1})
    assert r.status_code == 200, r.text


async def test_mammoth_up_stages_refuse_calls_without_the_token(up):
    components, tokens = up
    gateway_token = tokens["gateway"].read_text().strip()
    async with grpc.aio.insecure_channel(components["dit"].address) as ch:
        stub = pb_grpc.DiTStub(ch)
        code, _ = await first_event(stub.Generate(dit_request("up-anon"), timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        call = stub.Generate(dit_request("up-gw"), timeout=10, metadata=grpc_common.auth_metadata(gateway_token))
        code, first = await first_event(call)
        call.cancel()
        assert code == grpc.StatusCode.OK and first.WhichOneof("event") == "reserved"


class Listener:
    """A TCP listener on loopback that counts the connections it accepts."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()


async def test_ar_dials_only_dit_addresses_it_is_configured_to_reach(up):
    components, tokens = up
    gateway_token = tokens["gateway"].read_text().strip()
    target = Listener()  # stands in for an internal service an attacker wants the AR to reach
    try:
        async with grpc.aio.insecure_channel(components["ar"].address) as ch:
            stub = pb_grpc.ARStub(ch)
            for address in (target.address, "169.254.169.254:80", "dns:///example.invalid:80"):
                t0 = time.monotonic()
                call = stub.Generate(pb.ARGenerateRequest(
                    request_id="ssrf", prompt="x", width=32, height=32, dit_address=address,
                    reservation_token="t"), timeout=10,
                    metadata=grpc_common.auth_metadata(gateway_token))
                code, _ = await first_event(call)
                assert code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT), code
                assert time.monotonic() - t0 < 2.0
        await asyncio.sleep(0.5)
        assert target.accepted == 0, "the AR connected to an address it was not configured to reach"
    finally:
        target.close()


async def test_reservation_lives_no_longer_than_the_callers_deadline(up):
    components, tokens = up
    gateway_token = tokens["gateway"].read_text().strip()
    md = grpc_common.auth_metadata(gateway_token)
    async with grpc.aio.insecure_channel(components["dit"].address) as ch:
        stub = pb_grpc.DiTStub(ch)
        # no deadline at all: refused before a slot is taken
        code, _ = await first_event(stub.Generate(dit_request("bare"), metadata=md))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # both slots held by calls whose deadline is 1.5 s: free again soon after it
        calls = [stub.Generate(dit_request(f"hold-{i}"), timeout=1.5, metadata=md) for i in range(2)]
        for call in calls:
            code, first = await first_event(call)
            assert code == grpc.StatusCode.OK and first.WhichOneof("event") == "reserved"
        t0 = time.monotonic()
        call = None
        while time.monotonic() - t0 < 10:
            call = stub.Generate(dit_request("after"), timeout=5, metadata=md)
            code, first = await first_event(call)
            if code == grpc.StatusCode.OK:
                break
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            await asyncio.sleep(0.1)
        call.cancel()
        assert code == grpc.StatusCode.OK
        assert time.monotonic() - t0 < 4.0, "slots outlived their callers' deadlines"


def test_profiler_control_needs_the_stage_token(up):
    components, tokens = up
    url = f"http://127.0.0.1:{components['dit'].info['metrics_port']}/debug/profile"
    assert httpx.post(url, params={"requests": 1}, timeout=10).status_code == 401
    assert httpx.get(url, timeout=10).status_code == 401
    ar_token = tokens["ar"].read_text().strip()
    r = httpx.post(url, params={"requests": 1}, timeout=10, headers={"authorization": f"Bearer {ar_token}"})
    assert r.status_code == 403
    gateway_token = tokens["gateway"].read_text().strip()
    headers = {"authorization": f"Bearer {gateway_token}"}
    r = httpx.post(url, params={"requests": 0}, timeout=10, headers=headers)
    assert r.status_code == 200 and r.json()["armed"] == 0
