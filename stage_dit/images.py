"""Image tensor -> bytes for the API (PNG by default, JPEG/WebP on request)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

#: accepted `fmt` values -> Pillow format names
FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """`(3, H, W)` float in [-1, 1] -> uint8 `(H, W, 3)`: `round(clamp((x + 1) / 2, 0, 1) * 255)`.

    Raises:
        ValueError: if the tensor is not `(3, H, W)`.
    """
    if image.ndim != 3 or image.shape[0] != 3:
        raise ValueError(f"image must be (3, H, W), got {tuple(image.shape)}")
    x = ((image.detach().float().cpu() + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0
    return x.round().to(torch.uint8).permute(1, 2, 0).contiguous().numpy()


def encode_image(image: torch.Tensor, fmt: str = "png", compression: int = 0) -> bytes:
    """Encode a `(3, H, W)` image in [-1, 1].

    Args:
        image: float tensor `(3, H, W)`.
        fmt: `png`, `jpeg` (`jpg`) or `webp`, case-insensitive.
        compression: 0..100 (OpenAI `output_compression`), clamped; JPEG/WebP quality is
            `100 - compression`. PNG is lossless and ignores it; its bytes are deterministic.

    Returns:
        the encoded file.

    Raises:
        ValueError: on an unknown format or a bad shape.
    """
    name = FORMATS.get(fmt.lower())
    if name is None:
        raise ValueError(f"unsupported image format {fmt!r}; expected one of {sorted(FORMATS)}")
    pil = Image.fromarray(to_uint8(image))
    out = io.BytesIO()
    if name == "PNG":
        pil.save(out, format=name)
    else:
        quality = 100 - min(100, max(0, int(compression)))
        pil.save(out, format=name, quality=quality)
    return out.getvalue()
