"""Request defaults and limits: the one table, and the arithmetic of what the AR can hold.

Everything a deployment may tune about requests (default steps, guidance, pixel and prompt limits,
the AR grid recipe, the AR's position limit, the DiT's rows per slot) has its default, its allowed
range and its meaning in `RequestLimits` below. The rest derive from it:

- the component settings (`mammoth_core.settings`: the gateway's, the DiT's and the AR's fields
  of the same names take their defaults and help from `field_default`/`field_help`);
- the CRD's ``spec.requestDefaults`` schema (defaults, minimum, maximum of every field with a
  ``crd`` key) and the operator's spec parser (`operator/mammoth_operator/spec.py`);
  ``tests/unit/test_limits.py`` fails when any of them drifts from this table;
- the checks: the gateway runs `check_request` before any stage work, the DiT runs
  `check_image` on direct calls, the AR re-checks `positions_needed` against its own model.

Torch-free and stage-free (the gateway and the operator import it).

The AR grid (MODEL.md): a grid of ``gw x gh`` cells costs ``gh * (gw + 1)`` AR positions (each row
ends with an end-of-line token) after the prompt envelope; the DiT reads it through the Q-Former
refiner, so the grid is independent of the output size. ``ar_grid`` picks it: ``"auto"`` is
``(width // 16, height // 16)`` (vllm-omni's recipe); ``"WxH"`` is a grid of ``W * H`` cells in the
image's aspect ratio (`resolve_grid` says how it rounds), which is exactly ``W x H`` when ``W:H`` is
the image's aspect ratio (the model card's recipe is ``32x32`` for 1024x1024).

Prompt tokens are bounded without the tokenizer: the AR's tokenizer is byte-level BPE over the
NFC-normalised text, every token holds at least one byte, so a text never has more tokens than the
UTF-8 bytes of its NFC form (`text_token_bound`). The envelope around the prompt is bounded the same
way (`ENVELOPE_TOKEN_BOUND`; ``tests/unit/test_limits.py`` checks both against the real tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from mammoth_core.decoding import DEFAULT_JACOBI_WINDOW, JACOBI_WINDOW_RANGE, ARDecoding

#: Pixels per AR grid cell along each side (MODEL.md: ``ar_width = width // 16``).
GRID_PIXELS = 16
#: Largest grid side accepted in ``ar_grid`` (cells); the position limit bounds it further.
MAX_GRID_SIDE = 1024
#: Text-guidance scale bounds of the API (requests and the deployment default).
GUIDANCE_SCALE_RANGE = (0.0, 100.0)
#: ``dit_cache.threshold``: relative change of the DiT's first-layer residual (0 = off)
DIT_CACHE_THRESHOLD_RANGE = (0.0, 1.0)
#: Upper bound on the tokens of the text-to-image envelope around the prompt, without the grid
#: digits: 7 special tokens (``<|im_start|>`` x3, ``<|im_end|>`` x2, ``<|image start|>``,
#: ``<|image token|>``) + the UTF-8 bytes of ``system\nYou are a helpful image generator.``,
#: ``\n``, ``user\n``, ``\n`` and ``assistant\n`` (41 + 1 + 5 + 1 + 10).
ENVELOPE_TOKEN_BOUND = 65
#: Same for a negative prompt's envelope (system turn + user turn, no generation prompt):
#: 4 specials + 41 + 1 + 5 + 1 bytes.
NEGATIVE_ENVELOPE_TOKEN_BOUND = 52

_GRID_RE = re.compile(r"^([0-9]{1,4})x([0-9]{1,4})$")
#: Exactly ``WIDTHxHEIGHT``: ASCII digits, no leading zero, nothing around (matched with ``fullmatch``:
#: ``$`` would also let a trailing newline through).
_SIZE_RE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")


def _limit(default: Any, help_text: str, *, crd: str | None = None, minimum: float | None = None,
           maximum: float | None = None) -> Any:
    """A `RequestLimits` field: its default, help, CRD key and allowed range."""
    meta = {"help": help_text, "crd": crd, "minimum": minimum, "maximum": maximum}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RequestLimits:
    """The table. Field names are the settings' names; ``crd`` is the ``spec.requestDefaults`` key.

    Units: pixels (``*_pixels``), characters (``max_prompt_chars``), seconds, AR positions
    (``max_sequence_length``: prompt envelope + grid tokens of one sequence), DiT rows
    (``max_rows_per_slot``: CONDITION + NEGATIVE rows of one request).
    """

    default_steps: int = _limit(50, "default num_inference_steps", crd="steps", minimum=1, maximum=200)
    max_steps: int = _limit(200, "largest num_inference_steps accepted (gateway and DiT)",
                            minimum=1, maximum=1000)
    default_guidance_scale: float = _limit(
        9.0, "default text_guidance_scale", crd="guidanceScale", minimum=GUIDANCE_SCALE_RANGE[0],
        maximum=GUIDANCE_SCALE_RANGE[1])
    default_cfg_range: list[float] = _limit([0.0, 1.0], "default cfg_range start,end", crd="cfgRange")
    default_size: str = _limit("1024x1024", "size used for size=auto")
    default_ar_grid: str = _limit(
        "auto", "AR grid used when a request gives no ar_grid: 'auto' (width/16 x height/16) or "
        "'WxH' (W*H cells in the image's aspect ratio, e.g. the model card's 32x32)", crd="arGrid")
    default_ar_decoding: str = _limit(
        "sequential", "AR decoding of requests that give no ar_decoding: 'sequential' (one image token per "
        "forward) or 'jacobi' (speculative Jacobi windows: the same distribution, fewer forwards)",
        crd="arDecoding")
    default_jacobi_window: int = _limit(
        DEFAULT_JACOBI_WINDOW, "Jacobi window (tokens per verification forward) of requests that give no "
        "jacobi_window", crd="jacobiWindow", minimum=JACOBI_WINDOW_RANGE[0], maximum=JACOBI_WINDOW_RANGE[1])
    min_pixels: int = _limit(16 * 16, "smallest width*height accepted (gateway and DiT)",
                             crd="minPixels", minimum=256, maximum=16777216)
    max_pixels: int = _limit(1536 * 1536, "largest width*height accepted (gateway and DiT)",
                             crd="maxPixels", minimum=256, maximum=16777216)
    max_prompt_chars: int = _limit(4000, "longest prompt (and negative prompt) accepted, in characters",
                                   crd="maxPromptChars", minimum=1, maximum=1000000)
    request_timeout_seconds: int = _limit(
        600, "per-request time budget in seconds", crd="requestTimeoutSeconds", minimum=10, maximum=3600)
    max_sequence_length: int = _limit(
        12288, "AR positions per sequence (prompt envelope + grid tokens); 1536x1536 with ar_grid "
        "auto needs 9,312 grid positions", minimum=256, maximum=131072)
    max_rows_per_slot: int = _limit(
        16384, "largest CONDITION+NEGATIVE row count one DiT slot accepts", minimum=256, maximum=262144)


#: The defaults of the table.
DEFAULTS = RequestLimits()


def limit_fields() -> tuple[dataclasses.Field, ...]:
    """The table's rows (`dataclasses.Field` with ``metadata``: help, crd, minimum, maximum)."""
    return dataclasses.fields(RequestLimits)


def field_default(name: str) -> Any:
    """Default of the table's field ``name`` (a fresh copy for lists)."""
    value = getattr(DEFAULTS, name)
    return list(value) if isinstance(value, list) else value


def field_help(name: str) -> str:
    """Help text of the table's field ``name``."""
    return RequestLimits.__dataclass_fields__[name].metadata["help"]


def crd_keys() -> dict[str, str]:
    """``{settings name: spec.requestDefaults key}`` of the fields the CRD carries."""
    return {f.name: f.metadata["crd"] for f in limit_fields() if f.metadata["crd"]}


class LimitError(ValueError):
    """A request is outside the limits; ``param`` names the request field, ``code`` the kind."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# ------------------------------------------------------------------------------------------------
# The AR grid
# ------------------------------------------------------------------------------------------------


def parse_ar_grid(text: str, param: str = "ar_grid") -> tuple[int, int] | None:
    """``"auto"`` -> None; ``"WxH"`` -> ``(W, H)`` cells, each in [1, `MAX_GRID_SIDE`].

    Raises:
        LimitError: any other text (``param`` names the field).
    """
    if text == "auto":
        return None
    m = _GRID_RE.match(text) if isinstance(text, str) else None
    if m is None or not (1 <= int(m.group(1)) <= MAX_GRID_SIDE and 1 <= int(m.group(2)) <= MAX_GRID_SIDE):
        raise LimitError(f"invalid ar_grid {text!r}: expected 'auto' or 'WxH' with W and H in "
                         f"[1, {MAX_GRID_SIDE}] grid cells, e.g. '32x32'", param)
    return int(m.group(1)), int(m.group(2))


def parse_image_size(text: str, param: str = "size") -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` (ASCII digits, no sign or spaces) -> ``(width, height)`` in pixels; the
    limits on them are `check_image`'s.

    Raises:
        LimitError: any other text (``param`` names the field, code ``invalid_size``).
    """
    m = _SIZE_RE.fullmatch(text) if isinstance(text, str) else None
    if m is None:
        raise LimitError(f"invalid size {text!r}: expected 'WIDTHxHEIGHT' with positive integers, e.g. '1024x1024'",
                         param, code="invalid_size")
    return int(m.group(1)), int(m.group(2))


def resolve_grid(width: int, height: int, ar_grid: str) -> tuple[int, int]:
    """The AR grid ``(gw, gh)`` in cells for an image of ``width x height`` pixels.

    ``"auto"``: ``(width // 16, height // 16)``. ``"WxH"``: area ``A = W * H`` cells in the image's
    aspect ratio ``r = width / height``: ``gw = floor(sqrt(A * r) + 0.5)``,
    ``gh = floor(sqrt(A / r) + 0.5)`` (rounded half up, each at least 1), so the cell count stays
    within a few per cent of ``A`` and ``W x H`` comes back unchanged when ``W:H == width:height``
    (``32x32`` at 1536x1024 is 39x26; at 1024x512, 45x23).

    Raises:
        LimitError: ``ar_grid`` is malformed (``param="ar_grid"``).
    """
    cells = parse_ar_grid(ar_grid)
    if cells is None:
        return width // GRID_PIXELS, height // GRID_PIXELS
    w, h = cells
    if w * height == h * width:
        return w, h
    area, ratio = w * h, width / height
    return (max(1, math.floor(math.sqrt(area * ratio) + 0.5)),
            max(1, math.floor(math.sqrt(area / ratio) + 0.5)))


def grid_tokens(grid_width: int, grid_height: int) -> int:
    """AR positions of a ``gw x gh`` grid: ``gh * (gw + 1)`` (each row ends with an EOL)."""
    return grid_height * (grid_width + 1)


#: A request id: the gateway's (a client's well-formed ``x-request-id``, else ``img-<32 hex>``) and
#: the stages' (the gateway's plus ``-<image index>``). Only these characters, so an id written into
#: a log line cannot break or forge it (a break-it pass logged a newline sent straight to a stage).
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]+")
#: Longest client ``x-request-id`` the gateway keeps; a stage takes that plus the image suffix.
MAX_CLIENT_REQUEST_ID = 128
MAX_STAGE_REQUEST_ID = MAX_CLIENT_REQUEST_ID + 32


def request_id_problem(value: str, max_length: int = MAX_STAGE_REQUEST_ID) -> str | None:
    """Why ``value`` is not a request id (`REQUEST_ID_PATTERN`, 1..``max_length`` characters), or None."""
    if not value:
        return "request_id is required"
    if len(value) > max_length:
        return f"request_id is {len(value)} characters; the maximum is {max_length}"
    if not REQUEST_ID_PATTERN.fullmatch(value):
        return "request_id may hold only ASCII letters, digits and . _ : -"
    return None


def max_caption_rows(axes_lens) -> int:
    """Most condition rows the DiT takes in one CFG branch, from its rotary table lengths
    (``gen_dit_config.axes_lens``): condition row ``i`` has position ``i`` on the first axis and every
    image patch the condition's length, so that length must stay below ``axes_lens[0]``. The negative
    branch's rows are the negative prompt's raw AR rows, so this bounds a negative prompt's tokens."""
    return int(axes_lens[0]) - 1


def text_token_bound(text: str) -> int:
    """Upper bound on the tokens of ``text``: the UTF-8 bytes of its NFC form (byte-level BPE)."""
    return len(unicodedata.normalize("NFC", text).encode("utf-8"))


def positions_needed(prompt: str, grid_width: int, grid_height: int) -> int:
    """Upper bound on the AR positions of one request: envelope + prompt + grid digits + grid."""
    digits = len(f"{grid_width}*{grid_height}")
    return ENVELOPE_TOKEN_BOUND + digits + text_token_bound(prompt) + grid_tokens(grid_width, grid_height)


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


def check_image(width: int, height: int, steps: int, limits: RequestLimits, param: str = "size") -> None:
    """The image parameters every component enforces: sides positive multiples of 16,
    ``min_pixels <= width * height <= max_pixels``, ``1 <= steps <= max_steps``.

    Raises:
        LimitError: ``param`` (size) or ``num_inference_steps`` names the violation.
    """
    size = f"{width}x{height}"
    if width <= 0 or height <= 0 or width % GRID_PIXELS or height % GRID_PIXELS:
        raise LimitError(f"invalid size {size!r}: width and height must each be a positive multiple of "
                         f"{GRID_PIXELS}", param, "invalid_size")
    pixels = width * height
    if not limits.min_pixels <= pixels <= limits.max_pixels:
        raise LimitError(f"invalid size {size!r}: {pixels} pixels is outside [{limits.min_pixels}, "
                         f"{limits.max_pixels}]", param, "invalid_size")
    check_steps(steps, limits)


def check_steps(steps: int, limits: RequestLimits) -> None:
    """``1 <= steps <= max_steps`` (`check_image`'s rule for ``num_inference_steps``).

    Raises:
        LimitError: ``num_inference_steps`` names the violation.
    """
    if not 1 <= steps <= limits.max_steps:
        raise LimitError(f"num_inference_steps must be in [1, {limits.max_steps}], got {steps}",
                         "num_inference_steps")


def check_positions(prompt: str, negative_prompt: str, width: int, height: int,
                    grid: tuple[int, int], grid_param: str, limits: RequestLimits) -> None:
    """What the AR and the DiT can hold: grid + envelope + prompt <= ``max_sequence_length``;
    the negative prompt's sequence likewise; CONDITION + NEGATIVE rows <= ``max_rows_per_slot``.

    Args:
        grid: the resolved AR grid (`resolve_grid`).
        grid_param: the field that chose the grid (``size`` for auto, else ``ar_grid``).

    Raises:
        LimitError: ``param`` is ``grid_param`` when the grid alone cannot fit, ``prompt`` or
            ``negative_prompt`` when the text does not fit next to it.
    """
    gw, gh = grid
    limit = limits.max_sequence_length
    fixed = positions_needed("", gw, gh)
    if fixed > limit:
        raise LimitError(
            f"an AR grid of {gw}x{gh} cells ({grid_tokens(gw, gh)} tokens, for size {width}x{height}) "
            f"needs at least {fixed} positions; the AR holds {limit} (max_sequence_length)",
            grid_param, "invalid_size" if grid_param == "size" else "invalid_value")
    needed = positions_needed(prompt, gw, gh)
    if needed > limit:
        raise LimitError(
            f"prompt is up to {text_token_bound(prompt)} tokens (its UTF-8 bytes); with a {gw}x{gh} "
            f"AR grid the AR holds {limit} positions (max_sequence_length), which leaves "
            f"{limit - fixed} for the prompt", "prompt", "string_above_max_length")
    negative = NEGATIVE_ENVELOPE_TOKEN_BOUND + text_token_bound(negative_prompt) if negative_prompt else 0
    if negative > limit or needed + negative > limits.max_rows_per_slot:
        room = min(limit, limits.max_rows_per_slot - needed) - NEGATIVE_ENVELOPE_TOKEN_BOUND
        raise LimitError(
            f"negative_prompt is up to {text_token_bound(negative_prompt)} tokens (its UTF-8 bytes); "
            f"next to this prompt and grid at most {max(0, room)} fit (max_sequence_length "
            f"{limit}, max_rows_per_slot {limits.max_rows_per_slot})",
            "negative_prompt", "string_above_max_length")


# ------------------------------------------------------------------------------------------------
# Building and validating a table from settings
# ------------------------------------------------------------------------------------------------


def from_settings(settings: Any) -> RequestLimits:
    """The table with the values ``settings`` carries (fields it lacks keep their defaults)."""
    values = {f.name: getattr(settings, f.name) for f in limit_fields() if hasattr(settings, f.name)}
    if "default_cfg_range" in values:
        values["default_cfg_range"] = [float(v) for v in values["default_cfg_range"]]
    return RequestLimits(**values)


def validate(table: RequestLimits, present: set[str] | None = None) -> None:
    """Check every value against its range and the cross-field rules.

    Args:
        present: the fields a component actually configures (None: all); a cross-field rule is
            checked only when both of its fields are present (the DiT has no ``max_sequence_length``).

    Raises:
        ValueError: naming the field (settings name) and the rule.
    """
    def both(a: str, b: str) -> bool:
        return present is None or (a in present and b in present)

    for f in limit_fields():
        value, lo, hi = getattr(table, f.name), f.metadata["minimum"], f.metadata["maximum"]
        if lo is not None and not lo <= value <= hi:
            raise ValueError(f"{f.name} must be in [{lo}, {hi}], got {value}")
    if table.min_pixels > table.max_pixels:
        raise ValueError("min_pixels must not exceed max_pixels")
    if both("default_steps", "max_steps") and table.default_steps > table.max_steps:
        raise ValueError("default_steps must not exceed max_steps")
    if both("max_rows_per_slot", "max_sequence_length") and table.max_rows_per_slot < table.max_sequence_length:
        raise ValueError("max_rows_per_slot must be >= max_sequence_length (a DiT slot holds the "
                         "AR's longest sequence)")
    cfg = table.default_cfg_range
    if len(cfg) != 2 or not 0.0 <= cfg[0] <= cfg[1] <= 1.0:
        raise ValueError("default_cfg_range must be [start, end] with 0 <= start <= end <= 1")
    if table.default_ar_decoding not in {m.value for m in ARDecoding}:
        raise ValueError(f"default_ar_decoding must be one of {[m.value for m in ARDecoding]}, "
                         f"got {table.default_ar_decoding!r}")
    try:
        parse_ar_grid(table.default_ar_grid)
    except LimitError as exc:
        raise ValueError(f"default_ar_grid: {exc.message}") from None
    if present is None or "default_size" in present:  # what a request's size=auto means: a size it may have
        try:
            check_image(*parse_image_size(table.default_size), table.default_steps, table)
        except LimitError as exc:
            raise ValueError(f"default_size: {exc.message}") from None
