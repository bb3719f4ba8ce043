"""Issue 13, the replica set's own protocol from a client's side: roles and
terms, Promote's refusals, what a backup refuses and serves, the forward
marker that needs the admin token, ReplicaJoin/ReplicaFetch bounds, a failover
by hand and a rejoin whose state equals the primary's bit for bit.

Real zshard-server processes on 127.0.0.1 (ports picked below the ephemeral
range by ports.free_ports: --replicas needs every member's address before it
starts).
The trainer-side failover (libzshard) and the kill -9 matrix are tested in
test_replica_*.py.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_hostile_replica.py
"""

import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
import urllib.request

import grpc

import hostile
from hostile import stubs
from ports import free_ports

NUMELS = [1000, 24]
ZS_ENOTPRIMARY, ZS_ESTALE, ZS_ENOTREADY, ZS_ECANCELED = -26, -27, -15, -21
ZS_EPERM, ZS_ERANGE, ZS_EINVAL, ZS_EUNIMPL = -24, -22, -1, -19
ROLE = {0: "none", 1: "starting", 2: "primary", 3: "backup", 4: "joining", 5: "stale"}


class ReplicaSet:
    """n members of one shard's replica set; member i is self.procs[i]."""

    def __init__(self, n=2, tokens=False, metrics=False):
        self.tmp = tempfile.mkdtemp(prefix="zshard-rs-")
        self.ports = free_ports(n)
        self.addrs = ["127.0.0.1:%d" % p for p in self.ports]
        self.members = "|".join(self.addrs)
        self.trainer = self.admin = None
        self.extra = []
        if tokens:
            self.trainer = "trainer-" + os.urandom(16).hex()
            self.admin = "admin-" + os.urandom(16).hex()
            for flag, token in (("--token-file", self.trainer), ("--admin-token-file", self.admin)):
                path = os.path.join(self.tmp, flag[2:])
                with open(path, "w") as f:
                    f.write(token + "\n")
                os.chmod(path, 0o600)  # others may not read a token file
                self.extra += [flag, path]
        self.metrics = metrics
        self.procs = [None] * n
        self.clients = []

    def start(self, i):
        binary = os.environ["ZSHARD_SERVER_BIN"]
        args = [binary, "--listen", self.addrs[i], "--replicas", self.members, "--replica-index",
                str(i), "--threads", "1", "--failover-ms", "1000"] + self.extra
        mport = os.path.join(self.tmp, "metrics%d" % i)
        if self.metrics:
            args += ["--metrics-listen", "127.0.0.1:0", "--metrics-port-file", mport]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        log = open(os.path.join(self.tmp, "log%d" % i), "a")
        self.procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        assert hostile.wait_for(lambda: self.info(i) is not None, seconds=20), "member %d" % i

    def kill(self, i):
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(timeout=20)

    def __enter__(self):
        try:
            for i in range(len(self.addrs)):
                self.start(i)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, et, ev, tb):
        for c in self.clients:
            c.close()
        for p in self.procs:
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            if p:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if et is not None:
            for i in range(len(self.addrs)):
                path = os.path.join(self.tmp, "log%d" % i)
                if os.path.exists(path):
                    print("---- member %d log ----\n%s" % (i, open(path).read()[-4000:]))
        shutil.rmtree(self.tmp, ignore_errors=True)

    def client(self, i, token="trainer", md=()):
        token = {"trainer": self.trainer, "admin": self.admin}.get(token, token)
        c = hostile.Client(self.addrs[i], token)
        if md:
            c.metadata = tuple(c.metadata or ()) + tuple(md)
        self.clients.append(c)
        return c

    def info(self, i):
        try:
            c = hostile.Client(self.addrs[i], self.trainer)
            try:
                return c.call("GetInfo", stubs().pb.GetInfoRequest(), timeout=2)
            finally:
                c.close()
        except grpc.RpcError:
            return None

    def role(self, i):
        info = self.info(i)
        return ROLE[info.replica.role] if info else None

    def metrics_text(self, i):
        port = int(open(os.path.join(self.tmp, "metrics%d" % i)).read())
        return urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5).read().decode()


def zs_status(e):
    for k, v in e.trailing_metadata() or ():
        if k == "zs-status":
            return int(v)
    return None


def refused(fn, *args):
    try:
        fn(*args)
    except grpc.RpcError as e:
        return zs_status(e), e.details()
    raise AssertionError("the call succeeded")


def promote(rs, i, term):
    return rs.client(i).call("Promote", stubs().pb.PromoteRequest(term=term, index=i))


def read_state(c, h, tensor, n):
    pb = stubs().pb
    r = c.call("ReadState", pb.ReadStateRequest(spec_hash=h, tensor=tensor, slice=0,
                                                array=pb.STATE_ARRAY_MASTER, offset=0, count=n))
    return bytes(r.data)


def all_state(c, h):
    pb = stubs().pb
    out = []
    for t, n in enumerate(NUMELS):
        for a in (pb.STATE_ARRAY_MASTER, pb.STATE_ARRAY_EXP_AVG, pb.STATE_ARRAY_EXP_AVG_SQ):
            out.append(bytes(c.call("ReadState", pb.ReadStateRequest(
                spec_hash=h, tensor=t, slice=0, array=a, offset=0, count=n)).data))
    return out


def test_fresh_set_has_no_primary_until_promoted():
    """A replica never makes itself primary: a trainer's write is refused
    ENOTPRIMARY naming no primary; Promote makes one, whose peer follows as a
    backup; a second Promote of the same term is ESTALE, and a Promote of
    the live primary's peer ENOTPRIMARY naming the primary."""
    with ReplicaSet() as rs:
        assert rs.role(0) == "starting" and rs.role(1) == "starting"
        st, msg = refused(hostile.open_job, rs.client(0), NUMELS)
        assert st == ZS_ENOTPRIMARY and "no primary is known" in msg, msg
        r = promote(rs, 0, 1)
        assert r.term == 1 and ROLE[r.role] == "primary"
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        st, msg = refused(promote, rs, 0, 1)
        assert st == ZS_ESTALE, msg
        st, msg = refused(promote, rs, 1, 2)
        assert st == ZS_ENOTPRIMARY and rs.addrs[0] in msg, msg
        info = rs.info(0).replica
        assert info.term == 1 and info.primary == 0 and info.failovers == 1
        assert [m.address for m in info.members] == rs.addrs
        assert info.members[1].in_sync


def test_writes_reach_the_backup_bit_for_bit():
    """Three steps through the primary: the backup holds the same master and
    moments, bit for bit, and serves reads; it refuses a trainer's writes."""
    with ReplicaSet() as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        for s in (1, 2, 3):
            assert hostile.step(p, h, s, NUMELS).version == s
        b = rs.client(1)
        assert all_state(p, h) == all_state(b, h)
        assert hostile.pull(b, h, 0, min_version=3).data == hostile.pull(p, h, 0, 3).data
        st, msg = refused(hostile.push_all, b, h, 4, NUMELS)
        assert st == ZS_ENOTPRIMARY and rs.addrs[0] in msg, msg
        info = rs.info(0).replica
        assert info.forwards > 0 and info.forwarded_bytes > 0
        assert rs.info(1).version == 3


def test_forward_marker_needs_the_admin_token():
    """A call that claims to be the primary's forward must carry the admin
    token: with the trainers' it is refused EPERM and changes nothing."""
    with ReplicaSet(tokens=True) as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        h = hostile.open_job(rs.client(0), NUMELS)
        forged = rs.client(1, md=(("zshard-replica-term", "1"),))
        st, msg = refused(hostile.init_params, forged, h, NUMELS)
        assert st == ZS_EPERM and "admin token" in msg, msg
        # A forward of an older term than the backup's is ESTALE: term 5
        # reaches the backup with the primary's next forward.
        promote(rs, 0, 5)
        hostile.init_params(rs.client(0), h, NUMELS)
        assert hostile.wait_for(lambda: rs.info(1).replica.term == 5), rs.info(1)
        old = rs.client(1, token="admin", md=(("zshard-replica-term", "1"),))
        st, msg = refused(hostile.init_params, old, h, NUMELS)
        assert st == ZS_ESTALE and "term 1" in msg, msg


def test_join_and_fetch_refuse_bad_requests():
    """ReplicaJoin and ReplicaFetch are the admin's, check their member,
    term, part and range, and a server without --replicas does not have
    them."""
    with ReplicaSet(tokens=True) as rs:
        pb = stubs().pb
        promote(rs, 0, 1)
        a = rs.client(0, token="admin")
        t = rs.client(0)
        assert t.code("ReplicaJoin", pb.ReplicaJoinRequest(term=1, index=1)) == \
            grpc.StatusCode.PERMISSION_DENIED
        st, msg = refused(a.call, "ReplicaJoin", pb.ReplicaJoinRequest(term=1, index=7))
        assert st == ZS_EINVAL, msg
        st, msg = refused(a.call, "ReplicaJoin", pb.ReplicaJoinRequest(term=9, index=1))
        assert st == ZS_ESTALE, msg
        # A fetch must name a join in progress (the id ReplicaJoin gave):
        # a copy read outside one would miss the writes after it.
        for join_id in (0, 12345):
            st, msg = refused(a.call, "ReplicaFetch", pb.ReplicaFetchRequest(
                join_id=join_id, part=pb.REPLICA_PART_MASTER, offset=0, count=4))
            assert st == ZS_ECANCELED, msg
    with hostile.Shard() as s:
        assert s.client().code("Promote", pb.PromoteRequest(term=1)) == \
            grpc.StatusCode.UNIMPLEMENTED


def test_failover_by_hand_and_rejoin():
    """kill -9 the primary; Promote the backup (term 2): it holds every
    applied step and takes the next; the old primary, restarted, joins by
    copying the new primary's state and then holds the same bits."""
    with ReplicaSet(metrics=True) as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        for s in (1, 2):
            hostile.step(p, h, s, NUMELS)
        # The backup holds both steps (it was in sync for each write).
        assert rs.info(0).replica.members[1].in_sync and rs.info(1).version == 2
        rs.kill(0)
        r = promote(rs, 1, 2)
        assert ROLE[r.role] == "primary" and r.version == 2
        b = rs.client(1)
        assert hostile.step(b, h, 3, NUMELS).version == 3
        rs.start(0)
        # It joins at an applied step after it asked: train until it is a
        # backup, then one step more, which reaches it as a forward.
        version = 3
        deadline = time.monotonic() + 60
        while rs.role(0) != "backup":
            assert time.monotonic() < deadline, rs.info(0)
            version += 1
            hostile.step(b, h, version, NUMELS)
            time.sleep(0.2)
        version += 1
        hostile.step(b, h, version, NUMELS)
        assert rs.info(1).replica.members[0].in_sync
        c0 = rs.client(0)
        assert all_state(c0, h) == all_state(b, h)
        assert rs.info(0).version == rs.info(1).version
        text = rs.metrics_text(1)
        assert 'zshard_replica_role{shard="0",role="primary"} 1' in text
        assert 'zshard_replica_term{shard="0"} 2' in text
        assert 'zshard_replica_failovers_total{shard="0"} 1' in text
        assert rs.info(1).replica.joins >= 1
