"""Streaming detokenization: text deltas that never split a character, stop strings cut exactly."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers.decoders import DecodeStream

from scheduler_node.text.tokenizer import ModelTokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so a leading space or merge renders as in full text


class IncrementalDetokenizer:
    """Each token's text as it comes. The tokenizer's own incremental decoder (`DecodeStream`, in Rust) keeps the
    window of tokens whose text may still change and holds back incomplete characters; this class adds stop strings
    and the hold-back they need."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        prompt_ids: list[int],
        stop: list[str],
        may_stop: Callable[[int], bool] = lambda num_tokens: True,
    ) -> None:
        self.tokenizer = tokenizer
        self._rust = tokenizer.tokenizer  # what the decoder steps with, looked up once
        self.may_stop = may_stop  # whether a stop string in the text of this many tokens ends it (min_tokens)
        self.num_tokens = 0
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=True)
        self._last = context  # the tokens whose text came out last: the context of a final flush
        self._pending: list[int] = []  # tokens whose text has not come out yet (an incomplete character)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars that might start a stop string
        # Text not streamed yet: what could still become a stop string, and what is new. Only this tail is kept:
        # growing the whole text would copy it at every token (quadratic in the output's length).
        self._unsent = ""
        self.stopped = False

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; sets `stopped` when a stop string appears (the text is cut before it)."""
        if self.stopped or not token_ids:
            return
        self.num_tokens += len(token_ids)
        piece = self._stream.step(self._rust, token_ids[0] if len(token_ids) == 1 else token_ids)
        if piece is None:  # an incomplete UTF-8 sequence: wait for the next token
            self._pending += token_ids
            return
        if self._pending:
            self._last, self._pending = self._pending + token_ids, []
        else:
            self._last = token_ids
        if not self.stop:
            self._unsent += piece
            return
        # A stop string may begin in the held-back tail (the last `hold` characters are never streamed early).
        searched_from = max(0, len(self._unsent) - self.hold)
        self._unsent += piece
        cuts = [c for c in (self._unsent.find(s, searched_from) for s in self.stop) if c != -1]
        if cuts and self.may_stop(self.num_tokens):
            self._unsent = self._unsent[: min(cuts)]
            self.stopped = True

    def held(self) -> tuple[str, list[int]]:
        """What a migrated sequence's text carries to its next replica: the text decoded and not sent (held back
        for a stop string), and the tokens of an incomplete character."""
        return self._unsent, list(self._pending)

    def resume(self, num_tokens: int, held_text: str, pending: list[int]) -> None:
        """Continue a migrated sequence's text (`held` where it ran): this detokenizer was made with the prompt and
        the outputs before `pending` as its prompt, so their last tokens are the decoding context."""
        self.num_tokens = num_tokens
        self._unsent = held_text
        if pending:
            piece = self._stream.step(self._rust, pending)
            if piece is None:
                self._pending = list(pending)
            else:  # complete here after all (a different tokenizer build): the text is what it decodes to
                self._unsent += piece
                self._last = list(pending)

    def delta(self, final: bool) -> str:
        """Text not yet streamed; while running, hold back what could still become a stop string."""
        if final and not self.stopped and self._pending:  # ends mid-character: what there is, as the tokenizer has it
            decode = self.tokenizer.decode
            self._unsent += decode(self._last + self._pending)[len(decode(self._last)) :]
            self._pending = []
        if final or self.stopped or not self.hold:  # nothing held back: all of it goes
            out, self._unsent = self._unsent, ""
            return out
        ready = len(self._unsent) - self.hold
        if ready <= 0:
            return ""
        out, self._unsent = self._unsent[:ready], self._unsent[ready:]
        return out
