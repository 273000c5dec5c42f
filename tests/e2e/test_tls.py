"""TLS of the run's listeners (issue 26, item 14): the ``tls`` section's certificate and key make the embedded
server and the router serve HTTPS and the rollout's Flight server ``grpc+tls``; the run's clients verify them against
``tls.ca_file``. A client without that CA (the system's CAs, or another CA) is refused by its own handshake, and a
plain-text client gets no answer. The CA and certificates are made here (``cryptography``), for 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import ssl
import time
from pathlib import Path

import httpx
import pyarrow.flight as flight
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from flow_helpers import grpo_train_command
from serving_helpers import TINY

from grpo_core.config import RunConfig, TLSConfig
from grpo_core.errors import TransportError
from grpo_core.packing import Sample
from grpo_core.rollout.pace import TokenAllowance
from grpo_core.rollout.queue import SampleQueue
from grpo_core.security.auth import TLS_CA_ENV, run_token, tls_env
from grpo_core.serving import limits
from grpo_core.serving.client import GenerationClient
from grpo_core.transport.flight_client import FlightSource
from grpo_core.transport.flight_server import RolloutFlightServer

TOKEN = "tls-test-token-0123456789abcdefghijklmnopq"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca(folder: Path, stem: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(_name(stem))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate it signed for 127.0.0.1 and localhost, its key, and an unrelated CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key = _ca(folder, "ca")
    _ca(folder, "other-ca")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("grpo-flow test server"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (folder / "server.key").chmod(0o600)
    return {
        "ca": folder / "ca.pem",
        "other_ca": folder / "other-ca.pem",
        "cert": folder / "server.pem",
        "key": folder / "server.key",
    }


# ----- config and helpers ------------------------------------------------------------------------------------------


def test_tls_settings_come_in_pairs(pki):
    with pytest.raises(ValueError, match=r"tls.cert_file is set but tls.key_file is not"):
        TLSConfig(cert_file=pki["cert"])
    with pytest.raises(ValueError, match=r"tls.key_file is set but tls.cert_file is not"):
        TLSConfig(key_file=pki["key"])
    alone = TLSConfig(ca_file=pki["ca"])  # external https servers verified against it; the listeners stay plain
    assert not alone.enabled and alone.client_ca() == str(pki["ca"])
    tls = RunConfig(tls={"cert_file": str(pki["cert"]), "key_file": str(pki["key"]), "ca_file": str(pki["ca"])}).tls
    assert tls.enabled and tls.client_ca() == str(pki["ca"])
    assert tls_env(tls) == {
        "GRPO_TLS_CERT_FILE": str(pki["cert"]),
        "GRPO_TLS_KEY_FILE": str(pki["key"]),
        "GRPO_TLS_CA_FILE": str(pki["ca"]),
    }
    assert not RunConfig().tls.enabled and tls_env(RunConfig().tls) == {}


def test_a_key_that_is_not_the_certificates_is_refused_before_serving(pki, tmp_path):
    other = ec.generate_private_key(ec.SECP256R1())
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(
        other.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    with pytest.raises(ValueError, match="wrong.key"):
        limits.tls_options(pki["cert"], wrong)
    with pytest.raises(ValueError, match="both"):
        limits.tls_options(pki["cert"], None)
    assert limits.tls_options(None, None) == {}
    assert limits.tls_options(pki["cert"], pki["key"]) == {
        "ssl_certfile": str(pki["cert"]),
        "ssl_keyfile": str(pki["key"]),
    }


def test_the_plain_text_warning_names_the_tls_settings_and_tls_silences_it(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_core.serving.limits"):
        assert limits.warn_if_exposed("0.0.0.0", "the router") is True
        assert limits.warn_if_exposed("0.0.0.0", "the router", tls=True) is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "tls.cert_file and tls.key_file" in lines[0]


# ----- HTTP: a real embedded server and the router in front of it ---------------------------------------------------


def _refused_by_handshake(url: str, verify: object) -> str:
    """The error a client verifying with ``verify`` gets from ``url``'s /health (fails the test if answered)."""
    try:
        answer = httpx.get(url + "/health", verify=verify, timeout=10)
    except httpx.ConnectError as exc:
        return str(exc)
    pytest.fail(f"{url} answered {answer.status_code} to a client that cannot verify it")


def test_the_embedded_server_and_the_router_serve_https_verified_against_the_ca(pki, tmp_path, monkeypatch):
    from grpo_core.serving.launch import provision, teardown
    from grpo_core.serving.router.server import start_router

    monkeypatch.delenv(TLS_CA_ENV, raising=False)  # the CA reaches each client from the config here
    config = RunConfig(
        model={"name": TINY},
        server={
            "backend": "embedded",
            "port": 0,
            "router_port": 0,
            "embedded_num_threads": 1,
            "max_model_len": 256,
            "log_dir": tmp_path,
            "startup_timeout_s": 180,
        },
        train={"output_dir": tmp_path / "run"},
        rollout={"max_completion_length": 64, "num_sampler_logprobs": 4},
        tls={"cert_file": pki["cert"], "key_file": pki["key"], "ca_file": pki["ca"]},
    )
    handles = provision(config)  # its start check (health, identity) went through TLS verified with the CA
    try:
        replica = handles[0]
        router = start_router(config.server, [replica.url], run_token(), tls=config.tls)
        try:
            for url in (replica.url, router.url):
                assert url.startswith("https://127.0.0.1:"), url
                ca = limits.client_ssl_context(pki["ca"])
                assert httpx.get(url + "/health", verify=ca, timeout=10).status_code == 200

                async def models(url=url):
                    async with GenerationClient(url, ca_file=str(pki["ca"]), max_retries=0) as client:
                        return [card["id"] for card in await client.models()]

                assert asyncio.run(models()) == [TINY]  # through the router: its upstream client verified the replica
                assert "CERTIFICATE_VERIFY_FAILED" in _refused_by_handshake(url, True)  # the system's CAs only
                assert "CERTIFICATE_VERIFY_FAILED" in _refused_by_handshake(
                    url, limits.client_ssl_context(pki["other_ca"])
                )
                with pytest.raises(httpx.HTTPError):  # no plain-text HTTP on the TLS port
                    httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
        finally:
            router.stop()
    finally:
        teardown(handles)
    log = (tmp_path / replica.spec.log_path.name).read_text()
    assert "on https://127.0.0.1:" in log


# ----- Flight --------------------------------------------------------------------------------------------------------


class _NullWindow:
    def add(self, name: str, value: float) -> None:
        pass

    def add_many(self, name: str, values: list[float]) -> None:
        pass

    def drain(self) -> dict[str, float]:
        return {}


def _queue_with_groups(groups: int, size: int) -> tuple[SampleQueue, list[int]]:
    queue = SampleQueue(TokenAllowance(max_staleness=1, first_step_tokens=10_000), with_topk=False)
    ids = []
    for prompt in range(groups):
        samples = [
            Sample.build([1, 2, 3, 4], [0, 0, 1, 1], sample_id=prompt * 100 + k, group_id=prompt, prompt_index=prompt)
            for k in range(size)
        ]
        queue.allowance.group_started()
        queue.allowance.group_finished(4 * size, queued=True)
        queue.put_group(prompt, samples, tokens=4 * size)
        ids += [s.sample_id for s in samples]
    queue.finish()
    return queue, ids


def test_the_flight_stream_works_over_tls_with_the_ca_only(pki, monkeypatch):
    monkeypatch.delenv(TLS_CA_ENV, raising=False)
    queue, ids = _queue_with_groups(groups=4, size=3)
    server = RolloutFlightServer(
        "grpc://127.0.0.1:0",
        queue,
        _NullWindow(),
        lambda: 0,
        lambda: None,
        token=TOKEN,
        tls=(str(pki["cert"]), str(pki["key"])),
    )
    location = f"grpc+tls://127.0.0.1:{server.port}"
    try:
        assert server.tls
        for plain in (
            flight.connect(location),  # the system's CAs
            flight.connect(location, tls_root_certs=pki["other_ca"].read_bytes()),
            flight.connect(f"grpc://127.0.0.1:{server.port}"),  # no TLS at all
        ):
            with pytest.raises(flight.FlightError):
                plain.list_actions(options=flight.FlightCallOptions(timeout=5))
            plain.close()
        assert queue.num_in_flight == 0  # none of them reached the queue
        source = FlightSource(location, max_staleness=10, timeout_s=10.0, token=TOKEN, ca_file=str(pki["ca"]))
        received: list[int] = []
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                got = source.pull(0, min_samples=3, timeout_s=5.0)
                received += got.samples.column("sample_id").to_pylist() if got.samples.num_rows else []
                if got.exhausted:
                    break
        finally:
            source._client.close()
        assert sorted(received) == sorted(ids)
    finally:
        server.shutdown()


def test_a_flight_client_without_the_ca_cannot_pull(pki, monkeypatch):
    monkeypatch.delenv(TLS_CA_ENV, raising=False)
    queue, _ = _queue_with_groups(groups=1, size=2)
    server = RolloutFlightServer(
        "grpc://127.0.0.1:0", queue, _NullWindow(), lambda: 0, lambda: None, token=TOKEN, tls=(pki["cert"], pki["key"])
    )
    try:
        source = FlightSource(f"grpc+tls://127.0.0.1:{server.port}", max_staleness=10, timeout_s=3.0, token=TOKEN)
        try:
            with pytest.raises(TransportError):
                source.pull(0, min_samples=1, timeout_s=3.0)
        finally:
            source._client.close()
        assert queue.num_in_flight == 0 and len(queue._groups) == 1  # the group never left the queue
    finally:
        server.shutdown()


def test_the_ssl_context_verifies_host_names(pki):
    ctx = limits.client_ssl_context(pki["ca"])
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


# ----- a whole run ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_grpo_train_runs_over_tls(pki, tmp_path):
    """``grpo train`` of configs/tiny.yaml with the tls section: the embedded server serves https, the rollout's
    Flight server grpc+tls, and the rollout, the trainer (its server probe, weight sync and Flight client) verify
    them against the CA and train both steps. Before the trainer's server probe took the CA it stopped at once with
    CERTIFICATE_VERIFY_FAILED."""
    import json
    import os
    import subprocess

    cmd = grpo_train_command(
        tmp_path,
        "train.max_steps=2",
        f"tls.cert_file={pki['cert']}",
        f"tls.key_file={pki['key']}",
        f"tls.ca_file={pki['ca']}",
    )
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "OMP_NUM_THREADS": "1"}
    env.pop(TLS_CA_ENV, None)
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (run_dir,) = (p.parent for p in (tmp_path / "runs").glob("*/metrics.jsonl"))
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (run_dir / "rollout.location").read_text().startswith("grpc+tls://127.0.0.1:")
    assert "on https://127.0.0.1:" in (run_dir / "servers" / "embedded-replica0.log").read_text()


def test_validate_refuses_each_bad_tls_file_naming_its_field(pki, tmp_path):
    """``grpo validate`` (preflight) checks the tls files it used to pass: missing, a folder, not PEM, a key of
    another certificate, a CA file that is no certificate."""
    from grpo_core.errors import ConfigError
    from grpo_core.run.preflight import check_tls

    check_tls(RunConfig(tls=TLSConfig(cert_file=pki["cert"], key_file=pki["key"], ca_file=pki["ca"])))  # good
    other_key = tmp_path / "other.key"
    other_key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    not_pem = tmp_path / "cert.der"
    not_pem.write_bytes(b"\x30\x82\x01\x0a not a pem file")
    cases = [
        ({"cert_file": tmp_path / "missing.pem", "key_file": pki["key"]}, "tls.cert_file", "does not exist"),
        ({"cert_file": pki["cert"], "key_file": tmp_path}, "tls.key_file", "is a directory"),
        ({"cert_file": not_pem, "key_file": pki["key"]}, "tls.cert_file", "is not a PEM certificate"),
        ({"cert_file": pki["cert"], "key_file": pki["cert"]}, "tls.key_file", "is not a PEM private key"),
        ({"cert_file": pki["cert"], "key_file": other_key}, "tls.key_file", "is not the key of tls.cert_file"),
        ({"ca_file": pki["key"]}, "tls.ca_file", "is not a PEM CA certificate"),
        ({"ca_file": tmp_path / "nope.pem"}, "tls.ca_file", "does not exist"),
    ]
    for files, field, problem in cases:
        with pytest.raises(ConfigError) as err:
            check_tls(RunConfig(tls=TLSConfig(**files)))
        message = str(err.value)
        assert message.startswith(f"{field}=") and problem in message and "\n" not in message, (files, message)
