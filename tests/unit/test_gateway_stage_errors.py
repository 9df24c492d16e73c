"""The gateway's classification of stage errors and its retry rules, in process, branch by branch.

The errors are real ``grpc.aio.AioRpcError`` objects carrying the trailers the stages send
(`mammoth_core.errors.status_trailers`); one test sends them through a real gRPC server on
loopback, aborting with `mammoth_core.errors.abort` as the stages do.
"""

from __future__ import annotations

import grpc
import pytest

from gateway.errors import BackendError, DeadlineExceededError, InvalidRequestError
from gateway.health import HealthMonitor
from gateway.progress_watch import hung_error
from gateway.stage_errors import (MAX_AR_ATTEMPTS, MAX_DIT_ATTEMPTS, ARVerdict, StageFailure,
                                  after_ar_failure, after_dit_failure, check_ar_attempts, classify)
from mammoth_core import errors
from mammoth_core.errors import Origin, Reason, Stage

C = grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str, origin: Origin | None = None,
              trailers: tuple = ()) -> grpc.aio.AioRpcError:
    if origin is not None:
        trailers = trailers + errors.status_trailers(code, details, origin)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)


def classify_ar(exc):
    return classify(exc, "ar", "10.0.0.1:50051", "in the AR stage")


# ---------------------------------------------------------------- origin over message text

def test_the_ars_own_invalid_argument_is_400_even_when_its_message_names_the_dit():
    exc = rpc_error(C.INVALID_ARGUMENT, "the grid does not fit the DiT's slot",
                    Origin(Stage.AR, Reason.INVALID_REQUEST))
    verdict = classify_ar(exc)
    assert isinstance(verdict, InvalidRequestError)
    assert verdict.message == "the AR stage rejected the request: the grid does not fit the DiT's slot"


def test_an_invalid_argument_relayed_from_the_dit_is_retried_even_when_its_message_names_the_ar():
    exc = rpc_error(C.INVALID_ARGUMENT, "AR chunk 3: row_offset out of order",
                    Origin(Stage.DIT, Reason.CHUNK_REJECTED))
    verdict = classify_ar(exc)
    assert isinstance(verdict, StageFailure)
    assert (verdict.stage, verdict.code, verdict.origin) == ("ar", "INVALID_ARGUMENT",
                                                             Origin("dit", "CHUNK_REJECTED"))
    assert not (verdict.full or verdict.down or verdict.conditions_complete)


def test_an_invalid_argument_without_origin_is_the_called_stages_own():
    verdict = classify(rpc_error(C.INVALID_ARGUMENT, "bad size"), "dit", "d:1", "waiting")
    assert isinstance(verdict, InvalidRequestError)
    assert verdict.message == "the DiT stage rejected the image parameters: bad size"


def test_the_dits_refusal_of_its_conditions_is_retried_not_a_400():
    exc = rpc_error(C.INVALID_ARGUMENT, "no image rows", Origin(Stage.DIT, Reason.CONDITIONS_REJECTED))
    assert isinstance(classify(exc, "dit", "d:1", "in the DiT stage"), StageFailure)


# ---------------------------------------------------------------- every other branch

@pytest.mark.parametrize("origin", [None, Origin(Stage.AR, Reason.DEADLINE),
                                    Origin(Stage.DIT, Reason.DEADLINE)])
def test_a_deadline_from_anywhere_is_504_saying_where(origin):
    verdict = classify_ar(rpc_error(C.DEADLINE_EXCEEDED, "late", origin))
    assert isinstance(verdict, DeadlineExceededError)
    assert verdict.message == "the request's time budget ran out in the AR stage"


@pytest.mark.parametrize("code", [C.UNAUTHENTICATED, C.PERMISSION_DENIED, C.UNIMPLEMENTED])
def test_a_configuration_refusal_of_the_called_stage_is_502_at_once(code):
    verdict = classify_ar(rpc_error(code, "missing or invalid stage token"))
    assert isinstance(verdict, BackendError)
    assert verdict.message == (f"the AR at 10.0.0.1:50051 refused the call: {code.name} missing or "
                               "invalid stage token")


def test_a_configuration_refusal_relayed_from_the_dit_is_an_attempt_failure():
    exc = rpc_error(C.PERMISSION_DENIED, "the gateway token may not call PushConditions",
                    Origin(Stage.DIT, Reason.PUSH_FAILED))
    assert isinstance(classify_ar(exc), StageFailure)


def test_resource_exhausted_is_full_only_for_the_called_stage():
    own = classify_ar(rpc_error(C.RESOURCE_EXHAUSTED, "engine full", Origin(Stage.AR, Reason.FULL)))
    relayed = classify_ar(rpc_error(C.RESOURCE_EXHAUSTED, "message too large",
                                    Origin(Stage.DIT, Reason.PUSH_FAILED)))
    assert own.full and not own.down
    assert not relayed.full


def test_unavailable_marks_the_replica_down_only_when_it_is_its_own():
    own = classify_ar(rpc_error(C.UNAVAILABLE, "draining", Origin(Stage.AR, Reason.DRAINING)))
    relayed = classify_ar(rpc_error(C.UNAVAILABLE, "connection refused",
                                    Origin(Stage.DIT, Reason.PUSH_FAILED)))
    assert own.down and not relayed.down


async def test_a_hung_backend_is_down():
    channel = grpc.aio.insecure_channel("127.0.0.1:9")  # never dialled: the monitor is not started
    health = HealthMonitor(channel, "mammoth.v1.DiT", 1.0, 1.0, lambda: None, "dit backend d:1")
    try:
        verdict = classify(hung_error(health), "dit", "d:1", "in the DiT stage")
    finally:
        await channel.close()
    assert isinstance(verdict, StageFailure) and verdict.down


def test_conditions_complete_is_read_from_the_relayed_origin():
    exc = rpc_error(C.FAILED_PRECONDITION, "push failed: conditions already complete",
                    Origin(Stage.DIT, Reason.CONDITIONS_COMPLETE))
    verdict = classify_ar(exc)
    assert isinstance(verdict, StageFailure) and verdict.conditions_complete
    plain = classify_ar(rpc_error(C.FAILED_PRECONDITION, "conditions already complete"))
    assert not plain.conditions_complete  # the text alone means nothing


def test_a_foreign_or_malformed_status_detail_is_no_origin():
    from google.rpc import error_details_pb2, status_pb2

    foreign = status_pb2.Status(code=3, message="x")
    foreign.details.add().Pack(error_details_pb2.ErrorInfo(reason="INVALID_REQUEST",
                                                           domain="example.com",
                                                           metadata={"stage": "dit"}))
    for trailers in (((errors.STATUS_DETAILS_KEY, foreign.SerializeToString()),),
                     ((errors.STATUS_DETAILS_KEY, b"\xff\x00not a status"),)):
        exc = rpc_error(C.INVALID_ARGUMENT, "x", trailers=trailers)
        assert errors.origin_of(exc) is None
        assert isinstance(classify_ar(exc), InvalidRequestError)  # the called stage's own


# ---------------------------------------------------------------- retry rules

def failure(reason: str = "", stage: str = "ar") -> StageFailure:
    return StageFailure("ar", "ABORTED", "x", "a:1", Origin(stage, reason))


def test_after_an_ar_failure():
    refused = failure(Reason.CONDITIONS_COMPLETE, "dit")
    assert after_ar_failure(refused, False, False) is ARVerdict.CONDITIONS_COMPLETE
    assert after_ar_failure(refused, True, True) is ARVerdict.CONDITIONS_COMPLETE
    assert after_ar_failure(failure(), True, False) is ARVerdict.NOT_NEEDED
    assert after_ar_failure(failure(), False, True) is ARVerdict.NOT_NEEDED
    assert after_ar_failure(failure(Reason.PUSH_FAILED, "dit"), False, False) is ARVerdict.RETRY


def test_ar_attempts_per_slot_are_bounded():
    for attempts in range(MAX_AR_ATTEMPTS):
        check_ar_attempts(attempts)
    with pytest.raises(BackendError, match=f"the AR stage failed {MAX_AR_ATTEMPTS} times"):
        check_ar_attempts(MAX_AR_ATTEMPTS)


def test_dit_attempts_per_image_are_bounded():
    f = StageFailure("dit", "INTERNAL", "DiT generation failed", "d:1")
    for attempt in range(1, MAX_DIT_ATTEMPTS):
        assert after_dit_failure(f, attempt) is None
    give_up = after_dit_failure(f, MAX_DIT_ATTEMPTS)
    assert isinstance(give_up, BackendError)
    assert give_up.message == (f"the DiT stage failed {MAX_DIT_ATTEMPTS} times: dit d:1: INTERNAL: "
                               "DiT generation failed")


# ---------------------------------------------------------------- over a real gRPC call

async def test_the_origin_survives_a_real_grpc_abort():
    async def handler(request, context):
        await errors.abort(context, C.FAILED_PRECONDITION, "conditions already complete",
                           stage=Stage.DIT, reason=Reason.CONDITIONS_COMPLETE)

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Call": grpc.unary_unary_rpc_method_handler(handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/test.Echo/Call")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(b"", timeout=10)
        assert info.value.code() == C.FAILED_PRECONDITION
        assert info.value.details() == "conditions already complete"
        assert errors.origin_of(info.value) == Origin("dit", "CONDITIONS_COMPLETE")
    finally:
        await server.stop(None)
