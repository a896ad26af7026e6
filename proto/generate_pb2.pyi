from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GrammarType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRAMMAR_TYPE_UNSPECIFIED: _ClassVar[GrammarType]
    GRAMMAR_TYPE_JSON: _ClassVar[GrammarType]
    GRAMMAR_TYPE_REGEX: _ClassVar[GrammarType]
    GRAMMAR_TYPE_EBNF: _ClassVar[GrammarType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]

class KvTransferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_KIND_UNSPECIFIED: _ClassVar[KvTransferKind]
    KV_TRANSFER_KIND_OFFLOAD: _ClassVar[KvTransferKind]
    KV_TRANSFER_KIND_RESTORE: _ClassVar[KvTransferKind]
    KV_TRANSFER_KIND_DEMOTE: _ClassVar[KvTransferKind]
GRAMMAR_TYPE_UNSPECIFIED: GrammarType
GRAMMAR_TYPE_JSON: GrammarType
GRAMMAR_TYPE_REGEX: GrammarType
GRAMMAR_TYPE_EBNF: GrammarType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS_TOKEN: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
KV_TRANSFER_KIND_UNSPECIFIED: KvTransferKind
KV_TRANSFER_KIND_OFFLOAD: KvTransferKind
KV_TRANSFER_KIND_RESTORE: KvTransferKind
KV_TRANSFER_KIND_DEMOTE: KvTransferKind

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("requires_padding", "dtype", "device_type", "block_size", "max_position_embeddings", "model_id", "model_type", "world_size", "quantize", "weight_bytes", "kv_cache_dtype", "kv_cache_bytes_per_token", "attention_backend", "cpu_kernels", "model_implementation", "lora_adapters", "max_loras", "max_lora_rank", "resident_lora_adapters", "max_cpu_loras")
    class CpuKernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUIRES_PADDING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    CPU_KERNELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    requires_padding: bool
    dtype: str
    device_type: str
    block_size: int
    max_position_embeddings: int
    model_id: str
    model_type: str
    world_size: int
    quantize: str
    weight_bytes: int
    kv_cache_dtype: str
    kv_cache_bytes_per_token: int
    attention_backend: str
    cpu_kernels: _containers.ScalarMap[str, str]
    model_implementation: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    max_lora_rank: int
    resident_lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_cpu_loras: int
    def __init__(self, requires_padding: _Optional[bool] = ..., dtype: _Optional[str] = ..., device_type: _Optional[str] = ..., block_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., model_id: _Optional[str] = ..., model_type: _Optional[str] = ..., world_size: _Optional[int] = ..., quantize: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_cache_bytes_per_token: _Optional[int] = ..., attention_backend: _Optional[str] = ..., cpu_kernels: _Optional[_Mapping[str, str]] = ..., model_implementation: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., resident_lora_adapters: _Optional[_Iterable[str]] = ..., max_cpu_loras: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceDiscoveryResponse(_message.Message):
    __slots__ = ("urls",)
    URLS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, urls: _Optional[_Iterable[str]] = ...) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NextTokenChooserParameters(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "typical_p", "do_sample", "seed", "repetition_penalty", "frequency_penalty", "watermark", "presence_penalty", "logit_bias", "min_p")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    typical_p: float
    do_sample: bool
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    watermark: bool
    presence_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., do_sample: _Optional[bool] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., watermark: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ...) -> None: ...

class StoppingCriteriaParameters(_message.Message):
    __slots__ = ("max_new_tokens", "stop_sequences", "ignore_eos_token", "min_new_tokens", "stop_token_ids")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos_token: bool
    min_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_new_tokens: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., ignore_eos_token: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "inputs", "input_ids", "parameters", "stopping_parameters", "prefill_logprobs", "top_n_tokens", "cache_len", "grammar", "adapter_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STOPPING_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    id: int
    inputs: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    parameters: NextTokenChooserParameters
    stopping_parameters: StoppingCriteriaParameters
    prefill_logprobs: bool
    top_n_tokens: int
    cache_len: int
    grammar: Grammar
    adapter_id: str
    def __init__(self, id: _Optional[int] = ..., inputs: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., parameters: _Optional[_Union[NextTokenChooserParameters, _Mapping]] = ..., stopping_parameters: _Optional[_Union[StoppingCriteriaParameters, _Mapping]] = ..., prefill_logprobs: _Optional[bool] = ..., top_n_tokens: _Optional[int] = ..., cache_len: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., adapter_id: _Optional[str] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("type", "value", "thinking")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    type: GrammarType
    value: str
    thinking: ThinkingMarkers
    def __init__(self, type: _Optional[_Union[GrammarType, str]] = ..., value: _Optional[str] = ..., thinking: _Optional[_Union[ThinkingMarkers, _Mapping]] = ...) -> None: ...

class ThinkingMarkers(_message.Message):
    __slots__ = ("end_token_id", "starts_inside", "start_token_id")
    END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STARTS_INSIDE_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    end_token_id: int
    starts_inside: bool
    start_token_id: int
    def __init__(self, end_token_id: _Optional[int] = ..., starts_inside: _Optional[bool] = ..., start_token_id: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("ids", "logprobs", "texts", "is_special")
    IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    IS_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    texts: _containers.RepeatedScalarFieldContainer[str]
    is_special: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., texts: _Optional[_Iterable[str]] = ..., is_special: _Optional[_Iterable[bool]] = ...) -> None: ...

class GeneratedText(_message.Message):
    __slots__ = ("text", "generated_tokens", "finish_reason", "seed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int
    def __init__(self, text: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class Generation(_message.Message):
    __slots__ = ("request_id", "prefill_tokens", "tokens", "generated_text", "top_tokens", "error", "prefill_top_tokens", "proposed_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    prefill_tokens: Tokens
    tokens: Tokens
    generated_text: GeneratedText
    top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    error: str
    prefill_top_tokens: _containers.RepeatedCompositeFieldContainer[Tokens]
    proposed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[int] = ..., prefill_tokens: _Optional[_Union[Tokens, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., generated_text: _Optional[_Union[GeneratedText, _Mapping]] = ..., top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., error: _Optional[str] = ..., prefill_top_tokens: _Optional[_Iterable[_Union[Tokens, _Mapping]]] = ..., proposed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("max_input_tokens", "max_prefill_tokens", "max_total_tokens", "max_batch_size")
    MAX_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_input_tokens: int
    max_prefill_tokens: int
    max_total_tokens: int
    max_batch_size: int
    def __init__(self, max_input_tokens: _Optional[int] = ..., max_prefill_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., max_batch_size: _Optional[int] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("max_supported_total_tokens", "num_blocks", "decode_timings", "prefill_tokens_per_s", "prefill_chunk_tokens", "measure_ms", "device_name", "num_threads", "dtype", "dtype_source", "dtype_trials", "kv_offload_disk_hashes")
    MAX_SUPPORTED_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEASURE_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_TRIALS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_DISK_HASHES_FIELD_NUMBER: _ClassVar[int]
    max_supported_total_tokens: int
    num_blocks: int
    decode_timings: _containers.RepeatedCompositeFieldContainer[DecodeTiming]
    prefill_tokens_per_s: float
    prefill_chunk_tokens: int
    measure_ms: float
    device_name: str
    num_threads: int
    dtype: str
    dtype_source: str
    dtype_trials: _containers.RepeatedCompositeFieldContainer[DtypeTrial]
    kv_offload_disk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, max_supported_total_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., decode_timings: _Optional[_Iterable[_Union[DecodeTiming, _Mapping]]] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_chunk_tokens: _Optional[int] = ..., measure_ms: _Optional[float] = ..., device_name: _Optional[str] = ..., num_threads: _Optional[int] = ..., dtype: _Optional[str] = ..., dtype_source: _Optional[str] = ..., dtype_trials: _Optional[_Iterable[_Union[DtypeTrial, _Mapping]]] = ..., kv_offload_disk_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DecodeTiming(_message.Message):
    __slots__ = ("batch_size", "step_ms")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    step_ms: float
    def __init__(self, batch_size: _Optional[int] = ..., step_ms: _Optional[float] = ...) -> None: ...

class DtypeTrial(_message.Message):
    __slots__ = ("dtype", "decode_timings", "prefill_chunk_ms", "prefill_chunk_tokens", "score_ms")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_MS_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    decode_timings: _containers.RepeatedCompositeFieldContainer[DecodeTiming]
    prefill_chunk_ms: float
    prefill_chunk_tokens: int
    score_ms: float
    def __init__(self, dtype: _Optional[str] = ..., decode_timings: _Optional[_Iterable[_Union[DecodeTiming, _Mapping]]] = ..., prefill_chunk_ms: _Optional[float] = ..., prefill_chunk_tokens: _Optional[int] = ..., score_ms: _Optional[float] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("requests", "plan")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    plan: StepPlan
    def __init__(self, requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("scheduled", "finished_ids", "lora_residency", "kv_transfers")
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    LORA_RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledRequest]
    finished_ids: _containers.RepeatedScalarFieldContainer[int]
    lora_residency: LoraResidency
    kv_transfers: _containers.RepeatedCompositeFieldContainer[KvTransfer]
    def __init__(self, scheduled: _Optional[_Iterable[_Union[ScheduledRequest, _Mapping]]] = ..., finished_ids: _Optional[_Iterable[int]] = ..., lora_residency: _Optional[_Union[LoraResidency, _Mapping]] = ..., kv_transfers: _Optional[_Iterable[_Union[KvTransfer, _Mapping]]] = ...) -> None: ...

class KvTransfer(_message.Message):
    __slots__ = ("kind", "block_hash", "block_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    kind: KvTransferKind
    block_hash: bytes
    block_id: int
    def __init__(self, kind: _Optional[_Union[KvTransferKind, str]] = ..., block_hash: _Optional[bytes] = ..., block_id: _Optional[int] = ...) -> None: ...

class LoraResidency(_message.Message):
    __slots__ = ("adapter_ids",)
    ADAPTER_IDS_FIELD_NUMBER: _ClassVar[int]
    adapter_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, adapter_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ScheduledRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "start_position", "block_table", "produces_token", "num_draft_tokens", "num_proposed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    PRODUCES_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    produces_token: bool
    num_draft_tokens: int
    num_proposed_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., produces_token: _Optional[bool] = ..., num_draft_tokens: _Optional[int] = ..., num_proposed_tokens: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("generations", "forward_ns", "decode_ns", "total_ns", "draft_ns", "draft_pass_ns", "draft_pass_rows")
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PASS_NS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PASS_ROWS_FIELD_NUMBER: _ClassVar[int]
    generations: _containers.RepeatedCompositeFieldContainer[Generation]
    forward_ns: int
    decode_ns: int
    total_ns: int
    draft_ns: int
    draft_pass_ns: int
    draft_pass_rows: float
    def __init__(self, generations: _Optional[_Iterable[_Union[Generation, _Mapping]]] = ..., forward_ns: _Optional[int] = ..., decode_ns: _Optional[int] = ..., total_ns: _Optional[int] = ..., draft_ns: _Optional[int] = ..., draft_pass_ns: _Optional[int] = ..., draft_pass_rows: _Optional[float] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id", "path")
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    path: str
    def __init__(self, adapter_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("rank", "num_updates")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_UPDATES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_updates: int
    def __init__(self, rank: _Optional[int] = ..., num_updates: _Optional[int] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter_id",)
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    adapter_id: str
    def __init__(self, adapter_id: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
