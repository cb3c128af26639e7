"""TLS of the ext_proc port: self-signed by default, a given tls.crt/tls.key, reload on change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.cli import build_parser
from epp.envoy_bootstrap import render_envoy_config, validate_config
from epp.health import HealthService, add_health_service
from epp.server import EndpointPicker, ServerOptions
from epp.tls import (
    CERT_FILE,
    KEY_FILE,
    KeyPair,
    ReloadingCertificate,
    TLSConfigError,
    load_key_pair,
    self_signed,
    server_credentials,
)


def _write(directory: Path, pair: KeyPair) -> None:
    # Key first, then certificate: the reloader must not serve the half-written state.
    (directory / KEY_FILE).write_bytes(pair.private_key)
    (directory / CERT_FILE).write_bytes(pair.certificate_chain)


async def _serve(credentials: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    add_health_service(server, HealthService(lambda: True))
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


async def _check(port: int, trusted: bytes) -> bool:
    """One fresh TLS connection that trusts only ``trusted``; True if the handshake worked."""
    options = [
        ("grpc.ssl_target_name_override", "localhost"),
        ("grpc.use_local_subchannel_pool", 1),
    ]
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{port}", grpc.ssl_channel_credentials(trusted), options=options
    )
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False
    finally:
        await channel.close()


@pytest.fixture
async def stopper() -> AsyncIterator[list[grpc.aio.Server]]:
    servers: list[grpc.aio.Server] = []
    yield servers
    for server in servers:
        await server.stop(None)


def test_self_signed_certificate_is_a_matching_pair(tmp_path: Path) -> None:
    pair = self_signed(["10.1.2.3", "epp.example"])
    _write(tmp_path, pair)
    assert load_key_pair(tmp_path) == pair
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pair.certificate_chain)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "epp.example" in names.get_values_for_type(x509.DNSName)
    assert "localhost" in names.get_values_for_type(x509.DNSName)


def test_bad_certificate_directories_are_explained(tmp_path: Path) -> None:
    with pytest.raises(TLSConfigError, match=r"tls\.crt and tls\.key"):
        load_key_pair(tmp_path)
    (tmp_path / CERT_FILE).write_text("not a certificate")
    (tmp_path / KEY_FILE).write_bytes(self_signed().private_key)
    with pytest.raises(TLSConfigError, match="not a PEM certificate"):
        load_key_pair(tmp_path)
    (tmp_path / CERT_FILE).write_bytes(self_signed().certificate_chain)  # another key's cert
    with pytest.raises(TLSConfigError, match="not the private key"):
        load_key_pair(tmp_path)
    with pytest.raises(TLSConfigError, match="needs --cert-path"):
        server_credentials(reload=True)


async def test_self_signed_serving(stopper: list[grpc.aio.Server]) -> None:
    server, port = await _serve(server_credentials())
    stopper.append(server)
    assert not await _check(port, self_signed().certificate_chain)  # it is not that one


async def test_given_certificate_is_served(tmp_path: Path, stopper: list[grpc.aio.Server]) -> None:
    pair = self_signed()
    _write(tmp_path, pair)
    server, port = await _serve(server_credentials(cert_path=tmp_path))
    stopper.append(server)
    assert await _check(port, pair.certificate_chain)


async def test_a_changed_certificate_is_served_from_the_next_connection(
    tmp_path: Path, stopper: list[grpc.aio.Server]
) -> None:
    old, new = self_signed(), self_signed()
    _write(tmp_path, old)
    server, port = await _serve(server_credentials(cert_path=tmp_path, reload=True))
    stopper.append(server)
    assert await _check(port, old.certificate_chain)
    _write(tmp_path, new)
    assert await _check(port, new.certificate_chain)
    assert not await _check(port, old.certificate_chain)


def test_a_half_written_pair_keeps_the_previous_certificate(tmp_path: Path) -> None:
    old, new = self_signed(), self_signed()
    _write(tmp_path, old)
    fetcher = ReloadingCertificate(tmp_path)
    assert fetcher() is None  # unchanged
    (tmp_path / KEY_FILE).write_bytes(new.private_key)  # the certificate is still the old one
    assert fetcher() is None
    (tmp_path / CERT_FILE).write_bytes(new.certificate_chain)
    assert fetcher() is not None
    assert fetcher.reloads == 1


def test_flags_parse_like_the_inference_extension() -> None:
    parse = build_parser().parse_args
    assert parse(["serve"]).secure_serving is False
    assert parse(["serve", "--secure-serving"]).secure_serving is True
    assert parse(["serve", "--secure-serving=false"]).secure_serving is False
    args = parse(["serve", "--secure-serving", "--cert-path", "/c", "--enable-cert-reload"])
    assert (args.secure_serving, args.cert_path, args.enable_cert_reload) == (True, "/c", True)
    with pytest.raises(ValueError, match="--secure-serving"):
        EndpointPicker(ServerOptions(endpoints="127.0.0.1:8000", cert_path="/c"))


def test_envoy_config_with_tls_replicas_and_health_checks_is_valid(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_bytes(self_signed().certificate_chain)
    config = render_envoy_config(
        listen_port=10000,
        extproc_port=9002,
        admin_port=10001,
        extproc_tls=True,
        extproc_ca_file=str(ca),
        extproc_sni="localhost",
        extproc_endpoints=[("127.0.0.1", 9002), ("127.0.0.1", 9012)],
        extproc_health_check_interval_s=0.5,
    )
    assert "UpstreamTlsContext" in config
    assert config.count("port_value: 90") == 2
    result = validate_config(config, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
