"""Ranks are authenticated: a trainer that holds a rank token
(`zshard mint-rank-token`, signed with the shards' --rank-key-file) may push
only as its own rank of its own job, on gRPC and on the data plane; a forged,
another job's or an expired token gets nothing in; --require-rank-tokens
refuses pushes under the plain trainers' token. Every refused push leaves the
real rank's push new, not a duplicate (tests/python/hostile.py).

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_hostile_ranks.py
"""

import hashlib
import hmac
import os
import shutil
import struct
import subprocess
import tempfile
import time

import grpc

import hostile
from hostile import DataConn, Shard, stubs

ZS_EPERM = -24
NUMELS = [256, 16]
JOB = "hostile"


def _key_file(shard_or_dir, key):
    d = shard_or_dir.tmp if hasattr(shard_or_dir, "tmp") else shard_or_dir
    path = os.path.join(d, "rank-key")
    with open(path, "w") as f:
        f.write(key + "\n")
    os.chmod(path, 0o600)
    return path


def mint(key, job, rank, expiry=0):
    """The token format of common/net/rank_token.h, written independently of
    the C code: zsr1.<job>.<rank>.<expiry>.<hex HMAC-SHA256>."""
    msg = "zsr1|%s|%d|%d" % (job, rank, expiry)
    mac = hmac.new(key.encode(), msg.encode(), hashlib.sha256).hexdigest()
    return "zsr1.%s.%d.%d.%s" % (job, rank, expiry, mac)


def cli_mint(key_file, job, rank, *extra):
    """The same through `zshard mint-rank-token` (the CLI beside the server)."""
    cli = os.path.join(os.path.dirname(os.path.dirname(os.environ["ZSHARD_SERVER_BIN"])),
                       "client", "zshard")
    out = subprocess.run([cli, "mint-rank-token", "--key-file", key_file, "--job", job,
                          "--rank", str(rank)] + list(extra),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


class RankShard(Shard):
    """A shard with trainer and admin tokens and a rank key (self.key)."""

    def __init__(self, args=(), **kw):
        self.key = "rank-key-" + os.urandom(16).hex()
        self._args = list(args)
        super().__init__(args=(), tokens=True, **kw)
        self.key_file = _key_file(self, self.key)
        self.shards.extra_args = list(self.shards.extra_args) + ["--rank-key-file",
                                                                 self.key_file] + self._args


def _grpc_push(client, h, rank, value=0.25, step=1):
    pb = stubs().pb
    return client.call("Push", pb.PushRequest(spec_hash=h, step=step, rank=rank, micro=0,
                                              tensor=0, slice=0, dtype=pb.DTYPE_FP32,
                                              data=struct.pack("<f", value) * NUMELS[0]))


def _grpc_refused(client, h, rank):
    try:
        _grpc_push(client, h, rank, value=1e30)
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the push as rank %d was accepted" % rank)


def _dp_answer(conn, h, rank, request_id=7):
    conn.send(hostile.dp_push(h, 1, 0, struct.pack("<f", 1e30) * NUMELS[0], rank=rank,
                              request_id=request_id))
    ftype, rid, meta, _ = conn.read_frame()
    assert rid == request_id
    return ftype, meta


def _open(s, world_size=2, job=JOB):
    admin = s.client("admin")
    h = hostile.open_job(admin, NUMELS, world_size=world_size, job=job)
    hostile.init_params(admin, h, NUMELS)
    return admin, h


def test_rank_token_cannot_push_as_another_rank_on_grpc():
    with RankShard() as s:
        admin, h = _open(s)
        rank1 = s.client(cli_mint(s.key_file, JOB, 1))
        code, details = _grpc_refused(rank1, h, 0)
        assert code == grpc.StatusCode.PERMISSION_DENIED, (code, details)
        assert "rank 1" in details and "rank 0" in details, details
        # Its own rank goes in; rank 0's real push is new, not a duplicate.
        assert not _grpc_push(rank1, h, 1).duplicate
        rank0 = s.client(mint(s.key, JOB, 0))
        assert not _grpc_push(rank0, h, 0).duplicate, "the refused push took rank 0's place"


def test_rank_token_cannot_push_as_another_rank_on_the_data_plane():
    pb = stubs().pb
    with RankShard() as s:
        admin, h = _open(s)
        port = s.data_port()
        bad = DataConn(port, token=mint(s.key, JOB, 1))
        try:
            ftype, meta = _dp_answer(bad, h, 0)
            assert ftype == hostile.ERROR, "the push as rank 0 was answered %d" % ftype
            status, message = bad.error(meta)
            assert status == ZS_EPERM and "rank 0" in message, (status, message)
            # A PUSH_BATCH as rank 0 is refused the same way.
            d = stubs().dpb
            data = struct.pack("<f", 1e30) * NUMELS[0]
            meta = d.DataPushBatch(spec_hash=h, step=1, rank=0, micro=0, pieces=[
                d.DataPiece(tensor=0, slice=0, dtype=pb.DTYPE_FP32, length=len(data))])
            bad.send(hostile.frame(hostile.PUSH_BATCH, 8, meta.SerializeToString(), data))
            ftype, rid, meta, _ = bad.read_frame()
            assert rid == 8 and ftype == hostile.ERROR, ftype
            assert bad.error(meta)[0] == ZS_EPERM, bad.error(meta)
            assert bad.ping(9), "the connection did not survive the refusals"
        finally:
            bad.close()
        good = DataConn(port, token=mint(s.key, JOB, 0))
        try:
            ftype, meta = _dp_answer(good, h, 0)
            assert ftype == hostile.PUSH_ACK, ftype
            assert not stubs().dpb.DataPushAck.FromString(meta).duplicate, \
                "the refused push took rank 0's place"
        finally:
            good.close()


def test_forged_expired_and_other_job_tokens_are_refused():
    with RankShard() as s:
        admin, h = _open(s)
        port = s.data_port()
        forged = mint("not-the-key-" + os.urandom(8).hex(), JOB, 0)
        expired = mint(s.key, JOB, 0, expiry=int(time.time()) - 60)
        for token in (forged, expired, forged[:-1], mint(s.key, JOB, 0)[:-2] + "zz"):
            c = s.client(token)
            assert c.code("GetInfo", stubs().pb.GetInfoRequest()) == \
                grpc.StatusCode.UNAUTHENTICATED, token
            try:
                _grpc_push(c, h, 0, value=1e30)
                raise AssertionError("a push under %s was accepted" % token)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            try:
                DataConn(port, token=token).close()
                raise AssertionError("the data plane took %s" % token)
            except hostile.Refused as e:
                assert e.status == hostile.ZS_EUNAUTHENTICATED, e
        # Another job's token is a valid trainer but may not push to this job.
        other = mint(s.key, "other-job", 0)
        code, details = _grpc_refused(s.client(other), h, 0)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "other-job" in details, details
        conn = DataConn(port, token=other)
        try:
            ftype, meta = _dp_answer(conn, h, 0)
            assert ftype == hostile.ERROR and conn.error(meta)[0] == ZS_EPERM, ftype
        finally:
            conn.close()
        assert not _grpc_push(s.client(mint(s.key, JOB, 0)), h, 0).duplicate


def test_require_rank_tokens_refuses_the_plain_trainer_token():
    with RankShard(args=["--require-rank-tokens"]) as s:
        admin, h = _open(s)
        code, details = _grpc_refused(s.client("trainer"), h, 0)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "rank token" in details, details
        conn = DataConn(s.data_port(), token=s.trainer)
        try:
            ftype, meta = _dp_answer(conn, h, 1)
            assert ftype == hostile.ERROR and conn.error(meta)[0] == ZS_EPERM, ftype
            # Pulls under the plain token still work: only pushes need a rank.
            assert conn.ping(3)
        finally:
            conn.close()
        assert hostile.pull(s.client("trainer"), h, 0).version == 0
        assert not _grpc_push(s.client(mint(s.key, JOB, 0)), h, 0).duplicate
        assert not _grpc_push(s.client(mint(s.key, JOB, 1)), h, 1).duplicate


def test_rank_key_file_that_others_may_read_is_refused():
    """The key is checked as the token files are: a world-readable one is a
    usage error at start, naming the file."""
    d = tempfile.mkdtemp(prefix="zshard-rank-key-")
    try:
        key = _key_file(d, "rank-key-" + os.urandom(16).hex())
        os.chmod(key, 0o644)
        tok = os.path.join(d, "tok")
        with open(tok, "w") as f:
            f.write("trainer-" + os.urandom(16).hex() + "\n")
        os.chmod(tok, 0o600)
        out = subprocess.run([os.environ["ZSHARD_SERVER_BIN"], "--listen", "127.0.0.1:0",
                              "--token-file", tok, "--rank-key-file", key],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode != 0, out
        assert "rank-key" in out.stderr and "0644" in out.stderr, out.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)
