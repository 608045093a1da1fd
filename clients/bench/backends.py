"""The servers vllm-bench measures: minivllm's gRPC door, or any OpenAI-compatible base URL (minivllm's HTTP door,
vLLM, llama.cpp's llama-server, ...). Each request is streamed; the client notes when each piece arrives."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import grpc

from clients.bench.workload import BenchRequest
from proto import serving_pb2 as pb
from proto import serving_pb2_grpc as pb_grpc
from proto.wire import MAX_MESSAGE_BYTES


@dataclass(frozen=True, slots=True)
class SendOptions:
    endpoint: str = "completions"  # or chat: the prompt goes as one user message (the chat template applies)
    temperature: float = 0.0
    ignore_eos: bool = True  # outputs run to their set lengths (vLLM's extension; llama-server knows it too)
    timeout: float = 600.0  # seconds one request may take


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds from send to the first token
    latency: float = 0.0  # seconds from send to the end
    itl: list[float] = field(default_factory=list)  # seconds between successive pieces of output
    error: str = ""


class Clock:
    """Send time and each output piece's arrival for one request."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.arrivals: list[float] = []

    def piece(self) -> None:
        self.arrivals.append(time.perf_counter())

    def result(self, prompt_len: int, output_len: int) -> RequestResult:
        end = time.perf_counter()
        if not self.arrivals:
            return self.failed("no output arrived")
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        return RequestResult(True, prompt_len, output_len, self.arrivals[0] - self.start, end - self.start, gaps)

    def failed(self, error: str) -> RequestResult:
        return RequestResult(False, latency=time.perf_counter() - self.start, error=error)


class Backend(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def send(self, request: BenchRequest, options: SendOptions) -> RequestResult: ...


def user_message(request: BenchRequest) -> list[dict[str, str]]:
    return request.messages or [{"role": "user", "content": request.text}]


class GrpcBackend:
    """minivllm's Generation.Generate (prompt token ids when the workload has them, else text or messages)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel: grpc.aio.Channel | None = None

    async def open(self) -> None:
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.aio.insecure_channel(self.address, options=options)
        self.stub = pb_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def send(self, request: BenchRequest, options: SendOptions) -> RequestResult:
        sampling = pb.SamplingParams(
            max_tokens=request.output_len, temperature=options.temperature, ignore_eos=options.ignore_eos
        )
        message = pb.GenerateRequest(sampling=sampling)
        if options.endpoint == "chat":
            message.messages.messages.extend(pb.ChatMessage(**m) for m in user_message(request))
        elif request.prompt_ids is not None:
            message.prompt_token_ids.ids.extend(request.prompt_ids)
        else:
            message.prompt = request.text
        clock, tokens, prompt_len = Clock(), 0, 0
        try:
            async for delta in self.stub.Generate(message, timeout=options.timeout):
                if delta.token_ids:
                    clock.piece()
                    tokens += len(delta.token_ids)
                if delta.finish_reason:
                    prompt_len = delta.usage.prompt_tokens
        except grpc.aio.AioRpcError as exc:
            return clock.failed(f"{exc.code().name}: {exc.details()}")
        return clock.result(prompt_len, tokens)


class OpenAIBackend:
    """POST {base_url}/completions or /chat/completions with `stream: true`, reading server-sent events. Output
    tokens come from the closing usage chunk (`stream_options.include_usage`), else one per piece of text."""

    def __init__(self, base_url: str, model: str = "", api_key: str = "", send_text: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.send_text = send_text  # prompts as text even when token ids are known (servers that take no ids)
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # open-loop: as many connections as requests in flight
        self.session = aiohttp.ClientSession(connector=connector, headers=self.headers, read_bufsize=1 << 20)
        if not self.model:  # the server's first model
            async with self.session.get(self.base_url + "/models") as resp:
                resp.raise_for_status()
                self.model = (await resp.json())["data"][0]["id"]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, request: BenchRequest, options: SendOptions) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.output_len,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.ignore_eos:
            body["ignore_eos"] = True
        if options.endpoint == "chat":
            body["messages"] = user_message(request)
        else:
            use_ids = request.prompt_ids is not None and not self.send_text
            body["prompt"] = request.prompt_ids if use_ids else request.text
        return body

    async def send(self, request: BenchRequest, options: SendOptions) -> RequestResult:
        assert self.session is not None, "open() first"
        chat = options.endpoint == "chat"
        url = self.base_url + ("/chat/completions" if chat else "/completions")
        clock, pieces, usage = Clock(), 0, None
        timeout = aiohttp.ClientTimeout(total=options.timeout)
        try:
            async with self.session.post(url, json=self.body(request, options), timeout=timeout) as resp:
                if resp.status != 200:
                    return clock.failed(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        return clock.failed(str(event["error"]))
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                        if text:
                            clock.piece()
                            pieces += 1
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            return clock.failed(f"{type(exc).__name__}: {exc}")
        if usage:
            return clock.result(usage.get("prompt_tokens", 0), usage.get("completion_tokens", pieces))
        return clock.result(request.prompt_len, pieces)
