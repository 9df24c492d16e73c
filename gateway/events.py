"""The typed events of a request, as `gateway.engine_client.EngineClient.generate` yields them.

Progress and results travel on one channel, in the order they happened: `Progress` (a stage's
phase, AR tokens, DiT steps), `PartialImage` (a preview), `ImageReady` (an image's final bytes and
costs), `Failed` (the request failed: the last event), and `Idle` (nothing happened for the
heartbeat interval: the SSE renderer's keep-alive).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union


@dataclass
class Progress:
    """Progress of one image's stage (an ``image_generation.progress`` event)."""

    index: int
    stage: str
    phase: str
    tokens_generated: int | None = None
    total_tokens: int | None = None
    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None


@dataclass
class PartialImage:
    """An intermediate preview of image ``index`` (the DiT's ``Image{partial: true}``)."""

    index: int
    partial_index: int
    data: bytes


@dataclass
class ImageResult:
    """The final image of one pipeline and what it cost."""

    index: int
    seed: int
    data: bytes
    format: str
    width: int
    height: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    epoch: int = 0
    dit_attempts: int = 1
    dit_address: str = ""
    ar_address: str = ""
    #: Per-stage seconds of this image (`gateway.rendering.STAGES` order), each measured by the
    #: component that did the work; they partition the image's time from admission to the image.
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class ImageReady:
    """Image ``result.index`` is done."""

    result: ImageResult


@dataclass
class Failed:
    """The request failed with ``error`` (a `gateway.errors.GatewayError`, or any exception: an
    internal error); no event follows."""

    error: BaseException


@dataclass
class Idle:
    """No event for the heartbeat interval."""


Event = Union[Progress, PartialImage, ImageReady, Failed, Idle]
#: How a pipeline hands its `Progress` and `PartialImage` events on.
Emit = Callable[[Event], None]
