"""An image of a request, read where the API process reads it: a `data:` URL, or a file
under `--allowed-local-media-path`. Nothing of an image reaches the engine core unless it
is whole here: its encoded size is capped before it is decoded from base64 or read from
disk, its pixel count is read from its header and capped before its pixels are decoded
(a PNG claiming 100k x 100k pixels costs a header read), and a broken file is an
`ImageError` naming the content part it came in.

http(s) URLs are refused: fetching them (resolving every hop, refusing private
addresses) is not part of this server; clients send the image's bytes as a data URL.
"""

import base64
import binascii
import hashlib
import io
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

# What Pillow may decode here: the formats clients send. Others (PSD, EPS through
# Ghostscript, TGA, ...) are refused by name before any of their decoders runs.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MODALITIES = ("image",)


class ImageError(ValueError):
    """An image the server will not read, with the content part it came in (`where`,
    e.g. `messages[0].content[1].image_url`)."""

    def __init__(self, where: str, why: str) -> None:
        self.where = where
        super().__init__(f"{where}: {why}")


@dataclass(frozen=True)
class MediaLimits:
    """`max_images`: images one prompt may carry (0: the model takes none);
    `max_image_bytes`: an image's encoded size; `max_image_pixels`: its width x height,
    read from its header; `allowed_local_media_path`: the directory `file://` URLs may
    name (symlinks followed), None: none."""

    max_images: int = 0
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"limit_mm_per_prompt: image must be >= 0, got {self.max_images}")
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class LoadedImage:
    """An image decoded to RGB, and the SHA-256 of its encoded bytes: what the prefix
    cache and the encoder cache know it by."""

    image: Image.Image
    digest: str


def parse_limit_mm_per_prompt(text: str | None) -> int | None:
    """vLLM's `--limit-mm-per-prompt` JSON (`{"image": 2}`) -> the image limit; None when
    not given. ValueError naming the flag for anything else."""
    if text is None or not text.strip():
        return None
    try:
        limits = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"limit_mm_per_prompt: not valid JSON: {exc}") from None
    if not isinstance(limits, dict):
        raise ValueError('limit_mm_per_prompt: must be a JSON object such as {"image": 2}')
    unknown = set(limits) - set(MODALITIES)
    if unknown:
        raise ValueError(
            f"limit_mm_per_prompt: {', '.join(sorted(unknown))} is not served; "
            f"modalities: {', '.join(MODALITIES)}"
        )
    image = limits.get("image", 0)
    if isinstance(image, bool) or not isinstance(image, int) or image < 0:
        raise ValueError(f"limit_mm_per_prompt: image must be an integer >= 0, got {image!r}")
    return image


def load_image(url: str, where: str, limits: MediaLimits) -> LoadedImage:
    """The image a content part's URL names, decoded; ImageError otherwise."""
    if url.startswith("data:"):
        data = _data_url_bytes(url, where, limits)
    elif url.startswith("file://"):
        data = _local_file_bytes(url[len("file://") :], where, limits)
    elif url.startswith(("http://", "https://")):
        raise ImageError(
            where,
            "http(s) image URLs are not fetched by this server; send the image as a "
            "data: URL (data:image/png;base64,...)",
        )
    else:
        raise ImageError(where, "must be a data: URL (data:image/png;base64,...)")
    return LoadedImage(_decode(data, where, limits), hashlib.sha256(data).hexdigest())


def _data_url_bytes(url: str, where: str, limits: MediaLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64") or not header.startswith("data:image/"):
        raise ImageError(where, "a data URL must read data:image/<format>;base64,<data>")
    # base64 holds 3 bytes in every 4 characters: refused before it is decoded.
    if len(payload) // 4 * 3 > limits.max_image_bytes:
        raise ImageError(where, _too_large(len(payload) // 4 * 3, limits))
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(where, "the data URL's payload is not valid base64") from None


def _local_file_bytes(path: str, where: str, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise ImageError(
            where, "file:// URLs are not enabled on this server (--allowed-local-media-path)"
        )
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise ImageError(where, f"file:// URLs must name a file under {root}")
    try:
        with open(real, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size > limits.max_image_bytes:
                raise ImageError(where, _too_large(size, limits))
            data = file.read(limits.max_image_bytes + 1)
    except OSError as exc:
        raise ImageError(where, f"cannot read {Path(path).name}: {exc.strerror}") from None
    if len(data) > limits.max_image_bytes:  # the file grew while it was read
        raise ImageError(where, _too_large(len(data), limits))
    return data


def _decode(data: bytes, where: str, limits: MediaLimits) -> Image.Image:
    with warnings.catch_warnings():
        # Pillow's own bomb check only warns below twice its limit; ours is the cap.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except Image.DecompressionBombError:
            raise ImageError(where, _too_many_pixels(None, limits)) from None
        except Exception:  # noqa: BLE001 - Pillow raises what its format plugins raise
            raise ImageError(
                where, f"not an image Pillow can read (formats: {', '.join(IMAGE_FORMATS)})"
            ) from None
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise ImageError(where, _too_many_pixels((width, height), limits))
        try:
            return image.convert("RGB")
        except Exception:  # noqa: BLE001 - a truncated or corrupt body fails here
            raise ImageError(where, f"the {image.format} image is truncated or corrupt") from None


def _too_large(size: int, limits: MediaLimits) -> str:
    return f"the image is {size} bytes; at most {limits.max_image_bytes} are read"


def _too_many_pixels(size: tuple[int, int] | None, limits: MediaLimits) -> str:
    said = f"{size[0]} x {size[1]} pixels" if size else "too many pixels"
    return f"the image claims {said}; at most {limits.max_image_pixels} pixels are decoded"
