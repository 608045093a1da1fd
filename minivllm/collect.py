"""How `LLM.generate` gathers its requests' outputs: each request's deltas into a `RequestOutput` on the engine's
output thread (a threadsafe sink that reads its output whole), the batch's end (every request done, or the first
error) and the progress bar."""

from __future__ import annotations

import threading
import time

from tqdm import tqdm

from minivllm.outputs import CompletionOutput, RequestOutput
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.outputs import Delta


class Progress:
    """A tqdm bar of finished requests with input and output tokens per second."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc="Processed prompts", unit="req", disable=not enabled, dynamic_ncols=True)
        self.start = time.perf_counter()
        self.input_tokens = 0
        self.output_tokens = 0

    def done(self, input_tokens: int, output_tokens: int) -> None:
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"input: {self.input_tokens / elapsed:.1f} toks/s, output: {self.output_tokens / elapsed:.1f} toks/s"
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class Batch:
    """One generate's requests: `done` is set when every one ended, or at the first error."""

    def __init__(self, count: int, progress: Progress) -> None:
        self.left = count
        self.progress = progress
        self.error = ""
        self.done = threading.Event()
        if not count:
            self.done.set()

    def ended(self, error: str = "") -> None:
        self.left -= 1
        self.error = self.error or error
        if self.error or not self.left:
            self.done.set()


class Collector:
    """One request's output, gathered from its deltas on the output thread (a threadsafe sink: no event loop, no
    task per request)."""

    threadsafe = True
    incremental = False  # the output is read once it is whole: a sequence's tokens may come in one delta

    def __init__(self, spec: RequestSpec, text: str | None, batch: Batch) -> None:
        self.spec, self.batch, self.unfinished = spec, batch, spec.n
        logprobs = spec.sampling.logprobs is not None
        completions = [CompletionOutput(i, "", [], "", [] if logprobs else None) for i in range(spec.n)]
        self.output = RequestOutput(spec.request_id, text, spec.prompt_token_ids, completions)
        self.texts: list[list[str]] = [[] for _ in range(spec.n)]  # joined once at the end
        self.first = True  # sequence 0's first tokens not seen yet

    def put(self, delta: Delta) -> None:
        spec, out = self.spec, self.output
        if delta.error is not None:  # the offline door names the status
            self.batch.ended(f"request {spec.request_id} failed ({delta.error.status.name}): {delta.error.message}")
            return
        c = out.outputs[delta.index]
        if spec.sampling.prompt_logprobs is not None and delta.index == 0 and delta.token_ids and self.first:
            out.prompt_logprobs = [None, *delta.prompt_logprobs]  # they come with the first tokens
            self.first = False
        c.token_ids.extend(delta.token_ids)
        if delta.text:
            self.texts[delta.index].append(delta.text)
        if c.logprobs is not None:
            c.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            c.finish_reason = delta.finish_reason.value
            c.text = "".join(self.texts[delta.index])
            self.unfinished -= 1
            if not self.unfinished:
                self.batch.progress.done(len(spec.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
                self.batch.ended()
