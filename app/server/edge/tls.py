"""HTTPS for `diffcast serve --https`: browsers give the camera only to secure origins, so a phone or a
second laptop on the LAN needs the page over TLS.

Without ``--ssl-certfile/--ssl-keyfile`` the server makes a self-signed certificate on first run and
keeps it in a per-user directory (``$XDG_CONFIG_HOME/diffcast/tls``, else ``~/.config/diffcast/tls``),
so a browser that was told to trust it once keeps trusting it. Its subjectAltName names localhost and
every address of this machine's interfaces, so ``https://<LAN IP>:8080`` matches it; when the machine
has gained an address since, a new certificate is made (and its new fingerprint printed).
WebRTC media needs nothing of this: it is always encrypted (DTLS-SRTP) by aiortc and the browser.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import ssl
from dataclasses import dataclass, replace
from pathlib import Path

from app.server.config import ServerConfig

log = logging.getLogger(__name__)

CERT_NAME = "cert.pem"
KEY_NAME = "key.pem"
VALID_DAYS = 825  # the longest validity Apple platforms accept for a TLS server certificate
# Made anew this long before it expires, so a running server never outlives its certificate soon after start.
RENEW_BEFORE = datetime.timedelta(days=30)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class CertificateError(ValueError):
    """A certificate or key that cannot be used; the text says which file and why."""


@dataclass(frozen=True)
class Certificate:
    certfile: Path
    keyfile: Path
    fingerprint: str  # SHA-256 of the DER certificate, colon-separated hex (what browsers show)
    self_signed: bool


def tls_dir() -> Path:
    """Where the self-signed certificate is kept (docs/service.md)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "diffcast" / "tls"


def lan_addresses() -> list[IPAddress]:
    """Every address of this machine's interfaces (loopback included), IPv6 link-local left out:
    those need a zone id, which no URL a phone types carries."""
    import ifaddr

    found: list[IPAddress] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            text = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            try:
                address = ipaddress.ip_address(text)
            except ValueError:
                continue
            if address.is_link_local or address in found:
                continue
            found.append(address)
    return found


def load_pair(certfile: str | Path, keyfile: str | Path) -> Certificate:
    """Check that ``certfile`` and ``keyfile`` are readable PEM files that belong together;
    :class:`CertificateError` in plain words when they are not."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise CertificateError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
    try:
        cert = x509.load_pem_x509_certificate(Path(certfile).read_bytes())
    except ValueError:
        raise CertificateError(f"--ssl-certfile {certfile} is not a PEM certificate") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(str(certfile), str(keyfile))
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise CertificateError(
                f"--ssl-keyfile {keyfile} is not the private key of the certificate in {certfile}"
            ) from None
        raise CertificateError(
            f"--ssl-keyfile {keyfile} is not a usable PEM private key (an encrypted key is not supported): "
            f"{exc.reason or exc}"
        ) from None
    digest = cert.fingerprint(hashes.SHA256()).hex().upper()
    return Certificate(Path(certfile), Path(keyfile), ":".join(digest[i:i + 2] for i in range(0, len(digest), 2)),
                       self_signed=cert.issuer == cert.subject)


def _covers(certfile: Path, addresses: list[IPAddress]) -> bool:
    """The kept certificate is still valid for a while and names every current address."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(certfile.read_bytes())
    if cert.not_valid_after_utc - RENEW_BEFORE < datetime.datetime.now(datetime.UTC):
        return False
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    return set(addresses) <= set(names.get_values_for_type(x509.IPAddress))


def make_self_signed(directory: Path, addresses: list[IPAddress]) -> None:
    """A new EC P-256 key and a self-signed certificate for localhost and ``addresses``, written to
    ``directory`` (the key readable by its owner only)."""
    import socket

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    host = socket.gethostname()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"diffcast on {host}"[:64])])
    dns = [x509.DNSName(n) for n in dict.fromkeys(["localhost", host]) if n]
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName([*dns, *(x509.IPAddress(a) for a in addresses)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_path = directory / KEY_NAME
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    (directory / CERT_NAME).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def self_signed(directory: Path | None = None) -> Certificate:
    """The kept self-signed certificate in ``directory`` (default :func:`tls_dir`), made first when
    there is none, it expires soon, or it does not name every current address of this machine."""
    directory = tls_dir() if directory is None else directory
    addresses = lan_addresses()
    certfile, keyfile = directory / CERT_NAME, directory / KEY_NAME
    try:
        reuse = certfile.is_file() and keyfile.is_file() and _covers(certfile, addresses)
    except ValueError:
        reuse = False  # an unreadable or foreign file there: replaced
    if not reuse:
        log.info("making a self-signed TLS certificate for %s in %s",
                 ", ".join(["localhost", *map(str, addresses)]), directory)
        try:
            make_self_signed(directory, addresses)
        except OSError as exc:
            raise CertificateError(f"cannot write the self-signed certificate to {directory}: {exc.strerror or exc}") \
                from None
    return load_pair(certfile, keyfile)


def with_certificate(config: ServerConfig) -> ServerConfig:
    """``config`` with the certificate it serves: the given pair checked, or the kept self-signed one
    (made when needed) for ``--https`` alone; its fingerprint logged so a phone's user can compare it
    with what the browser shows. Unchanged without HTTPS. Raises :class:`CertificateError`."""
    if not config.https:
        return config
    if config.ssl_certfile is not None and config.ssl_keyfile is not None:
        cert = load_pair(config.ssl_certfile, config.ssl_keyfile)
    else:
        cert = self_signed()
    kind = "self-signed certificate" if cert.self_signed else "certificate"
    log.info("TLS %s %s, SHA-256 fingerprint %s", kind, cert.certfile, cert.fingerprint)
    return replace(config, https=True, ssl_certfile=str(cert.certfile), ssl_keyfile=str(cert.keyfile))


def page_urls(config: ServerConfig) -> list[str]:
    """The page's URLs: one per address of this machine when the server listens on all of them."""
    scheme = "https" if config.https else "http"
    hosts = [config.host]
    if config.host in ("0.0.0.0", "::", ""):
        hosts = [str(a) for a in lan_addresses() if a.version == 4 or config.host == "::"]
    return [f"{scheme}://{f'[{h}]' if ':' in h else h}:{config.port}/" for h in hosts]
