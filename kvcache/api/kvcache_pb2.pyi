from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "chat_json", "cache_salt", "endpoints")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_JSON_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    chat_json: str
    cache_salt: str
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat_json: _Optional[str] = ..., cache_salt: _Optional[str] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class PodMatch(_message.Message):
    __slots__ = ("endpoint", "matched_blocks", "weighted", "score", "held_blocks")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTED_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    matched_blocks: int
    weighted: float
    score: float
    held_blocks: int
    def __init__(self, endpoint: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., weighted: _Optional[float] = ..., score: _Optional[float] = ..., held_blocks: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("block_size", "total_blocks", "prompt_tokens", "pods")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    total_blocks: int
    prompt_tokens: int
    pods: _containers.RepeatedCompositeFieldContainer[PodMatch]
    def __init__(self, block_size: _Optional[int] = ..., total_blocks: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., pods: _Optional[_Iterable[_Union[PodMatch, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("block_keys", "endpoints")
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    endpoints: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, block_keys: _Optional[_Iterable[int]] = ..., endpoints: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("pods",)
    PODS_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[PodMatch]
    def __init__(self, pods: _Optional[_Iterable[_Union[PodMatch, _Mapping]]] = ...) -> None: ...
