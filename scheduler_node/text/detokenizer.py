"""Streaming detokenization: text deltas that never split a character, stop strings cut exactly."""

from __future__ import annotations

from scheduler_node.text.tokenizer import ModelTokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so a leading space or merge renders as in full text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: list[int], stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings in the text of the first min_tokens tokens do not stop it
        self.num_tokens = 0
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that might start a stop string
        self.text = ""  # the output text so far, cut at a stop string
        self.emitted = 0  # characters already streamed
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped` when a stop string appears (the text is cut before it)."""
        if self.stopped:
            return
        self.ids.extend(token_ids)
        self.num_tokens += len(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return  # an incomplete UTF-8 sequence: wait for the next token
        searched_from = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        cuts = [c for c in (self.text.find(s, searched_from) for s in self.stop) if c != -1]
        if cuts and self.num_tokens > self.min_tokens:
            self.text = self.text[: min(cuts)]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """Text not yet streamed; while running, hold back what could still become a stop string."""
        if final and not self.stopped and self.read_offset < len(self.ids):  # ends mid-character
            self.text += self.tokenizer.decode(self.ids[self.prefix_offset :])[
                len(self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])) :
            ]
            self.read_offset = len(self.ids)
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
