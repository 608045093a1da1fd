"""The scheduler's tokenizer: HF `tokenizers` plus the model's Jinja chat template (no transformers, no torch)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llguidance import LLTokenizer
from tokenizers import Tokenizer

from scheduler_node.text.tool_prompt import hermes_messages


class ModelTokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        self.path = path
        self.tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        config = _read_json(folder / "tokenizer_config.json")
        self.special_tokens = {
            key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.eos_token_ids = _eos_ids(folder, self.tokenizer, self.special_tokens["eos_token"])
        template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        self._template = _compile(template) if isinstance(template, str) else None
        # A template that reads `tools` renders tools and tool messages itself; others get them as text.
        self.supports_tools = isinstance(template, str) and "tools" in _variables(template)
        # The longest text one token stands for: text longer than max_model_len times this cannot fit.
        self.max_token_chars = max(1, max(len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def grammar_tokenizer(self) -> LLTokenizer:
        """The vocabulary as the grammar engine sees it (built on first use: about half a second)."""
        return LLTokenizer(str(self.path))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs name every token)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The conversation's prompt; `tools` in HF's form ([{"type": "function", "function": {...}}])."""
        if self._template is None:
            raise ValueError("the model has no chat template")
        extra: dict[str, Any] = {"tools": tools} if tools and self.supports_tools else {}
        if not self.supports_tools:
            messages = hermes_messages(messages, tools)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=True,
            **extra,
            **{k: v for k, v in self.special_tokens.items() if v},
        )
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _eos_ids(folder: Path, tokenizer: Tokenizer, eos_text: str | None) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(folder / name).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if eos_text is not None and (token := tokenizer.token_to_id(eos_text)) is not None:
        ids.add(token)
    return frozenset(ids)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson  # as transformers renders templates (jinja's own escapes <, > and &)
    return env.from_string(template)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _variables(template: str) -> set[str]:
    return jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(template))
