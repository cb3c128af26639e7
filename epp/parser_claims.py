"""Which of the pre-tokenized and Vertex AI parsers claims a path, and which one read a request.

llm-d-router resolves a request's parser by the ending of its path (``pkg/epp/handlers/
parsers.go``, ``ParserRegistry.Resolve``): every configured parser claims some endings, the
longest claimed ending wins.  The endings of ``vllmhttp-parser`` (``inference/v1/generate``),
``sglanghttp-parser`` (``generate``) and ``vertexai-parser`` (three ``PredictionService``
methods) overlap only among themselves, never with the OpenAI or Anthropic parsers', so they
are resolved here first and `epp.requests` goes on as before for every other path.

Once read, a request is known to be theirs by its path alone (`native_parser`): each of them
reads only the paths it claims, and a path another parser read is never one of them.
"""

from __future__ import annotations

from typing import Final

from epp import generate_requests, vertex_ai
from epp.generate_requests import (
    SGLANG_GENERATE,
    SGLANG_HTTP_PARSER,
    VLLM_GENERATE,
    VLLM_HTTP_PARSER,
    SGLangUsage,
)
from epp.vertex_ai import VERTEX_AI_PARSER, VertexUsage
from scorers.base import LLMRequest

# Path endings → the parser claiming them (llm-d-router's ``Claims().Paths``).
CLAIMS: Final = (
    (VLLM_GENERATE, VLLM_HTTP_PARSER),
    (SGLANG_GENERATE, SGLANG_HTTP_PARSER),
    *((method, VERTEX_AI_PARSER) for method in vertex_ai.METHODS),
)


def claimed_by(path: str, parsers: frozenset[str]) -> str | None:
    """The configured parser among `CLAIMS` whose ending ``path`` has, the longest winning, as
    llm-d-router's ``MatchPathSuffix`` matches (query, surrounding spaces and one trailing slash
    ignored; no segment boundary: ``/regenerate`` ends in ``generate``)."""
    route = path.split("?", 1)[0].strip().removesuffix("/")
    found = [(len(end), p) for end, p in CLAIMS if p in parsers and route.endswith(end)]
    return max(found)[1] if found else None


def native_parser(request: LLMRequest) -> str | None:
    """The pre-tokenized or Vertex AI parser that read ``request``, or None."""
    if request.kind == "other":
        return None
    if generate_requests.is_vllm_generate(request.path):
        return VLLM_HTTP_PARSER
    if generate_requests.is_sglang_generate(request.path):
        return SGLANG_HTTP_PARSER
    if vertex_ai.vertex_method(request.path) is not None:
        return VERTEX_AI_PARSER
    return None


def response_usage_reader(
    request: LLMRequest, content_type: str, limit: int
) -> SGLangUsage | VertexUsage | None:
    """The reader of a response's token counts when its parser reads them its own way
    (SGLang's ``meta_info``, Vertex AI's gRPC-wrapped JSON); None: OpenAI's ``usage``, which
    vLLM's generate responses carry too."""
    parser = native_parser(request)
    if parser == SGLANG_HTTP_PARSER:
        return SGLangUsage(streaming="text/event-stream" in content_type.lower(), limit=limit)
    if parser == VERTEX_AI_PARSER:
        return VertexUsage(limit=limit)
    return None
