"""The gRPC listener's limits (docs/OPERATIONS.md, "Limits"), tried as a hostile
client would: parked calls counted per connection and per server and released
as soon as their client cancels or goes away, capped health Watch streams,
connections closed when they never finish their handshake or stay idle, and
message sizes bounded per method.

Each test starts its own zshard-server on port 0 with the limit under test made
small through its hidden environment knob, so the outcome shows in a few calls.
No assertion is about time: a test waits for an outcome (an answer, a closed
socket) and fails if it does not come within a generous bound.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_grpc_limits.py
"""

import importlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

import pytest

SOURCE_DIR = os.environ.get(
    "ZS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_SECONDS = 20
STOP_SECONDS = 30
# The longest a test waits for an outcome that the server owes at once.
OUTCOME_SECONDS = 30
LONG_WAIT_MS = 250000  # a Pull that would wait for minutes without the limits


def generate_stubs(out_dir):
    """protoc + grpc_python_plugin into out_dir; the health proto goes under
    another package name so that it does not shadow grpcio's `grpc`."""
    proto_dir = os.path.join(out_dir, "protos")
    os.makedirs(os.path.join(proto_dir, "zshard", "v1"))
    os.makedirs(os.path.join(proto_dir, "zs_health", "v1"))
    shutil.copy(os.path.join(SOURCE_DIR, "proto", "zshard", "v1", "zshard.proto"),
                os.path.join(proto_dir, "zshard", "v1"))
    shutil.copy(os.path.join(SOURCE_DIR, "proto", "grpc", "health", "v1", "health.proto"),
                os.path.join(proto_dir, "zs_health", "v1"))
    gen = os.path.join(out_dir, "gen")
    os.makedirs(gen)
    subprocess.run(
        ["protoc", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
         "-I" + proto_dir, "--python_out=" + gen, "--grpc_out=" + gen,
         "zshard/v1/zshard.proto", "zs_health/v1/health.proto"],
        check=True)
    return gen


@pytest.fixture(scope="module")
def stubs():
    tmp = tempfile.mkdtemp(prefix="zshard-limits-")
    gen = generate_stubs(tmp)
    sys.path.insert(0, gen)
    mods = {
        "pb": importlib.import_module("zshard.v1.zshard_pb2"),
        "pbg": importlib.import_module("zshard.v1.zshard_pb2_grpc"),
        "hpb": importlib.import_module("zs_health.v1.health_pb2"),
        "hpbg": importlib.import_module("zs_health.v1.health_pb2_grpc"),
        "gen": gen,
    }
    yield mods
    sys.path.remove(gen)
    shutil.rmtree(tmp, ignore_errors=True)


class Server:
    """One zshard-server on 127.0.0.1:0 with the given ZSHARD_GRPC_* knobs."""

    def __init__(self, knobs):
        self.tmp = tempfile.mkdtemp(prefix="zshard-limits-srv-")
        binary = os.environ.get("ZSHARD_SERVER_BIN")
        if not binary or not os.access(binary, os.X_OK):
            raise RuntimeError("ZSHARD_SERVER_BIN must name the zshard-server binary")
        port_file = os.path.join(self.tmp, "port")
        self.log_path = os.path.join(self.tmp, "server.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        env.update({k: str(v) for k, v in knobs.items()})
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0", "--port-file", port_file,
             "--shard-id", "0", "--shards", "1", "--threads", "1"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env)
        deadline = time.monotonic() + READY_SECONDS
        self.port = None
        while self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError("zshard-server exited with %d:\n%s" %
                                   (self.proc.returncode, self.read_log()))
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("zshard-server not ready:\n" + self.read_log())
            try:
                with open(port_file) as f:
                    self.port = int(f.read())
            except (FileNotFoundError, ValueError):
                time.sleep(0.01)
        self.target = "127.0.0.1:%d" % self.port

    def read_log(self):
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def rss_bytes(self):
        with open("/proc/%d/status" % self.proc.pid) as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        assert code == 0, "zshard-server exited with %d after SIGTERM" % code


@pytest.fixture
def server_factory():
    made = []

    def make(**knobs):
        s = Server(knobs)
        made.append(s)
        return s
    yield make
    for s in made:
        s.stop()


def channel(target, conn_id):
    """A channel on a connection of its own: grpcio shares one connection
    between channels with equal arguments, so each gets a distinct one."""
    import grpc
    return grpc.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 1 << 30),
                         ("grpc.max_send_message_length", 1 << 30),
                         ("grpc.use_local_subchannel_pool", 1),
                         ("zs.test.connection", conn_id)])


def open_job(pb, stub):
    spec = pb.ModelSpec(
        job="limits", world_size=1, grad_accum=1, num_shards=1,
        grad_reduce=pb.GRAD_REDUCE_MEAN, param_dtype=pb.DTYPE_BF16,
        groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_SGD, lr_scale=1.0)],
        tensors=[pb.TensorSpec(name="w", numel=1024, group=0, shape=[1024])])
    return stub.Open(pb.OpenRequest(spec=spec, rank=0), timeout=OUTCOME_SECONDS).spec_hash


def pull_far_ahead(pb, stub, h, timeout_ms):
    """A Pull of a version that never comes: it parks until timeout_ms."""
    return stub.Pull.future(pb.PullRequest(spec_hash=h, tensor=0, slice=0, min_version=2,
                                           dtype=pb.DTYPE_FP32, timeout_ms=timeout_ms),
                            timeout=OUTCOME_SECONDS * 10)


def probe(pb, stub, h):
    """Whether one more Pull may park: it is admitted (and then times out at
    once, DEADLINE_EXCEEDED) or refused RESOURCE_EXHAUSTED. Returns the code
    and the detail."""
    import grpc
    with pytest.raises(grpc.RpcError) as e:
        stub.Pull(pb.PullRequest(spec_hash=h, tensor=0, slice=0, min_version=2,
                                 dtype=pb.DTYPE_FP32, timeout_ms=20),
                  timeout=OUTCOME_SECONDS)
    return e.value.code(), e.value.details()


def wait_for_probe(pb, stub, h, want, parked=None):
    """Probes until the answer is `want` (a grpc.StatusCode); the server owes
    it at once, so the bound is generous and only there to end a failing
    test. A call of `parked` (a list of futures) refused while a probe held a
    place is sent again."""
    deadline = time.monotonic() + OUTCOME_SECONDS
    while True:
        if parked:
            parked[:] = [pull_far_ahead(pb, stub, h, LONG_WAIT_MS) if f.done() else f
                         for f in parked]
        code, detail = probe(pb, stub, h)
        if code == want:
            return detail
        assert time.monotonic() < deadline, "still %s (%s), never %s" % (code, detail, want)
        time.sleep(0.05)


def wait_for_no_waiting_pulls(pb, stub):
    """Until the shard holds no waiting Pull (Stats.waiting_pulls)."""
    deadline = time.monotonic() + OUTCOME_SECONDS
    while True:
        n = stub.Stats(pb.StatsRequest(), timeout=OUTCOME_SECONDS).waiting_pulls
        if n == 0:
            return
        assert time.monotonic() < deadline, "the shard still holds %d waiting Pulls" % n
        time.sleep(0.05)


def test_parked_pulls_per_connection_are_capped_and_released_on_cancel(stubs, server_factory):
    import grpc
    pb, pbg = stubs["pb"], stubs["pbg"]
    srv = server_factory(ZSHARD_GRPC_MAX_PARKED_PER_CONN=8)
    ch = channel(srv.target, 1)
    stub = pbg.ZShardStub(ch)
    h = open_job(pb, stub)
    parked = [pull_far_ahead(pb, stub, h, LONG_WAIT_MS) for _ in range(8)]
    detail = wait_for_probe(pb, stub, h, grpc.StatusCode.RESOURCE_EXHAUSTED, parked)
    assert "per connection" in detail
    # Another connection has a budget of its own.
    other = channel(srv.target, 2)
    code, _ = probe(pb, pbg.ZShardStub(other), h)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # Cancelled, the parked calls give their room back at once, not when
    # their wait (minutes) ends.
    for f in parked:
        f.cancel()
    wait_for_probe(pb, stub, h, grpc.StatusCode.DEADLINE_EXCEEDED)
    # And the shard forgets their waits then too.
    wait_for_no_waiting_pulls(pb, stub)
    other.close()
    ch.close()


CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import grpc
from zshard.v1 import zshard_pb2 as pb, zshard_pb2_grpc as pbg
ch = grpc.insecure_channel(sys.argv[2])
stub = pbg.ZShardStub(ch)
h = int(sys.argv[3])
def pull():
    return stub.Pull.future(pb.PullRequest(spec_hash=h, tensor=0, slice=0, min_version=2,
                                           dtype=pb.DTYPE_FP32, timeout_ms=250000), timeout=300)
fs = [pull() for _ in range(int(sys.argv[4]))]
print("parked", flush=True)
while True:  # until the test kills us
    # A call refused while the test's probe held a place is sent again.
    fs = [pull() if f.done() else f for f in fs]
    time.sleep(0.05)
"""


def test_parked_pulls_per_server_are_capped_and_released_when_the_client_exits(
        stubs, server_factory):
    import grpc
    pb, pbg = stubs["pb"], stubs["pbg"]
    srv = server_factory(ZSHARD_GRPC_MAX_PARKED=6)
    ch = channel(srv.target, 1)
    stub = pbg.ZShardStub(ch)
    h = open_job(pb, stub)
    child = subprocess.Popen([sys.executable, "-c", CHILD, stubs["gen"], srv.target, str(h), "6"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"parked"
        detail = wait_for_probe(pb, stub, h, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "the server already holds 6 waiting calls" in detail
    finally:
        child.kill()
        child.wait()
    # The client is gone (its connection closed): its calls are released now.
    wait_for_probe(pb, stub, h, grpc.StatusCode.DEADLINE_EXCEEDED)
    wait_for_no_waiting_pulls(pb, stub)
    ch.close()


def test_health_watch_streams_are_capped(stubs, server_factory):
    import grpc
    hpb, hpbg = stubs["hpb"], stubs["hpbg"]
    srv = server_factory(ZSHARD_GRPC_MAX_WATCHERS=2)
    ch = channel(srv.target, 1)
    health = hpbg.HealthStub(ch)
    streams = []
    for _ in range(2):
        st = health.Watch(hpb.HealthCheckRequest(service=""), timeout=OUTCOME_SECONDS * 10)
        assert next(st).status == hpb.HealthCheckResponse.SERVING
        streams.append(st)
    with pytest.raises(grpc.RpcError) as e:
        next(health.Watch(hpb.HealthCheckRequest(service=""), timeout=OUTCOME_SECONDS))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Watch" in e.value.details()
    # Check stays open to everyone.
    assert health.Check(hpb.HealthCheckRequest(service=""),
                        timeout=OUTCOME_SECONDS).status == hpb.HealthCheckResponse.SERVING
    # A stream that ends gives its room back.
    streams[0].cancel()
    deadline = time.monotonic() + OUTCOME_SECONDS
    while True:
        try:
            st = health.Watch(hpb.HealthCheckRequest(service=""), timeout=OUTCOME_SECONDS)
            assert next(st).status == hpb.HealthCheckResponse.SERVING
            st.cancel()
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the cancelled Watch kept its room"
            time.sleep(0.05)
    streams[1].cancel()
    ch.close()


def read_until_closed(sock, answer_settings):
    """Reads until the server closes the connection; returns the HTTP/2 frame
    types seen. Acknowledges SETTINGS and PING when asked to, as a live but
    idle client would."""
    sock.settimeout(OUTCOME_SECONDS)
    buf, types = b"", []
    while True:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            raise AssertionError("the server kept the connection open (frames seen: %s)" % types)
        except ConnectionResetError:
            return types
        if not data:
            return types
        buf += data
        while len(buf) >= 9:
            length = int.from_bytes(buf[0:3], "big")
            ftype, flags = buf[3], buf[4]
            if len(buf) < 9 + length:
                break
            payload, buf = buf[9:9 + length], buf[9 + length:]
            types.append(ftype)
            if answer_settings and ftype == 4 and not flags & 1:
                sock.sendall(struct.pack(">I", 0)[1:] + bytes([4, 1]) + b"\0\0\0\0")
            if answer_settings and ftype == 6 and not flags & 1:
                sock.sendall(struct.pack(">I", 8)[1:] + bytes([6, 1]) + b"\0\0\0\0" + payload)


def test_a_connection_that_never_handshakes_is_closed(server_factory):
    srv = server_factory(ZSHARD_GRPC_HANDSHAKE_MS=300)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        read_until_closed(sock, answer_settings=False)


def test_an_idle_http2_connection_is_closed(server_factory):
    srv = server_factory(ZSHARD_GRPC_IDLE_MS=300)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        # The client preface and an empty SETTINGS frame: a complete HTTP/2
        # connection that then starts no call.
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0\0\0" + bytes([4, 0]) + b"\0\0\0\0")
        types = read_until_closed(sock, answer_settings=True)
        assert 7 in types, "closed without a GOAWAY (frames: %s)" % types


def raw_call(ch, method, body):
    """A call of `method` with `body` as its request bytes, unchecked."""
    return ch.unary_unary("/zshard.v1.ZShard/" + method, request_serializer=lambda x: x,
                          response_deserializer=lambda x: x)(body, timeout=OUTCOME_SECONDS * 4)


def with_unknown_field(msg, n):
    """The serialized `msg` followed by an unknown bytes field (number 15) of n
    bytes: still a valid message of its type, of any size."""
    varint, v = b"", n
    while True:
        if v < 0x80:
            varint += bytes([v])
            break
        varint += bytes([(v & 0x7f) | 0x80])
        v >>= 7
    return msg.SerializeToString() + b"\x7a" + varint + bytes(n)


def hwm_bytes(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def test_a_small_method_refuses_a_large_request(stubs, server_factory):
    import grpc
    pb = stubs["pb"]
    srv = server_factory()
    ch = channel(srv.target, 1)
    with pytest.raises(grpc.RpcError) as e:
        raw_call(ch, "GetInfo", with_unknown_field(pb.GetInfoRequest(), 1 << 20))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 65536 bytes" in e.value.details()
    # The same method with a request of its size is served.
    assert raw_call(ch, "GetInfo", with_unknown_field(pb.GetInfoRequest(), 1000)) is not None
    ch.close()


def test_huge_requests_are_refused_without_holding_their_size(stubs, server_factory):
    """Two requests of 300 MiB at once: refused, and the server's peak memory
    grows by less than one of them (gRPC's memory quota, 128 MiB here, resets
    the streams; before, every method took 1 GiB and kept all of it)."""
    import threading

    import grpc
    pb = stubs["pb"]
    srv = server_factory(ZSHARD_GRPC_MEMORY_MB=128)
    ch = channel(srv.target, 1)
    assert raw_call(ch, "GetInfo", pb.GetInfoRequest().SerializeToString()) is not None
    before = hwm_bytes(srv.proc.pid)
    body = with_unknown_field(pb.GetInfoRequest(), 300 << 20)
    codes = []

    def send():
        try:
            raw_call(ch, "GetInfo", body)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.append(err.code())
    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grown = hwm_bytes(srv.proc.pid) - before
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert grown < 300 << 20, "peak memory grew by %d MiB" % (grown >> 20)
    # The server is still there for calls of a sane size.
    assert raw_call(ch, "GetInfo", pb.GetInfoRequest().SerializeToString()) is not None
    ch.close()


def test_push_chunk_fields_are_checked(stubs, server_factory):
    import grpc
    pb, pbg = stubs["pb"], stubs["pbg"]
    srv = server_factory()
    ch = channel(srv.target, 1)
    stub = pbg.ZShardStub(ch)
    h = open_job(pb, stub)
    piece = bytes(1024 * 4)

    def push(**kw):
        return stub.Push(pb.PushRequest(spec_hash=h, step=1, rank=0, micro=0, tensor=0, slice=0,
                                        dtype=pb.DTYPE_FP32, **kw), timeout=OUTCOME_SECONDS)
    for bad in [dict(data=piece, total=len(piece) + 4),        # not the piece's size
                dict(data=piece[4:], offset=4, total=len(piece)),  # not on a chunk boundary
                dict(data=piece[:100], offset=0, total=len(piece))]:  # a short chunk
        with pytest.raises(grpc.RpcError) as e:
            push(**bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    # A payload of one chunk, sent as a chunk, is the whole contribution.
    assert not push(data=piece, offset=0, total=len(piece)).duplicate
    assert push(data=piece).duplicate
    ch.close()


def h2_frame(ftype, flags, stream, payload):
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


def hpack_literal(name, value):
    """A header field as an HPACK literal without indexing, new name, no
    Huffman coding (lengths below 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def start_unread_calls(port, method, body, n):
    """A raw HTTP/2 client that starts n calls of `method` and reads nothing:
    its SETTINGS give every stream a window of 0, so the server can send no
    answer bytes at all. Returns the socket (close it to end the calls)."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" +
                 h2_frame(4, 0, 0, struct.pack(">HI", 4, 0)))  # INITIAL_WINDOW_SIZE 0
    headers = b"".join(hpack_literal(k, v) for k, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
        (b":authority", b"zshard"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    message = b"\0" + struct.pack(">I", len(body)) + body
    for i in range(n):
        stream = 1 + 2 * i
        sock.sendall(h2_frame(1, 4, stream, headers) + h2_frame(0, 1, stream, message))
    return sock


def test_answers_a_peer_does_not_read_are_bounded_per_connection(stubs, server_factory):
    """20 Pulls of a 16 MiB piece from a peer that reads nothing: without a
    bound the server builds all 20 answers (320 MiB) and holds them while the
    peer stays connected; with 32 MiB per connection two are built and the
    rest wait, and another connection is served meanwhile."""
    pb, pbg = stubs["pb"], stubs["pbg"]
    srv = server_factory(ZSHARD_GRPC_MAX_ANSWER_MB_PER_CONN=32)
    ch = channel(srv.target, 1)
    stub = pbg.ZShardStub(ch)
    numel = 4 << 20
    spec = pb.ModelSpec(
        job="answers", world_size=1, grad_accum=1, num_shards=1,
        grad_reduce=pb.GRAD_REDUCE_MEAN, param_dtype=pb.DTYPE_BF16,
        groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_SGD, lr_scale=1.0)],
        tensors=[pb.TensorSpec(name="w", numel=numel, group=0, shape=[numel])])
    h = stub.Open(pb.OpenRequest(spec=spec, rank=0), timeout=OUTCOME_SECONDS).spec_hash
    chunk = 1 << 18
    for off in range(0, numel, chunk):
        stub.InitParams(pb.InitParamsRequest(spec_hash=h, tensor=0, slice=0, offset=off,
                                             data=bytes(chunk * 4)), timeout=OUTCOME_SECONDS)
    pull = pb.PullRequest(spec_hash=h, tensor=0, slice=0, min_version=0, dtype=pb.DTYPE_FP32)

    def pulls_built():
        return stub.Stats(pb.StatsRequest(), timeout=OUTCOME_SECONDS).pulls
    before = srv.rss_bytes()
    sock = start_unread_calls(srv.port, "/zshard.v1.ZShard/Pull", pull.SerializeToString(), 20)
    try:
        deadline = time.monotonic() + OUTCOME_SECONDS
        while pulls_built() < 2:
            assert time.monotonic() < deadline, "the unread Pulls were never answered"
            time.sleep(0.05)
        # Another connection is served while the answers wait.
        got = stub.Pull(pull, timeout=OUTCOME_SECONDS)
        assert len(got.data) == numel * 4
        grown = srv.rss_bytes() - before
        built = pulls_built()
        assert built <= 3, "%d answers built for a peer that reads nothing" % built
        assert grown < 160 << 20, "resident memory grew by %d MiB" % (grown >> 20)
    finally:
        sock.close()
    # Gone, the peer's answers give their room back; its waiting ones are
    # built then (and dropped, as nobody reads them).
    deadline = time.monotonic() + OUTCOME_SECONDS
    while pulls_built() < 21:
        assert time.monotonic() < deadline, "the waiting answers were never released"
        time.sleep(0.05)
    ch.close()


def test_a_read_state_answer_is_at_most_64_mib(stubs, server_factory):
    import grpc
    pb, pbg = stubs["pb"], stubs["pbg"]
    srv = server_factory()
    ch = channel(srv.target, 1)
    stub = pbg.ZShardStub(ch)
    h = open_job(pb, stub)
    with pytest.raises(grpc.RpcError) as e:
        stub.ReadState(pb.ReadStateRequest(spec_hash=h, tensor=0, slice=0, array=1,
                                           count=(64 << 20) // 4 + 1), timeout=OUTCOME_SECONDS)
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "67108864-byte" in e.value.details()
    ch.close()
