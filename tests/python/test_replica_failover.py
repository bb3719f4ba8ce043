"""Replicated shards: kill -9, restart and partition, and the results stay bit-identical.

Two shards of two replicas each (real zshard-server processes, 127.0.0.1,
--replicas, --failover-ms 1000) train the deterministic model of
replica_soak.py for 8 steps with zshard's low-level Client, and the test
kills members at chosen points of a step. Every run must end with the
weights, both AdamW moments and the optimizer step count of the same seed's
uninterrupted run on unreplicated shards, bit for bit, without a restore:

- the primary of a shard at each kill point once (before pushes, during
  pushes, between GradStats and Apply, during Apply, during a pull, during a
  checkpoint, which may then fail while training goes on); the killed member
  is restarted a step later, rejoins and ends BACKUP;
- a backup: the primary drops it and keeps its term;
- one member killed and restarted three times (primary, backup, primary):
  each time it rejoins as BACKUP and holds, read with ReadState from it, the
  primary's bits;
- (partitions are test_replica_partition.py).

GetInfo.replica shows the roles, terms, primary index and failover counts
asserted along the way. The long run with random kill points is
tests/python/replica_soak.py (--runs 30).

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_replica_failover.py
"""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replica_cluster  # noqa: E402
import replica_soak  # noqa: E402
from replica_cluster import ReplicaCluster  # noqa: E402
from replica_soak import Kill, Run, Trainer  # noqa: E402,F401

SEED = 7
SHARDS = 2
REJOIN_SECONDS = 30

_refs = {}


def reference(steps=replica_soak.STEPS):
    if steps not in _refs:
        _refs[steps] = replica_soak.reference(SEED, SHARDS, steps)
    return _refs[steps]


def assert_bit_identical(got, want):
    differ = replica_soak.diff(want, got)
    assert not differ, "differs from the uninterrupted run: %s" % differ


def assert_whole(rc, shard, seconds=5):
    """The shard's set is whole (ReplicaCluster.whole), or becomes so within
    `seconds` without a step (the monitor's view may trail by a probe)."""
    replica_cluster.wait_for(lambda: rc.whole(shard)[0], seconds)
    whole, seen = rc.whole(shard)
    assert whole, "shard %d: the set is not whole: %s" % (shard, seen)


def wait_whole(rc, tr, shard):
    """Steps the trainer until the shard's set is whole again
    (ReplicaCluster.whole): a rejoining member is added at the primary's
    next applied step. Returns the steps taken: at most 2, then more only
    while a member is JOINING (it asked after those steps and waits for the
    next one: the copy is made at an applied step), at most 6."""
    taken = 0
    deadline = time.monotonic() + REJOIN_SECONDS
    while True:
        whole, seen = rc.whole(shard)
        if whole:
            return taken
        assert time.monotonic() < deadline, "shard %d not whole again: %s" % (shard, seen)
        joining = any(r is not None and r[0] == "JOINING" for r in rc.roles(shard))
        if taken < 2 or (joining and taken < 6):
            tr.step()
            taken += 1
        else:
            time.sleep(0.1)


def open_trainer(rc):
    """A Trainer on the cluster, once every member has asked to join (a
    backup that asks only after a few steps would not be whole when the
    test kills its primary)."""
    tr = Trainer(rc.addresses, SEED)
    for shard in range(rc.nshards):
        assert rc.wait_joined(shard), "shard %d: %s" % (shard, rc.roles(shard))
    return tr


def assert_members_identical(rc, tr, shard):
    """Every member of `shard` holds the same version and the same bits of
    every array of every piece it owns (ReadState from each member)."""
    pb = replica_cluster.stubs()[0]
    arrays = (pb.STATE_ARRAY_MASTER, pb.STATE_ARRAY_EXP_AVG, pb.STATE_ARRAY_EXP_AVG_SQ)
    pieces = 0
    for t in tr.ids:
        for si, (owner, _, numel) in enumerate(tr.c.tensor_slices(t)):
            if owner != shard:
                continue
            pieces += 1
            for array in arrays:
                seen = [rc.read_state(shard, k, tr.c.spec_hash, t, si, array, numel)
                        for k in range(rc.nreplicas)]
                for k, got in enumerate(seen[1:], 1):
                    assert got[:2] == seen[0][:2], \
                        "s%d: member %d at (version, steps) %s, member 0 at %s" % (
                            shard, k, got[:2], seen[0][:2])
                    assert got[2] == seen[0][2], \
                        "s%d: member %d's array %d of tensor %d slice %d differs" % (
                            shard, k, array, t, si)
    assert pieces > 0


# ------------------------------------------------------------------ the matrix

MATRIX = [
    Kill(2, "before_push", 0),
    Kill(2, "mid_push", 1, frac=0.4),
    Kill(4, "between_stats_apply", 0),
    Kill(4, "during_apply", 1, frac=0.5),
    Kill(5, "mid_pull", 0, frac=0.6),
    Kill(3, "during_checkpoint", 1, frac=0.5),
]


@pytest.mark.parametrize("kill", MATRIX, ids=[k.point for k in MATRIX])
def test_a_killed_primary_costs_no_step_and_no_bit(kill):
    want, calib = reference()
    run = Run(SEED, SHARDS, [kill], calib)
    got = run.run()
    assert kill.victim is not None, "the kill did not happen"
    print("\n  %s: %s; failovers %d; roles %s; failed checkpoints %s" %
          (kill, "landed in the call" if kill.landed else "landed", run.failovers, run.roles,
           run.failed_checkpoints), file=sys.stderr)
    assert_bit_identical(got, want)
    if kill.point != "during_checkpoint":
        assert not run.failed_checkpoints
    # The killed member came back a step later and is a backup again; the
    # promotion shows in the failover count.
    for s in range(SHARDS):
        names = [r and r[0] for r in run.roles[s]]
        assert names.count("PRIMARY") == 1 and names.count("BACKUP") == 1, run.roles
    victim_role = run.roles[kill.shard][kill.victim]
    assert victim_role[0] == "BACKUP", run.roles
    # A fresh set's first primary has term 1 (Promote(highest seen + 1)).
    assert max(r[1] for r in run.roles[kill.shard]) >= 2, \
        "no new term on the shard that lost its primary: %s" % run.roles


def test_a_killed_backup_is_dropped_and_the_primary_keeps_its_term():
    want, _ = reference()
    with ReplicaCluster(SHARDS, 2, failover_ms=replica_soak.SERVER_FAILOVER_MS) as rc:
        tr = open_trainer(rc)
        try:
            tr.step()
            wait_whole(rc, tr, 1)
            p = rc.primary(1)
            before = rc.info(1, p).replica
            backup = 1 - p
            rc.kill(1, backup)
            tr.step()
            after = rc.info(1, p).replica
            assert rc.primary(1) == p
            assert (after.term, after.failovers) == (before.term, before.failovers)
            assert not after.members[backup].in_sync, after
            rc.restart(1, backup)
            taken = wait_whole(rc, tr, 1)
            while tr.step_no <= replica_soak.STEPS:
                tr.step()
            assert taken <= 2
            assert_whole(rc, 1)
            assert rc.primary(1) == p
            assert rc.info(1, backup).replica.joins >= 1
            assert_members_identical(rc, tr, 1)
            assert_bit_identical(tr.final_state(), want)
        finally:
            tr.close()


def test_a_replica_killed_and_restarted_three_times_rejoins_with_the_primarys_bits():
    steps = 11
    want, _ = reference(steps)
    with ReplicaCluster(SHARDS, 2, failover_ms=replica_soak.SERVER_FAILOVER_MS) as rc:
        tr = open_trainer(rc)
        try:
            tr.step()
            wait_whole(rc, tr, 0)
            terms = [rc.info(0, rc.primary(0)).replica.term]
            for round_, which in enumerate(("primary", "backup", "primary")):
                assert_whole(rc, 0)
                p = rc.primary(0)
                victim = p if which == "primary" else 1 - p
                rc.kill(0, victim)
                tr.step()
                rc.restart(0, victim)
                wait_whole(rc, tr, 0)
                assert_whole(rc, 0)
                info = rc.info(0, victim).replica
                assert info.role == replica_cluster.ROLE_BACKUP and info.joins >= 1, info
                assert_members_identical(rc, tr, 0)
                p_now = rc.primary(0)
                pinfo = rc.info(0, p_now).replica
                terms.append(pinfo.term)
                # The members agree on who is primary and list each other in
                # the configured order.
                for k in range(2):
                    r = rc.info(0, k).replica
                    assert r.primary == p_now and r.index == k
                    assert [m.address for m in r.members] == \
                        [rc.member(0, j).address for j in range(2)]
                if which == "primary":
                    assert p_now != victim and pinfo.failovers >= 1
                    assert terms[-1] > terms[-2], terms
                else:
                    assert p_now == p and terms[-1] == terms[-2], terms
            while tr.step_no <= steps:
                tr.step()
            assert_members_identical(rc, tr, 0)
            assert_bit_identical(tr.final_state(), want)
            print("\n  terms %s, failovers %d" % (terms, rc.failovers()), file=sys.stderr)
        finally:
            tr.close()
