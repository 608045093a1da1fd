"""A request's images, door-neutral: a URL (`data:` inline, or `file://` under `--allowed-local-media-path`; http(s)
is never fetched) or raw bytes decoded into a checked PIL image, and the images attached to the request's spec
(its placeholders expanded: scheduler_node/text/images.py). Every refusal is an InvalidField naming the field."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image

from scheduler_node.api.openai_protocol import IMAGE_PLACEHOLDER
from scheduler_node.api.validation import InvalidField
from scheduler_node.core.request import RequestSpec
from scheduler_node.text.images import ImageError, ImagePrompts

# The image formats (PIL's names) and MIME types a request may send.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
MIME_TYPES = frozenset(FORMATS.values()) | {"image/jpg"}
MAX_IMAGE_FILE_BYTES = 20 * 1024 * 1024  # one encoded image, before decoding


def image_from_url(url: str, field: str, allowed_local_path: str, max_pixels: int) -> Image.Image:
    """The image a URL names: `data:<mime>;base64,...` or `file://` under `allowed_local_path`."""
    if not isinstance(url, str) or not url:
        raise InvalidField(field, "must be a non-empty URL string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_image(_data_url(url, field), field, max_pixels)
    if scheme == "file":
        return decode_image(_local_file(url, field, allowed_local_path), field, max_pixels)
    if scheme in ("http", "https"):
        raise InvalidField(field, "http(s) URLs are not fetched by this server; send the image inline as a data: URL")
    raise InvalidField(field, f"URL scheme {scheme or '(none)'!r} is not supported; send a data: URL")


def _data_url(url: str, field: str) -> bytes:
    head, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise InvalidField(field, "a data: URL needs a ',' before its payload")
    parts = head.split(";")
    mime = parts[0].strip().lower()
    if mime not in MIME_TYPES:
        raise InvalidField(field, f"MIME type {mime or '(none)'!r} is not supported ({', '.join(sorted(MIME_TYPES))})")
    if "base64" not in parts[1:]:
        raise InvalidField(field, "an image data: URL must be base64 (data:image/png;base64,...)")
    if len(payload) > MAX_IMAGE_FILE_BYTES * 4 // 3 + 4:
        raise InvalidField(field, f"the image is larger than {MAX_IMAGE_FILE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidField(field, "the data: URL's payload is not valid base64") from None


def _local_file(url: str, field: str, allowed: str) -> bytes:
    if not allowed:
        raise InvalidField(field, "file:// URLs are refused: the server has no --allowed-local-media-path")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise InvalidField(field, f"file:// URL names host {parsed.netloc!r}; only local files are read")
    root = Path(allowed).resolve()
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise InvalidField(field, f"{path} is outside --allowed-local-media-path {root}")
    if not path.is_file():
        raise InvalidField(field, f"{path} is not a file")
    if path.stat().st_size > MAX_IMAGE_FILE_BYTES:
        raise InvalidField(field, f"{path} is larger than {MAX_IMAGE_FILE_BYTES} bytes")
    return path.read_bytes()


def decode_image(data: bytes, field: str, max_pixels: int) -> Image.Image:
    """Encoded bytes to an RGB image: its format one of FORMATS, its size within `max_pixels` (checked from the
    header, before the pixels are decoded), and the whole of it readable (a truncated file is refused)."""
    if len(data) > MAX_IMAGE_FILE_BYTES:
        raise InvalidField(field, f"the image is larger than {MAX_IMAGE_FILE_BYTES} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.format not in FORMATS:
                raise InvalidField(field, f"image format {image.format} is not supported ({', '.join(FORMATS)})")
            w, h = image.size
            if w * h > max_pixels:
                raise InvalidField(field, f"{w}x{h} pixels exceed the limit of {max_pixels} (--max-image-pixels)")
            image.load()
    except InvalidField:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise InvalidField(field, f"not a readable image ({exc})") from None
    return image.convert("RGB")


def with_images(
    spec: RequestSpec,
    images: list[Image.Image],
    fields: list[str],
    prompts: ImagePrompts | None,
    max_model_len: int,
    prompt_field: str,
) -> RequestSpec:
    """The spec with its images: each placeholder expanded to the image's tokens (ImageError → InvalidField). A
    text-only model refuses images; max_tokens is cut to what the longer prompt leaves."""
    if not images and (prompts is None or prompts.layout.image_token_id not in spec.prompt_token_ids):
        return spec  # (placeholders without images are refused below, as HF refuses them)
    prompts = images_taken(prompts, fields) if images else prompts
    assert prompts is not None
    try:
        ids, inputs = prompts.expand(spec.prompt_token_ids, images, fields, prompt_field)
    except ImageError as exc:
        raise InvalidField(exc.field, exc.message) from None
    if len(ids) >= max_model_len:
        raise InvalidField(prompt_field, f"with its images the prompt has {len(ids)} tokens; max_model_len is "
                                         f"{max_model_len}, leaving no room to generate")  # fmt: skip
    max_tokens = min(spec.max_tokens, max_model_len - len(ids))
    return dataclasses.replace(spec, prompt_token_ids=ids, images=inputs, max_tokens=max_tokens)


def images_taken(prompts: ImagePrompts | None, fields: list[str]) -> ImagePrompts:
    """The model's image handling when it takes these images: refused (naming the first) by a text-only model,
    and beyond --limit-mm-per-prompt (naming the first one over)."""
    if prompts is None:
        raise InvalidField(fields[0], "this model takes no images (a text-only model, or one served without "
                                      "--extra-modules vision_encoder)")  # fmt: skip
    if len(fields) > prompts.limit:
        raise InvalidField(fields[prompts.limit], f"{len(fields)} images exceed --limit-mm-per-prompt "
                                                  f"image={prompts.limit}")  # fmt: skip
    return prompts


def check_image(prompts: ImagePrompts | None, image: object, field: str) -> Image.Image:
    """An image a Python caller handed over (a PIL image): checked like a decoded one."""
    if not isinstance(image, Image.Image):
        raise InvalidField(field, f"must be a PIL.Image.Image, got {type(image).__name__}")
    if prompts is not None:
        try:
            prompts.check_size(image, field)
        except ImageError as exc:
            raise InvalidField(exc.field, exc.message) from None
    return image


def message_images(
    messages: list[dict[str, Any]], prompts: ImagePrompts | None, name: str = "messages"
) -> tuple[list[dict[str, Any]], list[Image.Image], list[str]]:
    """Python chat messages (`LLM.chat`) with their image parts (`image_url` as the OpenAI door takes it, or
    `image_pil` with a PIL image) replaced by the placeholder in the text; the images and their fields."""
    out: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    fields: list[str] = []
    pending: list[tuple[str, dict[str, Any]]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            field = f"{name}[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in ("image_url", "image_pil"):
                texts.append(IMAGE_PLACEHOLDER)
                pending.append((f"{field}.{kind}", part))
            else:
                raise InvalidField(field, "a content part is {'type': 'text' | 'image_url' | 'image_pil', ...}")
        out.append({**message, "content": "\n".join(texts)})
    if pending:
        prompts = images_taken(prompts, [f for f, _ in pending])
        for field, part in pending:
            if part["type"] == "image_pil":
                images.append(check_image(prompts, part.get("image_pil"), field).convert("RGB"))
            else:
                inner = part.get("image_url")
                url = inner.get("url") if isinstance(inner, dict) else inner
                images.append(image_from_url(str(url or ""), f"{field}.url", prompts.local_path, prompts.max_pixels))
            fields.append(field)
    return out, images, fields


def prompt_images(data: object, prompts: ImagePrompts | None, name: str) -> tuple[list[Image.Image], list[str]]:
    """A vLLM prompt dict's `multi_modal_data` (`{"image": PIL image | [PIL images]}`): the images, their fields."""
    if not isinstance(data, dict):
        raise InvalidField(name, f"must be a dict such as {{'image': PIL.Image}}, got {type(data).__name__}")
    unknown = [k for k in data if k != "image"]
    if unknown:
        raise InvalidField(f"{name}.{unknown[0]}", "only 'image' is supported")
    given = data.get("image")
    items: list[Any] = list(given) if isinstance(given, (list, tuple)) else [given]
    many = isinstance(given, (list, tuple))
    fields = [f"{name}.image[{k}]" if many else f"{name}.image" for k in range(len(items))]
    if not items:
        return [], []
    prompts = images_taken(prompts, fields)
    return [check_image(prompts, image, f).convert("RGB") for image, f in zip(items, fields)], fields
