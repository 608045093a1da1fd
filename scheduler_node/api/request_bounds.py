"""What one request may ask of a door beyond each field's own range: its size on the wire, its prompt logprobs in
total, and text that is Unicode. A refusal names the field (a 400 / INVALID_ARGUMENT). The field checks that
api/validation.py runs for every door bound the rest: a JSON schema's nesting (MAX_JSON_DEPTH), the x-priority
header's range."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from scheduler_node.api.validation import InvalidField
from scheduler_node.core.request import RequestSpec

# A request body (HTTP) or message (gRPC) at most: a prompt of max_model_len tokens fits many times over.
MAX_REQUEST_BYTES = 8 * 1024 * 1024
# Prompt logprobs entries an answer may carry: prompt tokens x (prompt_logprobs + 1) x n, summed over prompts
# (a completion's answer repeats them in each of its n choices). About 17 MB of JSON at the bound; a 128k-token
# prompt with prompt_logprobs 1 fits, and 4,000 tokens x 21 x n 64 (a 347 MB answer) does not.
MAX_PROMPT_LOGPROB_ENTRIES = 2**18
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_prompt_logprobs(specs: Sequence[RequestSpec], name: str = "prompt_logprobs") -> None:
    """Refuse a request whose prompt logprobs, as its answer carries them, exceed MAX_PROMPT_LOGPROB_ENTRIES."""
    asked = [s for s in specs if s.sampling.prompt_logprobs is not None]
    if not asked:
        return
    per_token = asked[0].sampling.prompt_logprobs + 1  # type: ignore[operator]
    tokens = sum(len(s.prompt_token_ids) for s in asked)
    n = asked[0].n
    entries = tokens * per_token * n
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidField(
            name,
            f"prompt tokens ({tokens}) x (prompt_logprobs + 1 = {per_token}) x n ({n}) = {entries} entries exceeds "
            f"{MAX_PROMPT_LOGPROB_ENTRIES}; ask for fewer prompt logprobs, a shorter prompt or a smaller n",
        )


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (as OpenAI names params: messages[0].content) of the first string in a parsed JSON body that holds
    a lone surrogate ("\\ud800" is valid JSON, but no Unicode text: it cannot be tokenized nor even echoed back
    as UTF-8), else None. A key holding one is named by the object it is in."""
    for at, text in _strings(value, path):
        if _SURROGATE.search(text):
            return at or "body"
    return None


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            yield at, item
        elif isinstance(item, Mapping):
            for key, child in reversed(list(item.items())):
                yield at, str(key)
                stack.append((child, f"{at}.{key}" if at else str(key)))
        elif isinstance(item, list):
            stack.extend((child, f"{at}[{i}]") for i, child in reversed(list(enumerate(item))))
