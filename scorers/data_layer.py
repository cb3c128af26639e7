"""llm-d-router's data-layer, request-parsing and tokenization plugin types whose work this EPP
does built in: declaring them is accepted, and their parameters must describe what the
built-in work does (anything else is an error naming the key), so a configuration that loads
means what it says.

* ``metrics-data-source`` + ``core-metrics-extractor``: each pod's ``/metrics`` scraped over
  HTTP for vLLM's gauges (`epp.scraping`; the period is ``--refresh-metrics-interval``).
* ``endpoint-notification-source``: endpoints coming and going, told to the plugins that keep
  per-endpoint state (the KV-cache views subscribe to each pod's events).
* ``openai-parser``, ``anthropic-parser``, ``passthrough-parser``, ``vllmgrpc-parser``,
  ``vllmhttp-parser``, ``sglanghttp-parser``, ``vertexai-parser``: request parsing
  (`epp.requests`, `epp.vllm_grpc`, `epp.generate_requests`, `epp.vertex_ai`), chosen by
  ``requestHandler.parsers`` (`epp.config_sections`).  All Beta in llm-d-router: no
  ``--allow-experimental-plugins`` needed.
* ``inflight-load-producer`` (`scorers.inflight_load`, which also offers its output estimate):
  the requests (and prompt tokens) each endpoint has in flight, which the EPP counts as it routes
  and as responses end (`epp.datastore`).
* ``token-producer``: the tokenizer of the precise prefix plugins that name none
  (``modelName``); prompts are tokenized in this process with the model's tokenizer and chat
  template, as vLLM renders them, where llm-d-router asks vLLM's ``/render`` endpoint
  (``vllm.url``) for the same token ids.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scorers.base import NoParameters, Plugin, register


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MetricsDataSourceParameters(_Strict):
    scheme: Literal["http"] = "http"
    path: Literal["/metrics"] = "/metrics"
    insecureSkipVerify: bool = True  # only meaningful for https, which is not offered
    interval: str = ""

    @field_validator("interval")
    @classmethod
    def _tick(cls, value: str) -> str:
        if value:
            raise ValueError("the scrape period is --refresh-metrics-interval; remove interval")
        return value


@register("metrics-data-source")
class MetricsDataSource(Plugin[MetricsDataSourceParameters]):
    """Scraping each endpoint's ``http://<pod>/metrics`` (built in; see the module docstring)."""


class CoreMetricsExtractorParameters(_Strict):
    engineLabelKey: str = "llm-d.ai/engine-type"
    defaultEngine: Literal["vllm"] = "vllm"
    engineConfigs: list[Any] = Field(default_factory=list)

    @field_validator("engineConfigs")
    @classmethod
    def _vllm_only(cls, value: list[Any]) -> list[Any]:
        if value:
            raise ValueError("only vLLM's metrics are read here; custom engines are not offered")
        return value


@register("core-metrics-extractor")
class CoreMetricsExtractor(Plugin[CoreMetricsExtractorParameters]):
    """vLLM's queue, running, KV-usage, LoRA and cache-config gauges (built in)."""


@register("endpoint-notification-source")
class EndpointNotificationSource(Plugin[NoParameters]):
    """Endpoints coming and going, told to the plugins that listen (built in)."""


@register("openai-parser")
class OpenAIParser(Plugin[NoParameters]):
    """OpenAI completions, chat completions, responses, embeddings and conversations."""


@register("anthropic-parser")
class AnthropicParser(Plugin[NoParameters]):
    """Anthropic Messages (``/v1/messages``)."""


@register("passthrough-parser")
class PassthroughParser(Plugin[NoParameters]):
    """Every path no other parser claims: forwarded unparsed, routed by load."""


@register("vllmgrpc-parser")
class VllmGrpcParser(Plugin[NoParameters]):
    """vLLM's gRPC API (``vllm.grpc.engine.VllmEngine`` Generate and Embed), byte for byte."""


@register("vllmhttp-parser")
class VllmHttpParser(Plugin[NoParameters]):
    """vLLM's pre-tokenized ``/inference/v1/generate`` (only that path: configure
    ``openai-parser`` beside it for the OpenAI API)."""


@register("sglanghttp-parser")
class SGLangHttpParser(Plugin[NoParameters]):
    """SGLang's pre-tokenized ``/generate``."""


@register("vertexai-parser")
class VertexAIParser(Plugin[NoParameters]):
    """Vertex AI's gRPC ``PredictionService`` ChatCompletions, RawPredict, StreamRawPredict."""


class VllmTokenizer(_Strict):
    url: str = "http://localhost:8000"
    timeout: str = "5s"
    mmTimeout: str = "30s"


class TokenProducerParameters(_Strict):
    modelName: str | None = None
    vllm: VllmTokenizer | None = None
    estimate: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_backend(self) -> TokenProducerParameters:
        if self.vllm is not None and self.estimate is not None:
            raise ValueError("set vllm or estimate, not both")
        if self.vllm is not None and not self.modelName:
            raise ValueError("vllm tokenization needs modelName")
        return self


@register("token-producer")
class TokenProducer(Plugin[TokenProducerParameters]):
    """Names the tokenizer (``modelName``) of the precise prefix plugins that name none; the
    configuration loader hands it to them (see the module docstring)."""
