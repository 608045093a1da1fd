"""The prompt forms the Python API takes (a string, token ids, or vLLM's dicts), and how a prompt becomes the
engine's token ids: one place for `LLM` and `AsyncLLMEngine`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

from scheduler_node.api.validation import InvalidField, prompt_from_ids, prompt_from_text
from scheduler_node.text.tokenizer import ModelTokenizer


class TextPrompt(TypedDict):
    """vLLM's dict form of a text prompt (with a multimodal model's images: `{"image": PIL image | [...]}`)."""

    prompt: str
    multi_modal_data: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """vLLM's dict form of a prompt given as token ids."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict[str, Any]]


Prompt = str | Sequence[int] | TextPrompt | TokensPrompt
Message = dict[str, Any]  # {"role", "content"}: content a string, or text and image parts


def unwrap(prompt: Any, name: str) -> tuple[Any, str]:
    """A prompt as text or token ids, and the name its errors give (a dict prompt's key included)."""
    if isinstance(prompt, str) or (isinstance(prompt, Sequence) and not isinstance(prompt, bytes)):
        return prompt, name
    if not isinstance(prompt, dict):
        kinds = "a string, a list of token ids, or {'prompt': ...} / {'prompt_token_ids': ...}"
        raise InvalidField(name, f"must be {kinds}; got {type(prompt).__name__}")
    keys = [k for k in prompt if k != "multi_modal_data"]
    if len(keys) != 1 or keys[0] not in ("prompt", "prompt_token_ids"):
        raise InvalidField(
            name,
            f"a dict prompt has one key, 'prompt' or 'prompt_token_ids' (and multi_modal_data); got {sorted(prompt)}",
        )
    key, value = keys[0], prompt[keys[0]]
    if key == "prompt" and not isinstance(value, str):
        raise InvalidField(f"{name}.prompt", f"must be a string, got {type(value).__name__}")
    return value, f"{name}.{key}"


def is_ids(prompts: Any) -> bool:
    return isinstance(prompts, Sequence) and bool(prompts) and all(isinstance(t, int) for t in prompts)


def per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != count:
            raise ValueError(f"{name}: {len(value)} given for {count} prompts")
        return list(value)
    return [value] * count


def prompt_ids(prompt: Any, tokenizer: ModelTokenizer, max_len: int, name: str) -> tuple[list[int], str | None]:
    """One prompt's token ids, and its text when it was given as text. ValueError naming `name` when bad."""
    value, spelled = unwrap(prompt, name)
    if isinstance(value, str):
        return prompt_from_text(value, tokenizer, max_len, spelled), value
    return prompt_from_ids(value, tokenizer, max_len, spelled), None
