from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    CONDITION: _ClassVar[Role]
    NEGATIVE: _ClassVar[Role]

class RefusalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_REASON_UNSPECIFIED: _ClassVar[RefusalReason]
    CONDITIONS_COMPLETE: _ClassVar[RefusalReason]

class ARDecodingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AR_DECODING_UNSPECIFIED: _ClassVar[ARDecodingMode]
    AR_DECODING_SEQUENTIAL: _ClassVar[ARDecodingMode]
    AR_DECODING_JACOBI: _ClassVar[ARDecodingMode]
DTYPE_UNSPECIFIED: DType
BFLOAT16: DType
FLOAT16: DType
FLOAT32: DType
ROLE_UNSPECIFIED: Role
CONDITION: Role
NEGATIVE: Role
REFUSAL_REASON_UNSPECIFIED: RefusalReason
CONDITIONS_COMPLETE: RefusalReason
AR_DECODING_UNSPECIFIED: ARDecodingMode
AR_DECODING_SEQUENTIAL: ARDecodingMode
AR_DECODING_JACOBI: ARDecodingMode

class ImageParams(_message.Message):
    __slots__ = ("width", "height", "num_inference_steps", "text_guidance_scale", "cfg_range_start", "cfg_range_end", "seed", "output_format", "output_compression", "partial_images", "has_negative", "dit_cache")
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_INFERENCE_STEPS_FIELD_NUMBER: _ClassVar[int]
    TEXT_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    CFG_RANGE_START_FIELD_NUMBER: _ClassVar[int]
    CFG_RANGE_END_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_IMAGES_FIELD_NUMBER: _ClassVar[int]
    HAS_NEGATIVE_FIELD_NUMBER: _ClassVar[int]
    DIT_CACHE_FIELD_NUMBER: _ClassVar[int]
    width: int
    height: int
    num_inference_steps: int
    text_guidance_scale: float
    cfg_range_start: float
    cfg_range_end: float
    seed: int
    output_format: str
    output_compression: int
    partial_images: int
    has_negative: bool
    dit_cache: DiTCache
    def __init__(self, width: _Optional[int] = ..., height: _Optional[int] = ..., num_inference_steps: _Optional[int] = ..., text_guidance_scale: _Optional[float] = ..., cfg_range_start: _Optional[float] = ..., cfg_range_end: _Optional[float] = ..., seed: _Optional[int] = ..., output_format: _Optional[str] = ..., output_compression: _Optional[int] = ..., partial_images: _Optional[int] = ..., has_negative: _Optional[bool] = ..., dit_cache: _Optional[_Union[DiTCache, _Mapping]] = ...) -> None: ...

class DiTCache(_message.Message):
    __slots__ = ("threshold", "warmup_steps")
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    threshold: float
    warmup_steps: int
    def __init__(self, threshold: _Optional[float] = ..., warmup_steps: _Optional[int] = ...) -> None: ...

class DiTGenerateRequest(_message.Message):
    __slots__ = ("request_id", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    params: ImageParams
    def __init__(self, request_id: _Optional[str] = ..., params: _Optional[_Union[ImageParams, _Mapping]] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("reservation_token", "slot_id")
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    reservation_token: str
    slot_id: str
    def __init__(self, reservation_token: _Optional[str] = ..., slot_id: _Optional[str] = ...) -> None: ...

class DiTProgress(_message.Message):
    __slots__ = ("phase", "step", "total_steps", "rows_received")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[DiTProgress.Phase]
        RECEIVING: _ClassVar[DiTProgress.Phase]
        DENOISING: _ClassVar[DiTProgress.Phase]
        DECODING: _ClassVar[DiTProgress.Phase]
    PHASE_UNSPECIFIED: DiTProgress.Phase
    RECEIVING: DiTProgress.Phase
    DENOISING: DiTProgress.Phase
    DECODING: DiTProgress.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROWS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    phase: DiTProgress.Phase
    step: int
    total_steps: int
    rows_received: int
    def __init__(self, phase: _Optional[_Union[DiTProgress.Phase, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., rows_received: _Optional[int] = ...) -> None: ...

class DiTTimings(_message.Message):
    __slots__ = ("queue_ms", "receive_ms", "transfer_tail_ms", "denoise_ms", "vae_ms", "encode_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_MS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_MS_FIELD_NUMBER: _ClassVar[int]
    VAE_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    receive_ms: float
    transfer_tail_ms: float
    denoise_ms: float
    vae_ms: float
    encode_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., receive_ms: _Optional[float] = ..., transfer_tail_ms: _Optional[float] = ..., denoise_ms: _Optional[float] = ..., vae_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "format", "width", "height", "partial", "partial_index", "timings", "condition_rows", "negative_rows", "steps_skipped")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_INDEX_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    STEPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    format: str
    width: int
    height: int
    partial: bool
    partial_index: int
    timings: DiTTimings
    condition_rows: int
    negative_rows: int
    steps_skipped: int
    def __init__(self, data: _Optional[bytes] = ..., format: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., partial: _Optional[bool] = ..., partial_index: _Optional[int] = ..., timings: _Optional[_Union[DiTTimings, _Mapping]] = ..., condition_rows: _Optional[int] = ..., negative_rows: _Optional[int] = ..., steps_skipped: _Optional[int] = ...) -> None: ...

class ConditionsComplete(_message.Message):
    __slots__ = ("epoch", "condition_rows", "negative_rows")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONDITION_ROWS_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    condition_rows: int
    negative_rows: int
    def __init__(self, epoch: _Optional[int] = ..., condition_rows: _Optional[int] = ..., negative_rows: _Optional[int] = ...) -> None: ...

class DiTGenerateResponse(_message.Message):
    __slots__ = ("reserved", "progress", "image", "conditions_complete")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    progress: DiTProgress
    image: Image
    conditions_complete: ConditionsComplete
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., progress: _Optional[_Union[DiTProgress, _Mapping]] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., conditions_complete: _Optional[_Union[ConditionsComplete, _Mapping]] = ...) -> None: ...

class StreamMetadata(_message.Message):
    __slots__ = ("protocol_major", "protocol_minor", "hidden_size", "dtype", "answer_start_index", "expected_rows", "expected_negative_rows", "answer_boundary")
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MINOR_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_START_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_ROWS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_NEGATIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    protocol_major: int
    protocol_minor: int
    hidden_size: int
    dtype: DType
    answer_start_index: int
    expected_rows: int
    expected_negative_rows: int
    answer_boundary: str
    def __init__(self, protocol_major: _Optional[int] = ..., protocol_minor: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., answer_start_index: _Optional[int] = ..., expected_rows: _Optional[int] = ..., expected_negative_rows: _Optional[int] = ..., answer_boundary: _Optional[str] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("request_id", "epoch", "sequence", "role", "dtype", "shape", "row_offset", "token_ids", "sent_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    sequence: int
    role: Role
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    row_offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sent_unix_ms: float
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., row_offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sent_unix_ms: _Optional[float] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("total_rows", "total_negative_rows", "crc32c", "negative_crc32c")
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NEGATIVE_ROWS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_CRC32C_FIELD_NUMBER: _ClassVar[int]
    total_rows: int
    total_negative_rows: int
    crc32c: int
    negative_crc32c: int
    def __init__(self, total_rows: _Optional[int] = ..., total_negative_rows: _Optional[int] = ..., crc32c: _Optional[int] = ..., negative_crc32c: _Optional[int] = ...) -> None: ...

class HiddenStateChunk(_message.Message):
    __slots__ = ("reservation_token", "header", "metadata", "data", "end")
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    reservation_token: str
    header: ChunkHeader
    metadata: StreamMetadata
    data: bytes
    end: StreamEnd
    def __init__(self, reservation_token: _Optional[str] = ..., header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., metadata: _Optional[_Union[StreamMetadata, _Mapping]] = ..., data: _Optional[bytes] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ...) -> None: ...

class PushConditionsResponse(_message.Message):
    __slots__ = ("rows_accepted", "negative_rows_accepted", "chunks_accepted")
    ROWS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_ROWS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    rows_accepted: int
    negative_rows_accepted: int
    chunks_accepted: int
    def __init__(self, rows_accepted: _Optional[int] = ..., negative_rows_accepted: _Optional[int] = ..., chunks_accepted: _Optional[int] = ...) -> None: ...

class DecodingParams(_message.Message):
    __slots__ = ("mode", "window", "token_reuse", "spatial_init")
    MODE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REUSE_FIELD_NUMBER: _ClassVar[int]
    SPATIAL_INIT_FIELD_NUMBER: _ClassVar[int]
    mode: ARDecodingMode
    window: int
    token_reuse: bool
    spatial_init: bool
    def __init__(self, mode: _Optional[_Union[ARDecodingMode, str]] = ..., window: _Optional[int] = ..., token_reuse: _Optional[bool] = ..., spatial_init: _Optional[bool] = ...) -> None: ...

class ARGenerateRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "prompt", "negative_prompt", "width", "height", "seed", "ar_guidance_scale", "dit_address", "reservation_token", "grid_width", "grid_height", "decoding")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    AR_GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    DIT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GRID_WIDTH_FIELD_NUMBER: _ClassVar[int]
    GRID_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    DECODING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    prompt: str
    negative_prompt: str
    width: int
    height: int
    seed: int
    ar_guidance_scale: float
    dit_address: str
    reservation_token: str
    grid_width: int
    grid_height: int
    decoding: DecodingParams
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ..., ar_guidance_scale: _Optional[float] = ..., dit_address: _Optional[str] = ..., reservation_token: _Optional[str] = ..., grid_width: _Optional[int] = ..., grid_height: _Optional[int] = ..., decoding: _Optional[_Union[DecodingParams, _Mapping]] = ...) -> None: ...

class ARProgress(_message.Message):
    __slots__ = ("prompt_tokens", "tokens_generated", "total_tokens", "rows_sent")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_SENT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    tokens_generated: int
    total_tokens: int
    rows_sent: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., total_tokens: _Optional[int] = ..., rows_sent: _Optional[int] = ...) -> None: ...

class ARDone(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "rows_sent", "prefill_ms", "decode_ms", "last_row_unix_ms")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_ROW_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    rows_sent: int
    prefill_ms: float
    decode_ms: float
    last_row_unix_ms: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., rows_sent: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., last_row_unix_ms: _Optional[float] = ...) -> None: ...

class ARGenerateResponse(_message.Message):
    __slots__ = ("progress", "done")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    progress: ARProgress
    done: ARDone
    def __init__(self, progress: _Optional[_Union[ARProgress, _Mapping]] = ..., done: _Optional[_Union[ARDone, _Mapping]] = ...) -> None: ...
