"""A request's images before any model sees them: data: URLs, local files only under --allowed-local-media-path,
http(s) never fetched, and every bad image (corrupt, truncated, too large, another format or MIME type) refused
with the field named; OpenAI chat content parts keep their image URLs in order."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from scheduler_node.api.media import decode_image, image_from_url
from scheduler_node.api.openai_protocol import IMAGE_PLACEHOLDER, ChatMessage
from scheduler_node.api.validation import InvalidField
from tests.support.images import picture, png_bytes

pytestmark = pytest.mark.unit

FIELD = "messages[0].content[1].image_url"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def refused(url: str, match: str, allowed: str = "", max_pixels: int = 10**6) -> None:
    with pytest.raises(InvalidField, match=match) as caught:
        image_from_url(url, FIELD, allowed, max_pixels)
    assert caught.value.field == FIELD


def test_a_data_url_decodes_to_the_image() -> None:
    image = picture(1)
    for fmt, mime in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        back = image_from_url(data_url(png_bytes(image, fmt), mime), FIELD, "", 10**6)
        assert back.size == image.size and back.mode == "RGB"
    back = image_from_url(data_url(png_bytes(image)), FIELD, "", 10**6)
    assert (np.asarray(back) == np.asarray(image)).all()  # lossless: the very pixels


def test_bad_images_are_refused_by_field() -> None:
    good = png_bytes(picture(1))
    refused(data_url(good, "image/svg+xml"), "MIME type 'image/svg\\+xml' is not supported")
    refused(data_url(good, "text/plain"), "MIME type 'text/plain'")
    refused("data:image/png;base64,@@@not base64@@@", "not valid base64")
    refused("data:image/png," + "x" * 10, "must be base64")
    refused(data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "not a readable image")
    refused(data_url(good[: len(good) // 2]), "not a readable image")  # truncated
    refused(data_url(png_bytes(picture(1), "TIFF"), "image/png"), "image format TIFF is not supported")
    refused(data_url(good), "40x53 pixels exceed the limit of 100", max_pixels=100)


def test_remote_urls_are_never_fetched_and_local_files_only_under_the_allowed_path(tmp_path: Path) -> None:
    refused("https://example.com/cat.png", "http\\(s\\) URLs are not fetched")
    refused("http://127.0.0.1/cat.png", "http\\(s\\) URLs are not fetched")
    refused("ftp://host/cat.png", "URL scheme 'ftp' is not supported")
    allowed, outside = tmp_path / "media", tmp_path / "private"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(picture(2)))
    (outside / "key.png").write_bytes(png_bytes(picture(3)))
    refused(f"file://{allowed / 'cat.png'}", "no --allowed-local-media-path")
    assert image_from_url(f"file://{allowed / 'cat.png'}", FIELD, str(allowed), 10**6).size == (40, 53)
    refused(f"file://{outside / 'key.png'}", "outside --allowed-local-media-path", allowed=str(allowed))
    refused(f"file://{allowed}/../private/key.png", "outside --allowed-local-media-path", allowed=str(allowed))
    refused(f"file://{allowed / 'none.png'}", "is not a file", allowed=str(allowed))


def test_decoding_checks_the_size_before_the_pixels() -> None:
    with pytest.raises(InvalidField, match="image: 4000x4000 pixels exceed"):
        decode_image(png_bytes(Image.new("RGB", (4000, 4000))), "image", 10**6)  # a small file, many pixels


def test_chat_content_parts_keep_their_image_urls_in_order() -> None:
    parts = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB", "detail": "low"}},
    ]
    message = ChatMessage.model_validate({"role": "user", "content": parts})
    assert message.content == f"Compare\n{IMAGE_PLACEHOLDER}\n{IMAGE_PLACEHOLDER}"
    assert message.image_urls == [(1, "data:image/png;base64,AAAA"), (2, "data:image/png;base64,BBBB")]
    with pytest.raises(ValidationError, match="image_url"):
        ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})
    with pytest.raises(ValidationError, match="content_part|only parts"):
        ChatMessage.model_validate({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]})
