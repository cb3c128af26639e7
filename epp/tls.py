"""TLS for the ext_proc server (``--secure-serving``, ``--cert-path``, ``--enable-cert-reload``).

As the Inference Extension's EPP: with secure serving on and no ``--cert-path``, the server
makes a self-signed certificate in memory at start-up (proxies that talk to an EPP accept any
certificate: Envoy's ``UpstreamTlsContext`` with an empty validation context); with
``--cert-path DIR`` it serves ``DIR/tls.crt`` (the chain, leaf first) and ``DIR/tls.key``, the
names of a Kubernetes ``kubernetes.io/tls`` Secret mounted as a volume.

Reload (``--enable-cert-reload``): gRPC asks `ReloadingCertificate` for the certificate at each
new TLS handshake; it compares the two files' stat (inode, size, mtime) with what it loaded, and
when they changed and hold a matching certificate and key, returns them.  A Secret update (the
kubelet swaps a symlink) or a cert-manager renewal is thus served from the next connection on;
connections already open keep the certificate they negotiated.  A half-written pair (a new
certificate with the old key) is not served: the previous pair stays until both files agree.

The gRPC health port (``--grpc-health-port``) stays plaintext: kubelet's gRPC probes cannot
speak TLS.  The health service registered on the ext_proc port (for Envoy's health checks) is
served with TLS like the rest of that port.

Not thread-safe by accident: gRPC calls the fetcher from its own threads, so it takes a lock.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

log = logging.getLogger(__name__)

CERT_FILE: Final = "tls.crt"
KEY_FILE: Final = "tls.key"
SELF_SIGNED_DAYS: Final = 3650  # the Inference Extension's self-signed certificate lasts 10 years


class TLSConfigError(ValueError):
    """Certificate files that cannot be served: missing, unreadable, or not a matching pair."""


@dataclass(slots=True, frozen=True)
class KeyPair:
    """A PEM certificate chain and its PEM private key."""

    certificate_chain: bytes
    private_key: bytes


def self_signed(hosts: Sequence[str] = (), *, days: int = SELF_SIGNED_DAYS) -> KeyPair:
    """A self-signed certificate (ECDSA P-256) for ``hosts`` (DNS names or IPs), plus
    ``localhost``, ``127.0.0.1``, ``::1`` and this machine's hostname."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = dict.fromkeys([*hosts, "localhost", "127.0.0.1", "::1", socket.gethostname()])
    alt_names: list[x509.GeneralName] = []
    for name in names:
        if not name:
            continue
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alt_names.append(x509.DNSName(name))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kv-epp")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(
        certificate_chain=certificate.public_bytes(serialization.Encoding.PEM),
        private_key=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )


def load_key_pair(directory: Path) -> KeyPair:
    """``directory/tls.crt`` and ``directory/tls.key``, checked to be a matching pair."""
    cert_path, key_path = directory / CERT_FILE, directory / KEY_FILE
    try:
        chain = cert_path.read_bytes()
        key_pem = key_path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(
            f"cannot read {exc.filename}: {exc.strerror}; --cert-path must be a directory "
            f"holding {CERT_FILE} and {KEY_FILE} (a kubernetes.io/tls Secret mounted as a volume)"
        ) from None
    try:
        leaf = x509.load_pem_x509_certificate(chain)
    except ValueError as exc:
        raise TLSConfigError(f"{cert_path} is not a PEM certificate: {exc}") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSConfigError(f"{key_path} is not an unencrypted PEM private key: {exc}") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.PEM
    if leaf.public_key().public_bytes(encoding, public) != key.public_key().public_bytes(
        encoding, public
    ):
        raise TLSConfigError(
            f"{key_path} is not the private key of the first certificate in {cert_path}"
        )
    return KeyPair(certificate_chain=chain, private_key=key_pem)


def _fingerprint(directory: Path) -> tuple[tuple[int, int, int], ...]:
    """What changes when either file is replaced: (inode, size, mtime) of each, symlinks
    followed (a mounted Secret's files are symlinks into a directory the kubelet swaps)."""
    out = []
    for name in (CERT_FILE, KEY_FILE):
        st = os.stat(directory / name)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _configuration(pair: KeyPair) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pair.private_key, pair.certificate_chain)])


class ReloadingCertificate:
    """gRPC's certificate-configuration fetcher over a ``tls.crt`` / ``tls.key`` directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._loaded = _fingerprint(directory)
        self.initial = load_key_pair(directory)
        self.reloads = 0  # for tests and logs

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """None keeps the current certificate (gRPC's contract for "unchanged")."""
        with self._lock:
            try:
                seen = _fingerprint(self.directory)
            except OSError:
                return None  # mid-swap: try again at the next handshake
            if seen == self._loaded:
                return None
            try:
                pair = load_key_pair(self.directory)
            except TLSConfigError as exc:
                log.warning("TLS certificate changed but cannot be served yet: %s", exc)
                return None
            self._loaded = seen
            self.reloads += 1
        log.info("TLS certificate reloaded from %s", self.directory)
        return _configuration(pair)


def server_credentials(
    *,
    cert_path: str | Path | None = None,
    reload: bool = False,
    hosts: Sequence[str] = (),
) -> grpc.ServerCredentials:
    """Credentials for the ext_proc port: from ``cert_path`` (reloaded on change when
    ``reload``), else a fresh self-signed certificate for ``hosts``."""
    if cert_path is None:
        if reload:
            raise TLSConfigError(
                "--enable-cert-reload needs --cert-path (a self-signed "
                "certificate made at start-up has no files to watch)"
            )
        pair = self_signed(hosts)
        log.info("ext_proc TLS: serving a self-signed certificate made at start-up")
        return grpc.ssl_server_credentials([(pair.private_key, pair.certificate_chain)])
    directory = Path(cert_path)
    if not reload:
        pair = load_key_pair(directory)
        return grpc.ssl_server_credentials([(pair.private_key, pair.certificate_chain)])
    fetcher = ReloadingCertificate(directory)
    # gRPC documents None from the fetcher as "unchanged"; types-grpcio's stub omits it.
    return grpc.dynamic_ssl_server_credentials(
        _configuration(fetcher.initial),
        fetcher,  # type: ignore[arg-type]
    )
