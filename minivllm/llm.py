"""LLM: the offline API. The same engine core as the servers, run on a private event loop in a thread.

A world of one runs its worker in this process (no sockets); a TP/PP world starts its workers as child processes
that join over ZeroMQ on loopback, as `vllm-serve` does, and are stopped by `close()`.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import inspect
import itertools
import json
import logging
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from kernels.custom_kernels import worker_setting
from kernels.openmp import release_thread_pool
from minivllm.collect import Batch, Collector, Progress
from minivllm.lm_cache import LMCache, with_cache
from minivllm.lora_request import LoRARequest
from minivllm.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from minivllm.prompts import Message, Prompt, is_ids, per_prompt, prompt_ids, unwrap
from minivllm.sampling_params import SamplingParams
from minivllm.scheduling import SchedulerArg, engine_policy
from scheduler_node.api.embeddings import (
    EngineFailed,
    check_dimensions,
    embedding_spec,
    finish,
    pooled,
)
from scheduler_node.api.media import message_images, prompt_images, with_images
from scheduler_node.api.validation import (
    InvalidField,
    build_spec,
    priority_from,
    prompt_from_messages,
)
from scheduler_node.core.lora_slots import LoraRef
from scheduler_node.core.request import RequestSpec
from scheduler_node.engine.builder import WorldPlan, check_model_split, make_engine, with_block_bytes
from scheduler_node.engine.core import EngineCore
from scheduler_node.engine.launchers import LocalLauncher
from scheduler_node.engine.model_path import DEFAULT, resolve_model
from scheduler_node.engine.placement import place
from scheduler_node.engine.ports import free_port
from scheduler_node.engine.topology import single_island
from scheduler_node.engine.worker_link import WorkerLink
from scheduler_node.text.tokenizer import ModelTokenizer
from settings.engine_args import EngineSettings, alias_parameters, engine_settings, keyword_parameters
from settings.server import POOLINGS
from settings.worker import offload_dir_problem, worker_argv

logger = logging.getLogger(__name__)

T = TypeVar("T")
# inprocess: the worker runs in this process (a world of one); processes: one vllm-worker process per rank, over
# ZeroMQ on loopback (any world); auto: inprocess for a world of one, else processes.
WORKER_BACKENDS = ("auto", "inprocess", "processes")


Priority = int | str  # a number, or a name of the engine's priority_ranges

# Every LLM not closed yet. At interpreter exit they are closed by an atexit hook, while the engine's daemon thread
# still runs: later, in the finalizer, that thread is frozen, and a close from `__del__` would wait on it forever.
_OPEN: weakref.WeakSet[LLM] = weakref.WeakSet()
CLOSE_TIMEOUT_S = 30.0  # at most this long for the engine to stop; then its workers are killed regardless


@atexit.register
def _close_all_at_exit() -> None:
    for llm in list(_OPEN):
        llm.close()


def build_settings(settings: Mapping[str, Any], attention: Mapping[str, Any] | None = None) -> EngineSettings:
    """`LLM(...)`'s keywords as the engine's and workers' settings. TypeError naming an unknown keyword,
    ValueError naming a bad value."""
    settings = dict(settings)
    if attention is not None or "attention_backend" in settings:  # a registered kernel's name gains its path
        settings["attention_backend"] = worker_setting(settings.get("attention_backend", "auto"), attention)
    return engine_settings(settings)


class LLM:
    """Generate completions for batches of prompts. Close it (or use `with`) to stop its workers."""

    def __init__(
        self,
        model: str | None = None,
        *,
        worker_backend: str = "auto",
        attention: Mapping[str, Any] | None = None,
        scheduler: SchedulerArg | None = None,
        cache: LMCache | None = None,
        **settings: Any,
    ) -> None:
        """`model`: as vllm-scheduler's --model. `settings`: any setting of the engine and its workers by name, as
        the flags spell them with underscores (`max_num_seqs=8`, `kv_cache_memory="4GiB"`,
        `speculative_config={"method": "ngram"}`; docs/settings.md lists them, `inspect.signature(LLM)` too);
        a setting not given takes its environment override, else its default. TypeError naming an unknown
        setting, ValueError naming one out of range. `attention`: a model config's attention section
        (`{"type": NAME, "params": {...}}`), a kernel registered with `minivllm._custom_ops.register_kernel`.
        `scheduler`: the request order, a `PriorityScheduler(...)` or a `minivllm.Scheduler` subclass's instance
        (minivllm/scheduling.py), instead of the `scheduling_policy` setting. `cache`: an `LMCache`, the KV offload
        tiers' settings in one object (minivllm/lm_cache.py)."""
        settings = with_cache(cache, settings)
        self.cache = cache  # a temporary disk tier's folder lives as long as it
        if worker_backend not in WORKER_BACKENDS:
            raise ValueError(f"worker_backend: must be one of {WORKER_BACKENDS}, got {worker_backend!r}")
        if isinstance(settings.get("limit_mm_per_prompt"), dict):  # vLLM's {"image": 2}
            settings["limit_mm_per_prompt"] = json.dumps(settings["limit_mm_per_prompt"])
        self._policy = engine_policy(scheduler, settings)
        built = build_settings(settings, attention)
        self.config, self.options = built.engine, built.worker
        world = self.config.layout.world_size
        if worker_backend == "inprocess" and world > 1:
            raise ValueError(f"worker_backend: 'inprocess' runs a world of one; this one has {world} ranks")
        self.worker_backend = (
            ("inprocess" if world == 1 else "processes") if worker_backend == "auto" else worker_backend
        )
        disk = self.options.kv_offload_disk
        problem = offload_dir_problem(disk, "kv_offload_disk:") if disk else ""
        if problem:
            raise ValueError(problem)
        self.folder = resolve_model(model or DEFAULT)
        c = self.config
        check_model_split(self.folder, c.layout, c.quantization, c.scheduler.speculative, c.multimodal.extra_modules)
        self.config = with_block_bytes(self.config, self.folder)  # kv_block_bytes="16KB": tokens for this model
        self.tokenizer = ModelTokenizer(self.folder)
        self._ids = itertools.count()
        self._launcher: LocalLauncher | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._engine: EngineCore | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="minivllm-engine", daemon=True)
        self._thread.start()
        _OPEN.add(self)
        try:
            self._call(self._start(self.config.worker_join_timeout))
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> EngineCore:
        if self._engine is None:
            raise RuntimeError("the LLM is closed")
        return self._engine

    # ---- generating

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Priority | Sequence[Priority | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt (a string, a list of token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": ...}`), in input order; `priority`: of every prompt or of each, a number (higher runs
        first) or a name of the `priority_ranges`; `lora_request`: the adapter of every prompt, or of each
        (None: the base model). ValueError names a bad field."""
        ids = self._prompt_ids(prompts)
        single = isinstance(prompts, (str, dict)) or is_ids(prompts)
        raw = [prompts] if single else list(prompts)
        batch = [unwrap(p, f"prompts[{i}]") for i, p in enumerate(raw)]
        texts = [p if isinstance(p, str) else None for p, _ in batch]
        images = [  # vLLM's {"prompt": ..., "multi_modal_data": {"image": ...}}
            prompt_images(p["multi_modal_data"], self.engine.images, f"prompts[{i}].multi_modal_data")
            if isinstance(p, dict) and "multi_modal_data" in p
            else ([], [])
            for i, p in enumerate(raw)
        ]
        prompt_fields = [name for _, name in batch]
        return self._run(ids, texts, sampling_params, use_tqdm, priority, lora_request, images, prompt_fields)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Completions of one conversation (a list of {"role", "content"}) or of several, through the model's chat
        template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        max_len = self.engine.max_model_len
        names = [f"messages[{i}]" for i in range(len(conversations))]
        parsed = [message_images(list(c), self.engine.images, n) for c, n in zip(conversations, names)]  # type: ignore[arg-type]
        ids = [prompt_from_messages(m, self.tokenizer, max_len, n) for (m, _, _), n in zip(parsed, names)]
        images = [(found, fields) for _, found, fields in parsed]
        return self._run(ids, [None] * len(ids), sampling_params, use_tqdm, None, lora_request, images, names)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling: str = "last",
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's final hidden states pooled (`last` token's or the `mean`), L2-normalized unless told
        not, cut to the first `dimensions` (scheduler_node/api/embeddings.py). ValueError names a bad field."""
        if pooling not in POOLINGS:
            raise InvalidField("pooling", f"must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        ids = self._prompt_ids(prompts)
        specs = [
            embedding_spec(p, self.tokenizer, self.engine.max_model_len, f"llm-{next(self._ids)}", pooling,
                           self.config.options.priorities.default_priority)
            for p in ids
        ]  # fmt: skip
        vectors = self._call(self._pooled(specs))
        if vectors:
            check_dimensions(dimensions, len(vectors[0]))
        return [
            EmbeddingRequestOutput(spec.request_id, spec.prompt_token_ids,
                                   EmbeddingOutput(finish(v, dimensions, normalize)))
            for spec, v in zip(specs, vectors)
        ]  # fmt: skip

    async def _pooled(self, specs: list[RequestSpec]) -> list[list[float]]:
        try:
            return await pooled(self.engine, specs)
        except EngineFailed as exc:
            raise RuntimeError(f"an embedding failed ({exc.error.status.name}): {exc.error.message}") from None

    def _prompt_ids(self, prompts: Prompt | Sequence[Prompt]) -> list[list[int]]:
        single = isinstance(prompts, (str, dict)) or is_ids(prompts)
        batch = [prompts] if single else list(prompts)
        return [
            prompt_ids(p, self.tokenizer, self.engine.max_model_len, f"prompts[{i}]")[0] for i, p in enumerate(batch)
        ]

    def _run(
        self,
        ids: list[list[int]],
        texts: list[str | None],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Priority | Sequence[Priority | None] | None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        images: list[tuple[list[Any], list[str]]] | None = None,  # each prompt's images and their fields
        prompt_fields: list[str] | None = None,
    ) -> list[RequestOutput]:
        params = per_prompt(sampling_params or SamplingParams(), len(ids), "sampling_params")
        requests = [lora_request] * len(ids) if not isinstance(lora_request, Sequence) else list(lora_request)
        if len(requests) != len(ids):
            raise ValueError(f"lora_request: {len(requests)} given for {len(ids)} prompts")
        loras = [None if r is None else self._lora(r) for r in requests]
        table = self.config.options.priorities
        priorities = [priority_from(p, None, table) for p in per_prompt(priority, len(ids), "priority")]
        specs = [
            self._spec(p, sp, f"llm-{next(self._ids)}", pr, lora)
            for p, sp, pr, lora in zip(ids, params, priorities, loras)
        ]
        if images and prompt_fields:
            specs = [with_images(s, found, fields, self.engine.images, self.engine.max_model_len, name)
                     for s, (found, fields), name in zip(specs, images, prompt_fields)]  # fmt: skip
        batch = Batch(len(specs), Progress(len(specs), use_tqdm))
        collectors = [Collector(spec, text, batch) for spec, text in zip(specs, texts)]
        try:
            self._call(self._submit(collectors))
            while not batch.done.wait(0.5):  # the output thread collects; the engine's thread only schedules
                if not self._thread.is_alive():
                    raise RuntimeError("the LLM's engine thread ended")
            if batch.error:
                raise RuntimeError(batch.error)
            return [c.output for c in collectors]
        except BaseException:
            if self._engine is not None and not self._loop.is_closed():
                self._call(self._abort(specs), CLOSE_TIMEOUT_S)
            raise
        finally:
            batch.progress.close()

    def request_spec(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        priority: Priority | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[RequestSpec, str | None]:
        """One request as the engine takes it, and its prompt's text (None for token ids); ValueError naming a
        bad field (`prompt`, `sampling_params.top_p`, `priority`, ...). `priority`: a number or a name of the
        engine's `priority_ranges` (None: its default). For a door that submits its own requests
        (minivllm/async_engine.py)."""
        ids, text = prompt_ids(prompt, self.tokenizer, self.engine.max_model_len, "prompt")
        lora = None if lora_request is None else self._lora(lora_request)
        rank = priority_from(priority, None, self.config.options.priorities)
        return self._spec(ids, params, request_id, rank, lora), text

    def _spec(
        self, ids: list[int], params: SamplingParams, request_id: str, priority: int, lora: LoraRef | None
    ) -> RequestSpec:
        spec = build_spec(
            ids,
            params.fields(),
            self.engine.max_model_len,
            tokenizer=self.tokenizer,
            request_id=request_id,
            priority=priority,
            kv_precision=params.kv_precision,
            compact_tokens=self.engine.compact_tokens,
        )
        return dataclasses.replace(spec, lora=lora) if lora else spec

    def on_engine(self, call: Callable[[EngineCore], T]) -> Future[T]:
        """Run `call(engine)` on the engine's thread, where the engine core's methods must run (submit, abort,
        its stats); the Future of its result (`asyncio.wrap_future` awaits it from another event loop)."""

        async def run() -> T:
            return call(self.engine)

        coro = run()
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed
            coro.close()
            raise RuntimeError("the LLM is closed") from None

    def _lora(self, request: LoRARequest) -> LoraRef:
        """The registered adapter of a LoRARequest, registering (and checking) it on first use."""
        registry = self.engine.loras
        if registry is None:
            raise ValueError("lora_request: LoRA is off; make the LLM with enable_lora=True")
        ref = registry.get(request.lora_name)
        if ref is None:
            return registry.add(request.lora_name, request.lora_path)
        if ref.path != str(Path(request.lora_path).expanduser().resolve()):
            raise ValueError(f"lora_request: {request.lora_name!r} is loaded from {ref.path}, not {request.lora_path}")
        return ref

    def unload_lora(self, lora_name: str) -> None:
        """Forget an adapter: requests naming it again load it anew (KeyError if it is not loaded)."""
        if self.engine.loras is None or self.engine.loras.get(lora_name) is None:
            raise KeyError(f"LoRA adapter {lora_name!r} is not loaded")
        self.engine.loras.remove(lora_name)

    async def _submit(self, collectors: list[Collector]) -> None:
        engine = self.engine
        try:
            for c in collectors:
                engine.submit_to(c.spec, c)
        except BaseException:
            await self._abort([c.spec for c in collectors])
            raise

    async def _abort(self, specs: list[RequestSpec]) -> None:
        if self._engine is not None:
            for spec in specs:
                self._engine.abort(spec.request_id)

    # ---- lifetime

    async def _start(self, join_timeout: float) -> None:
        layout = self.config.layout
        placement = place(single_island(layout.world_size), layout, worker_chooses_device=True)
        world = WorldPlan(self.config, self.folder, placement)
        if self.worker_backend == "inprocess":
            from worker_node.inprocess import InProcessWorkers

            workers: Any = InProcessWorkers(self.options)
        else:
            address = f"127.0.0.1:{free_port()}"
            workers = WorkerLink(address)
            workers.claim = world.claim
            workers.output_rank = layout.output_rank
            self._launcher = LocalLauncher(layout.world_size, None, join_timeout, workers.heartbeat_timeout)
            self._launcher.start(address, worker_argv(self.options))
            self._tasks.append(asyncio.get_running_loop().create_task(self._keep_alive()))
        capacity = await workers.start(world.assignment, join_timeout)
        self._engine = make_engine(self.config, self.folder, self.tokenizer, workers, capacity, policy=self._policy)
        self._tasks.append(asyncio.get_running_loop().create_task(self._engine.run()))

    async def _keep_alive(self) -> None:
        while self._launcher is not None:
            self._launcher.keep_alive()
            await asyncio.sleep(0.5)

    def close(self) -> None:
        """Stop the engine and every worker process; idempotent. Never waits more than about CLOSE_TIMEOUT_S."""
        _OPEN.discard(self)
        if self._loop.is_closed():
            return
        if self._loop.is_running() and self._thread.is_alive():
            try:
                self._call(self._stop(), CLOSE_TIMEOUT_S)
            except Exception:  # a stuck engine must not keep the program from ending: the workers go regardless
                logger.exception("the engine did not stop cleanly")
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._launcher is not None:
            self._launcher.stop(10.0)  # they got Shutdown
            self._launcher = None
        if not self._thread.is_alive():
            self._loop.close()

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._engine is not None:
            await self._engine.workers.close("the LLM was closed")
            self._engine = None
        others = asyncio.all_tasks() - {asyncio.current_task()}
        for task in others:  # whatever the engine left waiting (a drained stream's reader, a wake-up)
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_loop", None) is None or self._loop.is_closed():
            return
        if sys.is_finalizing():  # the engine thread is frozen: only the worker processes can still be stopped
            if self._launcher is not None:
                self._launcher.stop(0.0)
            return
        self.close()

    def _call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run `coro` on the engine's loop and wait for it. Interrupted (Ctrl-C) or timed out, the coroutine is
        cancelled, so a `generate` left behind aborts its requests instead of running on."""
        # This thread only waits: OpenMP workers it kept from its own torch work would slow every parallel region
        # of the step thread (kernels/openmp.py), so they go (its next parallel work makes them again).
        release_thread_pool()
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise


# What help(LLM) and inspect.signature(LLM) show: every setting a keyword with its default (the tree's).
LLM.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("worker_backend", inspect.Parameter.KEYWORD_ONLY, default="auto"),
        inspect.Parameter("attention", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("scheduler", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("cache", inspect.Parameter.KEYWORD_ONLY, default=None),
        *keyword_parameters(),
        *alias_parameters(),
    ]
)
