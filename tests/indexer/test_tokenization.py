"""Prompt tokenization must equal vLLM's: real Llama-3 tokenizer, chat template, exact cache."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer import tokenization
from indexer.chat_messages import conversation_from_messages
from indexer.chat_templates import template_content_format
from indexer.errors import TokenizationError
from indexer.tokenization import (
    PromptTokenizer,
    TokenizerRegistry,
    TokenizerSource,
    load_hf_tokenizer,
)
from indexer.tokenizer_assets import LLAMA3_CHAT_TEMPLATE, build_llama3_tokenizer_dir

BOS = 128000
HELLO_IDS = [
    9906,
    1917,
    11,
    420,
    374,
    264,
    1296,
    13,
]  # "Hello world, this is a test." (docs/toolchain.md §5)
HI_THERE_PROMPT = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.fixture(scope="session")
def llama3_hf(llama3_tokenizer_dir: Path) -> Any:
    return load_hf_tokenizer(llama3_tokenizer_dir)


@pytest.fixture
def llama3(llama3_hf: Any) -> PromptTokenizer:
    """A fresh `PromptTokenizer` (empty cache, zero counters) over the shared HF tokenizer."""
    return PromptTokenizer(llama3_hf, name="tiny-llama3")


# ------------------------------------------------------------------ assets


def test_builder_writes_a_loadable_directory_and_is_idempotent(tmp_path: Path) -> None:
    target = build_llama3_tokenizer_dir(tmp_path / "tok")
    names = {p.name for p in target.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    config = json.loads((target / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|begin_of_text|>"
    assert config["eos_token"] == "<|eot_id|>"
    assert config["chat_template"] == LLAMA3_CHAT_TEMPLATE

    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    build_llama3_tokenizer_dir(target)
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before

    (target / "tokenizer_config.json").write_text("{}")  # a damaged directory is rebuilt
    build_llama3_tokenizer_dir(target)
    assert json.loads((target / "tokenizer_config.json").read_text()) == config


# ------------------------------------------------------------------ completions


def test_completion_text_gets_bos_like_vllm(llama3: PromptTokenizer, llama3_hf: Any) -> None:
    ids = llama3.encode_completion("Hello world, this is a test.")
    assert ids == [BOS, *HELLO_IDS]
    assert ids == llama3_hf.encode("Hello world, this is a test.", add_special_tokens=True)
    assert llama3.encode_completion("Hello world, this is a test.", add_special_tokens=False) == (
        HELLO_IDS
    )
    assert llama3.encode_completion("") == [BOS]


def test_completion_token_ids_pass_through_after_validation(llama3: PromptTokenizer) -> None:
    prompt = (BOS, 9906, 128255)
    ids = llama3.encode_completion(prompt)
    assert ids == list(prompt)
    for bad, needle in [
        ([], "empty"),
        ([1, True], "not an integer"),
        ([1, "2"], "not an integer"),
        ([-1], "out of vocabulary"),
        ([128256], "out of vocabulary"),
    ]:
        with pytest.raises(TokenizationError, match=needle):
            llama3.encode_completion(bad)


# ------------------------------------------------------------------ chat


def test_chat_renders_the_llama3_template_and_tokenizes_without_a_second_bos(
    llama3: PromptTokenizer, llama3_hf: Any
) -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    assert llama3.render_chat(messages) == HI_THERE_PROMPT
    ids = llama3.encode_chat(messages)
    assert ids[:2] == [BOS, 128006]
    assert ids.count(BOS) == 1
    assert ids == llama3_hf.encode(HI_THERE_PROMPT, add_special_tokens=False)
    assert ids == llama3_hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    # vLLM's `add_special_tokens` request field (default false) adds BOS on top of the template's.
    assert llama3.encode_chat(messages, add_special_tokens=True) == [BOS, *ids]


def test_generation_prompt_and_continue_final_message(llama3: PromptTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": "Once upon"},
    ]
    without = llama3.render_chat(messages, add_generation_prompt=False)
    assert without.endswith("Once upon<|eot_id|>")
    continued = llama3.render_chat(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nOnce upon")
    with pytest.raises(TokenizationError, match="continue_final_message"):
        llama3.render_chat(messages, continue_final_message=True)  # add_generation_prompt=True


def test_text_parts_are_joined_with_newlines_like_vllm(llama3: PromptTokenizer) -> None:
    parts = [
        {"type": "text", "text": "Hi"},
        {"type": "text", "text": ""},  # vLLM drops empty parts before joining
        {"type": "text", "text": None},  # and parts without text
        "",
        "there",
        {"type": "input_text", "text": "friend"},
    ]
    rendered = llama3.render_chat([{"role": "user", "content": parts}])
    assert "<|end_header_id|>\n\nHi\nthere\nfriend<|eot_id|>" in rendered
    null_content = llama3.render_chat([{"role": "assistant", "content": None}, {"role": "user"}])
    assert "assistant<|end_header_id|>\n\n<|eot_id|>" in null_content


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"image_url": "http://example.com/cat.png"},
    ],
)
def test_multimodal_parts_are_rejected(llama3: PromptTokenizer, part: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    with pytest.raises(TokenizationError, match=r"messages\[0\]\.content\[1\].*multimodal"):
        llama3.encode_chat(messages)


def test_malformed_messages_are_rejected(llama3: PromptTokenizer) -> None:
    for messages, needle in [
        ([], "must not be empty"),
        ("hello", "list of objects"),
        ([{"content": "no role"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "no 'type'"),
        ([{"role": "user", "content": [{"type": "file", "file": {}}]}], "unsupported type"),
        ([{"role": "assistant", "tool_calls": "x"}], r"messages\[0\]\.tool_calls"),
    ]:
        with pytest.raises(TokenizationError, match=needle):
            llama3.encode_chat(messages)  # type: ignore[arg-type]


def test_template_kwargs_merge_like_vllm(llama3_hf: Any) -> None:
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}A:{% endif %}"
        "{{ reasoning_effort or '' }}"
    )
    tok = PromptTokenizer(llama3_hf, name="t", chat_template=template)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(messages) == "user: hi\nA:"
    assert tok.render_chat(messages, chat_template_kwargs={"enable_thinking": True}) == (
        "user: hi\n<think>A:"
    )
    # The request field wins over the same name in chat_template_kwargs (merge_kwargs).
    assert tok.render_chat(
        messages, chat_template_kwargs={"add_generation_prompt": True}, add_generation_prompt=False
    ) == ("user: hi\n")
    # reasoning_effort turns thinking on unless the request set enable_thinking itself.
    assert tok.render_chat(messages, reasoning_effort="low") == "user: hi\n<think>A:low"
    assert tok.render_chat(messages, reasoning_effort="none") == "user: hi\nA:none"
    assert tok.render_chat(
        messages, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}
    ) == ("user: hi\nA:low")
    # Variables the template never reads are dropped, as vLLM drops them.
    assert tok.render_chat(messages, chat_template_kwargs={"unused": object()}) == "user: hi\nA:"
    for key in ("tokenize", "chat_template"):
        with pytest.raises(TokenizationError, match=key):
            tok.render_chat(messages, chat_template_kwargs={key: False})

    defaulted = PromptTokenizer(
        llama3_hf,
        name="t",
        chat_template=template,
        default_chat_template_kwargs={"enable_thinking": True},
    )
    assert defaulted.render_chat(messages) == "user: hi\n<think>A:"
    assert defaulted.render_chat(messages, chat_template_kwargs={"enable_thinking": False}) == (
        "user: hi\nA:"
    )


def test_tools_and_tool_calls_reach_the_template_as_vllm_dumps_them(llama3_hf: Any) -> None:
    template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    )
    tok = PromptTokenizer(llama3_hf, name="t", chat_template=template)
    tools = [
        {"type": "function", "function": {"name": "get_weather", "strict": True}},
        {"function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
    ]
    messages = [
        {"role": "user", "content": "weather?", "extra": "dropped", "name": "bob"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    "id": "call_1",
                    "index": 0,
                },
                {"id": "call_2", "type": "function", "function": {"name": "f", "arguments": "{"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "assistant", "content": "ok", "tool_calls": []},
    ]
    lines = tok.render_chat(messages, tools=tools, add_generation_prompt=False).splitlines()
    dumped_tools = json.loads(lines[0].removeprefix("TOOLS "))
    assert dumped_tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": None,
                "parameters": None,
                "strict": True,
            },
        },
        {
            "type": "function",
            "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
        },
    ]
    assert list(dumped_tools[0]["function"]) == ["name", "description", "parameters", "strict"]
    user, assistant, tool, last = (json.loads(line) for line in lines[1:])
    assert user == {"role": "user", "content": "weather?", "name": "bob"}
    # transformers itself (`_alias_reasoning_fields`, 5.2x) copies reasoning under more names.
    assistant.pop("thinking", None)
    assert assistant == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "function": {"arguments": {"city": "Oslo"}, "name": "get_weather"},
                "type": "function",
            },
            {"id": "call_2", "function": {"arguments": {}, "name": "f"}, "type": "function"},
        ],
        "reasoning": "think",
        "reasoning_content": "think",
    }
    assert list(assistant["tool_calls"][0]) == ["id", "function", "type"]
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert "tool_calls" not in last  # an empty list is dropped
    with pytest.raises(TokenizationError, match="empty array"):
        tok.render_chat(messages, tools=[])


def test_openai_content_format_is_detected_from_the_template(llama3_hf: Any) -> None:
    openai_template = (
        "{% for message in messages %}{{ message.role }}:"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}[{{ part.text }}]{% endfor %}{% endif %}"
        "{{ '\\n' }}{% endfor %}"
    )
    assert template_content_format(openai_template) == "openai"
    assert template_content_format(LLAMA3_CHAT_TEMPLATE) == "string"
    aliased = (
        "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
        "{% for c in m.content | list %}{{ c }}{% endfor %}{% endfor %}"
    )
    assert template_content_format(aliased) == "openai"

    tok = PromptTokenizer(llama3_hf, name="t", chat_template=openai_template)
    messages = [
        {"role": "user", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
    ]
    assert tok.render_chat(messages, add_generation_prompt=False) == (
        "user:[plain]\nuser:[a][b]\ntool:x\ny\n"
    )
    forced = PromptTokenizer(
        llama3_hf, name="t", chat_template=openai_template, content_format="string"
    )
    assert forced.render_chat(messages[1:2], add_generation_prompt=False) == "user:a\nb\n"
    assert conversation_from_messages([{"role": "user", "content": ""}], "openai") == [
        {"role": "user", "content": [{"type": "text", "text": ""}]}
    ]


# ------------------------------------------------------------------ the exact cache

_FRAGMENTS = [
    "Hello",
    " world",
    "the quick brown fox",
    " jumps",
    ",",
    ".",
    "!?",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "'s",
    "'ll",
    " don't",
    "123",
    "4567",
    "3.14159",
    "naïve café",
    "東京タワー",
    "🙂🚀",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|begin_of_text|>",
    "<|reserved_special_token_7|>",
    "<|eot",
    "_id|>",
    "<|",
    "|>",
    "<|eot_id|",
    "```python\ndef f(x):\n    return x\n```",
    '{"key": [1, 2, 3]}',
]


def _random_text(rng: random.Random, max_fragments: int) -> str:
    return "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(0, max_fragments)))


def _random_conversations(seed: int, count: int) -> Iterator[list[dict[str, str]]]:
    """Multi-turn chats that grow turn by turn and share a few long system prompts."""
    rng = random.Random(seed)
    system_prompts = [_random_text(rng, 200) for _ in range(3)]
    for _ in range(count):
        messages = [{"role": "system", "content": rng.choice(system_prompts)}]
        for _turn in range(rng.randint(1, 6)):
            messages.append({"role": "user", "content": _random_text(rng, 30)})
            yield list(messages)
            messages.append({"role": "assistant", "content": _random_text(rng, 30)})


def test_cache_equals_whole_text_tokenization_on_random_chats(
    llama3: PromptTokenizer, llama3_hf: Any
) -> None:
    assert llama3.cache_disabled_reason is None
    checked = 0
    for messages in _random_conversations(seed=7, count=60):
        for continue_final in (False, True):
            if continue_final and messages[-1]["content"].strip() == "":
                continue  # transformers cannot continue a message that renders to nothing
            text = llama3.render_chat(
                messages,
                add_generation_prompt=not continue_final,
                continue_final_message=continue_final,
            )
            for special in (False, True):
                assert llama3.encode_text(text, add_special_tokens=special) == (
                    llama3.encode_uncached(text, add_special_tokens=special)
                ), (messages, special)
            checked += 1
    assert checked > 200
    stats = llama3.stats()
    assert stats.cache_hits > stats.cache_misses > 0
    assert stats.cached_tokens > stats.encoded_tokens
    assert stats.uncached_calls == 0
    # The reference itself equals transformers' encode (what vLLM calls).
    for messages in _random_conversations(seed=8, count=5):
        sample = llama3.render_chat(messages)
        for special in (False, True):
            assert llama3.encode_uncached(sample, add_special_tokens=special) == llama3_hf.encode(
                sample, add_special_tokens=special
            )


def test_repeated_system_prompt_is_served_from_the_cache(llama3: PromptTokenizer) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 200}
    llama3.encode_chat([system, {"role": "user", "content": "first question"}])
    cold = llama3.stats()
    ids = llama3.encode_chat([system, {"role": "user", "content": "second question"}])
    warm = llama3.stats()
    assert warm.cached_tokens - cold.cached_tokens >= 1000  # the system prompt
    assert warm.encoded_tokens - cold.encoded_tokens < 10  # only "second question"
    fresh = PromptTokenizer(llama3._hf, name="fresh")
    assert ids == fresh.encode_chat([system, {"role": "user", "content": "second question"}])


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_FRAGMENTS) | st.text(max_size=6), max_size=40),
    add_special_tokens=st.booleans(),
)
def test_cache_equals_whole_text_tokenization_on_arbitrary_text(
    llama3_hf: Any, pieces: list[str], add_special_tokens: bool
) -> None:
    tok = _shared_tokenizer(llama3_hf)
    text = "".join(pieces)
    expected = tok.encode_uncached(text, add_special_tokens=add_special_tokens)
    assert tok.encode_text(text, add_special_tokens=add_special_tokens) == expected
    assert tok.encode_text(text, add_special_tokens=add_special_tokens) == expected  # warm


_SHARED: dict[int, PromptTokenizer] = {}


def _shared_tokenizer(hf: Any) -> PromptTokenizer:
    # hypothesis forbids function-scoped fixtures; one tokenizer (and cache) across examples is
    # also the more demanding test: later examples reuse earlier examples' segments.
    if id(hf) not in _SHARED:
        _SHARED[id(hf)] = PromptTokenizer(hf, name="shared", cache_max_tokens=5000)
    return _SHARED[id(hf)]


def test_cache_is_bounded_and_evicts_least_recently_used(llama3_hf: Any) -> None:
    tok = PromptTokenizer(llama3_hf, name="small", cache_max_tokens=50)
    texts = [f"<|eot_id|>segment number {i} with some words<|eot_id|>" for i in range(40)]
    for text in texts:
        assert tok.encode_text(text, add_special_tokens=True) == tok.encode_uncached(
            text, add_special_tokens=True
        )
    stats = tok.stats()
    assert 0 < stats.cache_size_tokens <= 50
    assert stats.cache_entries < 40
    tok.clear_cache()
    assert tok.stats().cache_entries == 0


def test_encoding_from_many_threads_is_safe(llama3_hf: Any) -> None:
    tok = PromptTokenizer(llama3_hf, name="threads")
    chats = list(_random_conversations(seed=11, count=25))
    expected = [
        tok.encode_uncached(tok.render_chat(messages), add_special_tokens=False)
        for messages in chats
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _round in range(3):
            assert list(pool.map(tok.encode_chat, chats)) == expected


def _slow_counting_encoder(tok: PromptTokenizer, fail_first: bool = False) -> dict[str, int]:
    """Make ``tok``'s batch encoder slow (so concurrent callers overlap) and count how often
    each piece is encoded; with ``fail_first`` the first call raises after its delay."""
    encode = tok._encode_batch
    counts: dict[str, int] = {}
    calls = [0]
    lock = threading.Lock()

    def slow(pieces: list[str], add_special_tokens: bool) -> Any:
        with lock:
            calls[0] += 1
            first = calls[0] == 1
            for piece in pieces:
                counts[piece] = counts.get(piece, 0) + 1
        time.sleep(0.05)
        if fail_first and first:
            raise RuntimeError("tokenizer crashed")
        return encode(pieces, add_special_tokens=add_special_tokens)

    tok._encode_batch = slow
    return counts


def test_a_piece_wanted_by_many_threads_at_once_is_tokenized_once(llama3_hf: Any) -> None:
    # A burst of requests sharing a system prompt nobody has sent yet: one thread tokenizes
    # it, the others wait for that result instead of tokenizing the same text again.
    tok = PromptTokenizer(llama3_hf, name="burst", chunk_chars=1_000_000)
    counts = _slow_counting_encoder(tok)
    system = "You are the support assistant. " * 60
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]
        for i in range(6)
    ]
    expected = [
        tok.encode_uncached(tok.render_chat(messages), add_special_tokens=False)
        for messages in chats
    ]
    start = threading.Barrier(len(chats))

    def encode(messages: list[dict[str, str]]) -> list[int]:
        start.wait()
        return tok.encode_chat(messages)

    with ThreadPoolExecutor(max_workers=len(chats)) as pool:
        assert list(pool.map(encode, chats)) == expected
    shared = [piece for piece in counts if system.strip() in piece]
    assert shared and all(counts[piece] == 1 for piece in shared), counts


def test_a_failed_tokenization_does_not_fail_the_threads_waiting_for_it(
    llama3_hf: Any,
) -> None:
    tok = PromptTokenizer(llama3_hf, name="burst-failure", chunk_chars=1_000_000)
    _slow_counting_encoder(tok, fail_first=True)
    text = "a system prompt many requests share " * 40
    start = threading.Barrier(2)

    def encode(_: int) -> list[int] | str:
        start.wait()
        try:
            return tok.encode_text(text, add_special_tokens=False)
        except RuntimeError as exc:
            return str(exc)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(encode, range(2)))
    # One thread's tokenization failed (its own request reports that); the other, which waited
    # for it, tokenized the text itself.
    assert sorted(results, key=str) == sorted(
        ["tokenizer crashed", tok.encode_uncached(text, add_special_tokens=False)], key=str
    )
    assert tok.encode_text(text, add_special_tokens=False) == tok.encode_uncached(
        text, add_special_tokens=False
    )


def _tiny_bpe(**changes: Any) -> Any:
    """A small trained byte-level BPE, wrapped like any transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog " * 3, "naïve café 123 4567 ok"] * 20
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    backend.add_special_tokens(
        [AddedToken("<s>", special=True), AddedToken("</turn>", special=True)]
    )
    for name, value in changes.items():
        if name == "added":
            backend.add_tokens([value])
        else:
            setattr(backend, name, value)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</turn>")


def test_cache_is_exact_for_another_bpe_tokenizer() -> None:
    tok = PromptTokenizer(_tiny_bpe(), name="tiny-bpe")
    assert tok.cache_disabled_reason is None
    rng = random.Random(3)
    fragments = [*_FRAGMENTS, "</turn>", "<s>", "</tu", "the lazy dog", " fox"]
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 25)))
        assert tok.encode_text(text, add_special_tokens=False) == tok.encode_uncached(
            text, add_special_tokens=False
        )
    assert tok.stats().cache_hits > 0


def test_cache_cuts_overlapping_added_tokens_leftmost_longest_like_the_rust_tokenizer() -> None:
    from tokenizers import AddedToken

    hf = _tiny_bpe()
    hf.backend_tokenizer.add_special_tokens(
        [AddedToken(content, special=True) for content in ("<x>", "<x>y", "x>y", "y<x")]
    )
    hf.backend_tokenizer.add_tokens([AddedToken("<n>", normalized=True)])  # found inside pieces
    tok = PromptTokenizer(hf, name="overlapping")
    assert tok.cache_disabled_reason is None
    rng = random.Random(5)
    fragments = ["<x>", "y", "<", "x", ">", "the", " ", "<x>y", "y<x", "<n>", "n>"]
    for _ in range(3000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
        assert tok.encode_text(text, add_special_tokens=False) == tok.encode_uncached(
            text, add_special_tokens=False
        ), text


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("normalizer", "normalizer"),
        ("metaspace", "pre-tokenizer"),
        ("prefix_space", "pre-tokenizer"),
        ("lstrip", "lstrip"),
    ],
)
def test_cache_turns_itself_off_when_segments_are_not_independent(change: str, reason: str) -> None:
    from tokenizers import AddedToken, normalizers, pre_tokenizers

    changes: dict[str, Any] = {
        "normalizer": {"normalizer": normalizers.NFKC()},
        "metaspace": {"pre_tokenizer": pre_tokenizers.Metaspace(prepend_scheme="first")},
        "prefix_space": {"pre_tokenizer": pre_tokenizers.ByteLevel(add_prefix_space=True)},
        "lstrip": {"added": AddedToken("<mask>", lstrip=True)},
    }[change]
    tok = PromptTokenizer(_tiny_bpe(**changes), name="unsafe")
    assert tok.cache_disabled_reason is not None
    assert reason in tok.cache_disabled_reason
    text = "the fox</turn> jumps <mask> over</turn>"
    for special in (False, True):
        assert tok.encode_text(text, add_special_tokens=special) == tok.encode_uncached(
            text, add_special_tokens=special
        )
    stats = tok.stats()
    assert stats.uncached_calls == 2 and stats.cache_hits == 0


def test_verification_turns_a_wrong_cache_off(llama3_hf: Any) -> None:
    tok = PromptTokenizer(llama3_hf, name="verified", verify_every=1)
    text = "<|eot_id|>Hello world<|eot_id|>"
    expected = tok.encode_text(text, add_special_tokens=False)
    tok._entries["Hello world"] = (1, 2, 3)  # corrupt the cache on purpose
    assert tok.encode_text(text, add_special_tokens=False) == expected
    assert tok.stats().verify_failures == 1
    assert tok.cache_disabled_reason is not None


# ------------------------------------------------------------------ loading and the registry


def test_missing_or_empty_directories_name_the_path_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(TokenizationError, match="does not exist") as info:
        PromptTokenizer.from_pretrained(missing, name="model-a")
    assert str(missing) in str(info.value) and "model-a" in str(info.value)
    assert "tokenizer_assets" in str(info.value)
    with pytest.raises(TokenizationError, match="holds no tokenizer files"):
        PromptTokenizer.from_pretrained(tmp_path)
    with pytest.raises(TokenizationError, match="local Hugging Face cache"):
        PromptTokenizer.from_pretrained("kv-epp-tests/not-a-cached-model")


def test_a_model_without_chat_template_still_serves_completions(llama3_hf: Any) -> None:
    base_model = copy.copy(llama3_hf)  # shares the Rust tokenizer; only the template differs
    base_model.chat_template = None
    tok = PromptTokenizer(base_model, name="base-model")
    assert tok.encode_completion("Hello world, this is a test.") == [BOS, *HELLO_IDS]
    with pytest.raises(TokenizationError, match="'base-model' has no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])


def test_chat_template_override_from_text_or_file(llama3_hf: Any, tmp_path: Path) -> None:
    template_file = tmp_path / "template.jinja"
    template_file.write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    messages = [{"role": "user", "content": "x"}]
    from_file = PromptTokenizer(llama3_hf, name="t", chat_template=str(template_file))
    assert from_file.render_chat(messages) == "<x>"
    literal = PromptTokenizer(llama3_hf, name="t", chat_template="[{{ messages[0].content }}]")
    assert literal.render_chat(messages) == "[x]"
    with pytest.raises(TokenizationError, match="looks like a file path"):
        PromptTokenizer(llama3_hf, name="t", chat_template=str(tmp_path / "missing.jinja"))


def test_registry_loads_each_model_once_and_shares_it(
    llama3_hf: Any, llama3_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []

    def load(source: str | os.PathLike[str], *, model: str | None = None) -> Any:
        loads.append(os.fspath(source))
        if not Path(source).is_dir():
            return load_hf_tokenizer(source, model=model)  # the real errors
        return llama3_hf  # loading the real files is covered above; keep this test fast

    monkeypatch.setattr(tokenization, "load_hf_tokenizer", load)
    registry = TokenizerRegistry(
        {
            "tiny-llama3": llama3_tokenizer_dir,
            "tiny-llama3-raw": TokenizerSource(
                str(llama3_tokenizer_dir), chat_template="{{ messages[0]['content'] }}"
            ),
            "broken": "/nonexistent/tokenizer/dir",
        }
    )
    assert registry.models() == ("tiny-llama3", "tiny-llama3-raw", "broken")
    assert "tiny-llama3" in registry and "other" not in registry
    assert loads == []  # lazy
    start = threading.Barrier(6)

    def get(_: int) -> PromptTokenizer:
        start.wait()
        return registry.get("tiny-llama3")

    with ThreadPoolExecutor(max_workers=6) as pool:
        loaded = list(pool.map(get, range(6)))
    assert all(tok is loaded[0] for tok in loaded)
    assert loads == [str(llama3_tokenizer_dir)]
    assert loaded[0].name == "tiny-llama3"
    assert loaded[0].encode_chat([{"role": "user", "content": "Hi there"}])[:2] == [BOS, 128006]
    assert registry.get("tiny-llama3-raw").render_chat([{"role": "user", "content": "x"}]) == "x"
    assert set(registry.stats()) == {"tiny-llama3", "tiny-llama3-raw"}

    with pytest.raises(TokenizationError, match="no tokenizer is configured for model 'gpt-4'"):
        registry.get("gpt-4")
    with pytest.raises(TokenizationError, match=r"'broken'.*does not exist"):
        registry.get("broken")


def test_a_loaded_tokenizer_is_warm_and_a_template_that_fails_only_logs(
    llama3_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Loading renders and tokenizes once (the first request would otherwise compile the Jinja
    # template); a template that cannot render a one-message chat is reported, not fatal.
    registry = TokenizerRegistry(
        {
            "ok": llama3_tokenizer_dir,
            "bad-template": TokenizerSource(
                str(llama3_tokenizer_dir), chat_template="{{ raise_exception('no chats') }}"
            ),
        }
    )
    assert registry.get("ok").stats().cache_entries > 0
    with caplog.at_level("INFO", logger="indexer.tokenization"):
        bad = registry.get("bad-template")
    assert "tokenizer bad-template: chat template not warmed" in caplog.text
    assert bad.encode_completion("Hello world, this is a test.") == [BOS, *HELLO_IDS]
    with pytest.raises(TokenizationError, match="no chats"):
        bad.encode_chat([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------ chunks of long pieces

_CHUNK_ALPHABET = [*"ab Zq \n\n  \t'1234.,!?é日本\r", " the", "don't", "I'm", "<|eot_id|>", "  x"]


def test_long_pieces_are_cut_only_where_the_ids_cannot_change(llama3_hf: Any) -> None:
    tok = PromptTokenizer(llama3_hf, name="chunks", chunk_chars=3)
    assert tok._chunk_chars == 3  # the Llama-3 pre-tokenizer is one we can cut
    rng = random.Random(11)
    for number in range(2000):
        text = "".join(rng.choice(_CHUNK_ALPHABET) for _ in range(rng.randint(0, 50)))
        special = number % 2 == 0
        expected = tok.encode_uncached(text, add_special_tokens=special)
        assert tok.encode_text(text, add_special_tokens=special) == expected, repr(text)
        assert tok.encode_text(text, add_special_tokens=special) == expected, repr(text)  # warm
    assert tok.stats().cache_entries > 100  # the texts really were cut


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.sampled_from(_CHUNK_ALPHABET), max_size=40).map("".join),
    size=st.integers(1, 9),
)
def test_chunked_tokenization_equals_whole_text_tokenization(
    llama3_hf: Any, text: str, size: int
) -> None:
    tok = PromptTokenizer(llama3_hf, name="chunks", chunk_chars=size)
    assert tok.encode_text(text, add_special_tokens=False) == tok.encode_uncached(
        text, add_special_tokens=False
    )


def test_a_long_document_is_cut_into_chunks_cached_on_their_own(llama3: PromptTokenizer) -> None:
    document = " ".join(f"word{i % 97} alpha beta" for i in range(6000))  # ~110k chars
    assert len(document) > 10 * tokenization.CHUNK_CHARS
    ids = llama3.encode_text(document, add_special_tokens=False)
    assert ids == llama3.encode_uncached(document, add_special_tokens=False)
    assert llama3.stats().cache_entries >= 10
    # The same document with a new ending: every chunk but the last comes from the cache.
    before = llama3.stats()
    longer = document + " and one more sentence"
    assert llama3.encode_text(longer, add_special_tokens=False) == llama3.encode_uncached(
        longer, add_special_tokens=False
    )
    after = llama3.stats()
    assert after.cached_tokens - before.cached_tokens > 0.8 * len(ids)


def test_other_pre_tokenizers_are_never_cut() -> None:
    tok = PromptTokenizer(_tiny_bpe(), name="tiny-bpe", chunk_chars=4)
    assert tok._chunk_chars == 0
    with pytest.raises(TokenizationError, match="chunk_chars"):
        PromptTokenizer(_tiny_bpe(), name="tiny-bpe", chunk_chars=0)


def test_live_segment_caches_report_every_tokenizer_alive(llama3_hf: Any) -> None:
    tokenizer = PromptTokenizer(llama3_hf, name="soak-probe")
    assert tokenization.live_segment_caches().get("soak-probe") == 0
    tokenizer.encode_chat([{"role": "system", "content": "You are a careful assistant."}])
    held = tokenizer.stats().cache_size_tokens
    assert held > 0
    assert tokenization.live_segment_caches()["soak-probe"] == held


def test_cache_knobs_fail_with_the_value_and_the_range(llama3_hf: Any) -> None:
    with pytest.raises(TokenizationError, match=r"cache_max_tokens must be >= 0.*got -1.*MiB"):
        PromptTokenizer(llama3_hf, cache_max_tokens=-1)
    with pytest.raises(TokenizationError, match="cache_max_tokens must be an integer"):
        PromptTokenizer(llama3_hf, cache_max_tokens=1.5)  # type: ignore[arg-type]
    with pytest.raises(TokenizationError, match="verify_every must be >= 0"):
        PromptTokenizer(llama3_hf, verify_every=-2)


def test_loading_a_tokenizer_does_not_print_transformers_pytorch_advice(
    llama3_tokenizer_dir: Path,
) -> None:
    """`epp serve` runs without PyTorch on purpose: transformers' "PyTorch was not found" advice
    is noise there, and used to be the first line a user read."""
    code = (
        "from indexer.tokenization import load_hf_tokenizer; "
        f"load_hf_tokenizer({str(llama3_tokenizer_dir)!r})"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "PyTorch was not found" not in run.stderr + run.stdout
