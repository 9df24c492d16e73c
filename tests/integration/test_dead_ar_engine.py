"""A real `mammoth ar` process whose decode loop dies (not a request's fault: the loop itself), next
to a real DiT: the request in flight fails with the reason DECODE_FAILED (not the push's abort that follows from it,
whichever the call hears of first), the AR's health turns NOT_SERVING for good,
and a new call is refused before any work with ``ENGINE_FAILED`` (the gateway's cue to use another
replica). The fault is injected from outside the code under test: a ``sitecustomize`` in the AR's
child process makes the loop's flush of a launched step raise, as a device fault there would.
The DiT's counterpart: `test_transport_rules.test_a_dead_engine_loop_fails_its_request_and_refuses_new_work`.
Also here (the same real-AR set-up): a request the AR must refuse at admission, before any work.
"""

from __future__ import annotations

import os
import pathlib
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2
from pipeline_harness import launch_stage, until_health, wait_all

from mammoth_core import errors, grpc_common
from mammoth_core.pb import mammoth_pb2 as pb
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc

#: The AR child's ``sitecustomize``: the decode loop fails once a launched step is collected, and the
#: failure reaches the call after its aborted push does (the order that made the reason PUSH_FAILED).
LOOP_FAULT = """
import stage_ar.engine

_flush = stage_ar.engine.DecodeEngine._flush

def _failing_flush(self):
    if self._pending is not None:
        raise RuntimeError("injected fault in the AR decode loop")
    return _flush(self)

stage_ar.engine.DecodeEngine._flush = _failing_flush

# The engine thread aborts a failed job's push, then reports the failure. Make the report late, as
# a descheduled engine thread would, so the call sees its push end first.
import time
import stage_ar.session

_on_done = stage_ar.session.ARSession._on_done

def _late_on_done(self, error, stats):
    if error is not None:
        time.sleep(0.5)
    _on_done(self, error, stats)

stage_ar.session.ARSession._on_done = _late_on_done
"""

PARAMS = pb.ImageParams(width=64, height=64, num_inference_steps=1, text_guidance_scale=1.0, cfg_range_end=1.0,
                        seed=3, output_format="png")


def ar_request(request_id: str, dit_address: str, token: str) -> pb.ARGenerateRequest:
    return pb.ARGenerateRequest(request_id=request_id, epoch=0, prompt="a red fox", width=64, height=64, seed=3,
                                dit_address=dit_address, reservation_token=token)


async def test_a_dead_ar_decode_loop_fails_its_request_and_refuses_new_work(tiny_checkpoint, tmp_path):
    from mammoth_app.local import free_port, generate_role_tokens

    tokens = generate_role_tokens(tmp_path)
    env = {**os.environ, **tokens}
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LOOP_FAULT)
    dit_address = f"127.0.0.1:{free_port()}"
    dit, ar = (launch_stage("dit", tiny_checkpoint, tmp_path, "--port", dit_address.rsplit(":", 1)[1], env=env),
               launch_stage("ar", tiny_checkpoint, tmp_path, "--dit-allow-list", dit_address, env=env,
                            first_on_path=hook))
    try:
        _, ar_info = wait_all([dit, ar])
        auth = grpc_common.auth_metadata(pathlib.Path(tokens["MAMMOTH_GATEWAY_TOKEN_FILE"]).read_text().strip())
        async with grpc.aio.insecure_channel(dit_address) as dit_ch, \
                grpc.aio.insecure_channel(ar_info["address"]) as ar_ch:
            ar_stub = pb_grpc.ARStub(ar_ch)
            await until_health(ar_ch, health_pb2.HealthCheckResponse.SERVING, ("", "mammoth.v1.AR"))
            dit_call = pb_grpc.DiTStub(dit_ch).Generate(pb.DiTGenerateRequest(request_id="doomed", params=PARAMS),
                                                         metadata=auth, timeout=60)
            reserved = (await dit_call.read()).reserved
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in ar_stub.Generate(ar_request("doomed", dit_address, reserved.reservation_token),
                                                metadata=auth, timeout=60):
                    pass
            assert errors.origin_of(failed.value) == errors.Origin(errors.Stage.AR, errors.Reason.DECODE_FAILED), (
                failed.value.code(), failed.value.details())
            dit_call.cancel()
            await until_health(ar_ch, health_pb2.HealthCheckResponse.NOT_SERVING, ("", "mammoth.v1.AR"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in ar_stub.Generate(ar_request("late", dit_address, "no-slot-needed"), metadata=auth,
                                                timeout=10):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
            assert errors.origin_of(refused.value) == errors.Origin(errors.Stage.AR, errors.Reason.ENGINE_FAILED)
    finally:
        for stage in (ar, dit):
            if stage.proc.poll() is None:
                stage.proc.send_signal(signal.SIGTERM)
        for stage in (ar, dit):
            try:
                stage.proc.wait(20)
            except Exception:  # noqa: BLE001 - a stage that does not stop is killed, and the test says so
                stage.proc.kill()
                stage.proc.wait()
                raise


async def test_a_negative_prompt_too_long_for_the_dit_is_refused_by_the_ar_before_any_work(tiny_checkpoint,
                                                                                          tmp_path):
    """A negative prompt's raw AR rows are the DiT's unconditional condition, bounded by the DiT's
    rotary table (``gen_dit_config.axes_lens[0] - 1`` rows). Found by a break-it pass: the gateway
    admitted such prompts, the AR decoded the whole image, and only the DiT's forward failed
    (INTERNAL, then three full re-runs). The AR now refuses it at admission: INVALID_ARGUMENT with
    reason INVALID_REQUEST (the gateway's 400), before it contacts the DiT. The checkpoint here is the
    tiny one with a short table (64 caption positions) so a short negative prompt crosses it."""
    import json
    import shutil

    from mammoth_app.local import free_port, generate_role_tokens

    checkpoint = tmp_path / "short-rope"
    shutil.copytree(tiny_checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config["gen_dit_config"]["axes_lens"][0] = config["gen_axes_lens"][0] = 64
    (checkpoint / "config.json").write_text(json.dumps(config))
    tokens = generate_role_tokens(tmp_path)
    dit_address = f"127.0.0.1:{free_port()}"  # allowed, never started: the refusal must come first
    ar = launch_stage("ar", checkpoint, tmp_path, "--dit-allow-list", dit_address, env={**os.environ, **tokens})
    try:
        (ar_info,) = wait_all([ar])
        auth = grpc_common.auth_metadata(pathlib.Path(tokens["MAMMOTH_GATEWAY_TOKEN_FILE"]).read_text().strip())
        async with grpc.aio.insecure_channel(ar_info["address"]) as ch:
            stub = pb_grpc.ARStub(ch)
            request = ar_request("long-negative", dit_address, "a-reservation")
            request.negative_prompt = " ".join(["blurry"] * 80)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(request, metadata=auth, timeout=30):
                    pass
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert "shorten negative_prompt" in refused.value.details() and "at most 63" in refused.value.details()
            assert errors.origin_of(refused.value) == errors.Origin(errors.Stage.AR, errors.Reason.INVALID_REQUEST)
            assert errors.field_of(refused.value) == "negative_prompt"  # the gateway's 400 names it
            request.negative_prompt = "blurry"  # a short one passes admission (and then finds no DiT)
            with pytest.raises(grpc.aio.AioRpcError) as later:
                async for _ in stub.Generate(request, metadata=auth, timeout=30):
                    pass
            assert errors.origin_of(later.value) != errors.Origin(errors.Stage.AR, errors.Reason.INVALID_REQUEST)
    finally:
        ar.proc.send_signal(signal.SIGTERM)
        try:
            ar.proc.wait(20)
        except Exception:  # noqa: BLE001
            ar.proc.kill()
            ar.proc.wait()
            raise
