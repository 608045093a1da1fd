"""Streaming detokenization: text deltas that never split a character, stop strings cut exactly."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from scheduler_node.text.tokenizer import ModelTokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so a leading space or merge renders as in full text


class IncrementalDetokenizer:
    """Each token's text as it comes. The tokenizer's own incremental decoder (`DecodeStream`, in Rust) keeps the
    window of tokens whose text may still change and holds back incomplete characters; this class adds stop strings
    and the hold-back they need."""

    def __init__(self, tokenizer: ModelTokenizer, prompt_ids: list[int], stop: list[str], min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings in the text of the first min_tokens tokens do not stop it
        self.num_tokens = 0
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)
        self._last = context  # the tokens whose text came out last: the context of a final flush
        self._pending: list[int] = []  # tokens whose text has not come out yet (an incomplete character)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that might start a stop string
        self.text = ""  # the output text so far, cut at a stop string
        self.emitted = 0  # characters already streamed
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped` when a stop string appears (the text is cut before it)."""
        if self.stopped or not token_ids:
            return
        self.num_tokens += len(token_ids)
        piece = self._stream.step(self.tokenizer.tokenizer, token_ids[0] if len(token_ids) == 1 else token_ids)
        if piece is None:  # an incomplete UTF-8 sequence: wait for the next token
            self._pending += token_ids
            return
        self._last, self._pending = self._pending + token_ids, []
        if not self.stop:
            self.text += piece
            return
        searched_from = max(0, len(self.text) - self.hold)
        self.text += piece
        cuts = [c for c in (self.text.find(s, searched_from) for s in self.stop) if c != -1]
        if cuts and self.num_tokens > self.min_tokens:
            self.text = self.text[: min(cuts)]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """Text not yet streamed; while running, hold back what could still become a stop string."""
        if final and not self.stopped and self._pending:  # ends mid-character: what there is, as the tokenizer has it
            decode = self.tokenizer.decode
            self.text += decode(self._last + self._pending)[len(decode(self._last)) :]
            self._pending = []
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
