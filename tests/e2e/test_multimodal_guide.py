"""docs/guide.md's image example, as written (its address and file name aside), against a scheduler and worker
serving a tiny LLaVA with `--extra-modules vision_encoder`; the same server refuses a remote URL by its part and
serves on."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionContentPartImageParam

from minivllm.cluster import REPO, Cluster
from tests.support.images import picture

pytestmark = pytest.mark.e2e

NAME = "llava-1.5-7b-hf"  # the guide's model name, served under it


def guide_example() -> str:
    guide = (REPO / "docs" / "guide.md").read_text()
    section = guide[guide.index("### Images (LLaVA models)") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "the guide's image section lost its example"
    return found.group(1)


def test_the_guides_image_example_runs(
    tiny_llava_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    picture(1).save(tmp_path / "cat.png")
    cluster = Cluster(tiny_llava_dir, ["--extra-modules", "vision_encoder", "--served-model-name", NAME], http=True)
    try:
        cluster.wait_serving()
        code = guide_example().replace("http://127.0.0.1:8000/v1", cluster.base_url)
        code = code.replace('open("cat.png"', f'open("{tmp_path / "cat.png"}"')
        exec(compile(code, "guide.md", "exec"), {})  # noqa: S102 - the guide's own example
        printed = capsys.readouterr().out.split()
        assert int(printed[-1]) > 16, "the image's 16 tokens are not in the prompt"
        client = openai.OpenAI(base_url=cluster.base_url, api_key="none", max_retries=0)
        remote: ChatCompletionContentPartImageParam = {
            "type": "image_url",
            "image_url": {"url": "https://example.com/cat.png"},
        }
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [remote]}], max_tokens=4)
        assert "messages[0].content[0].image_url" in str(refused.value)
        again = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert again.choices[0].finish_reason in ("length", "stop")
    finally:
        cluster.stop()
