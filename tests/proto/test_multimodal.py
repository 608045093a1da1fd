"""Multimodal checkpoints on both sides: the modules a checkpoint holds, `extra_modules` checked against them, the
text decoder's config, the tokens an image becomes, and an image on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from proto.architectures import architecture_of
from proto.multimodal import ImageInput, ImageLayout, checkpoint_modules, resolve_extra_modules, text_config
from proto.wire import NewRequest, SamplingOptions, WireError

pytestmark = pytest.mark.unit

LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"],
    "image_token_index": 49152,
    "vision_config": {"image_size": 336, "patch_size": 14},
    "text_config": {"model_type": "llama", "hidden_size": 64},
}


def test_a_llava_config_is_its_decoders_and_holds_a_vision_encoder() -> None:
    assert checkpoint_modules(LLAVA) == ("vision_encoder",)
    assert checkpoint_modules({"architectures": ["LlamaForCausalLM"]}) == ()
    assert text_config(LLAVA)["hidden_size"] == 64
    assert architecture_of(LLAVA) == "LlamaForCausalLM"
    assert ImageLayout.of(LLAVA) == ImageLayout(49152, 576, 336)
    full = {**LLAVA, "vision_feature_select_strategy": "full"}
    assert ImageLayout.of(full).tokens_per_image == 577  # the class token kept


def test_extra_modules_are_checked_against_the_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAVA))
    assert resolve_extra_modules(["vision_encoder"], tmp_path) == ("vision_encoder",)
    assert resolve_extra_modules([], tmp_path) == ()
    with pytest.raises(ValueError, match="extra_modules: unknown module 'audio_encoder'"):
        resolve_extra_modules(["audio_encoder"], tmp_path)
    with pytest.raises(ValueError, match=r"cross_attention is not in the checkpoint .* \(it holds: vision_encoder\)"):
        resolve_extra_modules(["vision_encoder", "cross_attention"], tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="it holds: no extra modules"):
        resolve_extra_modules(["vision_encoder"], tmp_path)


def test_an_image_travels_as_raw_float32_with_its_shape() -> None:
    image = ImageInput(b"h" * 16, 3, 16, bytes(3 * 2 * 2 * 4), [3, 2, 2])
    new = NewRequest(1, [1, 2], [], SamplingOptions(), [0], 0, 2, images=[image])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=NewRequest)
    assert back.images == [image] and back.images[0].end == 19
    with pytest.raises(WireError, match="for shape"):
        ImageInput(b"h" * 16, 0, 1, bytes(10), [3, 2, 2])
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode([b"h" * 16, 0, 1, b"", [3, 2]]), type=ImageInput)
