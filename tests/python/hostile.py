"""Hostile clients for the attack suite, tests/python/test_hostile_*.py
(not a test itself).

Each test runs one attack against a real zshard-server
(zshard_servers.Shards) and asserts the bounded outcome: a refusal with the
right gRPC code or data-plane status, memory under a ceiling read from
/proc/<pid>/status, a legitimate trainer still served. Waits are deadlines
for an outcome, never measurements.

Memory ceilings are generous constants: they are far above what the server
needs for the job a test opens, and far below what the attack made it hold
before the fixes (hundreds of MiB to GiB).

The gRPC stubs come from test_grpc_interop.generate_stubs, plus the data
plane's meta messages (proto/zshard/v1/data.proto). The data plane is spoken
through raw sockets; every frame is built by frame() and every connection
that authenticates does it in DataConn.authenticate(), the only places that
know the frame format (docs/PROTOCOL.md, common/net/wire.h).

ZS_HOSTILE_UNBOUNDED_SERVER=1 runs the suite against a server from before the
limits and tokens (0.1): the flags they added (NEW_FLAGS) are dropped with their
values and data-plane connections do not say HELLO, so that the attack itself,
not an unknown flag or frame, is what a test sees fail. It exists to record
which attacks succeed without the defences; a normal run leaves it unset.
"""

import importlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

import grpc

from test_grpc_interop import SOURCE_DIR, generate_stubs
from zshard_servers import Shards

MiB = 1 << 20
# What any test's server may hold: its job is at most ~100 MiB of state.
SERVER_RSS_CEILING = 300 * MiB
CALL_TIMEOUT = 30
# How long an outcome (a refusal, a close, a release) may take to show.
OUTCOME_SECONDS = 20

# zs_status values (include/zshard/zshard.h) that the data plane's ERROR
# frames carry.
ZS_EUNAUTHENTICATED = -23
ZS_ELIMIT = -25

# ------------------------------------------------------------------ stubs

_stubs = None


class _Stubs:
    pass


def stubs():
    """The generated modules: pb (zshard.proto), pbg (its service), dpb
    (data.proto), hpb/hpbg (grpc.health.v1); generated once per process."""
    global _stubs
    if _stubs is None:
        tmp = tempfile.mkdtemp(prefix="zshard-hostile-stubs-")
        gen = generate_stubs(tmp)
        shutil.copy(os.path.join(SOURCE_DIR, "proto", "zshard", "v1", "data.proto"),
                    os.path.join(tmp, "protos", "zshard", "v1"))
        subprocess.run(["protoc", "-I" + os.path.join(tmp, "protos"), "--python_out=" + gen,
                        "zshard/v1/data.proto"], check=True)
        sys.path.insert(0, gen)
        s = _Stubs()
        s.pb = importlib.import_module("zshard.v1.zshard_pb2")
        s.pbg = importlib.import_module("zshard.v1.zshard_pb2_grpc")
        s.dpb = importlib.import_module("zshard.v1.data_pb2")
        s.hpb = importlib.import_module("zs_health.v1.health_pb2")
        s.hpbg = importlib.import_module("zs_health.v1.health_pb2_grpc")
        _stubs = s
    return _stubs


# ------------------------------------------------------------------ memory


def memory(pid):
    """VmRSS and VmHWM of process pid, in bytes."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def reset_peak(pid):
    """Resets VmHWM to the current RSS, so that a later peak is the attack's."""
    with open("/proc/%d/clear_refs" % pid, "w") as f:
        f.write("5")


def settle(pid, ceiling=SERVER_RSS_CEILING, seconds=OUTCOME_SECONDS, quiet=2.0):
    """Waits until the server's RSS has stopped growing (no MiB more for
    `quiet` seconds), or has passed `ceiling`, or `seconds` have passed;
    returns its peak (VmHWM). A deadline, not a measurement: the caller
    asserts the peak against the ceiling."""
    deadline = time.monotonic() + seconds
    last, since = memory(pid)[0], time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        rss, peak = memory(pid)
        if peak > ceiling:
            return peak
        if rss > last + MiB:
            last, since = rss, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return memory(pid)[1]


def wait_for(what, seconds=OUTCOME_SECONDS, poll=0.05):
    """Polls what() until it returns something true or `seconds` pass;
    returns its last value (the caller asserts it)."""
    deadline = time.monotonic() + seconds
    while True:
        value = what()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(poll)


# ------------------------------------------------------------------ servers

UNBOUNDED_SERVER = os.environ.get("ZS_HOSTILE_UNBOUNDED_SERVER") == "1"
NEW_FLAGS = ("--token-file", "--admin-token-file", "--max-params", "--max-tensors")


def _drop_flags(args):
    drop = NEW_FLAGS if UNBOUNDED_SERVER else ()
    out, i = [], 0
    while i < len(args):
        if args[i] in drop:
            i += 2
            continue
        out.append(args[i])
        i += 1
    return out


class Shard:
    """One zshard-server (shard 0 of 1) under attack.

    tokens=True gives it a trainer and an admin token file (--token-file,
    --admin-token-file): self.trainer and self.admin are the tokens.
    state_dir=True gives it a state directory (self.state_dir), or a path to
    use an existing one. `args` are further flags."""

    def __init__(self, args=(), tokens=False, state_dir=False, threads=1, env=None):
        self.tmp = tempfile.mkdtemp(prefix="zshard-hostile-")
        args = list(args)
        self.trainer = self.admin = None
        if tokens:
            self.trainer = "trainer-" + os.urandom(16).hex()
            self.admin = "admin-" + os.urandom(16).hex()
            for flag, token in (("--token-file", self.trainer), ("--admin-token-file", self.admin)):
                path = os.path.join(self.tmp, flag[2:])
                with open(path, "w") as f:
                    f.write(token + "\n")
                os.chmod(path, 0o600)
                args += [flag, path]
        self.state_dir = None
        if state_dir:
            self.state_dir = (state_dir if isinstance(state_dir, str)
                              else os.path.join(self.tmp, "state"))
            os.makedirs(self.state_dir, exist_ok=True)
            args += ["--state-dir", self.state_dir]
        self.shards = Shards(1, threads=threads, extra_args=_drop_flags(args))
        self.shards.env = dict(env or {})
        self.clients = []

    def __enter__(self):
        try:
            self.shards.__enter__()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.proc = self.shards.procs[0]
        self.pid = self.proc.pid
        self.address = self.shards.addresses
        self.port = int(self.address.rsplit(":", 1)[1])
        return self

    def __exit__(self, et, ev, tb):
        for c in self.clients:
            c.close()
        try:
            return self.shards.__exit__(et, ev, tb)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def client(self, token="trainer"):
        """A gRPC client sending `token`: "trainer", "admin", None (no
        authorization header) or any other string (sent as is)."""
        token = {"trainer": self.trainer, "admin": self.admin}.get(token, token)
        c = Client(self.address, token)
        self.clients.append(c)
        return c

    def memory(self):
        return memory(self.pid)

    def data_port(self):
        port = self.client().call("GetInfo", stubs().pb.GetInfoRequest()).data_port
        assert port, "the server has no data plane"
        return port

    def log(self):
        return self.shards.read_logs()


class Client:
    """A grpcio client of one server; every call carries `authorization:
    Bearer <token>` when a token is given."""

    def __init__(self, address, token=None, max_len=1 << 30):
        s = stubs()
        # A connection of its own (grpcio would share one between channels
        # of the same target and options): budgets are per connection.
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", max_len),
                              ("grpc.max_send_message_length", max_len),
                              ("grpc.use_local_subchannel_pool", 1)])
        self.stub = s.pbg.ZShardStub(self.channel)
        self.health = s.hpbg.HealthStub(self.channel)
        self.metadata = (("authorization", "Bearer " + token),) if token else None

    def call(self, method, request, timeout=CALL_TIMEOUT):
        return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)

    def future(self, method, request, timeout=CALL_TIMEOUT):
        return getattr(self.stub, method).future(request, timeout=timeout, metadata=self.metadata)

    def code(self, method, request, timeout=CALL_TIMEOUT):
        """The gRPC status code of the call (grpc.StatusCode.OK if it succeeded)."""
        try:
            self.call(method, request, timeout)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    def close(self):
        self.channel.close()


# ------------------------------------------------------------------ jobs


def open_job(client, numels, world_size=1, job="hostile", param_dtype=None, rank=0, mode=0):
    """Opens a job of one tensor per entry of numels (each one piece on a
    single shard), AdamW; returns the spec hash."""
    pb = stubs().pb
    spec = pb.ModelSpec(
        job=job, world_size=world_size, grad_accum=1, num_shards=1,
        grad_reduce=pb.GRAD_REDUCE_MEAN, param_dtype=param_dtype or pb.DTYPE_BF16,
        groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_ADAMW, lr_scale=1.0, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.01)],
        tensors=[pb.TensorSpec(name="t%d" % i, numel=n, group=0) for i, n in enumerate(numels)])
    return client.call("Open", pb.OpenRequest(spec=spec, rank=rank, mode=mode)).spec_hash


def init_params(client, h, numels, value=0.5):
    """Initial weights `value` for every piece, in the protocol's chunks."""
    pb = stubs().pb
    chunk = 262144
    for t, n in enumerate(numels):
        for off in range(0, n, chunk):
            k = min(chunk, n - off)
            client.call("InitParams", pb.InitParamsRequest(
                spec_hash=h, tensor=t, slice=0, offset=off,
                data=struct.pack("<f", value) * k))


def push_all(client, h, step, numels, rank=0, value=0.25):
    """Rank `rank`'s gradient `value` for every piece of step `step`, over gRPC."""
    pb = stubs().pb
    for t, n in enumerate(numels):
        client.call("Push", pb.PushRequest(spec_hash=h, step=step, rank=rank, micro=0, tensor=t,
                                           slice=0, dtype=pb.DTYPE_FP32,
                                           data=struct.pack("<f", value) * n))


def grad_stats(client, h, step_no):
    """GradStats of step step_no once complete: what a trainer asks before
    its Apply (the shard sums the step's statistics after the last push, so
    an Apply straight after the push may find them not ready yet)."""
    pb = stubs().pb
    r = client.call("GradStats", pb.GradStatsRequest(spec_hash=h, step=step_no,
                                                     timeout_ms=OUTCOME_SECONDS * 1000))
    assert r.complete, r
    return r


def step(client, h, step_no, numels, lr=1e-3):
    """Pushes and applies step step_no (world size 1); returns the ApplyResponse."""
    pb = stubs().pb
    push_all(client, h, step_no, numels)
    grad_stats(client, h, step_no)
    return client.call("Apply", pb.ApplyRequest(spec_hash=h, step=step_no, lr=lr, coef=1.0))


def pull(client, h, tensor, min_version=0, dtype=None):
    pb = stubs().pb
    return client.call("Pull", pb.PullRequest(spec_hash=h, tensor=tensor, slice=0,
                                              min_version=min_version,
                                              dtype=dtype or pb.DTYPE_FP32))


def waiting_pulls(client):
    return client.call("Stats", stubs().pb.StatsRequest()).waiting_pulls


# ------------------------------------------------------------------ data plane

PUSH, PUSH_ACK, PULL, PULL_DATA, ERROR, PING, PONG = 1, 2, 3, 4, 5, 6, 7
PUSH_BATCH, PUSH_BATCH_ACK, PULL_BATCH, PULL_BATCH_DATA = 8, 9, 10, 11
HELLO, HELLO_ACK = 12, 13
_HEADER = struct.Struct("<4sBBHQQIII")  # the 36 bytes the header CRC starts with


def _varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _crc_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_CRC_TABLE = _crc_table()


def crc32c(data, crc=0):
    """CRC-32C (Castagnoli), pure Python: for metas and small payloads only."""
    c = crc ^ 0xFFFFFFFF
    t = _CRC_TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def frame(ftype, request_id, meta=b"", payload=b"", payload_len=None, payload_crc=None):
    """Header and meta of one frame, with the payload appended when given.
    payload_len/payload_crc declare a payload the caller sends itself (or
    never sends); a declared payload without payload_crc gets 0."""
    version = 3 if ftype >= HELLO else 2 if ftype >= PUSH_BATCH else 1
    if payload_len is None:
        payload_len = len(payload)
    if payload_crc is None:
        payload_crc = crc32c(payload) if payload else 0
    head = _HEADER.pack(b"ZSDP", version, ftype, 0, request_id, payload_len, len(meta),
                        payload_crc, 0)
    return head + struct.pack("<I", crc32c(head + meta)) + meta + payload


class Closed(Exception):
    """The server closed the data-plane connection."""


class Refused(Exception):
    """The server refused a connection's HELLO: .status, .message."""

    def __init__(self, status, message):
        super().__init__("HELLO refused: %d %s" % (status, message))
        self.status, self.message = status, message


class DataConn:
    """One data-plane connection from address `source` (so that tests can be
    two peers on one host: 127.0.0.2 the attacker, 127.0.0.1 the trainer).
    It authenticates first with `token` (empty: a server without tokens
    takes any), unless hello=False: a peer that skips the handshake."""

    def __init__(self, port, source="127.0.0.1", token="", rcvbuf=None, host="127.0.0.1",
                 hello=True):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.bind((source, 0))
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hello and not UNBOUNDED_SERVER:
            try:
                self.authenticate(token)
            except BaseException:
                self.sock.close()
                raise

    def authenticate(self, token):
        """HELLO (frame version 3, meta DataHello{bytes token = 1}), then its
        HELLO_ACK; Refused when the server answers ERROR instead."""
        token = token.encode() if isinstance(token, str) else token
        meta = b"\x0a" + _varint(len(token)) + token if token else b""
        self.send(frame(HELLO, 1, meta))
        ftype, _, meta, _ = self.read_frame()
        if ftype == ERROR:
            raise Refused(*self.error(meta))
        assert ftype == HELLO_ACK, "HELLO answered with frame type %d" % ftype

    def send(self, data, seconds=OUTCOME_SECONDS):
        """Sends all of data; socket.timeout if the server has not taken it
        within `seconds` (it stopped reading from this peer)."""
        self.sock.settimeout(seconds)
        self.sock.sendall(data)

    def _recv_exact(self, n, deadline):
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no data-plane answer in time (%d of %d bytes)" % (len(buf), n))
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except socket.timeout:
                raise TimeoutError("no data-plane answer in time (%d of %d bytes)" % (len(buf), n))
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise Closed("the server closed the connection")
            buf += chunk
        return bytes(buf)

    def read_frame(self, seconds=OUTCOME_SECONDS):
        """(type, request_id, meta, payload) of the next frame."""
        deadline = time.monotonic() + seconds
        head = self._recv_exact(40, deadline)
        magic, _, ftype, _, rid, plen, mlen, _, _ = _HEADER.unpack(head[:36])
        assert magic == b"ZSDP", "not a data-plane frame: %r" % head
        meta = self._recv_exact(mlen, deadline) if mlen else b""
        payload = self._recv_exact(plen, deadline) if plen else b""
        return ftype, rid, meta, payload

    def error(self, meta):
        e = stubs().dpb.DataError.FromString(meta)
        return e.status, e.message

    def ping(self, request_id=1, seconds=OUTCOME_SECONDS):
        """True when a PING is answered with its PONG."""
        self.send(frame(PING, request_id))
        ftype, rid, _, _ = self.read_frame(seconds)
        return ftype == PONG and rid == request_id

    def closed_within(self, seconds=OUTCOME_SECONDS):
        """True when the server closes the connection within `seconds`
        (frames it sends before are read and dropped)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not self.sock.recv(1 << 16):
                    return True
            except socket.timeout:
                return False
            except (ConnectionResetError, BrokenPipeError):
                return True
        return False

    def close(self):
        self.sock.close()


def dp_push(h, step_no, tensor, data, rank=0, request_id=1):
    """A PUSH frame of fp32 gradient bytes."""
    d = stubs().dpb
    meta = d.DataPush(spec_hash=h, step=step_no, rank=rank, micro=0, tensor=tensor, slice=0,
                      dtype=stubs().pb.DTYPE_FP32).SerializeToString()
    return frame(PUSH, request_id, meta, data)


def dp_pull(h, tensor, min_version, request_id, dtype=None, timeout_ms=0):
    d = stubs().dpb
    meta = d.DataPull(spec_hash=h, tensor=tensor, slice=0, min_version=min_version,
                      dtype=dtype or stubs().pb.DTYPE_FP32, timeout_ms=timeout_ms)
    return frame(PULL, request_id, meta.SerializeToString())
