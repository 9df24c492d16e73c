"""What goes into and out of the AR decode engine (`stage_ar.engine.DecodeEngine`): the job a request
submits (`DecodeJob`), the sink its rows go to (`RowSink`, `CollectingSink`), the typed outputs of an
engine turn (`RowsReady`, `SequenceDone`), the job's `JobStats`, and the stream `Role` of a row.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from typing import Callable, Protocol, Union

import torch

from mammoth_core.decoding import SEQUENTIAL, DecodingOptions

__all__ = ["CollectingSink", "DecodeJob", "EngineOutput", "JobStats", "Role", "RowSink", "RowsReady", "SequenceDone"]


class Role(enum.Enum):
    """Which stream a row belongs to: the prompt + grid rows, or a negative prompt's rows."""

    CONDITION = "condition"
    NEGATIVE = "negative"


class RowSink(Protocol):
    """Where a sequence's hidden-state rows go (the hidden-state sender). Thread-safe, non-blocking."""

    def put_rows(self, role: Role, hidden: torch.Tensor, token_ids: list[int]) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


class CollectingSink:
    """A `RowSink` that keeps every row in order (in-process runs, benchmarks, tests)."""

    def __init__(self) -> None:
        self.rows: dict[Role, list[torch.Tensor]] = {role: [] for role in Role}
        self.token_ids: dict[Role, list[int]] = {role: [] for role in Role}
        self.finished = self.aborted = False

    def put_rows(self, role: Role, hidden: torch.Tensor, token_ids: list[int]) -> None:
        self.rows[role].append(hidden)
        self.token_ids[role].extend(int(t) for t in token_ids)

    def finish(self) -> None:
        self.finished = True

    def abort(self) -> None:
        self.aborted = True

    def hidden(self, role: Role = Role.CONDITION) -> torch.Tensor | None:
        """``(rows, H)`` of ``role`` in arrival order, or None when it has none."""
        return torch.cat(self.rows[role]) if self.rows[role] else None


@dataclasses.dataclass
class JobStats:
    """Timings and counts of one finished (or failed) job; times in ms, counts in tokens/rows."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    rows_sent: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    last_row_unix_ms: float = 0.0


@dataclasses.dataclass(eq=False)
class DecodeJob:
    """One request for the engine.

    Attributes:
        request_id, epoch: identity of the request attempt.
        prompt_ids: the text-to-image envelope token ids.
        negative_ids: negative prompt ids (prefilled as a second sequence) or None.
        ar_width, ar_height: grid size in tokens.
        seed: sampling seed.
        temperature, top_k, top_p: sampling overrides (0: checkpoint defaults).
        ar_guidance_scale: AR-side CFG scale (<= 1: off).
        sink: receives rows (`RowSink`).
        on_progress: called from the engine thread with (image tokens decoded, image tokens in all):
            rows emitted after the prompt, of ``h * (w + 1)``, the count ``usage`` reports (the
            look-ahead sample, never fed, is not counted).
        on_done: called from the engine thread once, with None on success or the exception; on
            success before ``sink.finish()``, so "decoding done" is known before the push can be
            acknowledged (on failure after ``sink.abort()``).
        deadline: `time.monotonic()` seconds after which the job is aborted, or None.
        row_times: when a list, the engine appends ``(CONDITION rows produced so far, unix ms)``
            after every hand-off to the sink (request traces; see the ``trace_dir`` setting).
        decoding: sequential (default) or speculative Jacobi windows (`DecodingOptions`).
    """

    request_id: str
    epoch: int
    prompt_ids: list[int]
    negative_ids: list[int] | None
    ar_width: int
    ar_height: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    ar_guidance_scale: float
    sink: RowSink
    on_progress: Callable[[int, int], None]
    on_done: Callable[[BaseException | None, JobStats], None]
    deadline: float | None = None
    row_times: list[tuple[int, float]] | None = None
    decoding: DecodingOptions = SEQUENTIAL
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    cancel_callbacks: list[Callable[[], None]] = dataclasses.field(default_factory=list, repr=False)

    def cancel(self) -> None:
        """Drop this job (thread-safe): it stops counting for admission at once (the engine's
        `cancel_callbacks`), and leaves the batch before the engine's next step."""
        self.cancelled.set()
        for callback in list(self.cancel_callbacks):
            callback()


@dataclasses.dataclass
class RowsReady:
    """Rows of one job ready for its sink (``hidden (rows, H)`` on the model's device)."""

    job: DecodeJob
    role: Role
    hidden: torch.Tensor
    token_ids: list[int]


@dataclasses.dataclass
class SequenceDone:
    """A job left the engine: ``error`` None on success."""

    job: DecodeJob
    error: BaseException | None


EngineOutput = Union[RowsReady, SequenceDone]
