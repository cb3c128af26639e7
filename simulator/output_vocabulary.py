"""The words generated text is made of.

The simulator has no model; each output token is drawn deterministically from a pool of common
single-token English words, so the text is readable and re-tokenizes to the same ids when a client
sends it back in the next turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from indexer.tokenization import PromptTokenizer
from simulator.server_config import SimulatorError

_OUTPUT_WORDS: Final = (
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "with", "was", "on",
    "be", "by", "at", "this", "have", "from", "or", "an", "are", "not", "but", "we", "you",
    "they", "can", "will", "one", "all", "has", "more", "their", "which", "time", "new", "some",
    "about", "so", "what", "when", "there", "would", "been", "like", "out", "up", "into",
    "other", "than", "its", "only", "over", "most", "also", "after", "first", "these", "may",
    "any", "where", "many", "well", "even", "because", "our", "through", "those", "both",
    "each", "much", "under", "same", "very",
)  # fmt: skip


@dataclass(slots=True, frozen=True)
class OutputVocabulary:
    token_ids: tuple[int, ...]
    text: Mapping[int, str]

    def text_of(self, token_ids: Sequence[int]) -> str:
        """The generated text of ``token_ids`` (ids outside the vocabulary render as nothing)."""
        text = self.text
        return "".join(text.get(t, "") for t in token_ids)


def output_vocabulary(tokenizer: PromptTokenizer) -> OutputVocabulary:
    """Common English words that are one token each (with their leading space)."""
    text: dict[int, str] = {}
    for word in _OUTPUT_WORDS:
        ids = tokenizer.encode_text(" " + word, add_special_tokens=False)
        if len(ids) == 1:
            text[ids[0]] = " " + word
    if len(text) < 8:
        raise SimulatorError(
            f"tokenizer {tokenizer.name!r} encodes too few common English words as one token "
            f"({len(text)}); the simulator needs at least 8 for its generated text"
        )
    return OutputVocabulary(tuple(text), text)
