"""Images through the OpenAI door (with the official client where it can say it): chat content parts with data:
URLs reach the engine as the image's tokens and pixels; every bad image, too many images, a URL the server must not
read and an image for a text-only model are a 400 naming the part, and the door serves on."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest

from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.core import RequestStream
from scheduler_node.text.tokenizer import ModelTokenizer
from tests.support.images import image_prompts, picture, png_bytes
from tests.support.openai_door import MODEL, openai_client
from tests.support.stand_in import running, stand_in_engine, tokenizer

pytestmark = pytest.mark.model


def url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(picture(seed))).decode()


def chat(*urls: str, text: str = "What is in the picture?") -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 3}


def test_images_reach_the_engine_and_bad_ones_are_400s_naming_the_part(tiny_llava_dir: Path) -> None:
    engine = stand_in_engine()
    engine.images = image_prompts(tiny_llava_dir, limit=2)
    seen: list[Any] = []
    submit = engine.submit

    def recording(spec: RequestSpec, deadline_s: float = 0.0) -> RequestStream:
        seen.append(spec)
        return submit(spec, deadline_s)

    engine.submit = recording  # type: ignore[method-assign]

    async def main() -> None:
        async with running(engine), openai_client(engine, ModelTokenizer(tiny_llava_dir)) as (client, raw):
            answer = await client.chat.completions.create(**chat(url(1), url(2)), extra_body={"ignore_eos": True})
            text_only = (await raw.post("/chat/completions", json=chat())).json()
            assert answer.usage is not None
            # each image part: a newline and its 16 tokens
            assert answer.usage.prompt_tokens == text_only["usage"]["prompt_tokens"] + 2 * (1 + 16)
            (spec,) = seen[:1]
            assert [(i.length, i.shape) for i in spec.images] == [(16, [3, 28, 28])] * 2
            bad = {
                "messages[0].content[1].image_url": chat("data:image/png;base64,AAAA"),
                "messages[0].content[3].image_url": chat(url(1), url(2), url(3)),
                "messages[0].content[2].image_url": chat(url(1), "https://example.com/cat.png"),
            }
            for param, body in bad.items():
                response = await raw.post("/chat/completions", json=body)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == param, response.text
            typed = await raw.post("/chat/completions", json=chat(text="<image> with no image part"))
            assert typed.status_code == 400 and typed.json()["error"]["param"] == "messages", typed.text
            again = await client.chat.completions.create(**chat(url(4)), extra_body={"ignore_eos": True})  # serving on
            assert again.choices[0].finish_reason == "length"
            assert engine.scheduler.blocks.num_free == engine.scheduler.blocks.num_blocks

    asyncio.run(main())


def test_a_text_only_model_refuses_an_image() -> None:
    engine = stand_in_engine()

    async def main() -> None:
        async with running(engine), openai_client(engine, tokenizer()) as (_, raw):
            response = await raw.post("/chat/completions", json=chat(url(1)))
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["param"] == "messages[0].content[1].image_url" and "takes no images" in error["message"]

    asyncio.run(main())
