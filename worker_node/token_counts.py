"""Per-request token counts for the penalties, kept on the device and updated incrementally.

A request that asks for a penalty gets a row: which tokens its prompt holds (set once) and how often each token
occurs in its output (one scatter-add of the tokens appended since the last step, for all requests at once). A
step gathers the rows of its batch in one indexing operation: nothing is recounted from the token lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker_node.runtime.host_copy import to_device


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._rows: dict[int, int] = {}  # by request handle
        self._counted: dict[int, int] = {}  # output tokens already added to each row
        self._free: list[int] = []
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.output = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)

    def rows(self, requests: Sequence[tuple[int, list[int], int]]) -> torch.Tensor:
        """The rows of these (handle, token_ids, num_prompt_tokens), brought up to date with their tokens."""
        slots, tokens, added = [], [], []
        for handle, token_ids, num_prompt in requests:
            row = self._rows.get(handle)
            if row is None:
                row = self._take(handle)
                self.prompt[row, to_device(token_ids[:num_prompt], self.device, torch.int64)] = True
            new = token_ids[num_prompt + self._counted[handle] :]
            self._counted[handle] += len(new)
            tokens += new
            added += [row] * len(new)
            slots.append(row)
        if tokens:
            index = (to_device(added, self.device, torch.int64), to_device(tokens, self.device, torch.int64))
            self.output.index_put_(index, torch.ones(len(tokens), dtype=torch.int32, device=self.device), True)
        return to_device(slots, self.device, torch.int64)

    def release(self, handle: int) -> None:
        row = self._rows.pop(handle, None)
        if row is not None:
            del self._counted[handle]
            self._free.append(row)

    def _take(self, handle: int) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.prompt[row] = False
        self.output[row] = 0
        self._rows[handle] = row
        self._counted[handle] = 0
        return row

    def _grow(self) -> None:
        """Double the rows (at least 8): requests with penalties come and go, the table keeps its peak size."""
        old = self.prompt.shape[0]
        new = max(8, 2 * old)
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(new - old, self.vocab_size)])
        self.output = torch.cat([self.output, self.output.new_zeros(new - old, self.vocab_size)])
        self._free.extend(range(new - 1, old - 1, -1))
