"""Anthropic Messages and OpenAI Responses bodies → the chat vLLM renders for them
(`kvcache.chat_prompts`); what they do not reproduce is refused with the reason.  That the
covered shapes tokenize to vLLM's own prompts is checked against real vLLM in
tests/vllm/test_real_vllm.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvcache.chat_prompts import Unsupported, anthropic_chat, responses_chat


def test_messages_become_the_chat_vllm_builds() -> None:
    prompt = anthropic_chat(
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=1"},
                {"type": "text", "text": "You are "},
                {"type": "text", "text": ""},
                {"type": "text", "text": "terse."},
            ],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}]},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                {"role": "user", "content": [{"type": "text", "text": ""}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}],
                },
            ],
            "chat_template_kwargs": {"x": 1},
        }
    )
    assert list(prompt.messages) == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant"},  # kept without content, as vLLM does
        # the empty user message is dropped
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
    ]
    assert prompt.chat_template_kwargs == {"x": 1}
    assert prompt.add_generation_prompt and not prompt.add_special_tokens


def test_responses_become_the_chat_vllm_builds() -> None:
    prompt = responses_chat({"instructions": "Be brief.", "input": "hi"})
    assert list(prompt.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    assert prompt.add_special_tokens  # vLLM 0.32 adds the tokenizer's BOS too
    partial = responses_chat(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": "The ans"}],
                },
            ]
        }
    )
    assert list(partial.messages) == [
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"role": "assistant", "content": "The ans"},
    ]
    assert partial.continue_final_message and not partial.add_generation_prompt


@pytest.mark.parametrize(
    ("convert", "body", "reason"),
    [
        (anthropic_chat, {"tools": [{"name": "f"}], "messages": []}, "tools"),
        (anthropic_chat, {"tools": [], "messages": []}, "tools"),  # vLLM: tool_choice auto
        (anthropic_chat, {"messages": [{"role": "user", "content": 3}]}, "unexpected shape"),
        (responses_chat, {"input": [{"role": "assistant", "content": [3]}]}, "unexpected shape"),
        (anthropic_chat, {"thinking": {"type": "enabled"}, "messages": []}, "thinking"),
        (anthropic_chat, {"messages": [{"role": "system", "content": "x"}]}, "inline system"),
        (
            anthropic_chat,
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image blocks",
        ),
        (responses_chat, {"input": "x", "previous_response_id": "r1"}, "previous_response_id"),
        (responses_chat, {"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        (
            responses_chat,
            {"input": [{"type": "function_call_output", "output": "1"}]},
            "input items other than messages",
        ),
    ],
)
def test_what_is_not_reproduced_is_refused_with_the_reason(
    convert: Any, body: dict[str, Any], reason: str
) -> None:
    with pytest.raises(Unsupported, match=reason):
        convert(body)
