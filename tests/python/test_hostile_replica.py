"""Issue 13, the replica set's own protocol from a client's side: roles and
terms, Promote's refusals, what a backup refuses and serves, the forward
marker that needs the admin token, ReplicaJoin/ReplicaFetch bounds, a failover
by hand and a rejoin whose state equals the primary's bit for bit. Issue 23:
the term attacks a trainer's token allowed (item 8), members whose --replicas
lists disagree (item 6), a stale backup that takes over (item 5).

Real zshard-server processes on 127.0.0.1 (ports picked below the ephemeral
range by ports.free_ports: --replicas needs every member's address before it
starts).
The trainer-side failover (libzshard) and the kill -9 matrix are tested in
test_replica_*.py.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_hostile_replica.py
"""

import contextlib
import json
import os
import shutil
import re
import signal
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request

import grpc
import pytest

import hostile
from hostile import stubs
from ports import free_ports

NUMELS = [1000, 24]
ZS_ENOTPRIMARY, ZS_ESTALE, ZS_ENOTREADY, ZS_ECANCELED = -26, -27, -15, -21
ZS_EPERM, ZS_ERANGE, ZS_EINVAL, ZS_EUNIMPL = -24, -22, -1, -19
ZS_EBEHIND, ZS_ESTEP = -20, -5
TERM_EXHAUSTED = 2**64 - 1
ROLE = {0: "none", 1: "starting", 2: "primary", 3: "backup", 4: "joining", 5: "stale"}


class ReplicaSet:
    """n members of one shard's replica set; member i is self.procs[i]."""

    def __init__(self, n=2, tokens=False, metrics=False, lists=None, failover_ms=1000):
        """lists(addrs, spare): each member's (--replicas, --replica-index),
        to start members that disagree; spare: an address nobody listens
        on. Default: every member gets the same list, its own place in it."""
        self.tmp = tempfile.mkdtemp(prefix="zshard-rs-")
        self.ports = free_ports(n + 1)
        self.addrs = ["127.0.0.1:%d" % p for p in self.ports[:n]]
        self.members = "|".join(self.addrs)
        self.lists = lists(self.addrs, "127.0.0.1:%d" % self.ports[n]) if lists else \
            [(self.members, i) for i in range(n)]
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
        self.failover_ms = failover_ms
        self.procs = [None] * n
        self.env = [{} for _ in range(n)]  # member i's own ZSHARD_ variables (test hooks)
        self.clients = []

    def start(self, i):
        binary = os.environ["ZSHARD_SERVER_BIN"]
        members, index = self.lists[i]
        args = [binary, "--listen", self.addrs[i], "--replicas", members, "--replica-index",
                str(index), "--threads", "1", "--failover-ms", str(self.failover_ms)] + self.extra
        mport = os.path.join(self.tmp, "metrics%d" % i)
        if self.metrics:
            args += ["--metrics-listen", "127.0.0.1:0", "--metrics-port-file", mport]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        env.update(self.env[i])
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

    def log(self, i):
        with open(os.path.join(self.tmp, "log%d" % i)) as f:
            return f.read()

    def role(self, i):
        info = self.info(i)
        return ROLE[info.replica.role] if info else None

    def metrics_text(self, i):
        port = int(open(os.path.join(self.tmp, "metrics%d" % i)).read())
        return urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5).read().decode()


def cli_status(rs, json_out=True):
    """`zshard status` (ZSHARD_CLI_BIN, as CTest sets it) over the set: the
    parsed --json document, or the table's text."""
    cli = os.environ.get("ZSHARD_CLI_BIN")
    assert cli, "ZSHARD_CLI_BIN must name the zshard CLI"
    args = [cli, "status", "--sample-ms", "0", "--shards", rs.members] + (["--json"] if json_out
                                                                          else [])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
    p = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode in (0, 1), (p.returncode, p.stdout, p.stderr)
    return json.loads(p.stdout) if json_out else p.stdout


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


def promote(rs, i, term, token="trainer"):
    return rs.client(i, token=token).call("Promote", stubs().pb.PromoteRequest(term=term, index=i))


def read_state(c, h, tensor, n):
    pb = stubs().pb
    r = c.call("ReadState", pb.ReadStateRequest(spec_hash=h, tensor=tensor, slice=0,
                                                array=pb.STATE_ARRAY_MASTER, offset=0, count=n))
    return bytes(r.data)


def all_state(c, h, numels=NUMELS):
    pb = stubs().pb
    out = []
    for t, n in enumerate(numels):
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
        rows = cli_status(rs)["shards"]
        assert [(r["role"], r["config_error"]) for r in rows] == [("PRIMARY", ""), ("BACKUP", "")]
        assert "refuses to form a set" not in cli_status(rs, json_out=False)


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
        # A forward of an older term than the backup's is ESTALE: the admin
        # moves the live primary to term 2, which reaches the backup with
        # the primary's next forward.
        promote(rs, 0, 2, token="admin")
        hostile.init_params(rs.client(0), h, NUMELS)
        assert hostile.wait_for(lambda: rs.info(1).replica.term == 2), rs.info(1)
        old = rs.client(1, token="admin", md=(("zshard-replica-term", "1"),))
        st, msg = refused(hostile.init_params, old, h, NUMELS)
        assert st == ZS_ESTALE and "term 1" in msg, msg


def test_a_starting_member_follows_no_forward_of_a_primary_it_has_not_seen():
    """Issue 23, a STARTING member and a newer term's forward: it follows
    only a primary its own probes saw as primary of that term with the same
    member list. A forward of term 1 (the admin token: tokens are off here,
    so any caller holds it) reaching a fresh member whose peer is not
    primary is refused ENOTREADY and changes nothing: the member stays
    STARTING at term 0 with no job. Once member 0 is promoted the set
    forms as before."""
    with ReplicaSet() as rs:
        forged = rs.client(1, md=(("zshard-replica-term", "1"),))
        st, msg = refused(hostile.open_job, forged, NUMELS)
        assert st == ZS_ENOTREADY and "has not yet seen the primary of term 1" in msg, msg
        info = rs.info(1)
        assert ROLE[info.replica.role] == "starting" and info.replica.term == 0, info.replica
        assert info.job == "", info.job
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        hostile.open_job(rs.client(0), NUMELS)
        assert hostile.wait_for(lambda: rs.info(1).job != ""), rs.info(1)
        assert terms(rs) == [1, 1]


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


class Throttle:
    """Runs a member in short bursts (SIGSTOP for `stopped` s, SIGCONT for
    `running` s, again and again) until stopped: a member that is alive and
    answers, but slowly, as one loading a large copy on a busy node."""

    def __init__(self, proc, stopped=0.1, running=0.02):
        self.proc, self.stopped, self.running = proc, stopped, running
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.done.is_set():
            self.proc.send_signal(signal.SIGSTOP)
            self.done.wait(self.stopped)
            self.proc.send_signal(signal.SIGCONT)
            time.sleep(self.running)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join(10)
        self.proc.send_signal(signal.SIGCONT)


# 8M parameters: a copy that takes a throttled joiner seconds to read and
# load; the small first tensor's push is the first write forwarded to it
# (answered at once, "still loading").
BIG = [1024] + [1 << 21] * 4


ASKED = "event=replica_join_asked member=1 term=1 copy=at the next"


def a_backup_misses_a_step_and_asks_to_join(rs, numels, joiner_env=None):
    """The joiner cases' set-up: member 1, a backup of primary 0 (term 1),
    is killed after step 1, misses step 2 (the primary drops it), starts
    again with joiner_env (its test hooks) and asks to join; its copy is
    made at the primary's next step. Returns (the primary's client, the
    job's hash, how many join requests the primary had logged before)."""
    promote(rs, 0, 1)
    assert hostile.wait_for(lambda: rs.role(1) == "backup")
    p = rs.client(0)
    h = hostile.open_job(p, numels)
    hostile.init_params(p, h, numels)
    hostile.step(p, h, 1, numels)
    rs.kill(1)
    hostile.step(p, h, 2, numels)  # dropped after --failover-ms
    before = rs.log(0).count(ASKED)
    rs.env[1].update(joiner_env or {})
    rs.start(1)
    assert hostile.wait_for(lambda: rs.log(0).count(ASKED) > before, seconds=30), \
        rs.log(0)[-2000:]
    return p, h, before


def the_joiner_joins_while_the_writes_go_on(rs, p, h, numels, before, slowly=None):
    """The joiner cases' story after the set-up: the copy is made at step 3
    and step 4's pushes, forwarded to the joiner, wait while it reads and
    loads the copy (both inside slowly(), a context that slows it, when
    given). The joiner must join at its first request without being dropped
    ("still loading its copy"), be in sync after step 5 and hold the
    primary's bits."""
    with slowly() if slowly else contextlib.nullcontext():
        hostile.step(p, h, 3, numels)  # the copy is made at this step: the joiner loads it
        hostile.push_all(p, h, 4, numels)  # forwarded to the joiner: waits while it loads
    hostile.grad_stats(p, h, 4)
    p.call("Apply", stubs().pb.ApplyRequest(spec_hash=h, step=4, lr=1e-3, coef=1.0))
    assert hostile.wait_for(lambda: rs.role(1) == "backup", seconds=30), rs.info(1)
    hostile.step(p, h, 5, numels)
    assert rs.info(0).replica.members[1].in_sync
    log = rs.log(0)
    assert log.count(ASKED) == before + 1, log[-3000:]
    assert "still loading its copy" not in log, log[-3000:]
    assert all_state(rs.client(1), h, numels) == all_state(p, h, numels)


def test_a_joiner_slower_than_the_failover_time_joins_while_the_writes_go_on():
    """Issue 23: a joiner that answers "still loading" (ENOTREADY) was
    dropped once a write had waited --failover-ms for it, so a member whose
    copy takes longer than that could never rejoin while the trainers
    wrote. The bound is on progress: a write waits while the joiner makes
    progress on its copy (the copy made, each ReplicaFetch served), and the
    joiner is dropped only after --failover-ms without any. A throttled
    joiner (alive but at half speed: its copy of 8M parameters takes it
    longer than the failover time on a quiet machine)
    joins at its first request while the trainer writes, and ends with the
    primary's bits."""
    with ReplicaSet() as rs:
        p, h, before = a_backup_misses_a_step_and_asks_to_join(rs, BIG)
        # Half speed: slower than --failover-ms over the whole copy, yet a
        # step forward well within it even on a loaded machine.
        the_joiner_joins_while_the_writes_go_on(
            rs, p, h, BIG, before, slowly=lambda: Throttle(rs.procs[1], stopped=0.05, running=0.05))
        loaded = re.findall(r"event=replica_loaded primary=0 term=1 copy=yes took_ms=(\d+)", rs.log(1))
        assert len(loaded) == 1, rs.log(1)[-2000:]
        print("the throttled joiner's copy took %s ms (--failover-ms 1000)" % loaded[0])


def test_a_joiner_whose_load_outlasts_the_failover_time_joins_while_the_writes_go_on():
    """Issue 23: a joiner that read its copy sent no sign of progress while
    it loaded the copy into its core (core_restore), so a load longer than
    --failover-ms got it dropped by the write waiting for it ("still
    loading its copy"), and it joined again at a later step, as often as
    its load took that long. It now tells the primary every quarter of the
    failover time that it is loading (ReplicaFetch of REPLICA_PART_LOADING),
    which counts as progress. Here its load takes 2.5 s
    (ZSHARD_TEST_LOAD_STALL_MS) against --failover-ms 1000, while the
    trainer's next step's pushes wait for it: it joins at its first request
    and ends with the primary's bits."""
    with ReplicaSet() as rs:
        p, h, before = a_backup_misses_a_step_and_asks_to_join(
            rs, NUMELS, joiner_env={"ZSHARD_TEST_LOAD_STALL_MS": "2500"})
        the_joiner_joins_while_the_writes_go_on(rs, p, h, NUMELS, before)
        assert "ZSHARD_TEST_LOAD_STALL_MS" in rs.log(1)
        loaded = re.findall(r"event=replica_loaded primary=0 term=1 copy=yes took_ms=(\d+)",
                            rs.log(1))
        assert len(loaded) == 1 and int(loaded[0]) >= 2500, rs.log(1)[-2000:]


def test_a_copy_slower_to_make_than_the_failover_time_does_not_drop_its_joiner():
    """Issue 23: the primary's own copy for a joiner (core_snapshot_async)
    took longer than --failover-ms under load (2.2 s for 8M parameters at a
    load average of 22), and a write waiting for the joiner meanwhile
    dropped it ("still loading its copy and made no progress"): the joiner
    can make none before the copy exists, and a shard whose copy always
    takes that long could never rejoin while the trainers wrote. The wait
    for a copy still being made is the primary's; the bound on the joiner
    counts from the copy made. Here the copy takes 2.5 s longer to make
    (ZSHARD_TEST_COPY_STALL_MS on the primary) against --failover-ms 1000."""
    rs = ReplicaSet()
    rs.env[0]["ZSHARD_TEST_COPY_STALL_MS"] = "2500"
    with rs:
        p, h, before = a_backup_misses_a_step_and_asks_to_join(rs, NUMELS)
        # The copy is made at step 3, 2.5 s late; step 4's pushes wait for it.
        the_joiner_joins_while_the_writes_go_on(rs, p, h, NUMELS, before)
        assert "ZSHARD_TEST_COPY_STALL_MS" in rs.log(0)


# ------------------------------------------------------------ issue 23, item 8: terms


def terms(rs):
    return [rs.info(i).replica.term for i in range(len(rs.addrs))]


def test_a_trainer_cannot_move_a_live_primarys_term():
    """Promote(2^64 - 1) with a trainer's token, to the live primary and to
    its backup, is refused and changes no term, not even through the next
    forward; a trainer may not move the live primary's term by one either.
    The admin may, by one and no more."""
    with ReplicaSet(tokens=True) as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        st, msg = refused(promote, rs, 0, TERM_EXHAUSTED)
        assert st == ZS_ERANGE and "to 2 at most" in msg, msg
        st, msg = refused(promote, rs, 1, TERM_EXHAUSTED)
        assert st == ZS_ERANGE, msg
        st, msg = refused(promote, rs, 0, 2)
        assert st == ZS_EPERM and "admin token" in msg, msg
        st, msg = refused(promote, rs, 1, 2)
        assert st == ZS_ENOTPRIMARY and rs.addrs[0] in msg, msg
        # The next forward carries the primary's term: still 1 everywhere.
        assert hostile.step(p, h, 1, NUMELS).version == 1
        assert terms(rs) == [1, 1]
        assert (rs.role(0), rs.role(1)) == ("primary", "backup")
        st, msg = refused(promote, rs, 0, TERM_EXHAUSTED, "admin")
        assert st == ZS_ERANGE, msg
        r = promote(rs, 0, 2, token="admin")
        assert r.term == 2 and ROLE[r.role] == "primary"
        assert hostile.step(p, h, 2, NUMELS).version == 2
        assert hostile.wait_for(lambda: terms(rs) == [2, 2]), terms(rs)


def test_a_trainers_term_hint_does_not_depose_the_primary():
    """A Stats call with metadata zshard-term: 2^64 - 1 (and one of term 2)
    makes the primary probe its peers, nothing more: it stays primary, its
    backup stays a backup, and the next step is taken by both."""
    with ReplicaSet(tokens=True) as rs:
        pb = stubs().pb
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        for hint in (TERM_EXHAUSTED, 2):
            hinted = rs.client(0, md=(("zshard-term", str(hint)),))
            hinted.call("Stats", pb.StatsRequest())
            hinted.call("Stats", pb.StatsRequest())
        # Time for the probes the hints asked for (a monitor round is 250 ms).
        time.sleep(1.5)
        assert (rs.role(0), rs.role(1)) == ("primary", "backup")
        assert hostile.step(p, h, 1, NUMELS).version == 1
        assert rs.info(0).replica.members[1].in_sync and rs.info(1).version == 1
        assert terms(rs) == [1, 1]


def test_failover_terms_move_by_one_and_cannot_be_exhausted():
    """With the primary dead, a trainer's Promote(2^64 - 1) or Promote(3) to
    the backup is refused; Promote(2) makes it primary of term 2, and the
    failover after that still works (term 3)."""
    with ReplicaSet(tokens=True) as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        assert hostile.step(p, h, 1, NUMELS).version == 1
        rs.kill(0)
        for term in (TERM_EXHAUSTED, 2**48 + 1, 3):
            st, msg = refused(promote, rs, 1, term)
            assert st == ZS_ERANGE and "to 2 at most" in msg, (term, msg)
        r = promote(rs, 1, 2)
        assert r.term == 2 and ROLE[r.role] == "primary" and r.version == 1
        b = rs.client(1)
        assert hostile.step(b, h, 2, NUMELS).version == 2
        rs.start(0)
        # It joins at an applied step after it asked: train until it is a
        # backup, then one step more, which reaches it as a forward.
        version, deadline = 2, time.monotonic() + 60
        while rs.role(0) != "backup":
            assert time.monotonic() < deadline, rs.info(0)
            version += 1
            hostile.step(b, h, version, NUMELS)
            time.sleep(0.2)
        version += 1
        hostile.step(b, h, version, NUMELS)
        assert rs.info(0).replica.term == 2
        rs.kill(1)
        r = promote(rs, 0, 3)
        assert r.term == 3 and ROLE[r.role] == "primary"


def test_a_term_dies_with_its_primary_only_once_the_peers_heard_it():
    """The admin moves the live primary to term 2 and it is killed at once,
    before its backup's next probe round could read the new term: the
    promoted primary told its peers before it answered, so a trainer that
    learnt term 2 from that answer can promote the backup to term 3."""
    with ReplicaSet(tokens=True) as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        # Both reach each other (member 0 started first: its channel to
        # member 1 may still be backing off from the start).
        assert hostile.wait_for(lambda: rs.info(0).replica.members[1].last_seen_s >= 0,
                                seconds=30), rs.info(0)
        assert promote(rs, 0, 2, token="admin").term == 2
        rs.kill(0)
        r = promote(rs, 1, 3)
        assert r.term == 3 and ROLE[r.role] == "primary"


def test_replica_methods_refuse_a_trainers_token():
    """ReplicaJoin and ReplicaFetch need the admin token (the members call
    each other with it); a forward marker with a trainer's token is refused;
    a member list sent with a trainer's GetInfo is not taken for a peer's."""
    with ReplicaSet(tokens=True) as rs:
        pb = stubs().pb
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        t = rs.client(0)
        for method, req in (("ReplicaJoin", pb.ReplicaJoinRequest(term=1, index=1)),
                            ("ReplicaFetch", pb.ReplicaFetchRequest(part=pb.REPLICA_PART_META))):
            assert t.code(method, req) == grpc.StatusCode.PERMISSION_DENIED, method
        forged = rs.client(0, md=(("zshard-replica-term", str(TERM_EXHAUSTED)),))
        st, msg = refused(forged.call, "Stats", pb.StatsRequest())
        assert st == ZS_EPERM, msg
        bogus = pb.GetInfoRequest(replica_members="10.9.9.9:1|10.9.9.8:1", replica_index=1)
        t.call("GetInfo", bogus)
        assert rs.info(0).replica.config_error == ""
        assert terms(rs) == [1, 1] and rs.role(0) == "primary"


# ------------------------------------------------------------ issue 23, item 5: a stale backup


def all_stopped(pid):
    """Whether every thread of process pid is in the stopped state (T)."""
    task = "/proc/%d/task" % pid
    states = []
    for tid in os.listdir(task):
        try:
            with open(os.path.join(task, tid, "stat")) as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return bool(states) and all(s in ("T", "t") for s in states)


def test_a_stale_backup_that_takes_over_answers_ebehind():
    """The backup is stopped, the primary drops it and applies three more
    steps, then dies; the backup, continued and promoted, holds version 2
    only: a trainer at step 6 is told ZS_EBEHIND and to restore, not
    ZS_ESTEP."""
    with ReplicaSet() as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        for s in (1, 2):
            hostile.step(p, h, s, NUMELS)
        rs.procs[1].send_signal(signal.SIGSTOP)
        # kill() returns before every thread has stopped: step 3 must find it
        # stopped, not still answering.
        assert hostile.wait_for(lambda: all_stopped(rs.procs[1].pid), seconds=10)
        try:
            # Step 3's forwards go unanswered: the member is dropped after
            # --failover-ms and the primary goes on alone.
            for s in (3, 4, 5):
                assert hostile.step(p, h, s, NUMELS).version == s
            assert not rs.info(0).replica.members[1].in_sync
            rs.kill(0)
        finally:
            rs.procs[1].send_signal(signal.SIGCONT)
        r = promote(rs, 1, 2)
        # Version 2. Loaded runs, before the test waited for every thread to
        # stop, saw 3 once and 4 once (a fresh-clone CI run, where step 4's
        # forwarded Apply ran out its 10 s deadline at the primary and the
        # backup took it, queued, once continued: its deadline counts from
        # when the backup reads it). Any version short of the primary's 5 is
        # behind it, and what follows holds for each.
        assert ROLE[r.role] == "primary" and 2 <= r.version <= 4, r
        b = rs.client(1)
        pb = stubs().pb
        st, msg = refused(b.call, "GradStats", pb.GradStatsRequest(spec_hash=h, step=6,
                                                                  timeout_ms=1000))
        assert st == ZS_EBEHIND and "restore" in msg, (st, msg)
        st, msg = refused(hostile.push_all, b, h, 6, NUMELS)
        assert st == ZS_EBEHIND and "restore" in msg, (st, msg)
        st, msg = refused(b.call, "Apply", pb.ApplyRequest(spec_hash=h, step=6, lr=1e-3, coef=1.0))
        assert st == ZS_EBEHIND, (st, msg)


def test_a_joined_backup_that_takes_over_answers_ebehind_for_the_step_of_its_copy():
    """A member joins with the primary's copy of version V (its state is
    loaded, not applied: it keeps no record of step V's statistics or
    apply), the primary dies, it is promoted. A trainer that missed step V's
    answers (a delayed rank) and asks for them again is told ZS_EBEHIND and
    to restore, the error the docs name for a set that cannot finish a
    step; it used to get ZS_ESTEP "statistics asked for step V but shard 0
    is at version V"."""
    with ReplicaSet() as rs:
        p, h, _ = a_backup_misses_a_step_and_asks_to_join(rs, NUMELS)
        hostile.step(p, h, 3, NUMELS)  # the copy is made at version 3
        assert hostile.wait_for(lambda: rs.role(1) == "backup", seconds=30), rs.info(1)
        assert rs.info(1).version == 3
        rs.kill(0)
        r = promote(rs, 1, 2)
        assert ROLE[r.role] == "primary" and r.version == 3, r
        b = rs.client(1)
        pb = stubs().pb
        st, msg = refused(b.call, "GradStats", pb.GradStatsRequest(spec_hash=h, step=3,
                                                                  timeout_ms=1000))
        assert st == ZS_EBEHIND and "restore" in msg and "no record" in msg, (st, msg)
        st, msg = refused(b.call, "Apply", pb.ApplyRequest(spec_hash=h, step=3, lr=1e-3, coef=1.0))
        assert st == ZS_EBEHIND and "restore" in msg, (st, msg)
        # The next step is trained as usual.
        assert hostile.step(b, h, 4, NUMELS).version == 4


# A trainer's deadline for each write below: more than the failover time
# (1 s) and the apply, less than the 10 s a silent backup held a gRPC write
# before (REPLICA_RPC_MS), so that the old server failed it ZS_ETIMEDOUT.
WRITE_TIMEOUT = 6


@pytest.mark.parametrize("stopped_before", ["push", "apply"])
def test_a_silent_backup_holds_a_grpc_write_at_most_the_failover_time(stopped_before):
    """Issue 23, "no hang at any point": a primary waited for a backup's
    answer to a gRPC write's forward for 10 s (REPLICA_RPC_MS) before it
    dropped the backup, while docs/OPERATIONS.md says a dead backup holds the
    trainers' writes --failover-ms once (the data plane's forwards did). A
    Push forward now waits the failover time, an Apply forward the failover
    time and REPLICA_APPLY_WAIT_FACTOR times the primary's own apply. The
    backup is SIGSTOPped (silent, its sockets open) before a step's pushes,
    or before its Apply once it took the pushes; the trainer's write, with a
    deadline below 10 s, is answered OK, and the primary dropped the backup
    and goes on alone."""
    pb = stubs().pb
    with ReplicaSet() as rs:  # --failover-ms 1000
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, NUMELS)
        hostile.init_params(p, h, NUMELS)
        hostile.step(p, h, 1, NUMELS)
        assert rs.info(0).replica.members[1].in_sync

        def stop():
            rs.procs[1].send_signal(signal.SIGSTOP)
            assert hostile.wait_for(lambda: all_stopped(rs.procs[1].pid), seconds=10)
        try:
            if stopped_before == "push":
                stop()
            for t, n in enumerate(NUMELS):
                p.call("Push", pb.PushRequest(spec_hash=h, step=2, rank=0, micro=0, tensor=t,
                                              slice=0, dtype=pb.DTYPE_FP32,
                                              data=struct.pack("<f", 0.25) * n),
                       timeout=WRITE_TIMEOUT)
            hostile.grad_stats(p, h, 2)
            if stopped_before == "apply":
                stop()
            r = p.call("Apply", pb.ApplyRequest(spec_hash=h, step=2, lr=1e-3, coef=1.0),
                       timeout=WRITE_TIMEOUT)
            assert r.version == 2, r
            assert not rs.info(0).replica.members[1].in_sync
            log = rs.log(0)
            assert "event=replica_dropped member=1" in log, log[-3000:]
            # The primary goes on alone: the next step waits for nobody.
            assert hostile.step(p, h, 3, NUMELS).version == 3
        finally:
            rs.procs[1].send_signal(signal.SIGCONT)


# ------------------------------------------------------------ issue 23, item 6: lists that disagree


def config_errors(rs):
    return [rs.info(i).replica.config_error for i in range(len(rs.addrs))]


def assert_refused_set(rs, expect):
    """Both members report why (GetInfo), log it once per finding (not once
    a probe), and refuse Promote; no member becomes primary."""
    assert hostile.wait_for(lambda: all(config_errors(rs))), config_errors(rs)
    errors = config_errors(rs)
    assert any(expect in e for e in errors), errors
    for i in range(len(rs.addrs)):
        st, msg = refused(promote, rs, i, 1)
        assert st == ZS_EINVAL and "refuses to form a set" in msg, msg
    time.sleep(1.0)  # several probe rounds: the log must not repeat per probe
    for i in range(len(rs.addrs)):
        lines = [l for l in rs.log(i).splitlines() if "event=replica_config_mismatch" in l]
        assert 1 <= len(lines) <= 2, lines
    assert [rs.role(i) for i in range(len(rs.addrs))] == ["starting", "starting"]
    # `zshard status` shows each member's reason, as GetInfo does.
    rows = cli_status(rs)["shards"]
    assert len(rows) == 2 and all(r["config_error"] for r in rows), rows
    assert any(expect in r["config_error"] for r in rows), rows
    table = cli_status(rs, json_out=False)
    assert table.count("refuses to form a set: ") == 2, table


def test_lists_with_an_unused_address_are_refused():
    """Member 0 lists an address nobody listens on in place of member 1:
    member 1 sees member 0's list differ, member 0 sees member 1's probe
    carry another list; neither forms a set."""
    with ReplicaSet(lists=lambda a, spare: [(a[0] + "|" + spare, 0), (a[0] + "|" + a[1], 1)]) as rs:
        assert_refused_set(rs, spare_name(rs))


def spare_name(rs):
    return "127.0.0.1:%d" % rs.ports[-1]


def test_reversed_lists_are_refused():
    """Member 1 was given the list reversed (it counts itself member 0)."""
    with ReplicaSet(lists=lambda a, spare: [(a[0] + "|" + a[1], 0), (a[1] + "|" + a[0], 0)]) as rs:
        assert_refused_set(rs, "counts itself member 0")


def test_three_members_on_one_side_are_refused():
    """Member 0 lists three members, member 1 two: the member counts differ
    (or, where three members are refused outright, member 0 does not start)."""
    lists = lambda a, spare: [("|".join([a[0], a[1], spare]), 0), (a[0] + "|" + a[1], 1)]
    with ReplicaSet(lists=lists) as rs:
        assert_refused_set(rs, "members in its --replicas")
