"""Where a stage error came from: a ``google.rpc.Status`` detail on every stage abort.

A status code says *how* a call failed; a caller that must act on *where* and *why* (the gateway:
is this INVALID_ARGUMENT the client's fault, is this UNAVAILABLE the AR's or the DiT's behind it,
did the DiT refuse a push because the conditions are already complete) reads the `Origin` the
failing stage attached, never the message text. The stages abort with `abort`, which sends the
gRPC standard rich status: trailing metadata ``grpc-status-details-bin`` holding a serialized
``google.rpc.Status`` (code, message) whose details carry one ``google.rpc.ErrorInfo`` with
``domain`` `DOMAIN`, ``reason`` (a `Reason`) and ``metadata["stage"]`` (a `Stage`). The caller
reads it back with `origin_of`. A relay keeps the origin: the AR answering its own ``Generate``
after the DiT refused its push aborts with the DiT's origin (stage ``dit``), so the gateway sees
that the failure arose behind the AR.

Uses the ``google.rpc`` protos of ``googleapis-common-protos`` (what ``grpcio-status`` builds on).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from google.rpc import error_details_pb2, status_pb2

#: ``google.rpc.ErrorInfo.domain`` of every origin this project sends.
DOMAIN = "mammoth.dev"
#: The gRPC standard trailing-metadata key of the rich status (``-bin``: base64 on the wire).
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class Stage(enum.StrEnum):
    """The stage an error arose in (``ErrorInfo.metadata["stage"]``)."""

    AR = "ar"
    DIT = "dit"


class Reason(enum.StrEnum):
    """Why a stage refused or failed a call (``ErrorInfo.reason``, UPPER_SNAKE_CASE)."""

    #: The request's own fields are invalid (the caller's fault; no retry helps).
    INVALID_REQUEST = "INVALID_REQUEST"
    #: The model is still loading.
    LOADING = "LOADING"
    #: The stage drains (SIGTERM) and takes nothing new.
    DRAINING = "DRAINING"
    #: The stage's engine loop died (its health is NOT_SERVING for good): it takes nothing new and
    #: must be replaced; another replica may serve the request.
    ENGINE_FAILED = "ENGINE_FAILED"
    #: No room now: the AR's engine or the DiT's slot pool is full.
    FULL = "FULL"
    #: The call's deadline passed in the stage.
    DEADLINE = "DEADLINE"
    #: The AR may not dial this ``dit_address`` (``dit_allow_list``).
    DIT_NOT_ALLOWED = "DIT_NOT_ALLOWED"
    #: The AR's decode loop failed.
    DECODE_FAILED = "DECODE_FAILED"
    #: Pushing the hidden states failed (the DiT went away or closed the stream early).
    PUSH_FAILED = "PUSH_FAILED"
    #: The DiT refused a push: the slot already holds complete conditions (no AR is needed).
    CONDITIONS_COMPLETE = "CONDITIONS_COMPLETE"
    #: The DiT refused a chunk (a wire-contract rule: INVALID_ARGUMENT, DATA_LOSS, ...).
    CHUNK_REJECTED = "CHUNK_REJECTED"
    #: The DiT's producer (the AR's push) broke and no retry began in time.
    PRODUCER_LOST = "PRODUCER_LOST"
    #: The DiT's pipeline refused the received conditions (e.g. no image rows).
    CONDITIONS_REJECTED = "CONDITIONS_REJECTED"
    #: The DiT's pipeline failed.
    GENERATION_FAILED = "GENERATION_FAILED"


@dataclass(frozen=True)
class Origin:
    """Where an error arose: ``stage`` (a `Stage` value, ``"ar"``/``"dit"``) and ``reason`` (a
    `Reason` value, or another UPPER_SNAKE string a newer stage sent)."""

    stage: str
    reason: str


def status_trailers(code: grpc.StatusCode, message: str, origin: Origin,
                    field: str | None = None) -> tuple[tuple[str, bytes]]:
    """Trailing metadata carrying the rich status of an abort with ``code``/``message`` from
    ``origin`` (one ``google.rpc.ErrorInfo`` detail), and with ``field`` a ``google.rpc.BadRequest``
    detail naming the request field at fault (the gateway's API parameter of the same name)."""
    info = error_details_pb2.ErrorInfo(reason=str(origin.reason), domain=DOMAIN,
                                       metadata={"stage": str(origin.stage)})
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(info)
    if field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return ((STATUS_DETAILS_KEY, status.SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, *,
                stage: Stage | str, reason: Reason | str, field: str | None = None) -> NoReturn:
    """Abort the RPC of ``context`` with ``code``/``message``, the `Origin` ``(stage, reason)`` and,
    for a refused request field, ``field`` (`status_trailers`).

    Raises:
        grpc.aio.AbortError: the status was sent (what ``context.abort`` raises).
        asyncio.CancelledError: the call had already ended (its deadline, or the client cancelled),
            so there was no status to send: the handler stops as on any cancellation. grpcio raises
            its internal ``ExecuteBatchError`` then; a DiT whose own condition wait ran out with the
            caller's deadline logged that as a failed generation and counted it ``failed``.
    """
    try:
        await context.abort(code, message, trailing_metadata=status_trailers(
            code, message, Origin(str(stage), str(reason)), field))
    except grpc.aio.AbortError:
        raise
    except Exception as exc:
        if context.done():
            raise asyncio.CancelledError(f"the call ended before its {code.name} status was sent") from exc
        raise
    raise AssertionError("context.abort returned")  # pragma: no cover


def _status_of(error: Any) -> Any:
    """The ``google.rpc.Status`` in the trailers of a failed call, or None."""
    trailers = getattr(error, "trailing_metadata", None)
    try:
        items = trailers() if callable(trailers) else ()
    except Exception:  # noqa: BLE001 - a call without trailers
        return None
    for key, value in items or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            return status_pb2.Status.FromString(value)
        except Exception:  # noqa: BLE001 - a malformed status carries nothing
            return None
    return None


def origin_of(error: Any) -> Origin | None:
    """The `Origin` in the trailers of a failed call (``grpc.aio.AioRpcError``, or anything with
    ``trailing_metadata()``); None when it has none, it does not parse, or its domain is not ours.
    """
    status = _status_of(error)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == DOMAIN:
            return Origin(info.metadata.get("stage", ""), info.reason)
    return None


def field_of(error: Any) -> str | None:
    """The request field a failed call's ``google.rpc.BadRequest`` detail names first, or None."""
    status = _status_of(error)
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Is(bad.DESCRIPTOR) and detail.Unpack(bad) and bad.field_violations:
            return bad.field_violations[0].field or None
    return None

