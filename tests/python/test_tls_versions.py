"""Which TLS a shard speaks: the data plane TLS 1.3 only; the gRPC port
TLS 1.3, and TLS 1.2 with AEAD cipher suites (ECDHE with AES-GCM or
ChaCha20-Poly1305) only, since gRPC core's C API here has no way to set a
minimum version (docs/SECURITY.md, "TLS and mTLS"). Each handshake is made with
Python's ssl module against a real zshard-server started with
deploy/gen-certs' files.

Run with Debian's interpreter (CTest does): /usr/bin/python3 -m pytest tests/python/test_tls_versions.py
"""

import os
import socket
import ssl
import subprocess
import sys
import time

import grpc
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostile  # noqa: E402

SRC = os.environ.get("ZS_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    certs = tmp / "certs"
    subprocess.run([os.path.join(SRC, "deploy", "gen-certs"), str(certs), "--shards", "1"],
                   check=True, capture_output=True, timeout=120)
    port_file = tmp / "port"
    log = open(tmp / "log", "w")
    proc = subprocess.Popen([os.environ["ZSHARD_SERVER_BIN"], "--listen", "127.0.0.1:0",
                             "--port-file", str(port_file), "--tls-cert", str(certs / "server.crt"),
                             "--tls-key", str(certs / "server.key")], stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, (tmp / "log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        port = int(port_file.read_text().strip())
        creds = grpc.ssl_channel_credentials(open(certs / "ca.crt", "rb").read())
        with grpc.secure_channel("localhost:%d" % port, creds) as ch:
            pb = hostile.stubs().pb
            info = ch.unary_unary("/zshard.v1.ZShard/GetInfo",
                                  request_serializer=pb.GetInfoRequest.SerializeToString,
                                  response_deserializer=pb.GetInfoResponse.FromString)(
                pb.GetInfoRequest(), timeout=10)
        yield {"grpc": port, "data": info.data_port, "ca": str(certs / "ca.crt")}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def handshake(port, ca, version, ciphers=None, alpn=None):
    """The negotiated (version, cipher) or the SSLError of a handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    ctx.minimum_version = ctx.maximum_version = version
    if ciphers:
        ctx.set_ciphers(ciphers)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                return s.version(), s.cipher()[0]
        except (ssl.SSLError, ConnectionResetError) as e:
            return e


def test_the_grpc_port_speaks_tls_1_3(server):
    got = handshake(server["grpc"], server["ca"], ssl.TLSVersion.TLSv1_3, alpn=["h2"])
    assert got[0] == "TLSv1.3", got


def test_the_grpc_port_takes_tls_1_2_with_aead_suites_only(server):
    got = handshake(server["grpc"], server["ca"], ssl.TLSVersion.TLSv1_2,
                    "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES128-GCM-SHA256", ["h2"])
    assert got[0] == "TLSv1.2" and "GCM" in got[1], got
    for cbc in ("ECDHE-RSA-AES128-SHA:ECDHE-ECDSA-AES128-SHA",
                "ECDHE-RSA-AES256-SHA384:ECDHE-ECDSA-AES256-SHA384", "AES128-SHA256:AES128-SHA"):
        got = handshake(server["grpc"], server["ca"], ssl.TLSVersion.TLSv1_2, cbc, ["h2"])
        assert isinstance(got, Exception), (cbc, got)


def test_the_data_plane_speaks_tls_1_3_only(server):
    assert server["data"]
    got = handshake(server["data"], server["ca"], ssl.TLSVersion.TLSv1_3)
    assert got[0] == "TLSv1.3", got
    got = handshake(server["data"], server["ca"], ssl.TLSVersion.TLSv1_2,
                    "ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES128-GCM-SHA256")
    assert isinstance(got, Exception), got
