"""`attention_support` (the article's `PagedAttention.supports`): yes with what it checked, or no with every reason,
for each form a model config comes in, and for each kind of backend its `attention` section may name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernels import custom_kernels
from tests.support.custom_kernel import build_example
from worker_node.models.attention_support import Support, attention_support
from worker_node.models.config import ModelConfig

pytestmark = pytest.mark.unit


def llama(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return config | overrides


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(custom_kernels, "_registry", {})
    yield


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_example(tmp_path_factory.mktemp("support"), "DECODE_ONLY")


def test_a_supported_model_says_what_was_checked(tmp_path: Path) -> None:
    answer = attention_support(llama())
    assert answer and answer.ok
    assert (
        str(answer) == "supported: LlamaForCausalLM, 4 query heads over 2 KV heads, head_dim 16; attention backend auto"
    )
    (tmp_path / "config.json").write_text(json.dumps(llama()))
    assert attention_support(tmp_path) == answer, "a model folder"
    assert attention_support(ModelConfig.from_dict(llama())) == answer
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(**{k: v for k, v in llama().items() if k not in ("architectures", "model_type")})
    hf.architectures = ["LlamaForCausalLM"]
    assert attention_support(hf) == answer, "an HF PretrainedConfig"


def test_windows_and_soft_caps_are_supported_and_said() -> None:
    gemma = llama(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        head_dim=32,
        sliding_window=512,
        attn_logit_softcapping=50.0,
        hidden_activation="gelu_pytorch_tanh",
    )
    answer = attention_support(gemma)
    assert answer, answer
    assert "a sliding window of 512 on 1 of 2 layers; scores soft-capped at 50" in str(answer)


def test_every_reason_is_given() -> None:
    answer = attention_support(llama(architectures=["BertModel"], model_type="bert", attention={"type": "flash"}))
    assert not answer
    text = str(answer)
    assert text.startswith("not supported: architecture BertModel is not supported; supported: LlamaForCausalLM")
    assert "attention.type: unknown attention backend 'flash'; registered kernels: none" in text
    assert "num_key_value_heads 3" in str(attention_support(llama(num_key_value_heads=3)))
    assert str(attention_support({"architectures": ["LlamaForCausalLM"]})) == (
        "not supported: the config has no 'num_attention_heads'"
    )


def test_the_backend_named_must_run_the_model(library: Path) -> None:
    assert "head_dim 20: the triton backend needs a power of two" in str(
        attention_support(llama(hidden_size=80, attention={"type": "triton"}))
    )
    assert attention_support(llama(hidden_size=80, attention={"type": "torch"}))
    missing = attention_support(llama(attention={"type": "nowhere.at_all:Backend"}))
    assert "attention.type: cannot load attention backend 'nowhere.at_all:Backend'" in str(missing)
    assert "attention.params: 'torch' is not a compiled kernel" in str(
        attention_support(llama(attention={"type": "torch", "params": {"a": 1}}))
    )


def test_a_compiled_kernel_must_be_registered_and_take_its_params(library: Path) -> None:
    kernel = llama(attention={"type": "my_attention"})
    assert "registered kernels: none" in str(attention_support(kernel))
    custom_kernels.register_kernel("my_attention", library)
    answer = attention_support(kernel)
    assert answer and "attention backend my_attention (a compiled kernel: float32 KV caches" in str(answer)
    with_params = attention_support(llama(attention={"type": "my_attention", "params": {"tile": 4}}))
    assert "exports no minivllm_attention_configure, so it takes none" in str(with_params)
    assert attention_support(llama(attention={"type": "other", "library": str(library)})), "named with its library"
    assert "other" not in custom_kernels.registered_kernels(), "checked, not registered"
    assert "attention.library: /nowhere.so: no such file" in str(
        attention_support(llama(attention={"type": "other", "library": "/nowhere.so"}))
    )


def test_something_that_is_no_config_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="expected a model config: .* got int"):
        attention_support(3)
    assert Support(False, "x").__bool__() is False and str(Support(True, "y")) == "supported: y"
