"""Multimodal settings: `--extra-modules` (the article's `model_loader: {extra_modules: [...]}` in a config file),
`--limit-mm-per-prompt` in vLLM's spellings, and refusals that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_node.cli.scheduler import build_parser, engine_config
from settings.config_file import parse_args
from settings.multimodal import MultiModalConfig, image_limit
from settings.setting import SettingError
from tests.seeds.blocks import block

pytestmark = pytest.mark.unit


def test_limit_mm_per_prompt_takes_vllms_spellings() -> None:
    assert image_limit("image=3") == 3
    assert image_limit('{"image": 2}') == 2
    assert image_limit("") == 1
    for bad, match in (("video=1", "modality 'video'"), ("image=x", "not a whole number"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=f"limit_mm_per_prompt: .*{match}"):
            image_limit(bad)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        MultiModalConfig(limit_mm_per_prompt="image=-1")


def test_extra_modules_from_the_flag_and_from_the_articles_yaml(tmp_path: Path) -> None:
    parser = build_parser()
    config = engine_config(
        parse_args(parser, ["--extra-modules", "vision_encoder", "--limit-mm-per-prompt", "image=2"])
    )
    assert config.multimodal.extra_modules == ("vision_encoder",) and config.multimodal.images_per_prompt == 2
    path = tmp_path / "serve.yaml"
    path.write_text(block("extra_modules").text + "\n")  # the article's block, as written
    config = engine_config(parse_args(build_parser(), ["--config", str(path)]))
    assert config.multimodal.extra_modules == ("vision_encoder", "cross_attention")


def test_bad_extra_modules_are_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SettingError, match="extra_modules"):
        MultiModalConfig(extra_modules=("audio",))
    path = tmp_path / "serve.yaml"
    path.write_text("model_loader:\n  modules: [vision_encoder]\n")
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["--config", str(path)])
    assert "model_loader.modules is not a key of model_loader" in capsys.readouterr().err
