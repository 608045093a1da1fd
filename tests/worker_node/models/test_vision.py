"""LLaVA's vision encoder and projector (ours, read from HF's safetensors names) give HF's image features; the
decoder reads its weights through the multimodal checkpoint's names; the vision encoder loads only when
`extra_modules` names it, and a module the checkpoint lacks is refused by name."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.support.images import hf_pixels, load_hf_llava, picture
from worker_node.image_embeds import load_image_embedder
from worker_node.models.config import ModelConfig
from worker_node.models.loader import DecoderView, open_checkpoint
from worker_node.models.vision import feature_layers, load_vision_encoder

pytestmark = pytest.mark.model


def test_the_encoder_gives_hf_image_features(tiny_llava_dir: Path) -> None:
    config = json.loads((tiny_llava_dir / "config.json").read_text())
    ours = load_vision_encoder(tiny_llava_dir, config, torch.float32, torch.device("cpu"))
    pixels = hf_pixels(tiny_llava_dir, [picture(1), picture(2, 70, 30)])
    assert pixels is not None
    with torch.inference_mode():
        theirs = load_hf_llava(tiny_llava_dir).get_image_features(pixel_values=pixels)
        theirs = torch.stack(list(getattr(theirs, "pooler_output", theirs)))
        mine = ours(pixels)
    assert mine.shape == (2, 16, config["text_config"]["hidden_size"])  # 4 x 4 patches, the class token dropped
    assert float((mine - theirs.reshape(mine.shape)).abs().max()) < 1e-5


def test_the_features_come_from_the_configured_layer() -> None:
    config = {"vision_config": {"num_hidden_layers": 3}, "vision_feature_layer": -2}
    assert feature_layers(config) == 2  # HF's hidden_states[-2]: the output of 2 of 3 layers
    assert feature_layers({**config, "vision_feature_layer": 1}) == 1
    with pytest.raises(ValueError, match="vision_feature_layer -5"):
        feature_layers({**config, "vision_feature_layer": -5})
    with pytest.raises(ValueError, match="only one layer"):
        feature_layers({**config, "vision_feature_layer": [-2, -1]})


def test_the_decoder_reads_the_llava_checkpoint_as_a_causal_lm(tiny_llava_dir: Path) -> None:
    config = ModelConfig.from_folder(tiny_llava_dir)
    assert config.architecture == "LlamaForCausalLM" and config.hidden_size == 64
    hf = DecoderView.over(open_checkpoint(tiny_llava_dir))
    try:
        assert "model.layers.0.self_attn.q_proj.weight" in hf and "lm_head.weight" in hf
        assert hf["model.embed_tokens.weight"].shape[0] == config.vocab_size
    finally:
        hf.close()


def test_the_vision_encoder_loads_only_when_named(tiny_llava_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    embedder = load_image_embedder(tiny_llava_dir, ["vision_encoder"], torch.float32, cpu, True, cache_bytes=4096)
    assert embedder is not None and embedder.cache.budget == 4096  # --encoder-cache-memory
    assert load_image_embedder(tiny_llava_dir, ["vision_encoder"], torch.float32, cpu, False) is None  # stage 2
    with caplog.at_level(logging.INFO):
        assert load_image_embedder(tiny_llava_dir, [], torch.float32, cpu, True) is None
    assert "text only" in caplog.text
    with pytest.raises(ValueError, match="extra_modules: cross_attention is not in the checkpoint"):
        load_image_embedder(tiny_llava_dir, ["cross_attention"], torch.float32, cpu, True)
