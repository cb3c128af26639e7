"""Prompt tokenization exactly as vLLM does it, with an exact cache of tokenization work.

What vLLM does (paths in the vLLM repository; read on its main branch, the 0.3x line):

* ``/v1/completions``: a text prompt is tokenized with ``add_special_tokens=True``
  (``CompletionRequest.add_special_tokens`` defaults to True; ``BaseRenderer.default_cmpl_tok_params``
  in ``vllm/renderers/base.py``); a prompt given as token ids is passed through as is.
* ``/v1/chat/completions``: the messages are first normalised (``parse_chat_messages`` in
  ``vllm/entrypoints/chat_utils.py``): each message keeps only ``role``, ``content`` and a few known
  fields; text content parts are joined with ``"\\n"`` when the template wants a string, or kept as
  ``[{"type": "text", "text": ...}]`` when the template iterates over ``message['content']`` (the
  "openai" content format, detected from the template's Jinja AST in ``vllm/renderers/hf.py``);
  tool-call arguments are parsed from JSON. The template is rendered by transformers'
  ``apply_chat_template`` with ``add_generation_prompt`` / ``continue_final_message`` /
  ``documents`` / ``reasoning_effort`` merged over ``chat_template_kwargs``
  (``ChatCompletionRequest.build_chat_params``, ``merge_kwargs`` in ``vllm/renderers/params.py``),
  and the text is tokenized with ``add_special_tokens=False`` by default
  (``ChatCompletionRequest.add_special_tokens``), because the template already writes BOS.

We call the same transformers function on the same tokenizer files, so the result is exact as long
as the EPP runs the transformers version the pods run (templates render through
``transformers.utils.chat_template_utils``, which changes between releases).

The cache (a segment cache: the "prefix cache" of tokenization work)
--------------------------------------------------------------------
BPE output is not additive over arbitrary splits of a text, but it is at the boundaries of added
tokens. A Hugging Face fast tokenizer first cuts the text at every occurrence of an added token
that is matched on the raw text (``normalized=False``; leftmost-longest, non-overlapping), and only
then normalises, pre-tokenizes and runs the model on each piece separately. So the ids of a text are
the concatenation, in order, of the added tokens' ids and the ids of each piece between them
tokenized alone. We reproduce that cut with a regex over the same token strings (alternatives
sorted longest first, which makes Python's leftmost-first alternation leftmost-longest) and cache
the ids of each piece in a bounded LRU keyed by the piece's text. A shared system prompt, tool
block or earlier turn is therefore tokenized once; a new request tokenizes only its new pieces.

The argument needs the per-piece pipeline to be context-free, so the cache switches itself off (and
every call tokenizes the whole text) when the tokenizer has a normalizer, an added token with
``lstrip``/``rstrip``/``single_word``, a pre-tokenizer that depends on the position of a piece
(``Metaspace`` prepending only to the first piece, ``ByteLevel`` with ``add_prefix_space``, or any
type not known to be context-free), BPE dropout, or ``encode_special_tokens``.
`PromptTokenizer.cache_disabled_reason` says which. ``add_special_tokens=True`` adds the
post-processor's fixed prefix and suffix (BOS for Llama-3), measured once at load and verified on
probe texts; if they are not fixed, those calls are not cached either. Optionally
(``verify_every=N``), every N-th cached call is checked against a whole-text tokenization and a
mismatch turns the cache off for good.

Long pieces are cut further, into chunks of about `CHUNK_CHARS` characters, when the
pre-tokenizer is one whose word boundaries we can prove (`indexer.tokenizer_analysis`: Llama-3's
and Qwen2's regex followed by a plain ``ByteLevel``).  There, a space between two ASCII letters
always starts a new pre-token (the alternative "one optional non-letter, then letters"), no
match spans it, and every later step works on one pre-token at a time, so the ids of a text are
those of its chunks, cut before such spaces, concatenated.  The Rust tokenizer is about twice as
fast per token on 4-16 KB chunks as on one 64 KB text (measured with one thread: 8k words
12.6 ms whole, 6.4 ms in four chunks), one batch call spreads the chunks over its threads, and a
long document's chunks are cached on their own.

Memory: a cached token costs about `CACHE_BYTES_PER_TOKEN` bytes (its slot in a tuple of shared
int objects, its share of the piece's text and of the entry; measured with tracemalloc on chat
text), so the default `DEFAULT_CACHE_MAX_TOKENS` holds at most about 8 MiB per model.

Everything here is synchronous and safe to call from several worker threads at once: the Rust
tokenizer is only read after loading, and the cache has its own lock.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from indexer.chat_messages import ContentFormat, conversation_from_messages, tool_dicts
from indexer.chat_templates import (
    apply_chat_template_params,
    load_chat_template,
    template_content_format,
    template_variables,
)
from indexer.errors import TokenizationError
from indexer.tokenizer_analysis import (
    added_token_matcher,
    chunkable,
    segmentation_hazard,
    special_token_affixes,
)

logger = logging.getLogger(__name__)

# transformers warns at import that PyTorch is missing and models will not load: true and
# irrelevant here (only its tokenizers and chat templates are used), and it is the first thing a
# user of `epp serve` read.  The variable silences transformers' advisory warnings only; a user
# who sets it to something else keeps their choice.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

ContentFormatOption = Literal["auto", "string", "openai"]

DEFAULT_CACHE_MAX_TOKENS: Final = 1 << 19
"""Tokens held by one tokenizer's segment cache: 512k tokens, about 8 MiB (see below)."""
CACHE_BYTES_PER_TOKEN: Final = 16
"""Measured cost of one cached token, rounded up: 14.8 bytes (tracemalloc, Llama-3, soak-like
chats of 3,000 new 40-word user turns over 48 system prompts: 3,052 entries, 205k tokens)."""
CHUNK_CHARS: Final = 8192
"""Target length of the chunks a long piece is cut into (see the module docstring)."""

# ASCII only: Python's and Oniguruma's Unicode tables may differ on what is a letter.
_SAFE_CUT: Final = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_REPO_ID: Final = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

# Values vLLM's `merge_kwargs` treats as "not set" when request fields override template kwargs.
_UNSET: Final = (None, "auto")
_FORBIDDEN_TEMPLATE_KWARGS: Final = ("chat_template", "tokenize")


@dataclass(frozen=True, slots=True)
class TokenizationStats:
    """Counters of one `PromptTokenizer` since it was loaded."""

    cache_hits: int
    """Text segments whose ids came from the cache."""
    cache_misses: int
    """Text segments that had to be tokenized (then cached)."""
    cached_tokens: int
    """Tokens served from the cache."""
    encoded_tokens: int
    """Tokens produced by the tokenizer itself (cache misses and uncached calls)."""
    uncached_calls: int
    """Whole-text tokenizations, made because the cache is off for this tokenizer or call."""
    verify_failures: int
    """Cached results that differed from a whole-text tokenization (each turns the cache off)."""
    cache_entries: int
    cache_size_tokens: int


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """Where a model's tokenizer comes from, plus the vLLM serving options that change prompts."""

    path: str
    """A local directory, or a Hugging Face repo id already in the local cache (never downloaded)."""
    chat_template: str | None = None
    """vLLM's ``--chat-template``: a template, or the path of a file holding one."""
    content_format: ContentFormatOption = "auto"
    """vLLM's ``--chat-template-content-format``."""
    default_chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """vLLM's ``--default-chat-template-kwargs``."""


def load_hf_tokenizer(source: str | os.PathLike[str], *, model: str | None = None) -> Any:
    """Load a fast transformers tokenizer from a directory or the local HF cache, offline.

    ``local_files_only=True`` keeps transformers and huggingface_hub off the network without
    touching the process-wide ``HF_HUB_OFFLINE``.
    """
    label = f"model {model!r}" if model else "tokenizer"
    text = os.fspath(source)
    path = Path(text).expanduser()
    from_directory = path.is_dir()
    if from_directory:
        if not any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise TokenizationError(
                f"{label}: {path} holds no tokenizer files (expected one of "
                f"{', '.join(_TOKENIZER_FILES)}); point the model at its Hugging Face model "
                "directory, or build a Llama-3 one with `python -m indexer.tokenizer_assets DIR`"
            )
    elif os.path.isabs(text) or text.startswith(("./", "../", "~")) or not _REPO_ID.fullmatch(text):
        raise TokenizationError(
            f"{label}: tokenizer directory {path} does not exist; give the path of a directory "
            "with tokenizer.json and tokenizer_config.json (vLLM's model directory works), or "
            "build a Llama-3 one with `python -m indexer.tokenizer_assets DIR`"
        )
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(
            str(path) if from_directory else text, local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        if from_directory:
            raise TokenizationError(f"{label}: cannot load the tokenizer in {path}: {exc}") from exc
        raise TokenizationError(
            f"{label}: {text!r} is neither an existing directory nor a model in the local Hugging "
            f"Face cache ({_hf_cache_dir()}), and tokenizers are never downloaded at run time; "
            f"give the path of a directory with tokenizer.json, or fetch it beforehand with "
            f"`hf download {text} --include 'tokenizer*'` ({exc})"
        ) from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TokenizationError(
            f"{label}: {text} loaded as {type(tokenizer).__name__}, which has no fast (Rust) "
            "tokenizer; the EPP needs tokenizer.json (save the tokenizer once with "
            "transformers' `save_pretrained` to produce it)"
        )
    return tokenizer


def _hf_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:
        return "the Hugging Face cache"


class PromptTokenizer:
    """One model's tokenizer and chat template, as vLLM uses them, with a segment cache.

    Build it with `from_pretrained` (or get it from a `TokenizerRegistry`). The ``encode_*``
    methods are synchronous, CPU-bound and thread-safe: run them in a bounded executor.
    """

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        name: str = "",
        chat_template: str | None = None,
        content_format: ContentFormatOption = "auto",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_max_tokens: int = DEFAULT_CACHE_MAX_TOKENS,
        verify_every: int = 0,
        chunk_chars: int = CHUNK_CHARS,
    ) -> None:
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TokenizationError(
                f"{type(hf_tokenizer).__name__} is not a fast tokenizer; load one from a "
                "directory that has tokenizer.json"
            )
        if content_format not in ("auto", "string", "openai"):
            raise TokenizationError(
                f"content_format must be 'auto', 'string' or 'openai', not {content_format!r}"
            )
        if isinstance(cache_max_tokens, bool) or not isinstance(cache_max_tokens, int):
            raise TokenizationError(
                f"cache_max_tokens must be an integer, got {cache_max_tokens!r}"
            )
        if cache_max_tokens < 0:
            raise TokenizationError(
                f"cache_max_tokens must be >= 0 (0 turns the segment cache off), got "
                f"{cache_max_tokens}; each cached token costs about {CACHE_BYTES_PER_TOKEN} bytes, "
                f"so the default {DEFAULT_CACHE_MAX_TOKENS:,} holds about "
                f"{DEFAULT_CACHE_MAX_TOKENS * CACHE_BYTES_PER_TOKEN >> 20} MiB"
            )
        if verify_every < 0:
            raise TokenizationError(
                f"verify_every must be >= 0 (0: never re-check cached results), got {verify_every}"
            )
        if chunk_chars < 1:
            raise TokenizationError(f"chunk_chars must be >= 1, got {chunk_chars}")
        self.name: str = name or str(getattr(hf_tokenizer, "name_or_path", "")) or "tokenizer"
        self._hf = hf_tokenizer
        self._backend = backend
        # `encode_batch_fast` (tokenizers >= 0.21) skips offsets; the ids are the same.
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)
        # transformers resets truncation and padding on every call it makes; we call the Rust
        # tokenizer directly, so make sure neither is configured (once, before any sharing).
        if backend.truncation is not None:
            backend.no_truncation()
        if backend.padding is not None:
            backend.no_padding()
        self._chat_template = load_chat_template(chat_template, self.name)
        self._content_format: ContentFormatOption = content_format
        self._default_template_kwargs = dict(default_chat_template_kwargs or {})

        added = dict(backend.get_added_tokens_decoder())
        # vLLM rejects prompt ids above the tokenizer's largest id. Vocabularies are contiguous
        # from 0 in practice, which lets us skip `get_vocab()` (0.35 s for Llama-3).
        vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.max_token_id: int = max(vocab_size - 1, max(added, default=-1))
        self._canonical_ids = list(range(self.max_token_id + 1))
        self._boundary, self._boundary_ids = added_token_matcher(added.items())
        self._affixes = special_token_affixes(backend)
        self._hazard: str | None = segmentation_hazard(backend, added.values())
        if cache_max_tokens == 0 and self._hazard is None:
            self._hazard = "the cache is configured with cache_max_tokens=0"
        if self._hazard is not None:
            logger.info("tokenizer %s: segment cache off: %s", self.name, self._hazard)
        # 0: long pieces are tokenized whole (the pre-tokenizer's boundaries are not provable).
        self._chunk_chars = chunk_chars if chunkable(backend) else 0

        self._verify_every = verify_every
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}  # pieces being tokenized now, by one thread
        self._cache_max_tokens = cache_max_tokens
        self._cache_tokens = 0
        self._hits = self._misses = self._cached_tokens = self._encoded_tokens = 0
        self._uncached_calls = self._verify_failures = self._calls = 0
        _LIVE_TOKENIZERS.add(self)

    @classmethod
    def from_pretrained(
        cls,
        source: str | os.PathLike[str],
        *,
        name: str | None = None,
        chat_template: str | None = None,
        content_format: ContentFormatOption = "auto",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        cache_max_tokens: int = DEFAULT_CACHE_MAX_TOKENS,
        verify_every: int = 0,
    ) -> PromptTokenizer:
        """Load offline from a directory (or the local HF cache); see `load_hf_tokenizer`."""
        label = name or os.fspath(source)
        return cls(
            load_hf_tokenizer(source, model=label),
            name=label,
            chat_template=chat_template,
            content_format=content_format,
            default_chat_template_kwargs=default_chat_template_kwargs,
            cache_max_tokens=cache_max_tokens,
            verify_every=verify_every,
        )

    # ---------------------------------------------------------------- public API

    @property
    def cache_disabled_reason(self) -> str | None:
        """Why every call tokenizes the whole text, or None when the segment cache is in use."""
        return self._hazard

    def encode_completion(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> list[int]:
        """The prompt ids of a ``/v1/completions`` request (one prompt of it).

        Text is tokenized with ``add_special_tokens`` (vLLM's default: True). Token ids are
        passed through after the checks vLLM makes (non-empty, in the vocabulary).
        """
        if isinstance(prompt, str):
            return self.encode_text(prompt, add_special_tokens=add_special_tokens)
        return self.validate_token_ids(prompt)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The prompt ids of a ``/v1/chat/completions`` request, as vLLM computes them.

        Keyword arguments mirror the request fields of the same names and defaults.
        """
        text = self.render_chat(
            messages,
            tools=tools,
            documents=documents,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            reasoning_effort=reasoning_effort,
        )
        return self.encode_text(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        reasoning_effort: str | None = None,
    ) -> str:
        """The prompt text vLLM renders from a chat request (before tokenization)."""
        if continue_final_message and add_generation_prompt:
            raise TokenizationError(
                "cannot set both continue_final_message and add_generation_prompt to true "
                "(vLLM rejects it); set add_generation_prompt to false to continue the last message"
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TokenizationError(
                f"messages must be a list of objects, not {type(messages).__name__}"
            )
        if not messages:
            raise TokenizationError("messages must not be empty")
        tool_list = tool_dicts(tools)
        template = self._resolve_chat_template(tool_list)
        content_format: ContentFormat = (
            template_content_format(template)
            if self._content_format == "auto"
            else self._content_format
        )
        conversation = conversation_from_messages(messages, content_format)
        kwargs = self._template_kwargs(
            template,
            chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            documents=documents,
            reasoning_effort=reasoning_effort,
        )
        # vLLM's newest renderer also reads tools from the template kwargs; request tools win.
        kwarg_tools = kwargs.pop("tools", None)
        try:
            rendered = self._hf.apply_chat_template(
                conversation,
                tools=tool_list if tool_list is not None else kwarg_tools,
                chat_template=template,
                tokenize=False,
                **kwargs,
            )
        except Exception as exc:
            raise TokenizationError(
                f"model {self.name!r}: the chat template failed on this request: {exc}"
            ) from exc
        if not isinstance(rendered, str):
            raise TokenizationError(
                f"model {self.name!r}: apply_chat_template returned {type(rendered).__name__}, "
                "expected the prompt text"
            )
        return rendered

    def warm(self) -> None:
        """Tokenize a system-and-user chat and a text of a few hundred tokens once, as a
        request would.

        The first chat request otherwise compiles the Jinja template and takes the tokenizer's
        first calls: 5-10 ms on a 2-core machine, which every request queued behind it waits
        for too.  A short text is not enough: after a one-word warm-up the first 2k-token chat
        still took 4.5 ms to tokenize against 2.2-2.5 for the next ones; after this one, 2.8.
        Called where the tokenizer is loaded, before the EPP reports SERVING.  A model without
        a usable chat template only logs it: its chat requests report the error themselves,
        and its completions requests work.
        """
        text = " ".join(
            f"Warm-up sentence {i}, with words, numbers and 'quotes'." for i in range(40)
        )
        self.encode_text(text, add_special_tokens=True)
        # Some templates refuse a system role (Gemma's): a user-only chat then warms them.
        failure: TokenizationError | None = None
        for messages in (
            [{"role": "system", "content": text}, {"role": "user", "content": text}],
            [{"role": "user", "content": text}],
        ):
            try:
                self.encode_chat(messages)
                return
            except TokenizationError as exc:
                failure = exc
        logger.info("tokenizer %s: chat template not warmed: %s", self.name, failure)

    def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Tokenize text exactly like ``tokenizer.encode(text, add_special_tokens=...)``, cached."""
        if self._hazard is not None or (add_special_tokens and self._affixes is None):
            with self._lock:
                self._uncached_calls += 1
            ids = self.encode_uncached(text, add_special_tokens=add_special_tokens)
            with self._lock:
                self._encoded_tokens += len(ids)
            return ids
        ids = self._encode_by_segments(text)
        if add_special_tokens and self._affixes is not None:
            prefix, suffix = self._affixes
            ids = [*prefix, *ids, *suffix]
        if self._verify_every and self._due_for_verification():
            expected = self.encode_uncached(text, add_special_tokens=add_special_tokens)
            if expected != ids:
                self._turn_cache_off(text)
                return expected
        return ids

    def encode_uncached(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Whole-text tokenization by the Rust tokenizer: the reference the cache must equal.

        The same ids as transformers' ``encode`` (which calls the same Rust tokenizer), without
        the character offsets it computes, which cost about as much as the tokenization itself.
        """
        (encoding,) = self._encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def validate_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        """A prompt given as token ids, checked the way vLLM checks it, as a new list."""
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise TokenizationError(
                f"a token-id prompt must be a list of integers, not {type(token_ids).__name__}"
            )
        if not token_ids:
            raise TokenizationError("the prompt is empty: give a non-empty string or token-id list")
        ids = list(token_ids)
        for position, token in enumerate(ids):
            if type(token) is not int:
                raise TokenizationError(
                    f"prompt[{position}] = {token!r} is not an integer token id"
                )
            if not 0 <= token <= self.max_token_id:
                raise TokenizationError(
                    f"prompt[{position}] = {token} is out of vocabulary for model {self.name!r} "
                    f"(valid ids are 0..{self.max_token_id})"
                )
        return ids

    def stats(self) -> TokenizationStats:
        with self._lock:
            return TokenizationStats(
                cache_hits=self._hits,
                cache_misses=self._misses,
                cached_tokens=self._cached_tokens,
                encoded_tokens=self._encoded_tokens,
                uncached_calls=self._uncached_calls,
                verify_failures=self._verify_failures,
                cache_entries=len(self._entries),
                cache_size_tokens=self._cache_tokens,
            )

    def clear_cache(self) -> None:
        with self._lock:
            self._entries.clear()
            self._cache_tokens = 0

    # ---------------------------------------------------------------- chat template

    def _resolve_chat_template(self, tools: list[dict[str, Any]] | None) -> str:
        # vLLM's order (`resolve_chat_template`): --chat-template, then the tokenizer's own
        # (its "tool_use" variant when tools are given). vLLM's last resort, templates bundled for
        # a few model types without one, is not mirrored: configure chat_template for those.
        if self._chat_template is not None:
            return self._chat_template
        try:
            template = self._hf.get_chat_template(None, tools=tools)
        except Exception as exc:
            raise TokenizationError(
                f"model {self.name!r} has no chat template, so /v1/chat/completions cannot be "
                "tokenized; add `chat_template` to its tokenizer_config.json (or a "
                "chat_template.jinja file), configure one for the model in the EPP as vLLM's "
                f"--chat-template, or send /v1/completions ({exc})"
            ) from exc
        if not isinstance(template, str):
            raise TokenizationError(f"model {self.name!r}: chat template is not a string")
        return template

    def _template_kwargs(
        self,
        template: str,
        chat_template_kwargs: Mapping[str, Any] | None,
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        documents: Sequence[Mapping[str, Any]] | None,
        reasoning_effort: str | None,
    ) -> dict[str, Any]:
        user = dict(chat_template_kwargs or {})
        for key in _FORBIDDEN_TEMPLATE_KWARGS:
            if key in user:
                raise TokenizationError(
                    f"chat_template_kwargs may not set {key!r} (vLLM rejects it); remove it"
                )
        request_fields: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "documents": None if documents is None else [dict(d) for d in documents],
            "reasoning_effort": reasoning_effort,
        }
        # ChatCompletionRequest.build_chat_params: asking for reasoning turns thinking on for
        # templates that need an explicit opt-in, unless the request says otherwise.
        if reasoning_effort is not None and "enable_thinking" not in user:
            request_fields["enable_thinking"] = reasoning_effort != "none"
        merged = user | {k: v for k, v in request_fields.items() if v not in _UNSET}
        if self._default_template_kwargs:  # ChatParams.with_defaults
            merged = self._default_template_kwargs | {
                k: v for k, v in merged.items() if v not in _UNSET
            }
        # vLLM's `resolve_chat_template_kwargs` drops what neither the template nor
        # apply_chat_template can use.
        variables = template_variables(template)
        if variables is None:
            return merged
        accepted = (variables | apply_chat_template_params()) - set(_FORBIDDEN_TEMPLATE_KWARGS)
        return {k: v for k, v in merged.items() if k in accepted}

    # ---------------------------------------------------------------- the segment cache

    def _encode_by_segments(self, text: str) -> list[int]:
        pieces: list[str | int] = []
        position = 0
        if self._boundary is not None:
            boundary_ids = self._boundary_ids
            for match in self._boundary.finditer(text):
                start, end = match.span()
                if start > position:
                    pieces.append(text[position:start])
                pieces.append(boundary_ids[match.group()])
                position = end
        if position < len(text):
            pieces.append(text[position:] if position else text)
        if self._chunk_chars and len(text) > self._chunk_chars:
            pieces = self._chunked(pieces)

        found: dict[str, tuple[int, ...]] = {}
        missing: list[str] = []
        awaited: dict[str, _Flight] = {}
        with self._lock:
            entries = self._entries
            flights = self._flights
            for piece in pieces:
                if not isinstance(piece, str) or piece in found or piece in awaited:
                    continue
                cached = entries.get(piece)
                if cached is not None:
                    entries.move_to_end(piece)
                    found[piece] = cached
                    self._hits += 1
                    self._cached_tokens += len(cached)
                elif (flight := flights.get(piece)) is not None:
                    awaited[piece] = flight
                elif piece not in missing:
                    missing.append(piece)
                    flights[piece] = _Flight()
        if missing:
            self._encode_and_store(missing, found)
        for piece, flight in awaited.items():
            # Another thread is tokenizing this piece now (a burst of requests sharing a new
            # system prompt): wait for its result rather than tokenize the same text again.
            flight.done.wait()
            if flight.ids is None:  # that thread failed; its error is its own request's
                self._encode_and_store([piece], found, claimed=False)
            else:
                found[piece] = flight.ids

        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids.extend(found[piece])
        return ids

    def _chunked(self, pieces: list[str | int]) -> list[str | int]:
        """``pieces`` with every text longer than the chunk size cut before safe spaces."""
        size = self._chunk_chars
        out: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, int) or len(piece) <= size:
                out.append(piece)
                continue
            start = 0
            while (cut := _SAFE_CUT.search(piece, start + size)) is not None:
                out.append(piece[start : cut.start()])
                start = cut.start()
            out.append(piece[start:] if start else piece)
        return out

    def _encode_pieces(self, pieces: list[str]) -> list[tuple[int, ...]]:
        # One batch call: the Rust side spreads the pieces over its thread pool. Ids are mapped to
        # one shared int object each, so cached tuples cost 8 bytes per token, not 36.
        canonical = self._canonical_ids.__getitem__
        encodings = self._encode_batch(pieces, add_special_tokens=False)
        return [tuple(map(canonical, encoding.ids)) for encoding in encodings]

    def _encode_and_store(
        self, pieces: list[str], found: dict[str, tuple[int, ...]], *, claimed: bool = True
    ) -> None:
        """Tokenize ``pieces`` into ``found`` and the cache; with ``claimed``, this thread
        registered them as in flight and answers the threads waiting for them, failure
        included (they then tokenize themselves)."""
        encoded: list[tuple[int, ...]] | None = None
        try:
            encoded = self._encode_pieces(pieces)
            found.update(zip(pieces, encoded, strict=True))
            self._store(pieces, encoded)
        finally:
            if claimed:
                with self._lock:
                    for i, piece in enumerate(pieces):
                        flight = self._flights.pop(piece)
                        flight.ids = None if encoded is None else encoded[i]
                        flight.done.set()

    def _store(self, pieces: list[str], encoded: list[tuple[int, ...]]) -> None:
        with self._lock:
            self._misses += len(pieces)
            for piece, ids in zip(pieces, encoded, strict=True):
                self._encoded_tokens += len(ids)
                if len(ids) > self._cache_max_tokens or piece in self._entries:
                    continue
                self._entries[piece] = ids
                self._cache_tokens += len(ids)
            while self._cache_tokens > self._cache_max_tokens:
                _, evicted = self._entries.popitem(last=False)
                self._cache_tokens -= len(evicted)

    def _due_for_verification(self) -> bool:
        with self._lock:
            self._calls += 1
            return self._calls % self._verify_every == 0

    def _turn_cache_off(self, text: str) -> None:
        with self._lock:
            self._verify_failures += 1
            self._hazard = "a cached result differed from whole-text tokenization"
            self._entries.clear()
            self._cache_tokens = 0
        logger.error(
            "tokenizer %s: segment cache disagreed with whole-text tokenization on a %d-char "
            "text; the cache is now off for this tokenizer",
            self.name,
            len(text),
        )


class _Flight:
    """One piece being tokenized by one thread, which the others that need it wait for."""

    __slots__ = ("done", "ids")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ids: tuple[int, ...] | None = None  # None once done: the tokenization failed


def live_segment_caches() -> dict[str, int]:
    """Tokens held now by the segment cache of every `PromptTokenizer` alive in this process,
    by tokenizer name (exported as a metric, so a soak can tell a cache filling from a leak)."""
    sizes: dict[str, int] = {}
    for tokenizer in list(_LIVE_TOKENIZERS):
        sizes[tokenizer.name] = sizes.get(tokenizer.name, 0) + tokenizer.stats().cache_size_tokens
    return sizes


_LIVE_TOKENIZERS: Final[weakref.WeakSet[PromptTokenizer]] = weakref.WeakSet()


class TokenizerRegistry:
    """Model name → `PromptTokenizer`, loaded lazily on first use, shared and thread-safe.

    ``TokenizerRegistry({"model-a": "/models/a"})``; a value may also be a `TokenizerSource`.
    """

    def __init__(
        self,
        sources: Mapping[str, str | os.PathLike[str] | TokenizerSource],
        *,
        cache_max_tokens: int = DEFAULT_CACHE_MAX_TOKENS,
        verify_every: int = 0,
    ) -> None:
        self._sources: dict[str, TokenizerSource] = {
            name: source
            if isinstance(source, TokenizerSource)
            else TokenizerSource(os.fspath(source))
            for name, source in sources.items()
        }
        self._cache_max_tokens = cache_max_tokens
        self._verify_every = verify_every
        self._loaded: dict[str, PromptTokenizer] = {}
        self._load_locks = {name: threading.Lock() for name in self._sources}

    def models(self) -> tuple[str, ...]:
        return tuple(self._sources)

    def __contains__(self, model: object) -> bool:
        return model in self._sources

    def get(self, model: str) -> PromptTokenizer:
        """The model's tokenizer, loading it on first use (other threads wait for that load)."""
        tokenizer = self._loaded.get(model)
        if tokenizer is not None:
            return tokenizer
        lock = self._load_locks.get(model)
        if lock is None:
            known = ", ".join(repr(name) for name in self._sources) or "none"
            raise TokenizationError(
                f"no tokenizer is configured for model {model!r} (configured: {known}); add the "
                "model and its tokenizer directory to the EPP's tokenizer configuration, or "
                "check the request's `model` field"
            )
        with lock:
            tokenizer = self._loaded.get(model)
            if tokenizer is None:
                source = self._sources[model]
                tokenizer = PromptTokenizer.from_pretrained(
                    source.path,
                    name=model,
                    chat_template=source.chat_template,
                    content_format=source.content_format,
                    default_chat_template_kwargs=source.default_chat_template_kwargs,
                    cache_max_tokens=self._cache_max_tokens,
                    verify_every=self._verify_every,
                )
                tokenizer.warm()
                self._loaded[model] = tokenizer
        return tokenizer

    def stats(self) -> dict[str, TokenizationStats]:
        """Counters of the tokenizers loaded so far."""
        return {name: tokenizer.stats() for name, tokenizer in list(self._loaded.items())}
