"""Chat messages normalised as vLLM does before it renders a chat template.

vLLM's ``parse_chat_messages`` (``vllm/entrypoints/chat_utils.py``) keeps only ``role``,
``content`` and a few known fields of each message; text content parts are joined with ``"\\n"``
when the template wants a string, or kept as ``[{"type": "text", "text": ...}]`` for the "openai"
content format; tool-call arguments are parsed from JSON; media parts are refused here (their
placeholders depend on the model's processor).  The template then sees exactly what vLLM's does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final, Literal

from indexer.errors import TokenizationError

ContentFormat = Literal["string", "openai"]

# Content parts (vllm/entrypoints/chat_utils.py, `MM_PARSER_MAP` and
# `_parse_chat_message_content_part`): these carry text, under the given key.
_TEXT_PART_KEYS: Final = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_WHEN_NONE: Final = frozenset({"text", "refusal"})  # `PART_TYPES_TO_SKIP_NONE_CONTENT`
# Keys that mark a media part sent without "type", in the order vLLM checks them.
_MEDIA_KEYS: Final = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)
_MEDIA_PART_TYPES: Final = frozenset({*_MEDIA_KEYS, "input_image"})


def conversation_from_messages(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template (`parse_chat_messages`).

    Each message keeps ``role`` and ``content`` (text parts joined with ``"\\n"`` for "string"
    templates, ``[{"type": "text", ...}]`` parts for "openai" ones), ``tool_calls`` and
    ``reasoning`` on assistant messages, ``tool_call_id`` on tool messages, ``name`` and ``task``
    when they are strings, ``tools`` on developer messages; nothing else. Image, audio and video
    parts raise `TokenizationError`: the precise scorer does not support multimodal prompts.
    """
    conversation: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizationError(
                f"messages[{index}] must be an object, not {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise TokenizationError(f"messages[{index}].role must be a string, not {role!r}")
        content = message.get("content")
        parts: Sequence[Any]
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, Sequence) and not isinstance(content, bytes):
            parts = content
        else:
            raise TokenizationError(
                f"messages[{index}].content must be a string, a list of parts or null, "
                f"not {type(content).__name__}"
            )
        converted: dict[str, Any] = {
            "role": role,
            "content": _message_content(index, parts, content_format),
        }
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            if isinstance(tool_calls, (str, bytes, Mapping)) or not (
                tool_calls is None or isinstance(tool_calls, Iterable)
            ):
                raise TokenizationError(f"messages[{index}].tool_calls must be a list")
            if tool_calls is not None:
                converted["tool_calls"] = [_tool_call(call) for call in tool_calls]
            # ChatCompletionRequest renames the deprecated `reasoning_content` to `reasoning`.
            reasoning = message.get("reasoning")
            if reasoning is None:
                reasoning = message.get("reasoning_content")
            if reasoning is not None:
                converted["reasoning"] = reasoning
                converted["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                converted["tool_call_id"] = message["tool_call_id"]
            converted["content"] = _tool_message_content(converted["content"])
        for key in ("name", "task"):
            if isinstance(message.get(key), str):
                converted[key] = message[key]
        if role == "developer":
            converted["tools"] = message.get("tools")
        conversation.append(converted)
    _parse_tool_call_arguments(conversation)
    return conversation


def _message_content(
    index: int, parts: Sequence[Any], content_format: ContentFormat
) -> str | list[dict[str, Any]]:
    as_dicts = content_format == "openai"
    texts: list[str] = []
    dicts: list[dict[str, Any]] = []
    for number, part in enumerate(parts):
        where = f"messages[{index}].content[{number}]"
        if isinstance(part, str):
            if part:
                texts.append(part)
            dicts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, Mapping):
            raise TokenizationError(
                f"{where} must be a string or an object, not {type(part).__name__}"
            )
        kind = part.get("type")
        if kind is None:
            media = next((key for key in _MEDIA_KEYS if key in part), None)
            if media is not None:
                raise _multimodal_error(where, media)
            raise TokenizationError(f"{where} has no 'type' field")
        if kind in _TEXT_PART_KEYS:
            text = part.get(_TEXT_PART_KEYS[kind])
            if text is None and (kind in _SKIP_WHEN_NONE or not as_dicts):
                continue  # vLLM skips text parts without text
            if text is not None and not isinstance(text, str):
                raise TokenizationError(f"{where}.{_TEXT_PART_KEYS[kind]} must be a string")
            # vLLM keeps only truthy parse results before joining, so "" parts vanish from
            # string content (but stay as dicts in "openai" content).
            if text:
                texts.append(text)
            dicts.append({"type": "text", "text": text})
        elif kind == "tool_reference":
            name = part.get("name")
            if name:
                texts.append(str(name))
            dicts.append({"type": "tool_reference", "name": name})
        elif kind in _MEDIA_PART_TYPES:
            raise _multimodal_error(where, str(kind))
        else:
            raise TokenizationError(
                f"{where} has unsupported type {kind!r}; text parts are "
                f"{', '.join(sorted(_TEXT_PART_KEYS))}"
            )
    if as_dicts:
        return dicts
    return "\n".join(texts)


def _multimodal_error(where: str, kind: str) -> TokenizationError:
    return TokenizationError(
        f"{where} is a {kind!r} part: multimodal content is not supported by the precise "
        "prefix-cache scorer (its tokens depend on the model's multimodal processor); send "
        "text-only messages, or route multimodal models with a load-based profile"
    )


def _tool_message_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    # Tool results sent as text parts become one string, even for "openai" templates, unless a
    # part is not text (vLLM `_parse_chat_message_content`, role "tool").
    if not isinstance(content, list):
        return content
    if any(part.get("type") != "text" for part in content):
        return content
    texts = [part.get("text") or "" for part in content]
    return "\n".join(texts) if texts else ""


def _tool_call(call: Any) -> Any:
    # The request model validates tool calls as OpenAI TypedDicts, which keeps only their
    # declared keys, in declaration order: {id, function: {arguments, name}, type}.
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    if not isinstance(function, Mapping):
        return dict(call)
    result: dict[str, Any] = {}
    if "id" in call:
        result["id"] = call["id"]
    result["function"] = {key: function[key] for key in ("arguments", "name") if key in function}
    if "type" in call:
        result["type"] = call["type"]
    return result


def _parse_tool_call_arguments(conversation: list[dict[str, Any]]) -> None:
    # vLLM `_postprocess_messages`: templates get tool-call arguments as parsed JSON; an empty
    # tool_calls list is dropped so the template takes its plain assistant path.
    for message in conversation:
        if message["role"] != "assistant" or "tool_calls" not in message:
            continue
        tool_calls = message["tool_calls"]
        if not tool_calls:
            del message["tool_calls"]
            continue
        for call in tool_calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except json.JSONDecodeError:
                    function["arguments"] = {}
            elif not isinstance(arguments, (dict, list)):
                function["arguments"] = {}


def tool_dicts(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as vLLM passes them to the template: ``ChatCompletionToolsParam.model_dump()``.

    That is ``{"type", "function": {"name", "description", "parameters", <other function keys>}}``
    with ``description``/``parameters`` present (as None) even when the request left them out.
    """
    if tools is None:
        return None
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise TokenizationError(f"tools must be a list of objects, not {type(tools).__name__}")
    if not tools:
        raise TokenizationError(
            "tools must not be an empty array (vLLM rejects it); omit the field instead"
        )
    dumped: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise TokenizationError(f"tools[{index}].function.name must be a string")
        described = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        described |= {k: v for k, v in function.items() if k not in described}
        dumped.append({"type": tool.get("type", "function"), "function": described})
    return dumped
