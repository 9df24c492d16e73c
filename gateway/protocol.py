"""Pydantic models of the OpenAI images API as the gateway speaks it (requests, responses, SSE events).

Types and ranges are checked here, strictly (``true`` is not a number, ``"5"`` not an integer:
what the OpenAPI document says is what is accepted); checks that need settings (prompt length, pixel limits, model
name, step cap) and cross-field rules live in `gateway.serving.resolve_request`, which raises
`gateway.errors.InvalidRequestError` naming the field. Unknown request fields are accepted by the
parser (so a newer official client never meets a 422) and then answered with a 400
``unknown_parameter`` naming them: nothing the client sends is silently dropped.

Extensions (not in OpenAI's API) may be given at the top level or inside an ``extra_body`` object
(raw HTTP clients copying SDK code); see `EXTENSION_FIELDS`. docs/API.md documents every field.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator,
                      model_validator)

from mammoth_core.decoding import JACOBI_WINDOW_RANGE
from mammoth_core.limits import DIT_CACHE_THRESHOLD_RANGE, GUIDANCE_SCALE_RANGE

logger = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1

#: Extension request fields (also accepted inside ``extra_body``).
EXTENSION_FIELDS = (
    "seed",
    "negative_prompt",
    "num_inference_steps",
    "text_guidance_scale",
    "cfg_range",
    "ar_guidance_scale",
    "ar_grid",
    "ar_decoding",
    "jacobi_window",
    "jacobi_token_reuse",
    "jacobi_spatial_init",
    "stream_progress",
    "dit_cache",
)

#: OpenAI request fields this deployment cannot honour; any non-null value is a 400 naming it.
UNSUPPORTED_OPENAI_FIELDS = {
    "complexity": "planning complexity is a GPT Image feature; MammothModa2 has no planner",
    "frame_count": "animated output (gif) is not supported",
    "frame_duration_ms": "animated output (gif) is not supported",
    "svg": "svg output is not supported",
    "moderation": "this deployment runs no content moderation model, so it cannot apply "
    "a moderation level; omit the field",
}

Quality = Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"]


class OpenAIBaseModel(BaseModel):
    """Base of the request models: accepts unknown fields (kept in ``model_extra``)."""

    model_config = ConfigDict(extra="allow")


class DiTCacheOptions(BaseModel):
    """The ``dit_cache`` extension: opt-in DiT step caching (a first-block residual cache).

    A step whose first-layer residual changed by less than ``threshold`` (relative L1) since the last
    full step reuses the cached output of the remaining layers; the first ``warmup_steps`` always
    run in full. Off unless given. Faster, not identical: quality on real weights is the user's to
    judge.
    """

    model_config = ConfigDict(extra="forbid")

    threshold: float = Field(ge=DIT_CACHE_THRESHOLD_RANGE[0], le=DIT_CACHE_THRESHOLD_RANGE[1],
                             allow_inf_nan=False, description="relative change below which a step "
                             "reuses the cache (0: off)")
    warmup_steps: StrictInt = Field(2, ge=0, description="first steps that always run every layer")


class ImageGenerationRequest(OpenAIBaseModel):
    """Body of ``POST /v1/images/generations``.

    OpenAI fields: prompt, model, n, size, response_format, output_format, output_compression,
    quality, background, style, moderation, user, safety_identifier, stream, partial_images
    (complexity, frame_count, frame_duration_ms and svg are recognised and rejected).
    Extensions: seed, negative_prompt, num_inference_steps, text_guidance_scale, cfg_range,
    ar_guidance_scale, ar_grid, ar_decoding, jacobi_window, jacobi_token_reuse, jacobi_spatial_init.
    """

    prompt: str = Field(min_length=1, description="Text description of the image (length cap: "
                        "the gateway's `max_prompt_chars`).")
    model: str | None = Field(None, description="Model id; `GET /v1/models` lists it. Unknown -> 404 "
                              "`model_not_found`.")
    n: StrictInt | None = Field(None, ge=1, le=10, description="Number of images, 1-10; image i uses "
                          "seed + i.")
    size: str | None = Field(None, description="`WIDTHxHEIGHT` (multiples of 16, within the "
                             "pixel limits) or `auto` (the gateway's `default_size`).")
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="`b64_json` (default) or `url` (served by the gateway for "
        "`image_ttl_seconds`).")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(
        None, description="Encoding of the image (default png).")
    output_compression: StrictInt | None = Field(
        None, ge=0, le=100, description="0-100 for jpeg/webp: encoder quality = 100 - compression. "
        "Rejected with png.")
    quality: Quality | None = Field(
        None, description="Denoising effort: scales the default number of inference steps "
        "(low 1/4, medium 1/2, auto/standard/high 1, hd/xhigh 3/2, max 2).")
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        None, description="`auto`/`opaque` (the model paints opaque images); `transparent` is "
        "rejected.")
    style: Literal["vivid", "natural"] | None = Field(
        None, description="`vivid` (default): the default text guidance scale; `natural`: half of "
        "it (at least 1), for less saturated images.")
    moderation: Any = Field(None, description="Rejected when set: no moderation model runs here.")
    user: str | None = Field(None, max_length=256, description="End-user id: logged with the "
                             "request id and echoed as `safety_identifier`.")
    safety_identifier: str | None = Field(None, max_length=256, description="Same as `user` "
                                          "(wins over it).")
    stream: StrictBool | None = Field(None, description="Server-sent events instead of one JSON body.")
    partial_images: StrictInt | None = Field(
        None, ge=0, le=3, description="0-3 intermediate previews, streamed as "
        "`image_generation.partial_image` (needs stream=true).")
    complexity: Any = Field(None, description="Rejected when set.")
    frame_count: Any = Field(None, description="Rejected when set.")
    frame_duration_ms: Any = Field(None, description="Rejected when set.")
    svg: Any = Field(None, description="Rejected when set.")

    # --- extensions ---
    seed: StrictInt | None = Field(None, ge=0, le=INT64_MAX, description="Extension: base seed; image i "
                             "uses seed + i. Random when omitted; always returned.")
    negative_prompt: str | None = Field(None, description="Extension: negative prompt, prefilled by "
                                        "the AR as a second sequence (role NEGATIVE) for "
                                        "classifier-free guidance.")
    num_inference_steps: StrictInt | None = Field(None, ge=1, description="Extension: denoising steps "
                                            "(default: the gateway's `default_steps`).")
    text_guidance_scale: StrictFloat | None = Field(None, ge=GUIDANCE_SCALE_RANGE[0],
                                              le=GUIDANCE_SCALE_RANGE[1], description="Extension: "
                                              "DiT classifier-free guidance scale (<= 1: off).")
    cfg_range: tuple[StrictFloat, StrictFloat] | None = Field(None, description="Extension: [start, end] in "
                                                  "[0, 1]: guidance applies while start <= i/N <= "
                                                  "end.")
    ar_guidance_scale: StrictFloat | None = Field(None, ge=0.0, le=100.0, description="Extension: AR-side "
                                            "classifier-free guidance (<= 1: off, default).")
    ar_grid: str | None = Field(None, description="Extension: the AR grid, `auto` (width/16 x "
                                "height/16) or `WxH` cells (W*H cells in the image's aspect ratio; "
                                "default: the gateway's `default_ar_grid`). Checked against the AR's "
                                "position limit.")
    ar_decoding: Literal["sequential", "jacobi"] | None = Field(
        None, description="Extension: how the AR decodes the grid: `sequential` (one image token per "
        "forward) or `jacobi` (speculative Jacobi decoding: several tokens per forward, the same "
        "distribution of images; default: the gateway's `default_ar_decoding`).")
    jacobi_window: StrictInt | None = Field(
        None, ge=JACOBI_WINDOW_RANGE[0], le=JACOBI_WINDOW_RANGE[1], description="Extension: tokens per "
        "Jacobi verification forward (default: the gateway's `default_jacobi_window`).")
    jacobi_token_reuse: StrictBool | None = Field(
        None, description="Extension: with jacobi, keep re-drafted positions' previous drafts where the "
        "new prediction supports them (SJD++ token reuse; default off).")
    jacobi_spatial_init: StrictBool | None = Field(
        None, description="Extension: with jacobi, draft new positions as the token one grid row above "
        "(default off: uniform drafts).")
    stream_progress: StrictBool | None = Field(
        None, description="Extension: with stream=true, also send `image_generation.progress` "
        "events (AR tokens, DiT steps). Off by default: a default stream carries only the event "
        "types the OpenAI API defines.")
    dit_cache: DiTCacheOptions | None = Field(None, description="Extension: opt-in DiT step cache "
                                              "`{threshold, warmup_steps}`; off when omitted.")
    extra_body: dict[str, Any] | None = Field(None, description="Extensions may also be sent "
                                              "inside this object.")

    @model_validator(mode="before")
    @classmethod
    def _merge_extra_body(cls, data: Any) -> Any:
        """Lift extension fields out of ``extra_body`` (conflicts are checked on that field)."""
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            data = dict(data)
            for key, value in data["extra_body"].items():
                if key in EXTENSION_FIELDS and key not in data:
                    data[key] = value
        return data

    @field_validator("extra_body")
    @classmethod
    def _check_extra_body(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            unknown = sorted(k for k in value if k not in EXTENSION_FIELDS)
            if unknown:
                raise ValueError(f"unknown extension {unknown[0]!r} (known: "
                                 f"{', '.join(EXTENSION_FIELDS)})")
        return value

    @field_validator("cfg_range")
    @classmethod
    def _check_cfg_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None:
            start, end = value
            if not (0.0 <= start <= end <= 1.0):
                raise ValueError("cfg_range must be [start, end] with 0 <= start <= end <= 1")
        return value


class ImageObject(BaseModel):
    """One generated image: ``b64_json`` or ``url`` (never ``url: null``), plus its ``seed``."""

    b64_json: str | None = None
    url: str | None = None
    seed: int = Field(description="Extension: the seed this image was generated with.")


class InputTokensDetails(BaseModel):
    text_tokens: int
    image_tokens: int = 0


class OutputTokensDetails(BaseModel):
    image_tokens: int
    text_tokens: int = 0


class ImageUsage(BaseModel):
    """Token counts summed over the request's images: prompt tokens in, visual tokens out."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    ar_grid: str | None = Field(None, description="Extension: the AR grid used, `WxH` cells "
                                "(output tokens per image = H * (W + 1)).")


class ImagesResponse(BaseModel):
    """Body of a successful non-streaming ``POST /v1/images/generations``."""

    created: int
    data: list[ImageObject]
    usage: ImageUsage
    background: Literal["opaque"] = "opaque"
    output_format: Literal["png", "jpeg", "webp"]
    quality: str
    size: str
    safety_identifier: str | None = None
    seed: int = Field(description="Extension: the base seed (image i used seed + i).")
    num_inference_steps: int = Field(description="Extension: denoising steps used.")
    text_guidance_scale: float = Field(description="Extension: DiT guidance scale used.")
    cfg_range: tuple[float, float] = Field(description="Extension: guidance interval used.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mammoth-pipeline"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------------------------------------
# Server-sent events (``stream: true``)
# ------------------------------------------------------------------------------------------------


class ImageGenPartialImageEvent(BaseModel):
    """``image_generation.partial_image``: an intermediate preview of image ``image_index``."""

    type: Literal["image_generation.partial_image"] = "image_generation.partial_image"
    b64_json: str
    background: Literal["opaque"] = "opaque"
    created_at: int
    output_format: Literal["png", "jpeg", "webp"]
    partial_image_index: int
    quality: str
    size: str
    image_index: int = Field(description="Extension: which of the n images (0-based).")


class ImageGenCompletedEvent(BaseModel):
    """``image_generation.completed``: the final image ``image_index`` (one per image, in order)."""

    type: Literal["image_generation.completed"] = "image_generation.completed"
    b64_json: str
    background: Literal["opaque"] = "opaque"
    created_at: int
    output_format: Literal["png", "jpeg", "webp"]
    quality: str
    size: str
    usage: ImageUsage
    safety_identifier: str | None = None
    image_index: int = Field(description="Extension: which of the n images (0-based).")
    seed: int = Field(description="Extension: this image's seed.")
    url: str | None = Field(None, description="Extension: set when response_format is url.")
    timings: dict[str, float] | None = Field(
        None, description="Extension: this image's stage breakdown in milliseconds, under the "
        "`Server-Timing` names (`queue`, `ar_prefill`, `ar_decode`, `transfer`, `dit_denoise`, "
        "`dit_vae`, `dit_encode`) plus `total` (request start to this image's completion).")


class ProgressEvent(BaseModel):
    """Extension ``image_generation.progress``: AR tokens (``stage: ar``) or DiT steps (``stage: dit``).

    One ``stage: dit, phase: denoising`` event per finished denoising step (``step`` 1..
    ``total_steps``); ``stage: ar`` events carry ``tokens_generated`` of ``total_tokens``.
    """

    type: Literal["image_generation.progress"] = "image_generation.progress"
    created_at: int
    image_index: int
    stage: Literal["ar", "dit"]
    phase: Literal["queued", "reserved", "decoding_tokens", "denoising", "vae_decoding"]
    tokens_generated: int | None = None
    total_tokens: int | None = None
    step: int | None = None
    total_steps: int | None = None
    epoch: int | None = None
