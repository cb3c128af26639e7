"""models-data-source and models-data-extractor: upstream's cases (source/models/
datasource_test.go, extractor/models/extractor_test.go), the answer decoded as its Go structs
decode it, and a real HTTP(S) model server's /v1/models read by `epp.models_scraping`."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from epp.cli import main
from epp.config import ConfigError, build_scheduler, load_config
from epp.datastore import Datastore, EndpointSpec
from epp.models_scraping import ModelsScraper, ModelsWiring, metrics_host, models_wirings
from epp.tls import self_signed
from scorers.base import NoEndpoints, PluginConfigError, PluginContext
from scorers.models_data import (
    MODELS_ATTRIBUTE_KEY,
    ModelData,
    ModelsDataExtractor,
    ModelsDataSource,
    ModelsExtractError,
    parse_models,
)
from tests.scorers.plugin_helpers import endpoint, make
from tests.support.servers import running

VLLM_ANSWER = {
    "object": "list",
    "data": [
        {
            "id": "food-review",
            "object": "model",
            "created": 1755000000,
            "owned_by": "vllm",
            "root": "/models/food-review",
            "parent": None,
            "max_model_len": 4096,
            "permission": [{"id": "modelperm-1"}],
        },
        {"id": "lora1", "object": "model", "owned_by": "vllm", "parent": "food-review"},
    ],
}


# ---------------------------------------------------------------------------------------------
# Decoding the answer


def test_a_vllm_answer() -> None:
    assert parse_models(json.dumps(VLLM_ANSWER)) == (
        ModelData("food-review", "model", 1755000000, "vllm", ""),
        ModelData("lora1", "model", 0, "vllm", "food-review"),
    )


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("{}", ()),
        ("null", ()),
        ('{"object": "list", "data": null}', ()),
        (
            '{"data": [null, {"ID": "m", "Owned_By": "x"}]}',
            (ModelData(), ModelData("m", owned_by="x")),
        ),
        ('{"data": [{"id": "a", "id": "b"}]}', (ModelData("b"),)),  # the last wins, as in Go
    ],
)
def test_what_go_decodes(body: str, expected: tuple[ModelData, ...]) -> None:
    assert parse_models(body) == expected


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("not json", "not JSON"),
        ("[]", "the answer: expected an object, got list"),
        ('{"object": 1}', "object: expected a string"),
        ('{"data": {}}', "data: expected a list, got dict"),
        ('{"data": ["m"]}', r"data\[0\]: expected an object"),
        ('{"data": [{"id": 7}]}', r"data\[0\]\.id: expected a string"),
        ('{"data": [{"id": "m", "created": 1.5}]}', r"data\[0\]\.created: expected an integer"),
        ('{"data": [{"id": "m", "created": 1e3}]}', "expected an integer"),
        ('{"data": [{"id": "m", "created": true}]}', "expected an integer"),
        ('{"data": [{"id": "m", "created": 99999999999999999999}]}', "overflows an int64"),
    ],
)
def test_what_go_refuses(body: str, message: str) -> None:
    with pytest.raises(ModelsExtractError, match=message):
        parse_models(body)


# ---------------------------------------------------------------------------------------------
# The plugins


def test_source_defaults_and_urls() -> None:
    source = make("models-data-source")
    assert (source.p.scheme, source.path, source.p.insecureSkipVerify) == (
        "http",
        "/v1/models",
        True,
    )
    assert source.ssl_context is None and source.experimental is False  # Beta
    assert source.url("10.0.0.1:8000") == "http://10.0.0.1:8000/v1/models"
    bare = make("models-data-source", {"scheme": "https", "path": "models"})
    assert bare.url("[fd00::1]:8000") == "https://[fd00::1]:8000/models"
    assert bare.ssl_context is not None and bare.ssl_context.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    ("interval", "tick", "period"),
    [("", 0.05, 0.05), ("5s", 0.05, 5.0), ("70ms", 0.05, 0.05), ("1s", 0.3, 0.9)],
)
def test_the_interval_is_rounded_to_whole_ticks(interval: str, tick: float, period: float) -> None:
    assert make("models-data-source", {"interval": interval}).period(tick) == pytest.approx(period)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"scheme": "ftp"}, r"parameters\.scheme"),
        ({"interval": "soon"}, r"parameters\.interval"),
        ({"insecureSkipVerify": "false"}, r"parameters\.insecureSkipVerify"),
        ({"scheme": "https", "clientCertPath": "/c.pem"}, "set both or neither"),
        (
            {"scheme": "https", "clientCertPath": "/nope/c.pem", "clientKeyPath": "/nope/k.pem"},
            r"parameters\.clientCertPath: cannot load the client certificate '/nope/c.pem'",
        ),
        (
            {"scheme": "https", "insecureSkipVerify": False, "caCertPath": "/nope/ca.pem"},
            r"parameters\.caCertPath: cannot read CA certificates from '/nope/ca.pem'",
        ),
        ({"port": 9400}, r"parameters\.port"),
    ],
)
def test_bad_source_parameters(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message):
        make("models-data-source", parameters)


def test_tls_files_are_ignored_over_http_as_upstream() -> None:
    assert make("models-data-source", {"caCertPath": "/nope", "insecureSkipVerify": False})


def test_the_extractor_keeps_each_endpoints_last_good_list() -> None:
    reader = make("models-data-extractor", name="mine")
    assert reader.attribute_key == MODELS_ATTRIBUTE_KEY == "/v1/models/models-data-extractor"
    a = endpoint("10.0.0.1:8000")
    assert reader.served_models(a) is None
    assert reader.extract(a, json.dumps(VLLM_ANSWER))[1].parent == "food-review"
    with pytest.raises(ModelsExtractError):
        reader.extract(a, b"{oops")
    assert [m.id for m in reader.served_models(a.address)] == ["food-review", "lora1"]
    assert reader.extract(a, "{}") == () and reader.served_models(a) == ()
    reader.endpoint_removed(a)
    assert reader.served_models(a) is None
    with pytest.raises(PluginConfigError, match=r"parameters\.x"):
        make("models-data-extractor", {"x": 1})


def test_metrics_host() -> None:
    assert metrics_host("http://10.0.0.1:9090/metrics", "10.0.0.1:8000") == "10.0.0.1:9090"
    assert metrics_host("", "10.0.0.1:8000") == "10.0.0.1:8000"


# ---------------------------------------------------------------------------------------------
# In a configuration

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: models-data-source
  name: vllm-models-source
  parameters:
    scheme: "http"
    interval: "5s"
- type: models-data-extractor
  name: vllm-models-extractor
- type: queue-scorer
dataLayer:
  sources:
  - pluginRef: vllm-models-source
    extractors:
    - pluginRef: vllm-models-extractor
"""


def test_upstreams_example_loads_without_the_experimental_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(CONFIG)
    assert main(["check-config", str(path)]) == 0
    assert ": OK (" in capsys.readouterr().out


def test_the_source_feeds_only_the_models_extractor() -> None:
    wrong = CONFIG.replace("type: models-data-extractor", "type: core-metrics-extractor")
    with pytest.raises(
        ConfigError, match="does not read models-data-source; it reads: models-data-extractor"
    ):
        load_config(text=wrong)


def test_the_server_wires_the_source_to_its_extractor() -> None:
    from epp.server import EndpointPicker, ServerOptions

    picker = EndpointPicker(ServerOptions(endpoints="127.0.0.1:8000", config_text=CONFIG))
    try:
        (wiring,) = picker.models_scraper.wirings
        assert wiring.source.name == "vllm-models-source"
        assert [e.name for e in wiring.extractors] == ["vllm-models-extractor"]
        assert picker.models_scraper.periods == [pytest.approx(5.0)]
    finally:
        picker.executor.shutdown(wait=False)


def test_without_a_models_source_nothing_is_wired() -> None:
    text = CONFIG[: CONFIG.index("dataLayer:")]
    config = load_config(text=text)
    scheduler = build_scheduler(config, PluginContext(endpoints=NoEndpoints()))
    assert models_wirings(config, scheduler.plugin) == []


# ---------------------------------------------------------------------------------------------
# Reading a model server


class FakeModelServer:
    """Answers ``GET /v1/models`` with ``answer`` (``status`` when not 200), over TLS when
    given a context."""

    def __init__(self, answer: Any, tls: ssl.SSLContext | None = None) -> None:
        self.answer = answer
        self.status = 200
        self.hits = 0
        self.port = 0
        self.tls = tls
        self._runner: web.AppRunner | None = None

    async def _models(self, _: web.Request) -> web.Response:
        self.hits += 1
        if self.status != 200:
            return web.Response(status=self.status, text="unavailable")
        body = self.answer if isinstance(self.answer, str) else json.dumps(self.answer)
        return web.Response(text=body, content_type="application/json")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def scraper_for(
    datastore: Datastore, **parameters: Any
) -> tuple[ModelsScraper, ModelsDataExtractor]:
    source: ModelsDataSource = make("models-data-source", parameters)
    reader: ModelsDataExtractor = make("models-data-extractor")
    scraper = ModelsScraper(datastore, [ModelsWiring(source, (reader,))], tick=0.02, timeout=0.5)
    return scraper, reader


def models_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("models-scraper ")]


async def test_the_models_are_read_and_an_outage_keeps_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(FakeModelServer(VLLM_ANSWER)) as server:
        datastore = Datastore()
        address = f"127.0.0.1:{server.port}"
        datastore.upsert(EndpointSpec(address=address, name="vllm-a"))
        scraper, reader = scraper_for(datastore)
        async with running(scraper):
            await eventually(lambda: reader.served_models(address) is not None)
            assert [m.id for m in reader.served_models(address) or ()] == ["food-review", "lora1"]
            server.status = 503
            await eventually(lambda: (0, address) in scraper.failing)
            assert scraper.failing[(0, address)].endswith("HTTP 503")
            assert reader.served_models(address)  # the last list stays
            server.status, server.answer = 200, "[1, 2]"
            await eventually(lambda: "expected an object" in scraper.failing.get((0, address), ""))
            server.answer = {"data": [{"id": "new-model"}]}
            await eventually(
                lambda: [m.id for m in reader.served_models(address) or ()] == ["new-model"]
            )
            assert scraper.failing == {}
            datastore.remove(address)
            await eventually(lambda: models_tasks() == [])
        hits = server.hits
        await asyncio.sleep(0.1)
        assert server.hits == hits  # nothing polls after stop
    assert any("serves new-model" in r.getMessage() for r in caplog.records)


async def test_the_metrics_host_is_the_one_read() -> None:
    async with running(FakeModelServer(VLLM_ANSWER)) as server:
        datastore = Datastore()
        # The model server's own port is not served; its metrics host is.
        metrics_url = f"http://127.0.0.1:{server.port}/metrics"
        datastore.upsert(EndpointSpec(address="127.0.0.1:1", metrics_url=metrics_url))
        scraper, reader = scraper_for(datastore)
        async with running(scraper):
            await eventually(lambda: reader.served_models("127.0.0.1:1") is not None)


async def test_https_verified_against_the_configured_ca(tmp_path: Path) -> None:
    pair = self_signed(["127.0.0.1"])
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pair.certificate_chain)
    key.write_bytes(pair.private_key)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with running(FakeModelServer(VLLM_ANSWER, tls)) as server:
        datastore = Datastore()
        address = f"127.0.0.1:{server.port}"
        datastore.upsert(EndpointSpec(address=address))
        verified, reader = scraper_for(
            datastore, scheme="https", insecureSkipVerify=False, caCertPath=str(cert)
        )
        async with running(verified):
            await eventually(lambda: reader.served_models(address) is not None)
        untrusting, other = scraper_for(datastore, scheme="https", insecureSkipVerify=False)
        async with running(untrusting):
            await eventually(
                lambda: "CERTIFICATE_VERIFY_FAILED" in untrusting.failing.get((0, address), "")
            )
        assert other.served_models(address) is None
