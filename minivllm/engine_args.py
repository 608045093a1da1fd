"""AsyncEngineArgs: vLLM's engine arguments, `AsyncEngineArgs(model=..., scheduler_delay=0.05, max_batch_size=32,
enable_preemption=True)`. Its keywords are the settings tree's (settings/engine_args.py), as `LLM(...)`'s are, so a
setting added there is a keyword here with no edit; they are checked when the arguments are made."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from minivllm.llm import WORKER_BACKENDS, build_settings
from settings.build import flat_values
from settings.engine_args import alias_names, alias_parameters, keyword_parameters


class AsyncEngineArgs:
    """`model` (a folder or hub id; None: the default model) and any engine or worker setting by its name with
    underscores, or by an alias (`max_batch_size` for `max_num_seqs`). TypeError naming an unknown keyword,
    ValueError naming a bad value. Each setting reads back as an attribute (`args.max_num_seqs`)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        worker_backend: str = "auto",
        attention: Mapping[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if worker_backend not in WORKER_BACKENDS:
            raise ValueError(f"worker_backend: must be one of {WORKER_BACKENDS}, got {worker_backend!r}")
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model: must be a folder or a hub id, got {type(model).__name__}")
        self.model = model
        self.worker_backend = worker_backend
        self.attention = attention
        self.settings = dict(settings)  # as given: the engine builds them again, with the environment of then
        self.values = flat_values(build_settings(settings, attention))

    def keywords(self) -> dict[str, Any]:
        """What `LLM(...)` and `AsyncLLMEngine(...)` take besides the model."""
        return {"worker_backend": self.worker_backend, "attention": self.attention, **self.settings}

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        key = alias_names().get(name, name)
        if key in values:
            return values[key]
        raise AttributeError(f"AsyncEngineArgs has no setting {name!r}")

    def __repr__(self) -> str:
        given = "".join(f", {k}={v!r}" for k, v in self.settings.items())
        return f"AsyncEngineArgs(model={self.model!r}{given})"


AsyncEngineArgs.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None),
        inspect.Parameter("worker_backend", inspect.Parameter.KEYWORD_ONLY, default="auto"),
        inspect.Parameter("attention", inspect.Parameter.KEYWORD_ONLY, default=None),
        *keyword_parameters(),
        *alias_parameters(),
    ]
)
