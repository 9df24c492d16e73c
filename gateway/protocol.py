"""Pydantic models of the OpenAI images API as the gateway speaks it (requests, responses, SSE events).

The request rules live on the request model. Types and ranges are checked strictly by the fields
(``true`` is not a number, ``"5"`` not an integer: what the OpenAPI document says is what is
accepted); the cross-field rules that need no settings (unsupported OpenAI fields, conflicting
fields, a blank prompt, ``partial_images`` without ``stream``, ...) are model validators raising
`rule_error` (a ``PydanticCustomError``), rendered as the 400 naming its ``param`` and ``code``;
the rules that need the settings (prompt length, pixel limits, model name, step cap, the AR grid)
run in `ImageGenerationRequest.to_image_job`, which raises `gateway.errors.InvalidRequestError`
and returns the `gateway.image_job.ImageJob` with every default applied.

Unknown request fields are accepted and ignored, and logged with a warning naming them
(`OpenAIBaseModel`, vLLM's idea): a newer official client sending a field this gateway does not
know still gets its image. Fields known to be unsupported (`UNSUPPORTED_OPENAI_FIELDS`) are refused.

Extensions (not in OpenAI's API) may be given at the top level or inside an ``extra_body`` object
(raw HTTP clients copying SDK code); see `EXTENSION_FIELDS`. An unknown key inside ``extra_body`` is
refused: the SDKs never send that object, so a key there is a typo of an extension. docs/API.md
documents every field.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from gateway.errors import InvalidRequestError, NotFoundError
from gateway.image_job import (DEFAULT_OUTPUT_COMPRESSION, NATURAL_GUIDANCE_FACTOR, QUALITY_ECHO,
                               QUALITY_STEP_FACTORS, ImageJob, check_prompt_length,
                               limit_errors, parse_size, resolve_ar_grid)
from mammoth_core import limits
from mammoth_core.decoding import JACOBI_WINDOW_RANGE, DecodingOptions
from mammoth_core.limits import DIT_CACHE_THRESHOLD_RANGE, GUIDANCE_SCALE_RANGE
from mammoth_core.settings import GatewaySettings
from mammoth_core.text import is_blank

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


def rule_error(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A request-rule violation raised by a model validator: error type ``code``, context
    ``param`` and ``message`` (`gateway.errors.error_info` renders it as the 400 naming ``param``)."""
    return PydanticCustomError(code, "{message}", {"param": param, "message": message})


def _first_surrogate(value: Any) -> str | None:
    """The first lone surrogate code point in ``value`` (a string, or strings inside lists and dicts), or None."""
    if isinstance(value, str):
        return next((ch for ch in value if "\ud800" <= ch <= "\udfff"), None)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        return next((bad for item in value if (bad := _first_surrogate(item)) is not None), None)
    return None


#: The ignored-fields warning names this many fields, each cut to `EXTRA_FIELD_NAME_CHARS`, and
#: counts them all: field names are the client's text, and a break-it pass filled 20 MB of log with
#: 20 requests naming 1 MB keys (a line stays under 500 bytes now, like the request's own line).
EXTRA_FIELDS_NAMED = 5
EXTRA_FIELD_NAME_CHARS = 64


def _clip(name: str) -> str:
    return name if len(name) <= EXTRA_FIELD_NAME_CHARS else name[:EXTRA_FIELD_NAME_CHARS] + "..."


class OpenAIBaseModel(BaseModel):
    """Base of the request models: accepts unknown fields (kept in ``model_extra``) and logs a
    warning naming them, once per request. Floats must be finite (JSON's NaN/Infinity: 400 "Input
    should be a finite number")."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        """JSON may escape a lone UTF-16 surrogate (``"\\udfff"``), which no UTF-8 text can hold:
        refuse it in any field, ``extra_body``'s included (named by its own key), before anything
        encodes it (found by a break-it pass: ``negative_prompt`` and ``model`` gave a 500)."""
        if isinstance(data, dict):
            for key, value in data.items():
                fields = value.items() if key == "extra_body" and isinstance(value, dict) else [(key, value)]
                for name, item in fields:
                    bad = _first_surrogate(name) or _first_surrogate(item)
                    if bad is not None:
                        label = name.encode("utf-8", "backslashreplace").decode("utf-8")
                        raise rule_error(label, f"{label} holds a lone UTF-16 surrogate (U+{ord(bad):04X}), "
                                                "which is not valid Unicode text")
        return data

    @model_validator(mode="after")
    def _log_extra_fields(self) -> "OpenAIBaseModel":
        if self.model_extra:
            names = sorted(self.model_extra)
            shown = ", ".join(repr(_clip(name)) for name in names[:EXTRA_FIELDS_NAMED])
            more = f" and {len(names) - EXTRA_FIELDS_NAMED} more" if len(names) > EXTRA_FIELDS_NAMED else ""
            logger.warning("ignored request fields not in this API (%d fields): %s%s", len(names), shown, more)
        return self


class DiTCacheOptions(BaseModel):
    """The ``dit_cache`` extension: opt-in DiT step caching (a first-block residual cache).

    A step whose first-layer residual changed by less than ``threshold`` (relative L1) since the last
    full step reuses the cached output of the remaining layers; the first ``warmup_steps`` always
    run in full. Off unless given. Faster, not identical: quality on real weights is the user's to
    judge.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
    ar_guidance_scale: StrictFloat | None = Field(None, ge=GUIDANCE_SCALE_RANGE[0], le=GUIDANCE_SCALE_RANGE[1],
                                                  description="Extension: AR-side "
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

    @model_validator(mode="after")
    def _check_supported(self) -> "ImageGenerationRequest":
        """Known-unsupported OpenAI fields and ``extra_body`` values that contradict the top level."""
        for name, why in UNSUPPORTED_OPENAI_FIELDS.items():
            if getattr(self, name) is not None:
                raise rule_error(name, f"'{name}' is not supported: {why}",
                                       "unsupported_parameter")
        for key, value in (self.extra_body or {}).items():
            top = getattr(self, key)
            same = top == value
            if key == "cfg_range" and isinstance(value, (list, tuple)) and top is not None:
                same = len(value) == 2 and tuple(float(v) for v in value) == tuple(top)
            if not same:
                raise rule_error(key, f"extra_body.{key}={value!r} conflicts with {key}={top!r} "
                                       "given at the top level", "conflicting_parameter")
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> "ImageGenerationRequest":
        """The cross-field rules that need no settings."""
        if is_blank(self.prompt):
            raise rule_error("prompt", "prompt must not be blank (it has no visible character)")
        if self.output_compression is not None and (self.output_format or "png") == "png":
            raise rule_error("output_compression", "output_compression applies to jpeg and "
                                   "webp only (png is lossless)")
        if self.background == "transparent":
            raise rule_error("background", "background 'transparent' is not supported: the "
                                   "model paints opaque images (use 'opaque' or 'auto')")
        if self.num_inference_steps is not None and self.quality not in (None, "auto"):
            raise rule_error("quality", "give either quality or num_inference_steps, not both",
                                   "conflicting_parameter")
        if self.text_guidance_scale is not None and self.style is not None:
            raise rule_error("style", "give either style or text_guidance_scale, not both",
                                   "conflicting_parameter")
        if self.partial_images and not self.stream:
            raise rule_error("partial_images", "partial_images needs stream=true")
        if self.stream_progress and not self.stream:
            raise rule_error("stream_progress", "stream_progress needs stream=true")
        if self.seed is not None and self.seed + (self.n or 1) - 1 > INT64_MAX:
            raise rule_error("seed", "seed + n - 1 must fit in a signed 64-bit integer")
        return self

    # --- the rules that need the deployment's settings ---

    def to_image_job(self, settings: GatewaySettings, request_id: str) -> ImageJob:
        """Check the request against ``settings`` and fill every default.

        Raises:
            InvalidRequestError: a limit of ``settings`` is exceeded (``param`` names the field).
            NotFoundError: ``model`` is not the served model (``code="model_not_found"``).
        """
        if self.model is not None and self.model != settings.model_name:
            raise NotFoundError(f"the model '{self.model}' does not exist; this gateway serves "
                                f"'{settings.model_name}'", param="model", code="model_not_found")
        negative = self.negative_prompt or ""
        check_prompt_length("prompt", self.prompt, settings)
        check_prompt_length("negative_prompt", negative, settings)
        width, height = parse_size(self.size, settings)
        grid = resolve_ar_grid(self.ar_grid, width, height, self.prompt, negative, settings)
        steps = self._steps(settings)
        with limit_errors():
            limits.check_image(width, height, steps, limits.from_settings(settings))
        partial_images = self.partial_images or 0
        if partial_images > steps:
            raise InvalidRequestError(f"partial_images ({partial_images}) exceeds the number of "
                                      f"denoising steps ({steps})", param="partial_images")
        dit_cache = self._dit_cache(steps)
        output_format = self.output_format or "png"
        compression = 0 if output_format == "png" else (
            DEFAULT_OUTPUT_COMPRESSION if self.output_compression is None
            else self.output_compression)
        cfg_range = self.cfg_range if self.cfg_range is not None else settings.default_cfg_range
        return ImageJob(
            request_id=request_id, prompt=self.prompt, negative_prompt=negative, width=width,
            height=height, ar_grid=grid, n=self.n or 1,
            seed=self.seed if self.seed is not None else secrets.randbelow(2**32),
            num_inference_steps=steps, text_guidance_scale=self._guidance(settings),
            cfg_range=(float(cfg_range[0]), float(cfg_range[1])),
            ar_guidance_scale=float(self.ar_guidance_scale or 0.0),
            decoding=DecodingOptions.resolve(
                self.ar_decoding, self.jacobi_window, self.jacobi_token_reuse,
                self.jacobi_spatial_init,
                DecodingOptions(settings.default_ar_decoding, settings.default_jacobi_window)),
            output_format=output_format,
            output_compression=compression, partial_images=partial_images,
            response_format=self.response_format or "b64_json", stream=bool(self.stream),
            quality=QUALITY_ECHO[self.quality or "auto"],
            safety_identifier=self.safety_identifier or self.user or None, dit_cache=dit_cache,
            stream_progress=bool(self.stream_progress))

    def _steps(self, settings: GatewaySettings) -> int:
        """``num_inference_steps``, else the default scaled by ``quality`` (capped by max_steps)."""
        if self.num_inference_steps is not None:
            return self.num_inference_steps
        steps = max(1, round(settings.default_steps * QUALITY_STEP_FACTORS[self.quality or "auto"]))
        return min(steps, settings.max_steps)

    def _dit_cache(self, steps: int) -> tuple[float, int] | None:
        """``(threshold, warmup_steps)`` of an enabled ``dit_cache``, or None (off).

        Raises:
            InvalidRequestError: ``warmup_steps`` exceeds ``steps`` (``param="dit_cache"``).
        """
        if self.dit_cache is None or self.dit_cache.threshold <= 0:
            return None
        if self.dit_cache.warmup_steps > steps:
            raise InvalidRequestError(f"dit_cache.warmup_steps ({self.dit_cache.warmup_steps}) exceeds "
                                      f"the number of denoising steps ({steps})", param="dit_cache")
        return float(self.dit_cache.threshold), int(self.dit_cache.warmup_steps)

    def _guidance(self, settings: GatewaySettings) -> float:
        """``text_guidance_scale``, else the default (halved, at least 1, for ``style: natural``)."""
        if self.text_guidance_scale is not None:
            return float(self.text_guidance_scale)
        if self.style == "natural":
            return max(1.0, settings.default_guidance_scale * NATURAL_GUIDANCE_FACTOR)
        return float(settings.default_guidance_scale)


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
