"""`diffcast serve --https`: the kept self-signed certificate, given certificates checked in plain
words, and the real command serving TLS that verifies against the certificate it printed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from cryptography import x509

from app.cli import build_parser
from app.server.edge.tls import CertificateError, lan_addresses, load_pair, self_signed

ROOT = Path(__file__).resolve().parents[1]


def der_sha256(certfile: Path) -> str:
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(certfile.read_text())).hexdigest().upper()
    return ":".join(re.findall("..", digest))


def test_self_signed_is_made_once_names_the_machine_and_is_kept(tmp_path: Path) -> None:
    psutil = pytest.importorskip("psutil")
    first = self_signed(tmp_path / "tls")
    assert first.self_signed and first.fingerprint == der_sha256(first.certfile)
    assert first.keyfile.stat().st_mode & 0o077 == 0  # the key is its owner's alone
    names = x509.load_pem_x509_certificate(first.certfile.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    # Every IPv4 address of the machine's interfaces, as psutil (not ifaddr) sees them.
    ipv4 = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    assert ipv4 and ipv4 <= {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    again = self_signed(tmp_path / "tls")
    assert again.fingerprint == first.fingerprint  # reused: a browser that trusted it keeps trusting it
    assert set(lan_addresses()) <= set(names.get_values_for_type(x509.IPAddress))


def test_unusable_certificates_are_refused_in_plain_words(tmp_path: Path) -> None:
    a, b = self_signed(tmp_path / "a"), self_signed(tmp_path / "b")
    with pytest.raises(CertificateError, match=f"--ssl-keyfile {b.keyfile} is not the private key of the certificate"):
        load_pair(a.certfile, b.keyfile)
    with pytest.raises(CertificateError, match=f"cannot read --ssl-certfile {tmp_path}/none.pem: No such file"):
        load_pair(tmp_path / "none.pem", a.keyfile)
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(CertificateError, match="is not a PEM certificate"):
        load_pair(tmp_path / "junk.pem", a.keyfile)
    with pytest.raises(CertificateError, match="is not a usable PEM private key"):
        load_pair(a.certfile, a.certfile)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--ssl-certfile", "c.pem"], "--ssl-certfile and --ssl-keyfile go together"),
     (["--ssl-certfile", "/nonexistent/c.pem", "--ssl-keyfile", "/nonexistent/k.pem"],
      "cannot read --ssl-certfile /nonexistent/c.pem"),
     (["--osc-port", "70000"], "--osc-port must be a UDP port")],
)
def test_serve_refuses_bad_tls_and_osc_flags(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(SystemExit, match=message):
        args._run(args)


def _request(url: str, context: ssl.SSLContext, headers: dict[str, str] | None = None,
             body: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_serve_https_makes_prints_and_serves_its_certificate(tmp_path: Path) -> None:
    """The real command on all addresses, as the phone flow runs it (docs/service.md)."""
    port = free_port()
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--https", "--host", "0.0.0.0", "--port", str(port),
         "--model", "tiny-random", "--threads", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        while not any("serving on" in line for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        log = "".join(lines)
        certfile = tmp_path / "diffcast" / "tls" / "cert.pem"
        printed = re.search(r"SHA-256 fingerprint ([0-9A-F:]{95})", log)
        assert printed and printed.group(1) == der_sha256(certfile), log
        lan = [str(a) for a in lan_addresses() if a.version == 4 and not a.is_loopback]
        for address in lan:
            assert f"https://{address}:{port}/" in log
        # A client that trusts only this certificate verifies the server, by address (subjectAltName).
        context = ssl.create_default_context(cafile=str(certfile))
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = _request(f"https://127.0.0.1:{port}/healthz", context)
                break
            except (ConnectionError, urllib.error.URLError):
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert status == 200 and json.loads(body)["status"] == "ok"
        # The page, opened as https://<LAN IP>:port, may call the API; another site's page may not.
        host = f"{lan[0] if lan else '127.0.0.1'}:{port}"
        base = {"Host": host, "Content-Type": "application/json"}
        status, body = _request(f"https://127.0.0.1:{port}/api/offer", context,
                                {**base, "Origin": f"https://{host}"}, b"{}")
        assert status == 422, body  # past the origin check: the empty offer itself is refused
        status, body = _request(f"https://127.0.0.1:{port}/api/offer", context,
                                {**base, "Origin": "https://elsewhere.example"}, b"{}")
        assert status == 403 and b"is not allowed" in body
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
