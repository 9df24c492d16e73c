"""`ImageJob`: a request with every default applied, and the settings-dependent request rules.

The request model (`gateway.protocol.ImageGenerationRequest`) checks types, ranges and the
cross-field rules that need no settings; `ImageGenerationRequest.to_image_job` applies the rules
that do (model name, prompt length, pixel and step limits, the AR grid) with the helpers here and
builds the `ImageJob` the engine client runs.
"""

from __future__ import annotations

import contextlib
import uuid
from dataclasses import dataclass
from typing import Iterator

from gateway.errors import InvalidRequestError
from mammoth_core import limits
from mammoth_core.decoding import SEQUENTIAL, DecodingOptions
from mammoth_core.settings import GatewaySettings

#: ``quality`` -> multiple of the default number of inference steps (capped by ``max_steps``).
QUALITY_STEP_FACTORS = {
    "low": 0.25, "medium": 0.5, "auto": 1.0, "standard": 1.0, "high": 1.0,
    "hd": 1.5, "xhigh": 1.5, "max": 2.0,
}
#: ``quality`` as responses and events echo it: the effort actually used, in the values the API's
#: response schema allows (``low``/``medium``/``high``/``xhigh``/``max``).
QUALITY_ECHO = {
    "low": "low", "medium": "medium", "auto": "high", "standard": "high", "high": "high",
    "hd": "xhigh", "xhigh": "xhigh", "max": "max",
}
#: ``style: natural`` multiplies the default text guidance scale by this (floor 1.0).
NATURAL_GUIDANCE_FACTOR = 0.5
#: JPEG/WebP ``output_compression`` when the request gives none (encoder quality 75).
DEFAULT_OUTPUT_COMPRESSION = 25


@dataclass
class ImageJob:
    """A validated request with every default applied (the parameters actually used)."""

    request_id: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    #: AR grid ``(width, height)`` in cells (`mammoth_core.limits.resolve_grid`).
    ar_grid: tuple[int, int]
    n: int
    seed: int
    num_inference_steps: int
    text_guidance_scale: float
    cfg_range: tuple[float, float]
    ar_guidance_scale: float
    output_format: str
    output_compression: int
    partial_images: int
    response_format: str
    stream: bool
    quality: str
    safety_identifier: str | None
    stream_progress: bool = False
    #: How the AR decodes the grid (`mammoth_core.decoding`).
    decoding: DecodingOptions = SEQUENTIAL
    #: opt-in DiT step cache ``(threshold, warmup_steps)``, or None (off)
    dit_cache: tuple[float, int] | None = None

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


@contextlib.contextmanager
def limit_errors() -> Iterator[None]:
    """Turn a `mammoth_core.limits.LimitError` into the 400 naming its ``param``."""
    try:
        yield
    except limits.LimitError as exc:
        raise InvalidRequestError(exc.message, param=exc.param, code=exc.code) from None


def parse_size(size: str | None, settings: GatewaySettings) -> tuple[int, int]:
    """``"WxH"`` or ``"auto"`` -> ``(width, height)`` in pixels.

    Rules: both sides positive multiples of 16; ``min_pixels <= width*height <= max_pixels``
    (`mammoth_core.limits.check_image`, the rule the DiT applies too).

    Raises:
        InvalidRequestError: with ``param="size"`` for any violation.
    """
    text = settings.default_size if size in (None, "auto") else size  # default_size: checked at start
    try:
        width, height = limits.parse_image_size(text)
    except limits.LimitError:
        raise InvalidRequestError(
            f"invalid size {size!r}: expected 'auto' or 'WIDTHxHEIGHT' with positive integers, "
            "e.g. '1024x1024'", param="size", code="invalid_size") from None
    with limit_errors():
        limits.check_image(width, height, 1, limits.from_settings(settings))
    return width, height


def resolve_ar_grid(ar_grid: str | None, width: int, height: int, prompt: str, negative: str,
                    settings: GatewaySettings) -> tuple[int, int]:
    """The AR grid (cells) of a request: ``ar_grid`` or the deployment's ``default_ar_grid``,
    checked against what the AR and the DiT hold (`mammoth_core.limits.check_positions`).

    Raises:
        InvalidRequestError: ``param`` is ``ar_grid`` (malformed, or a given grid too large),
            ``size`` (the auto grid of this size too large), ``prompt`` or ``negative_prompt``.
    """
    text = ar_grid if ar_grid is not None else settings.default_ar_grid
    with limit_errors():
        grid = limits.resolve_grid(width, height, text)
        grid_param = "size" if text == "auto" else "ar_grid"
        limits.check_positions(prompt, negative, width, height, grid, grid_param,
                               limits.from_settings(settings))
    return grid


def check_prompt_length(name: str, text: str, settings: GatewaySettings) -> None:
    """Raise the 400 ``string_above_max_length`` naming ``name`` when ``text`` is longer than
    ``settings.max_prompt_chars`` characters."""
    if len(text) > settings.max_prompt_chars:
        raise InvalidRequestError(
            f"{name} is {len(text)} characters; the maximum is {settings.max_prompt_chars}",
            param=name, code="string_above_max_length")


def new_request_id(header_value: str | None) -> str:
    """The client's ``x-request-id`` when it is well formed, else ``img-<32 hex>``."""
    if header_value and not limits.request_id_problem(header_value, limits.MAX_CLIENT_REQUEST_ID):
        return header_value
    return f"img-{uuid.uuid4().hex}"
