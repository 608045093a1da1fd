"""What routing sees of a request, whichever door it came in by (gRPC today; an HTTP door converts its own)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

# The prefix key hashes characters of text; a token-id prompt contributes this many fewer ids for the same window
# (English BPE vocabularies average about four characters per token).
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str  # as the client named it ("" for the default)
    request_id: str = ""
    prompt: str = ""  # exactly one of prompt, prompt_token_ids, messages is set
    prompt_token_ids: Sequence[int] = ()
    messages: Sequence[tuple[str, str]] = ()  # (role, content)
    max_tokens: int | None = None
    priority: int | str | None = None  # a number, or a name of the replicas' --priority-ranges
    cache_salt: str = ""
    metadata: dict[str, str] = field(default_factory=dict)  # the door's headers a routing function may read

    def prefix_key(self, chars: int) -> bytes:
        """A fingerprint of the prompt's first `chars` characters (or `chars // 4` token ids), salted like the
        prefix cache: requests that share it can share cached KV blocks on one replica."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(self.cache_salt.encode() + b"\0")
        if self.prompt_token_ids:
            ids = self.prompt_token_ids[: max(1, chars // CHARS_PER_TOKEN)]
            digest.update(b"ids\0" + b",".join(str(t).encode() for t in ids))
        elif self.messages:
            digest.update(b"chat\0" + _leading_text(self.messages, chars).encode())
        else:
            digest.update(b"text\0" + self.prompt[:chars].encode())
        return digest.digest()

    def estimated_prompt_tokens(self) -> int:
        """The prompt's length in tokens: exact for token ids, else its characters (messages' contents) / 4 (the
        router holds no tokenizer for this; an estimate is enough to tell a short prompt from a long one)."""
        if self.prompt_token_ids:
            return len(self.prompt_token_ids)
        chars = sum(len(content) for _, content in self.messages) if self.messages else len(self.prompt)
        return chars // CHARS_PER_TOKEN


def _leading_text(messages: Sequence[tuple[str, str]], chars: int) -> str:
    """The first `chars` characters of the conversation, each message as role, a separator, then its content."""
    parts: list[str] = []
    left = chars
    for role, content in messages:
        piece = f"{role}\x1f{content}\x1e"[:left]
        parts.append(piece)
        left -= len(piece)
        if left <= 0:
            break
    return "".join(parts)
