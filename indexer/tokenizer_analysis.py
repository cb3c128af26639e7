"""What a tokenizer's configuration proves about caching its work by segments.

The segment cache of `indexer.tokenization` is exact only when the per-piece pipeline is
context-free (see that module's docstring); these functions read a Hugging Face fast
tokenizer's normalizer, pre-tokenizer, added tokens and post-processor and say whether it is,
where a text may be cut into chunks, and which fixed ids ``add_special_tokens`` adds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

# Split regexes (the pre-tokenizer's first step) for which a space between two letters always
# starts a pre-token that no match crosses: every alternative that matches a letter matches only
# letters (or one leading non-letter), and none matches a letter and a space.
_CHUNKABLE_SPLIT_PATTERNS: Final = frozenset(
    {
        # Llama-3 (tiktoken cl100k)
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        # Qwen2
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
_CONTEXT_FREE_PRE_TOKENIZERS: Final = frozenset(
    {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "BertPreTokenizer"}
    | {"UnicodeScripts", "CharDelimiterSplit"}
)


def added_token_matcher(
    added: Iterable[tuple[int, Any]],
) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A regex that finds added tokens the way the Rust tokenizer's first pass does.

    Only tokens matched on the raw text (``normalized=False``) cut it before normalisation; the
    others are found later inside pieces and need no special care here.
    """
    ids = {
        token.content: token_id
        for token_id, token in added
        if not token.normalized and token.content
    }
    if not ids:
        return None, ids
    alternatives = sorted(ids, key=lambda content: (-len(content), content))
    return re.compile("|".join(map(re.escape, alternatives))), ids


def segmentation_hazard(backend: Any, added: Iterable[Any]) -> str | None:
    """Why cutting text at added tokens might change the ids, or None when it cannot."""
    if backend.normalizer is not None:
        return f"the tokenizer has a normalizer ({type(backend.normalizer).__name__})"
    if getattr(backend, "encode_special_tokens", False):
        return "special tokens are tokenized as text (encode_special_tokens / split_special_tokens)"
    for token in added:
        if token.lstrip or token.rstrip or token.single_word:
            return (
                f"added token {token.content!r} has lstrip/rstrip/single_word, so its match "
                "depends on the text around it"
            )
    if getattr(backend.model, "dropout", None):
        return "the BPE model uses dropout, so tokenization is random"
    if backend.pre_tokenizer is not None:
        return _pre_tokenizer_hazard(json.loads(backend.pre_tokenizer.__getstate__()))
    return None


def chunkable(backend: Any) -> bool:
    """True when the pre-tokenizer is a `_CHUNKABLE_SPLIT_PATTERNS` split followed by a plain
    byte-level step, so cutting a piece before a space between two letters changes no id."""
    if backend.pre_tokenizer is None:
        return False
    spec = json.loads(backend.pre_tokenizer.__getstate__())
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    split, byte_level = steps
    pattern = split.get("pattern") if isinstance(split, dict) else None
    return (
        split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and isinstance(pattern, dict)
        and pattern.get("Regex") in _CHUNKABLE_SPLIT_PATTERNS
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex")
    )


def _pre_tokenizer_hazard(spec: Mapping[str, Any]) -> str | None:
    kind = spec.get("type")
    if kind == "Sequence":
        for step in spec.get("pretokenizers", []):
            if (reason := _pre_tokenizer_hazard(step)) is not None:
                return reason
        return None
    if kind in _CONTEXT_FREE_PRE_TOKENIZERS:
        return None
    if kind == "ByteLevel" and not spec.get("add_prefix_space"):
        return None
    if kind == "Metaspace" and spec.get("prepend_scheme") == "never":
        return None
    return f"the pre-tokenizer {kind!r} (as configured) may treat a text's first piece differently"


def special_token_affixes(backend: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The ids ``add_special_tokens=True`` puts before and after any text, if they are fixed."""
    probes = ("a", "", "Hello world, 123!", " \n<|x|>")
    with_special = backend.encode(probes[0], add_special_tokens=True).ids
    plain = backend.encode(probes[0], add_special_tokens=False).ids
    affixes = None
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            affixes = (tuple(with_special[:start]), tuple(with_special[start + len(plain) :]))
            break
    if affixes is None:
        return None
    prefix, suffix = affixes
    for probe in probes:
        plain = backend.encode(probe, add_special_tokens=False).ids
        if backend.encode(probe, add_special_tokens=True).ids != [*prefix, *plain, *suffix]:
            return None
    return affixes
