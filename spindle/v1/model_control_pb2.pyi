from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DISK: Tier
TIER_HOST: Tier
TIER_DEVICE: Tier

class AdapterState(_message.Message):
    __slots__ = ("name", "tier", "slot", "refcount", "pinned", "rank", "sha256", "adapter_id", "requests_total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    tier: Tier
    slot: int
    refcount: int
    pinned: bool
    rank: int
    sha256: str
    adapter_id: int
    requests_total: int
    def __init__(self, name: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., slot: _Optional[int] = ..., refcount: _Optional[int] = ..., pinned: _Optional[bool] = ..., rank: _Optional[int] = ..., sha256: _Optional[str] = ..., adapter_id: _Optional[int] = ..., requests_total: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "slot", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    slot: int
    path: str
    def __init__(self, name: _Optional[str] = ..., slot: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class SlotChange(_message.Message):
    __slots__ = ("slot", "evicted", "adapter")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    slot: int
    evicted: str
    adapter: AdapterState
    def __init__(self, slot: _Optional[int] = ..., evicted: _Optional[str] = ..., adapter: _Optional[_Union[AdapterState, _Mapping]] = ...) -> None: ...

class PromoteFromDiskRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class PromoteFromPeerRequest(_message.Message):
    __slots__ = ("name", "peer", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    peer: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., peer: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class RotateRequest(_message.Message):
    __slots__ = ("name", "path", "peer", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    peer: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., peer: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("name", "from_host", "from_disk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_HOST_FIELD_NUMBER: _ClassVar[int]
    FROM_DISK_FIELD_NUMBER: _ClassVar[int]
    name: str
    from_host: bool
    from_disk: bool
    def __init__(self, name: _Optional[str] = ..., from_host: _Optional[bool] = ..., from_disk: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("name", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SetActiveRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class GetSlotsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Slot(_message.Message):
    __slots__ = ("index", "adapter", "refcount", "pinned")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    index: int
    adapter: str
    refcount: int
    pinned: bool
    def __init__(self, index: _Optional[int] = ..., adapter: _Optional[str] = ..., refcount: _Optional[int] = ..., pinned: _Optional[bool] = ...) -> None: ...

class SlotReport(_message.Message):
    __slots__ = ("slots", "adapters", "active_adapter")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterState]
    active_adapter: str
    def __init__(self, slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., adapters: _Optional[_Iterable[_Union[AdapterState, _Mapping]]] = ..., active_adapter: _Optional[str] = ...) -> None: ...

class FetchAdapterWeightsRequest(_message.Message):
    __slots__ = ("name", "chunk_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    chunk_bytes: int
    def __init__(self, name: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class AdapterWeightsChunk(_message.Message):
    __slots__ = ("name", "config_json", "total_bytes", "offset", "data", "last", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: str
    total_bytes: int
    offset: int
    data: bytes
    last: bool
    sha256: str
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., sha256: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds", "exit")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    exit: bool
    def __init__(self, timeout_seconds: _Optional[float] = ..., exit: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("finished", "aborted")
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    finished: int
    aborted: int
    def __init__(self, finished: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...
