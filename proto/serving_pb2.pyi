from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "n", "logprobs", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens", "stop_token_ids", "logit_bias", "bad_words", "prompt_logprobs", "json", "regex", "choice", "json_object", "speculate")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    SPECULATE_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    n: int
    logprobs: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.ScalarMap[int, float]
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    prompt_logprobs: int
    json: str
    regex: str
    choice: Choices
    json_object: bool
    speculate: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., bad_words: _Optional[_Iterable[str]] = ..., prompt_logprobs: _Optional[int] = ..., json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., json_object: _Optional[bool] = ..., speculate: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "messages", "sampling", "priority", "cache_salt", "deadline_s", "model", "kv_precision", "migratable", "resume", "kv_handoff")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_PRECISION_FIELD_NUMBER: _ClassVar[int]
    MIGRATABLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    priority: int
    cache_salt: str
    deadline_s: float
    model: str
    kv_precision: str
    migratable: bool
    resume: ResumeState
    kv_handoff: KVHandoff
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., deadline_s: _Optional[float] = ..., model: _Optional[str] = ..., kv_precision: _Optional[str] = ..., migratable: _Optional[bool] = ..., resume: _Optional[_Union[ResumeState, _Mapping]] = ..., kv_handoff: _Optional[_Union[KVHandoff, _Mapping]] = ...) -> None: ...

class SequenceState(_message.Message):
    __slots__ = ("index", "output_token_ids", "held_text", "pending_token_ids", "prompt_tokens", "cached_tokens", "kv_source")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_TEXT_FIELD_NUMBER: _ClassVar[int]
    PENDING_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    index: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    held_text: str
    pending_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    cached_tokens: int
    kv_source: KVHandoff
    def __init__(self, index: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., held_text: _Optional[str] = ..., pending_token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_source: _Optional[_Union[KVHandoff, _Mapping]] = ...) -> None: ...

class ResumeState(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceState]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceState, _Mapping]]] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("produce", "addresses", "lease", "blocks", "tokens")
    PRODUCE_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    produce: bool
    addresses: _containers.RepeatedScalarFieldContainer[str]
    lease: bytes
    blocks: _containers.RepeatedScalarFieldContainer[int]
    tokens: int
    def __init__(self, produce: _Optional[bool] = ..., addresses: _Optional[_Iterable[str]] = ..., lease: _Optional[bytes] = ..., blocks: _Optional[_Iterable[int]] = ..., tokens: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("logprob", "top")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs", "migrated", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    migrated: SequenceState
    kv_source: KVHandoff
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., migrated: _Optional[_Union[SequenceState, _Mapping]] = ..., kv_source: _Optional[_Union[KVHandoff, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("total_blocks", "used_blocks", "free_blocks", "kv_usage", "num_running", "num_waiting", "num_preemptions", "block_size", "max_model_len", "cached_free_blocks", "fragmentation", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "preemptions_recompute", "preemptions_swap", "swap_blocks_used", "swap_blocks_total", "usable_blocks", "mean_worker_idle_ms", "interrupted_steps", "memory", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "lora_memory", "migrations_imported", "migrations_recomputed", "migration_kv_tokens_imported")
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_SWAP_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    SWAP_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEAN_WORKER_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    LORA_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_KV_TOKENS_IMPORTED_FIELD_NUMBER: _ClassVar[int]
    total_blocks: int
    used_blocks: int
    free_blocks: int
    kv_usage: float
    num_running: int
    num_waiting: int
    num_preemptions: int
    block_size: int
    max_model_len: int
    cached_free_blocks: int
    fragmentation: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    preemptions_recompute: int
    preemptions_swap: int
    swap_blocks_used: int
    swap_blocks_total: int
    usable_blocks: int
    mean_worker_idle_ms: float
    interrupted_steps: int
    memory: _containers.RepeatedCompositeFieldContainer[KvPool]
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    lora_memory: _containers.RepeatedCompositeFieldContainer[LoraPool]
    migrations_imported: int
    migrations_recomputed: int
    migration_kv_tokens_imported: int
    def __init__(self, total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., cached_free_blocks: _Optional[int] = ..., fragmentation: _Optional[float] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., preemptions_recompute: _Optional[int] = ..., preemptions_swap: _Optional[int] = ..., swap_blocks_used: _Optional[int] = ..., swap_blocks_total: _Optional[int] = ..., usable_blocks: _Optional[int] = ..., mean_worker_idle_ms: _Optional[float] = ..., interrupted_steps: _Optional[int] = ..., memory: _Optional[_Iterable[_Union[KvPool, _Mapping]]] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., lora_memory: _Optional[_Iterable[_Union[LoraPool, _Mapping]]] = ..., migrations_imported: _Optional[int] = ..., migrations_recomputed: _Optional[int] = ..., migration_kv_tokens_imported: _Optional[int] = ...) -> None: ...

class LoraPool(_message.Message):
    __slots__ = ("tier", "adapters", "capacity", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    adapters: int
    capacity: int
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., adapters: _Optional[int] = ..., capacity: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class KvPool(_message.Message):
    __slots__ = ("tier", "format", "bytes_per_block", "total_blocks", "used_blocks", "allocated_bytes", "used_bytes", "hits")
    TIER_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    format: str
    bytes_per_block: int
    total_blocks: int
    used_blocks: int
    allocated_bytes: int
    used_bytes: int
    hits: int
    def __init__(self, tier: _Optional[str] = ..., format: _Optional[str] = ..., bytes_per_block: _Optional[int] = ..., total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., hits: _Optional[int] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "host", "pid", "device", "tp_rank", "pp_stage", "state", "heartbeat_age_s", "num_kv_blocks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_STAGE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    pid: int
    device: str
    tp_rank: int
    pp_stage: int
    state: str
    heartbeat_age_s: float
    num_kv_blocks: int
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., device: _Optional[str] = ..., tp_rank: _Optional[int] = ..., pp_stage: _Optional[int] = ..., state: _Optional[str] = ..., heartbeat_age_s: _Optional[float] = ..., num_kv_blocks: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s", "migrate")
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    migrate: bool
    def __init__(self, timeout_s: _Optional[float] = ..., migrate: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained", "remaining", "migrated")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    remaining: int
    migrated: int
    def __init__(self, drained: _Optional[bool] = ..., remaining: _Optional[int] = ..., migrated: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("migrated",)
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    migrated: int
    def __init__(self, migrated: _Optional[int] = ...) -> None: ...

class ResizeCacheRequest(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class ResizeCacheResponse(_message.Message):
    __slots__ = ("usable_blocks", "blocks_moved", "seconds")
    USABLE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    usable_blocks: int
    blocks_moved: int
    seconds: float
    def __init__(self, usable_blocks: _Optional[int] = ..., blocks_moved: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("address", "model", "state", "weight", "num_running", "num_waiting", "kv_usage", "in_flight", "requests", "ttft_ewma_s", "tpot_ewma_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_EWMA_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_EWMA_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    model: str
    state: str
    weight: float
    num_running: int
    num_waiting: int
    kv_usage: float
    in_flight: int
    requests: int
    ttft_ewma_s: float
    tpot_ewma_s: float
    def __init__(self, address: _Optional[str] = ..., model: _Optional[str] = ..., state: _Optional[str] = ..., weight: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., in_flight: _Optional[int] = ..., requests: _Optional[int] = ..., ttft_ewma_s: _Optional[float] = ..., tpot_ewma_s: _Optional[float] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "id", "parent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    id: int
    parent: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., id: _Optional[int] = ..., parent: _Optional[str] = ...) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...
