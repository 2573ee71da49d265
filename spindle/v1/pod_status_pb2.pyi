from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PodLoad(_message.Message):
    __slots__ = ("model", "num_waiting", "num_running", "num_swapped", "kv_usage", "kv_blocks_total", "kv_blocks_free", "prefix_cache_hit_rate", "resident_adapters", "waiting_adapters", "max_adapters", "draining", "requests_total", "requests_in_flight", "available_adapters", "control_port", "state_slots_total", "state_slots_free", "host_adapters", "disk_adapters", "adapter_memory_used_bytes", "adapter_memory_capacity_bytes", "max_model_len")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_PORT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    HOST_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DISK_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_MEMORY_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_usage: float
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    waiting_adapters: _containers.RepeatedScalarFieldContainer[str]
    max_adapters: int
    draining: bool
    requests_total: int
    requests_in_flight: int
    available_adapters: _containers.RepeatedScalarFieldContainer[str]
    control_port: int
    state_slots_total: int
    state_slots_free: int
    host_adapters: _containers.RepeatedScalarFieldContainer[str]
    disk_adapters: _containers.RepeatedScalarFieldContainer[str]
    adapter_memory_used_bytes: int
    adapter_memory_capacity_bytes: int
    max_model_len: int
    def __init__(self, model: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., kv_usage: _Optional[float] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., waiting_adapters: _Optional[_Iterable[str]] = ..., max_adapters: _Optional[int] = ..., draining: _Optional[bool] = ..., requests_total: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., available_adapters: _Optional[_Iterable[str]] = ..., control_port: _Optional[int] = ..., state_slots_total: _Optional[int] = ..., state_slots_free: _Optional[int] = ..., host_adapters: _Optional[_Iterable[str]] = ..., disk_adapters: _Optional[_Iterable[str]] = ..., adapter_memory_used_bytes: _Optional[int] = ..., adapter_memory_capacity_bytes: _Optional[int] = ..., max_model_len: _Optional[int] = ...) -> None: ...
