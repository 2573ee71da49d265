from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlacementTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLACEMENT_TIER_UNSPECIFIED: _ClassVar[PlacementTier]
    PLACEMENT_TIER_DISK: _ClassVar[PlacementTier]
    PLACEMENT_TIER_HOST: _ClassVar[PlacementTier]
    PLACEMENT_TIER_DEVICE: _ClassVar[PlacementTier]
PLACEMENT_TIER_UNSPECIFIED: PlacementTier
PLACEMENT_TIER_DISK: PlacementTier
PLACEMENT_TIER_HOST: PlacementTier
PLACEMENT_TIER_DEVICE: PlacementTier

class RegisterHeader(_message.Message):
    __slots__ = ("name", "config_json", "total_bytes", "sha256", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_json: bytes
    total_bytes: int
    sha256: str
    description: str
    def __init__(self, name: _Optional[str] = ..., config_json: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class RegisterChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: RegisterHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[RegisterHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportRequest(_message.Message):
    __slots__ = ("name", "uri", "sha256", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    uri: str
    sha256: str
    description: str
    def __init__(self, name: _Optional[str] = ..., uri: _Optional[str] = ..., sha256: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class PodPlacement(_message.Message):
    __slots__ = ("pod", "tier", "version", "refcount")
    POD_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REFCOUNT_FIELD_NUMBER: _ClassVar[int]
    pod: str
    tier: PlacementTier
    version: int
    refcount: int
    def __init__(self, pod: _Optional[str] = ..., tier: _Optional[_Union[PlacementTier, str]] = ..., version: _Optional[int] = ..., refcount: _Optional[int] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "version", "sha256", "size_bytes", "rank", "target_modules", "base_model", "created_at", "pinned", "description", "placements")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    sha256: str
    size_bytes: int
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    base_model: str
    created_at: float
    pinned: bool
    description: str
    placements: _containers.RepeatedCompositeFieldContainer[PodPlacement]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., base_model: _Optional[str] = ..., created_at: _Optional[float] = ..., pinned: _Optional[bool] = ..., description: _Optional[str] = ..., placements: _Optional[_Iterable[_Union[PodPlacement, _Mapping]]] = ...) -> None: ...

class GetAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "next_page_token")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    next_page_token: str
    def __init__(self, adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("versions_deleted",)
    VERSIONS_DELETED_FIELD_NUMBER: _ClassVar[int]
    versions_deleted: int
    def __init__(self, versions_deleted: _Optional[int] = ...) -> None: ...

class PinAdapterRequest(_message.Message):
    __slots__ = ("name", "pinned")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    name: str
    pinned: bool
    def __init__(self, name: _Optional[str] = ..., pinned: _Optional[bool] = ...) -> None: ...

class PodHint(_message.Message):
    __slots__ = ("address", "num_waiting", "kv_usage", "resident_adapters", "max_adapters")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    address: str
    num_waiting: int
    kv_usage: float
    resident_adapters: int
    max_adapters: int
    def __init__(self, address: _Optional[str] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., resident_adapters: _Optional[int] = ..., max_adapters: _Optional[int] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("adapter", "pods")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    pods: _containers.RepeatedCompositeFieldContainer[PodHint]
    def __init__(self, adapter: _Optional[str] = ..., pods: _Optional[_Iterable[_Union[PodHint, _Mapping]]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("pods", "source", "version")
    PODS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedScalarFieldContainer[str]
    source: str
    version: int
    def __init__(self, pods: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class CatalogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CatalogEntry(_message.Message):
    __slots__ = ("name", "version", "sha256", "pods")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    sha256: str
    pods: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., sha256: _Optional[str] = ..., pods: _Optional[_Iterable[str]] = ...) -> None: ...

class CatalogResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[CatalogEntry]
    def __init__(self, adapters: _Optional[_Iterable[_Union[CatalogEntry, _Mapping]]] = ...) -> None: ...
