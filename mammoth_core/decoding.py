"""How the AR decodes a request's grid: one token per forward, or speculative Jacobi windows.

`DecodingOptions` is the one typed value the gateway (request field ``ar_decoding`` and friends,
deployment defaults), the wire (`mammoth.v1.ARRequest`'s decoding fields) and the AR engine
(its speculative decoding) share. Torch-free and stage-free.

* ``sequential`` (default): one image token per forward, the engine as it always was.
* ``jacobi``: speculative Jacobi decoding (SJD, Teng et al. 2024): a window of ``window`` tokens
  (the next token, already sampled, and ``window - 1`` drafts) is fed in one forward, each draft is
  accepted with probability ``min(1, p(x) / q(x))`` against the model's distribution ``p`` given
  the accepted prefix, the first rejected one is resampled from ``norm(max(0, p - q))``, and the
  drafts after it are re-drafted from that forward's own predictions (Jacobi iteration). The
  sampled grid has exactly the distribution of ``sequential`` (not the same tokens for a seed).
  Options from SJD++ (arXiv 2512.07503): ``token_reuse`` keeps a re-drafted position's previous
  draft where the new prediction supports it (with the mixture proposal that keeps the rule
  exact), ``spatial_init`` drafts a new position as the token one grid row above.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = ["ARDecoding", "DEFAULT_JACOBI_WINDOW", "DecodingOptions", "JACOBI_WINDOW_RANGE", "SEQUENTIAL", "from_proto",
           "to_proto"]

#: Tokens per Jacobi window (the next token + ``window - 1`` drafts) by default, and the allowed range.
DEFAULT_JACOBI_WINDOW = 16
JACOBI_WINDOW_RANGE = (2, 64)


class ARDecoding(str, enum.Enum):
    """The AR decoding mode (the API's ``ar_decoding`` strings)."""

    SEQUENTIAL = "sequential"
    JACOBI = "jacobi"


@dataclasses.dataclass(frozen=True)
class DecodingOptions:
    """One request's decoding mode.

    Attributes:
        mode: `ARDecoding`.
        window: Jacobi window in tokens (``jacobi`` only), in `JACOBI_WINDOW_RANGE`.
        token_reuse: SJD++ token reuse (``jacobi`` only).
        spatial_init: new drafts from the token one grid row above (``jacobi`` only).

    Raises:
        ValueError: an unknown mode or a window outside the range (message names the field).
    """

    mode: ARDecoding = ARDecoding.SEQUENTIAL
    window: int = DEFAULT_JACOBI_WINDOW
    token_reuse: bool = False
    spatial_init: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", ARDecoding(self.mode))
        except ValueError:
            raise ValueError(f"ar_decoding must be one of {[m.value for m in ARDecoding]}, got {self.mode!r}") from None
        lo, hi = JACOBI_WINDOW_RANGE
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not lo <= self.window <= hi:
            raise ValueError(f"jacobi_window must be an integer in [{lo}, {hi}], got {self.window!r}")

    @property
    def jacobi(self) -> bool:
        """Whether this request decodes with Jacobi windows."""
        return self.mode is ARDecoding.JACOBI

    @classmethod
    def resolve(cls, mode: str | None, window: int | None, token_reuse: bool | None, spatial_init: bool | None,
                default: DecodingOptions | None = None) -> DecodingOptions:
        """A request's options: each field given (not None/empty/0) wins over ``default``'s."""
        base = default or SEQUENTIAL
        return cls(
            mode=mode or base.mode,
            window=window or base.window,
            token_reuse=base.token_reuse if token_reuse is None else bool(token_reuse),
            spatial_init=base.spatial_init if spatial_init is None else bool(spatial_init),
        )


#: The default: one token per forward.
SEQUENTIAL = DecodingOptions()


def to_proto(options: DecodingOptions) -> Any:
    """`DecodingOptions` -> ``mammoth.v1.DecodingParams`` (``sequential`` as the unset message)."""
    from mammoth_core.pb import mammoth_pb2 as pb

    if not options.jacobi:
        return pb.DecodingParams()
    return pb.DecodingParams(mode=pb.AR_DECODING_JACOBI, window=options.window, token_reuse=options.token_reuse,
                             spatial_init=options.spatial_init)


def from_proto(message: Any) -> DecodingOptions:
    """``mammoth.v1.DecodingParams`` -> `DecodingOptions` (unset mode: sequential; window 0: the default).

    Raises:
        ValueError: an unknown mode or a window outside `JACOBI_WINDOW_RANGE`.
    """
    from mammoth_core.pb import mammoth_pb2 as pb

    if message.mode in (pb.AR_DECODING_UNSPECIFIED, pb.AR_DECODING_SEQUENTIAL):
        return SEQUENTIAL
    if message.mode != pb.AR_DECODING_JACOBI:
        raise ValueError(f"ar_decoding: unknown mode {message.mode}")
    return DecodingOptions(ARDecoding.JACOBI, window=int(message.window) or DEFAULT_JACOBI_WINDOW,
                           token_reuse=bool(message.token_reuse), spatial_init=bool(message.spatial_init))
