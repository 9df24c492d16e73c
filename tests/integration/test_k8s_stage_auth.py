"""Stage RPCs refuse unauthenticated callers on Kubernetes by default (issue 15.4), through real processes.

There is no cluster here, so the test runs what a pod runs: the operator renders ``pipeline.yaml``
for the example ``mammothpipeline.yaml`` (no token settings in it: the defaults), the generated
stage-token Secret's files are laid out where the pod mounts them, and a real ``mammoth dit`` and
``mammoth ar`` start from exactly that configuration. A call without a token is refused
(UNAUTHENTICATED), one with the gateway's token is served, and the AR refuses a DiT outside the
headless Service it was configured with before doing any work.
"""

from __future__ import annotations

import pathlib
import secrets

import grpc
import pytest
import yaml

from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_operator import builders
from mammoth_operator.spec import parse_spec

from pipeline_harness import has_ipv6_loopback
from test_secure_defaults import dit_request, first_event, spawn_all, stop

ROOT = pathlib.Path(__file__).resolve().parents[2]


def rendered_config(tmp: pathlib.Path) -> tuple[pathlib.Path, dict[str, str]]:
    """The operator's ``pipeline.yaml`` for the example pipeline, with the pod's mount paths mapped
    into ``tmp`` and the generated Secret's tokens written where the pod would mount them."""
    manifest = yaml.safe_load((ROOT / "mammothpipeline.yaml").read_text())
    images = {c: f"example/{c}:test" for c in ("ar", "dit", "gateway")}
    spec = parse_spec(manifest["metadata"]["name"], "default", manifest["spec"], images=images)
    assert spec.transport.generated_role_tokens, "the example pipeline must get the generated token Secret by default"
    config = builders.pipeline_config(spec)
    tokens = {role: secrets.token_urlsafe(24) for role in ("gateway", "ar")}
    token_dir = tmp / "role-tokens"
    token_dir.mkdir()
    for role, token in tokens.items():
        (token_dir / role).write_text(token)
    text = yaml.safe_dump(config).replace(builders.ROLE_TOKENS_DIR, str(token_dir))
    rendered = yaml.safe_load(text)
    for key in ("cache_dir", "device", "dtype"):  # pod paths and GPU placement: the test's own
        rendered.pop(key, None)
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(rendered))
    return path, tokens


def pod_host(role: str, config: pathlib.Path) -> str:
    """The address a stage pod listens on: the image's ``MAMMOTH_HOST`` (``Dockerfile.<role>``; the
    environment beats the settings file), else the rendered ``pipeline.yaml``'s ``host``."""
    import re
    import shlex

    text = (ROOT / f"Dockerfile.{role}").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.strip().startswith("ENV "):
            for word in shlex.split(line.strip()[4:]):
                if (found := re.fullmatch(r"MAMMOTH_HOST=(.*)", word)) is not None:
                    return found.group(1)
    return yaml.safe_load(config.read_text())["host"]


@pytest.fixture(scope="module")
def k8s_stages(tiny_checkpoint, tmp_path_factory):
    """DiT and AR started from the rendered ``pipeline.yaml``, listening on the host their pods would
    (`pod_host`: the harness's ``--host 127.0.0.1`` overridden by it); dialled on 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("k8s-auth")
    config, tokens = rendered_config(tmp)
    stages = spawn_all(tiny_checkpoint, tmp, ("dit", "--config", str(config), "--host", pod_host("dit", config)),
                       ("ar", "--config", str(config), "--host", pod_host("ar", config)))
    try:
        (_, dit), (_, ar) = stages
        ports = {role: (int(info["address"].rsplit(":", 1)[1]), info["metrics_port"])
                 for role, info in (("dit", dit), ("ar", ar))}
        yield {"dit": f"127.0.0.1:{ports['dit'][0]}", "ar": f"127.0.0.1:{ports['ar'][0]}", "tokens": tokens,
               "ports": ports}
    finally:
        for proc, _ in stages:
            stop(proc)



@pytest.mark.skipif(not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
async def test_stage_pods_answer_on_ipv4_and_ipv6(k8s_stages):
    """A pod of an IPv6 (single-stack) cluster has only an IPv6 address: the stages must listen on it
    as well as on IPv4, their gRPC port (the kubelet's probes, the gateway, the AR's push) and their
    metrics port (Prometheus). The operator rendered ``host: 0.0.0.0``, IPv4 only: ``[::1]`` stands in
    for the pod's IPv6 address here, and was refused."""
    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for role, (port, metrics_port) in k8s_stages["ports"].items():
        for host in ("127.0.0.1", "[::1]"):
            async with grpc.aio.insecure_channel(f"{host}:{port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (role, host)
            async with httpx.AsyncClient(timeout=10) as client:
                metrics = await client.get(f"http://{host}:{metrics_port}/metrics")
                assert metrics.status_code == 200 and b"# HELP" in metrics.content, (role, host, metrics.status_code)


async def test_stage_rpcs_refuse_callers_without_the_generated_tokens(k8s_stages):
    dit, ar, tokens = k8s_stages["dit"], k8s_stages["ar"], k8s_stages["tokens"]
    async with grpc.aio.insecure_channel(dit) as ch:
        stub = pb_grpc.DiTStub(ch)
        call = stub.Generate(dit_request("anon"), timeout=10)
        code, _ = await first_event(call)
        call.cancel()
        assert code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PushConditions(iter([pb.HiddenStateChunk(reservation_token="t")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = stub.Generate(dit_request("gw"), timeout=10,
                             metadata=(("authorization", f"Bearer {tokens['gateway']}"),))
        code, first = await first_event(call)
        call.cancel()
        assert code == grpc.StatusCode.OK and first.WhichOneof("event") == "reserved"
    async with grpc.aio.insecure_channel(ar) as ch:
        stub = pb_grpc.ARStub(ch)
        request = pb.ARGenerateRequest(request_id="anon", prompt="x", width=32, height=32,
                                       dit_address=dit, reservation_token="t")
        code, _ = await first_event(stub.Generate(request, timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # Authenticated, but the DiT is not behind the configured headless Service: refused, no work.
        code, _ = await first_event(stub.Generate(request, timeout=10, metadata=(
            ("authorization", f"Bearer {tokens['gateway']}"),)))
        assert code == grpc.StatusCode.PERMISSION_DENIED
