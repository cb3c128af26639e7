"""Anthropic Messages and OpenAI Responses requests as the chat vLLM renders for them, so their
prompts tokenize (and hash) exactly as vLLM computes them.

vLLM serves both by converting them to a chat completion before its chat template runs:
``/v1/messages`` in ``vllm/entrypoints/anthropic/serving.py`` (``to_chat_completion_request``),
``/v1/responses`` in ``vllm/entrypoints/openai/responses/utils.py``
(``construct_input_messages``) with the chat parameters of ``ResponsesRequest.build_chat_params``.
These functions reproduce those conversions for the shapes they cover:

* Messages: ``system`` (a string, or text blocks joined, Claude Code's
  ``x-anthropic-billing-header`` block left out), then each message: a string content as is,
  text blocks as one string (one block) or text parts (several), empty text blocks skipped, a
  user message left with no content dropped, ``chat_template_kwargs`` passed on.
* Responses: ``instructions`` as a system message, a string ``input`` as the user's message,
  an ``input`` list's message items as they are (an assistant's content reduced to its first
  text), the last item continued (no generation prompt) when it is an assistant message
  ``in_progress`` or ``incomplete``, ``chat_template_kwargs`` passed on, and the rendered
  prompt tokenized with the tokenizer's special tokens too (vLLM 0.32 does: Llama 3's prompt
  then starts with two BOS tokens).

What they do not cover raises `Unsupported` with the reason (the scorer then computes no block
keys for the request and says so once): tools, tool calls and results, images, thinking and
reasoning settings, inline system messages in a Messages conversation (vLLM merges them or not
depending on the chat template), Responses that continue a stored response
(``previous_response_id``, ``conversation``: the server holds that history), and bodies of
another shape than the APIs'.  Models vLLM renders with another renderer than the chat
template (gpt-oss's harmony) are not told apart here: their chat requests are keyed as the
template renders them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kvcache.view import ChatPrompt

_BILLING_HEADER: Final = "x-anthropic-billing-header"
# Block types vLLM converts that are not reproduced here (named in the warning).
_BLOCKS: Final = frozenset({"image", "thinking", "tool_use", "tool_result", "tool_reference"})


class Unsupported(ValueError):
    """The request has a part whose rendering by vLLM is not reproduced here."""


def anthropic_chat(body: Mapping[str, Any]) -> ChatPrompt:
    """The chat vLLM renders for an Anthropic Messages request body."""
    try:
        return _anthropic_chat(body)
    except (AttributeError, KeyError, TypeError, IndexError) as exc:
        raise Unsupported("a body of an unexpected shape") from exc


def responses_chat(body: Mapping[str, Any]) -> ChatPrompt:
    """The chat vLLM renders for an OpenAI Responses request body."""
    try:
        return _responses_chat(body)
    except (AttributeError, KeyError, TypeError, IndexError) as exc:
        raise Unsupported("a body of an unexpected shape") from exc


def _anthropic_chat(body: Mapping[str, Any]) -> ChatPrompt:
    # "tools": [] counts too: vLLM then sets tool_choice "auto", and with a tool parser the
    # template renders its tool preamble.
    if "tools" in body:
        raise Unsupported("tools")
    if body.get("thinking"):
        raise Unsupported("thinking")
    if (body.get("output_config") or {}).get("effort") is not None:
        raise Unsupported("output_config.effort")
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        if isinstance(system, str):
            texts = [system]
        else:
            texts = [
                b["text"]
                for b in system
                if b.get("type") == "text"
                and b.get("text")
                and not b["text"].startswith(_BILLING_HEADER)
            ]
        if texts:
            messages.append({"role": "system", "content": "".join(texts)})
    for message in body.get("messages") or []:
        role = message.get("role")
        if role == "system":
            raise Unsupported("an inline system message")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        parts = []
        for block in content or []:
            kind = block.get("type")
            if kind == "text":
                if block.get("text"):
                    parts.append({"type": "text", "text": block["text"]})
            elif kind != "redacted_thinking":  # vLLM skips these; the rest it converts
                raise Unsupported(f"{kind} blocks" if kind in _BLOCKS else "unknown blocks")
        if parts:
            text = parts[0]["text"] if len(parts) == 1 else parts
            messages.append({"role": role, "content": text})
        elif role != "user":
            messages.append({"role": role})
    return ChatPrompt(messages=messages, chat_template_kwargs=body.get("chat_template_kwargs"))


def _responses_chat(body: Mapping[str, Any]) -> ChatPrompt:
    if "tools" in body:
        raise Unsupported("tools")
    for key in ("previous_response_id", "conversation", "reasoning"):
        if body.get(key):
            raise Unsupported(key)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    continue_final = False
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    else:
        for item in given or []:
            if not isinstance(item, dict) or "role" not in item:
                raise Unsupported("input items other than messages")
            if item["role"] == "assistant":
                content = item.get("content")
                text = content if isinstance(content, str) else (content or [{}])[0].get("text")
                if text is not None:
                    messages.append({"role": "assistant", "content": text})
                    continue
            messages.append(item)
        last = given[-1] if given else None
        if isinstance(last, dict) and last.get("type", "message") in ("message", "reasoning"):
            continue_final = last.get("status") in ("in_progress", "incomplete")
    return ChatPrompt(
        messages=messages,
        chat_template_kwargs=body.get("chat_template_kwargs"),
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        # vLLM 0.32 tokenizes a Responses prompt with the tokenizer's special tokens on top of
        # the template's (its TokenizeParams default): a second BOS for Llama 3.
        add_special_tokens=True,
    )
