"""Issue 26, elastic trainers on replica sets: membership changes replicate
like every other write, and a joining member's state copy carries the
membership.

Two shards of two replicas each (real zshard-server processes, 127.0.0.1,
--trainer-timeout-ms, --failover-ms) run test_elastic.py's trainers (W = 3,
gRPC and the data plane): rank 2 is SIGKILLed at step K (left out by the
timeout, decided on the primaries) and a new rank 2 joins at step M while the
others hold before it. Then:

- shard 0: its primary is SIGKILLed right after the join, before any push
  of step M (every trainer holds until then); the trainers fail over to the backup, which must have the join
  (the forwarded ChangeMembership) and the leave (the Apply's set);
- shard 1: its backup was SIGKILLed before the run and is restarted after
  the join; it joins the set at the next applied step while the trainers
  push (over gRPC, their pushes' forwards wait for it on the primary's
  forwarding pool), and its copy must carry the membership (members,
  counters, log, timeout).

The weights must be bit-identical to torch's replay of the membership log
(test_elastic.reference: rank 2 out from K, back from M), which is also the
unreplicated scripted replay's (test_elastic.py checks that one), and every
live member's membership log must be the same.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_elastic_replica.py
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_elastic as te  # noqa: E402
from replica_cluster import ReplicaCluster, stubs, wait_for  # noqa: E402

FAILOVER_MS = 3000  # a loaded machine: a joiner loading its copy must not be dropped
# The trainer timeout: far beyond what a failover holds a trainer up, so that
# only the killed rank is ever left out (it is waited for once, at step K).
TIMEOUT_MS = 8000
REJOIN_SECONDS = 30


def member_stats(rc, shard, index):
    pb, pbg, grpc = stubs()
    with grpc.insecure_channel(rc.member(shard, index).address) as ch:
        return pbg.ZShardStub(ch).Stats(pb.StatsRequest(), timeout=5)


def membership(rc, shard, index):
    s = member_stats(rc, shard, index)
    return (s.member_log, s.members, s.world_size, s.membership_epoch, s.member_joins,
            s.trainer_timeout_ms)


def run(transport):
    args = ["--trainer-timeout-ms", str(TIMEOUT_MS)]
    # Both transports restart the member: over gRPC, a push's forward to it
    # (answered ZS_ENOTREADY while it loads its copy) runs on the primary's
    # forwarding pool, so that its polling threads serve the member's
    # ReplicaFetch calls meanwhile (it used to be dropped for making no
    # progress, and found no step left to copy at).
    with ReplicaCluster(2, 2, failover_ms=FAILOVER_MS, extra_args=args) as rc:
        backup1 = 1
        rc.kill(1, backup1)  # restarted after the membership changed
        procs = [te.spawn({"addresses": rc.addresses, "rank": r, "mode": "before",
                           "transport": transport, "hold_at": te.M}) for r in range(te.W)]
        held = [procs[r] for r in range(te.W) if r != te.VICTIM]
        joiner = None
        try:
            for p in held:
                line = p.stdout.readline().strip()
                assert line == "holding", line + p.stderr.read()[-3000:]
            joiner = te.spawn({"addresses": rc.addresses, "rank": te.VICTIM, "mode": "joiner",
                               "transport": transport, "hold_after_join": True})
            line = joiner.stdout.readline().strip()
            assert line == "joined", line + joiner.stderr.read()[-3000:]
            # Every shard admitted the new rank 2 at step M. Shard 0's primary
            # dies before any push of M; shard 1's backup comes back.
            rc.kill(0, rc.primary(0))
            rc.restart(1, backup1)
            for p in held + [joiner]:
                p.stdin.write("go\n")
                p.stdin.flush()
            logs = {}
            for r in range(te.W):
                if r == te.VICTIM:
                    continue
                out, err = procs[r].communicate(timeout=120)
                assert procs[r].returncode == 0, "rank %d: %s" % (r, err[-3000:])
                logs[r] = te.json.loads(out.strip().splitlines()[-1])
            out, err = joiner.communicate(timeout=120)
            assert joiner.returncode == 0, err[-3000:]
            logs["joiner"] = te.json.loads(out.strip().splitlines()[-1])
            procs[te.VICTIM].wait(30)
        finally:
            for p in procs + ([joiner] if joiner else []):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert wait_for(lambda: rc.whole(1)[0], REJOIN_SECONDS), rc.roles(1)
        live = [(0, rc.primary(0)), (1, 0), (1, 1)]
        return logs, {m: membership(rc, *m) for m in live}


@pytest.mark.parametrize("transport", ["data", "grpc"])
def test_a_kill_a_join_and_a_failover_keep_the_membership_and_the_bits(transport):
    logs, members = run(transport)
    expected = te.reference(join=te.M)
    for r in range(te.W):
        if r == te.VICTIM:
            continue
        assert [s[:3] for s in logs[r]["steps"]] == [
            [s, te.W if s < te.K or s >= te.M else te.W - 1, r] for s in range(1, te.STEPS + 1)
        ], logs[r]["steps"]
        assert logs[r]["weights"] == expected, "rank %d's weights differ" % r
    assert logs["joiner"]["joined_at"] == te.M, logs["joiner"]
    # After every trainer closed: no member left, the log of the kill and the
    # join, the same on the promoted backup and on both members of shard 1
    # (the restarted one from its copy, and the closes forwarded to it).
    log = "1:0,1,2;%d:0,1;%d:0,1,2" % (te.K, te.M)
    want = (log, 0, te.W, te.W + 2, 1, TIMEOUT_MS)
    assert list(members.values()) == [want] * 3, members


def test_a_backup_restarted_without_the_flag_keeps_a_flag_only_job_elastic():
    """A job elastic only through --trainer-timeout-ms (no timeout of its
    own; test_elastic.flag_job_client, W = 2) on one shard of two replicas.
    The backup is SIGKILLed and restarted WITHOUT the flag: it joins from the
    primary's copy, whose membership carries the flag's timeout
    (ReplicaMembership.flag_timeout_ms), so the job stays elastic on it. The
    primary is then SIGKILLed at a step boundary and rank 1 goes silent:
    the promoted backup leaves rank 1 out at the timeout and rank 0 trains
    on, bit-identical to torch's SGD over that membership log. Before the
    fix the joined backup had a fixed membership (timeout 0) and rank 0's
    step waited for rank 1 until its step timeout."""
    te.zshard_servers.use_build_tree_package()
    import array
    import zshard
    timeout_ms = 1000  # the kill is at a step boundary: no push waits on the failover
    args = ["--trainer-timeout-ms", str(timeout_ms)]
    with ReplicaCluster(1, 2, failover_ms=FAILOVER_MS, extra_args=args) as rc:
        # The data plane: over gRPC a joiner loading its copy can be dropped
        # (run()'s comment).
        a = te.flag_job_client(rc.addresses, 0, transport="data")
        b = te.flag_job_client(rc.addresses, 1, transport="data")

        def train(c, rank):
            step = c.current_step
            for t in range(len(te.NUMELS)):
                c.push(t, te.grad(step, rank, t)).wait()
            r = c.step(te.LR)
            return (r.step, r.num_members, r.member_rank)

        def both():
            import threading
            out = [None, None]
            threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, train(c, i)))
                       for i, c in enumerate((a, b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            return out

        assert both() == [(1, 2, 0), (1, 2, 1)]
        primary = rc.wait_primary(0)
        assert primary is not None, rc.roles(0)
        backup = 1 - primary
        rc.kill(0, backup)
        rc.restart(0, backup, without=["--trainer-timeout-ms"])
        assert "--trainer-timeout-ms" not in rc._args(rc.member(0, backup))
        # The backup joins at the primary's next applied step and is in sync
        # after the write after that: both ranks train until the set is
        # whole (at most 10 steps).
        step = 1
        while step < 11:
            step += 1
            assert both() == [(step, 2, 0), (step, 2, 1)]
            if step >= 3 and wait_for(lambda: rc.whole(0)[0], 5):
                break
        assert rc.whole(0)[0], rc.roles(0)
        assert membership(rc, 0, backup) == ("1:0,1", 2, 2, 0, 0, timeout_ms)
        # The primary dies between steps; rank 1 goes silent (never pushes
        # again); the promoted backup leaves it out at the copy's timeout.
        rc.kill(0, primary)
        assert [train(a, 0) for _ in (1, 2)] == [(step + 1, 1, 0), (step + 2, 1, 0)]
        assert rc.primary(0) == backup, rc.roles(0)
        s = member_stats(rc, 0, backup)
        assert (s.member_log, s.members, s.member_leaves, s.trainer_timeout_ms) == \
            ("1:0,1;%d:0" % (step + 1), 1, 1, timeout_ms), s
        weights = []
        for t, n in enumerate(te.NUMELS):
            buf = array.array("f", [0.0] * n)
            a.state_read(t, zshard.MASTER, buf)
            weights.append(buf.tobytes())
        a.close()
    expected = te.reference_members([[0, 1]] * step + [[0], [0]])
    assert weights == [bytes.fromhex(h) for h in expected]
