"""The one classifier from a failed stage call to what the gateway does, and the retry rules.

`classify` reads a failed call's status code and the `mammoth_core.errors.Origin` the failing
stage attached (which stage the error arose in, and why; a status without one arose in the called
stage), never its message text:

=============================================  ==============================================
status (origin)                                 result
=============================================  ==============================================
DEADLINE_EXCEEDED (any)                         `DeadlineExceededError` (504)
INVALID_ARGUMENT (the called stage, reason      `InvalidRequestError` (400): the stage refused
INVALID_REQUEST or none)                        the request itself; no replica can accept it
UNAUTHENTICATED, PERMISSION_DENIED,             `BackendError` (502) at once: configuration, no
UNIMPLEMENTED (the called stage)                retry fixes it
anything else                                   `StageFailure`: retried (``full``: the called
                                                stage has no room, try another replica;
                                                ``down``: the called replica is unavailable,
                                                mark it failed; ``conditions_complete``: the
                                                DiT refused a push it no longer needs)
=============================================  ==============================================

The retry rules (DESIGN.md, "Retries") are the pure functions `after_ar_failure` and
`after_dit_failure`.
"""

from __future__ import annotations

import enum

import grpc

from gateway.errors import BackendError, DeadlineExceededError, GatewayError, InvalidRequestError
from mammoth_core.errors import Origin, Reason, field_of, origin_of

#: Stage answers that no retry can fix (configuration errors): answered with 502 at once.
FATAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                         grpc.StatusCode.UNIMPLEMENTED})
#: AR attempts (epochs) per DiT slot, and DiT attempts (slots) per image.
MAX_AR_ATTEMPTS = 4
MAX_DIT_ATTEMPTS = 3

_NAMES = {"ar": "AR", "dit": "DiT"}
#: How a 400 names the stage that refused the request.
_REJECTED = {"ar": "the AR stage rejected the request",
             "dit": "the DiT stage rejected the image parameters"}


class StageFailure(Exception):
    """A retryable failure of one stage call.

    Attributes:
        stage: the called stage (``"ar"``/``"dit"``).
        code: the gRPC status name, or a short reason (``"EOF"``).
        origin: where the error arose (`mammoth_core.errors.Origin`).
        address: the replica called.
        full: the called stage has no room now (RESOURCE_EXHAUSTED of its own): try another replica.
        down: the called replica is unavailable (UNAVAILABLE of its own): mark it failed.
        conditions_complete: the DiT refused a push because it holds every row already.
    """

    def __init__(self, stage: str, code: str, message: str, address: str = "",
                 origin: Origin | None = None) -> None:
        super().__init__(f"{stage} {address}: {code}: {message}")
        self.stage = stage
        self.code = code
        self.address = address
        self.origin = origin or Origin(stage, "")
        own = self.origin.stage == stage
        self.full = own and code == grpc.StatusCode.RESOURCE_EXHAUSTED.name
        self.down = own and code == grpc.StatusCode.UNAVAILABLE.name
        self.conditions_complete = self.origin.reason == Reason.CONDITIONS_COMPLETE


def classify(exc: grpc.aio.AioRpcError, stage: str, address: str,
             during: str) -> GatewayError | StageFailure:
    """What a failed call to ``stage`` (``"ar"``/``"dit"``) at ``address`` means (module table).

    Args:
        during: how a deadline error says where the time ran out (``"in the AR stage"``).

    Returns:
        a `GatewayError` to answer the client with, or a `StageFailure` to retry.
    """
    code = exc.code()
    details = exc.details() or ""
    origin = origin_of(exc) or Origin(stage, "")
    own = origin.stage == stage
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(f"the request's time budget ran out {during}")
    if code == grpc.StatusCode.INVALID_ARGUMENT and own and origin.reason in ("",
                                                                               Reason.INVALID_REQUEST):
        return InvalidRequestError(f"{_REJECTED[stage]}: {details}", param=field_of(exc))
    if code in FATAL_CODES and own:
        return BackendError(f"the {_NAMES[stage]} at {address} refused the call: {code.name} "
                            f"{details}")
    return StageFailure(stage, code.name, details, address, origin)


class ARVerdict(enum.Enum):
    """What follows an AR attempt's `StageFailure` (`after_ar_failure`)."""

    #: The DiT refused the push because it holds every row: no AR failed, nothing to retry.
    CONDITIONS_COMPLETE = "conditions_complete"
    #: The DiT has every row or has failed itself: no AR retry starts.
    NOT_NEEDED = "not_needed"
    #: Retry on another AR with ``epoch + 1`` (the slot survives).
    RETRY = "retry"


def after_ar_failure(failure: StageFailure, conditions_complete: bool,
                     dit_finished: bool) -> ARVerdict:
    """The rule after an AR attempt failed, once the DiT had its short say
    (``AR_FAILURE_GRACE_SECONDS``): ``conditions_complete`` (the DiT's ``ConditionsComplete``),
    ``dit_finished`` (the DiT stream ended: its own outcome decides)."""
    if failure.conditions_complete:
        return ARVerdict.CONDITIONS_COMPLETE
    if dit_finished or conditions_complete:
        return ARVerdict.NOT_NEEDED
    return ARVerdict.RETRY


def check_ar_attempts(attempts: int) -> None:
    """Raise the 502 when ``attempts`` AR attempts of one slot were used up (`MAX_AR_ATTEMPTS`).

    Raises:
        BackendError: ``attempts >= MAX_AR_ATTEMPTS``.
    """
    if attempts >= MAX_AR_ATTEMPTS:
        raise BackendError(f"the AR stage failed {attempts} times")


def after_dit_failure(failure: StageFailure, attempt: int) -> BackendError | None:
    """The rule after DiT attempt ``attempt`` (1-based) failed: None to start over (new slot, new
    AR run), or the 502 to answer once `MAX_DIT_ATTEMPTS` were used."""
    if attempt >= MAX_DIT_ATTEMPTS:
        return BackendError(f"the DiT stage failed {attempt} times: {failure}")
    return None
