"""Typed refusal reasons in gRPC trailers (``mammoth.v1.Refusal`` under `REFUSAL_KEY`).

A status code says how a call failed; where the caller must act on *why* (the DiT refusing a push
because the conditions are already complete, which is not an AR failure), the refusing side adds a
serialized `mammoth.v1.Refusal` to the call's trailing metadata and the caller reads it back with
`refusal_of`, never from the message text. A relay (the AR answering its own Generate after the
DiT refused its push) copies the reason into its own trailers.
"""

from __future__ import annotations

from typing import Any

from mammoth_core.pb import mammoth_pb2 as pb

#: Trailing-metadata key (``-bin``: binary value, base64 on the wire).
REFUSAL_KEY = "mammoth-refusal-bin"


def refusal_trailers(reason: int) -> tuple[tuple[str, bytes], ...]:
    """Trailing metadata carrying ``reason`` (a ``mammoth.v1.RefusalReason``); empty for 0."""
    if not reason:
        return ()
    return ((REFUSAL_KEY, pb.Refusal(reason=reason).SerializeToString()),)


def refusal_of(error: Any) -> int:
    """The ``mammoth.v1.RefusalReason`` in the trailers of a failed call (``grpc.aio.AioRpcError``
    or anything with ``trailing_metadata()``); 0 when there is none or it does not parse."""
    trailers = getattr(error, "trailing_metadata", None)
    try:
        items = trailers() if callable(trailers) else ()
    except Exception:  # noqa: BLE001 - a call without trailers
        return 0
    for key, value in items or ():
        if key == REFUSAL_KEY and isinstance(value, bytes):
            try:
                return pb.Refusal.FromString(value).reason
            except Exception:  # noqa: BLE001 - a malformed refusal is no refusal
                return 0
    return 0
