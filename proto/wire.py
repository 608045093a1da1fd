"""The scheduler ⇄ worker messages on ZMQ: typed msgspec Structs, msgpack on the wire, versioned and checked.

Each message is written once, as a Struct: its fields in order are its layout (array-like, so no field names travel)
and its kind (`Kind`) is the tag that comes first. A frame is `[WIRE_VERSION, [kind, *fields]]`. Decoding checks the
size, the version, and every field against its type, its bounds (`Meta`) and the message's own rules
(`__post_init__`), so a malformed message raises `WireError` naming the field instead of reaching the engine.
Messages are trees, never cycles, so their Structs are left out of the garbage collector's tracking (`gc=False`):
a plan of thousands of requests adds nothing for a collection to walk. Never pickle.

Requests travel as short integer handles the scheduler assigns at admission (its string ids stay with it): a
steady decode request costs a plan about 8 bytes.
"""

from __future__ import annotations

import re
from typing import Any, Union, get_args

import msgspec
import msgspec.inspect

from proto.session_messages import (
    Assignment,
    ExecutionMode,
    Heartbeat,
    Interrupt,
    Shutdown,
    StepError,
    WorkerHello,
    WorkerReady,
)
from proto.step_messages import (
    STRUCTURED_KINDS,
    CachedRequest,
    KVGrant,
    KVImport,
    LoraAdapter,
    NewRequest,
    SamplingOptions,
    StepPlan,
    StepResult,
    StructuredOutput,
    TierMove,
    TokenLogprobs,
    pack_int32,
    unpack_int32,
)
from proto.wire_base import BlockPair, Count, Handle, Kind, Message, Record, WireError

# The messages are defined by idea (proto/wire_base.py, step_messages.py, session_messages.py); every caller imports
# them from here, the wire's one public face.
__all__ = [
    "MAX_MESSAGE_BYTES",
    "STRUCTURED_KINDS",
    "WIRE_VERSION",
    "AnyMessage",
    "Assignment",
    "BlockPair",
    "CachedRequest",
    "Count",
    "ExecutionMode",
    "Handle",
    "Heartbeat",
    "Interrupt",
    "KVGrant",
    "KVImport",
    "Kind",
    "LoraAdapter",
    "Message",
    "NewRequest",
    "Record",
    "SamplingOptions",
    "Shutdown",
    "StepError",
    "StepPlan",
    "StepResult",
    "StructuredOutput",
    "TierMove",
    "TokenLogprobs",
    "WireError",
    "WorkerHello",
    "WorkerReady",
    "decode",
    "encode",
    "pack_int32",
    "unpack_int32",
]

# 2: results say whether an Interrupt reached them (a new message); cached requests carry new_token_ids, and
# with P > 1 stages the workers take sampled tokens from the plan instead of broadcasting them; a v1 process in
# such a world would wait on a broadcast that never comes.
# 3: the Assignment carries the execution mode and the world's KV size (a replacement worker allocates exactly it).
# 4: SamplingOptions carries penalties, min_p, logit_bias, bad words, min_tokens with the tokens that end the
# sequence, prompt_logprobs and structured output; results carry prompt logprobs. A v3 worker would misread the
# longer sampling record.
# 5: msgspec Structs in a `[version, [kind, *fields]]` frame; requests are integer handles, each scheduled request
# carries its own token count (no separate map repeating the ids), logit_bias is a map. A v4 peer's flat frame is
# refused by its version.
# 6: plans carry KV offload tier moves, results the time spent on them, Ready the KV format, the tiers' sizes and
# the blocks a warm disk tier holds (scheduler_node/core/kv/tier_index.py, worker_node/kv/tiers.py).
# 7: results name the tier loads that failed (a disk block corrupted since start) and the requests left out of
# the step for reading them, which the scheduler has recomputed (a v6 scheduler would use the bad KV); and the
# time the tier loads took.
# 8: per-request KV precision: the Assignment carries the compact pool's share, format and (for a replacement) size,
# Ready the compact pool's blocks, bytes and format, plans the first compact block id (core/kv/precision.py). A v6
# worker would read compact block ids as full ones (a v7 one, too).
# 9: embeddings and reasoning grammars: SamplingOptions.pooling, StepResult.pooled, structured kind "lark" (a v8
# worker would refuse the longer records, and sample an embedding request without pooling it).
# 10: cached requests carry proposed tokens (speculative decoding) and results may carry several tokens per request
# (the accepted proposals and one more); a v9 worker would compute the proposals as known tokens.
# 11: LoRA: a NewRequest names its adapter and the worker slot it runs in (a v10 worker would run the base model).
# 12: LoRA host tier: the adapter record carries --max-cpu-loras (a v11 worker would refuse the longer record).
# 13: disaggregated prefill/decode: plans carry KV imports (pull a prefix from another world's ranks), lease grants
# and revocations (worker_node/kv/transfer/exporter.py), Ready the rank's KV exporter address. A v12 worker would
# compute a prefix the scheduler counts as imported.
# 14: a draft model (speculative decoding): Assignment.draft_model, StepPlan.propose, StepResult.drafts (a v13
# worker would never propose, and the requests would wait on proposals that never come).
# 15: a result of one token per request carries them packed (StepResult.token_handles, tokens: int32 arrays); a
# v14 scheduler would refuse the longer record.
# 16: a Hello may name the worker's model and world shape (--model, TP, PP: a scheduler without --model takes them
# from the first worker), and a Shutdown may be a refusal (a v15 worker would be restarted to be refused again).
WIRE_VERSION = 16
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# libzmq's own ZMTP heartbeats, set on both ends of the worker socket: a quiet connection is PINGed this often by
# libzmq's I/O thread (so a busy Python thread does not drop it), and dropped after the heartbeat timeout.
ZMQ_HEARTBEAT_IVL_MS = 1000
WORKER_JOIN_TIMEOUT_S = 600.0  # a worker still loading after this long gives its rank back: --worker-join-timeout
HEARTBEAT_TIMEOUT_S = 10.0  # silence after which a peer is gone: --heartbeat-timeout's default, a worker's own


AnyMessage = Union[
    WorkerHello, Assignment, WorkerReady, StepPlan, StepResult, Shutdown, Heartbeat, StepError, Interrupt
]
_ENCODER = msgspec.msgpack.Encoder()
_FRAME = msgspec.msgpack.Decoder(list[msgspec.Raw])
_VERSION = msgspec.msgpack.Decoder(int)
_MESSAGE = msgspec.msgpack.Decoder(AnyMessage)  # type: ignore[arg-type]


def _kind_of(cls: type[Message]) -> int:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, int), f"{cls.__name__} has no Kind tag"
    return tag


# Each message's kind is its Struct's tag: the table of kinds is read from the union, not written again.
_BY_KIND: dict[int, type[Message]] = {_kind_of(cls): cls for cls in get_args(AnyMessage)}


def encode(message: Message) -> bytes:
    data = _ENCODER.encode((WIRE_VERSION, message))
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return data


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        frame = _FRAME.decode(data)
        version = _VERSION.decode(frame[0]) if frame else None
    except msgspec.MsgspecError as exc:
        raise WireError(f"expected [version, message]: {exc}") from exc
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version!r}, this build speaks {WIRE_VERSION}")
    if len(frame) != 2:
        raise WireError(f"expected [version, message], got {len(frame)} items")
    try:
        message: Message = _MESSAGE.decode(frame[1])
    except msgspec.MsgspecError as exc:
        raise WireError(_explain(exc, frame[1])) from exc
    try:
        message.check()
    except WireError as exc:
        raise WireError(f"malformed {type(message).__name__}: {exc}") from exc
    return message


_PATH = re.compile(r" - at (`key` in )?`\$((?:\[(?:\d+|\.\.\.)\])*)`$")


def _explain(exc: msgspec.MsgspecError, raw: msgspec.Raw) -> str:
    """msgspec's error, its position (`$[3][0][1]`) spelled as field names (`cached_requests[0].new_block_ids`)."""
    text = str(exc)
    try:
        items = msgspec.msgpack.decode(raw, type=list[msgspec.Raw])
        kind = msgspec.msgpack.decode(items[0]) if items else None
    except msgspec.MsgspecError:
        kind = None
    cls = _BY_KIND.get(kind) if type(kind) is int else None
    if cls is None:
        return f"unknown message kind {kind!r}" if type(kind) is int else f"expected [kind, *fields]: {text}"
    match = _PATH.search(text)
    if match is None:
        return f"malformed {cls.__name__}: {text}"
    steps = re.findall(r"\[(\d+|\.\.\.)\]", match.group(2))
    where = _name_path(cls, steps)
    key = " key" if match.group(1) else ""
    return f"malformed {cls.__name__}: {where}{key}: {text[: match.start()]}"


def _name_path(cls: type[Message], steps: list[str]) -> str:
    """Field names along the indices of an error's position, through Structs, lists, tuples and maps."""
    info: Any = msgspec.inspect.type_info(cls)
    out = ""
    top = True  # a message's fields start after its kind
    for step in steps:
        while isinstance(info, msgspec.inspect.UnionType):  # X | None: the non-None one
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
        if isinstance(info, msgspec.inspect.StructType) and step.isdigit():
            index = int(step) - (1 if top else 0)
            top = False
            if not 0 <= index < len(info.fields):
                return out + f"[{step}]"
            out += ("." if out else "") + info.fields[index].name
            info = info.fields[index].type
        elif isinstance(info, msgspec.inspect.ListType):
            out += f"[{step}]"
            info = info.item_type
        elif isinstance(info, msgspec.inspect.TupleType):
            out += f"[{step}]"
            info = info.item_types[int(step)] if step.isdigit() and int(step) < len(info.item_types) else None
        elif isinstance(info, msgspec.inspect.DictType):
            out += "[...]" if step == "..." else f"[{step}]"
            info = info.value_type
        else:
            out += f"[{step}]"
    return out or "message"
