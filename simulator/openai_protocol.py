"""vLLM's OpenAI-compatible wire format, as the simulator speaks it: request bodies (untrusted
input, validated with pydantic), response and stream-chunk bodies, usage and error bodies.

Field names follow vLLM 0.33's ``vllm/entrypoints/openai/protocol.py``; fields the simulator has
no use for (logprobs, tool calls, reasoning) are sent empty, as vLLM sends them when unused.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from simulator.engine_outputs import RequestStats

COMPLETIONS_DEFAULT_MAX_TOKENS: Final = 16  # OpenAI's and vLLM's default for /v1/completions

Kind = Literal["completion", "chat"]
"""Which endpoint a generation came through: ``/v1/completions`` or ``/v1/chat/completions``."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionBody(GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    add_special_tokens: bool = True


class ChatBody(GenerationBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None
    add_special_tokens: bool = False


class SamplingParamsBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS  # vLLM's SamplingParams default


class GenerateBody(BaseModel):
    """vLLM's pre-tokenized ``/inference/v1/generate`` request (0.32,
    ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``): ids in, ids out."""

    model_config = ConfigDict(extra="allow")
    token_ids: list[NonNegativeInt] = Field(min_length=1)
    sampling_params: SamplingParamsBody
    model: str | None = None
    stream: bool | None = False
    cache_salt: str | None = Field(default=None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


class HTTPError(Exception):
    """A request the API refuses: the HTTP status and vLLM's error ``type``."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def single_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise HTTPError(400, "prompt must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [p for p in prompt if isinstance(p, int)]
    if len(prompt) == 1:
        (only,) = prompt
        if isinstance(only, str | list):
            return only
    raise HTTPError(
        400, f"prompt holds {len(prompt)} prompts; the simulator serves one prompt per request"
    )


def usage(stats: RequestStats, completion_tokens: int | None = None) -> dict[str, Any]:
    completion = stats.completion_tokens if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "total_tokens": stats.prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def generate_response_body(
    req_id: str, created: int, model: str, token_ids: list[int], stats: RequestStats
) -> dict[str, Any]:
    """vLLM's ``GenerateTokensResponse`` (``output_mode`` "tokens"): the choice's token ids
    and OpenAI's ``usage``; the simulator always stops on length."""
    return {
        "request_id": req_id,
        "created": created,
        "model": model,
        "usage": usage(stats),
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "kv_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": token_ids}
        ],
    }


def response_body(
    kind: Kind,
    req_id: str,
    created: int,
    model: str,
    text: str,
    stats: RequestStats,
    kv_transfer_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole answer of a non-streamed generation (the simulator has no EOS: it always
    stops on length)."""
    if kind == "completion":
        return {
            "id": req_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
            ],
            "usage": usage(stats),
            "system_fingerprint": None,
            "kv_transfer_params": kv_transfer_params,
        }
    return {
        "id": req_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(stats),
        "prompt_logprobs": None,
        "kv_transfer_params": kv_transfer_params,
    }


def stream_chunk(
    kind: Kind,
    req_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    chunk_usage: dict[str, Any] | None = None,
) -> bytes:
    """One server-sent event of a streamed generation."""
    data: dict[str, Any] = {
        "id": req_id,
        "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if chunk_usage is not None:
        data["usage"] = chunk_usage
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def chat_role_choice() -> dict[str, Any]:
    """The first choice of a chat stream: the assistant role, no content yet."""
    return {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


def stream_choice(kind: Kind, text: str, finish: str | None) -> dict[str, Any]:
    """The choice of a stream chunk carrying new text (``finish`` on the last one)."""
    if kind == "completion":
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": finish,
    }
    if finish is not None:
        choice["stop_reason"] = None
    return choice


def model_card(
    model_id: str, root: str, parent: str | None, created: int, max_model_len: int
) -> dict[str, Any]:
    """One entry of ``/v1/models``: the base model (with its context length) or a LoRA."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len if parent is None else None,
        "permission": [],
    }
