"""Replicated shards: a primary killed and back before any trainer call saw it die.

A supervisor (Kubernetes, systemd) restarts a killed server within a second,
often before the trainer's next call reaches the shard. The restarted member
comes up STARTING with the same flags; with a --state-dir it has loaded its
newest checkpoint, so it holds the job at the same version as the in-sync
backup. The trainer's next call finds no primary: the backup, which holds
every acknowledged write, must become primary (the restarted member is not
in sync: it missed nothing only by chance) and the restarted one must rejoin
as BACKUP. The run ends bit-identical to the uninterrupted one, without a
restore. Both with the kill right after a checkpoint (the restarted member
loads it: equal versions) and without one (it comes back empty).

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_replica_restart.py
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replica_soak  # noqa: E402
from replica_cluster import ReplicaCluster  # noqa: E402
from test_replica_failover import (  # noqa: E402
    SHARDS, assert_bit_identical, assert_members_identical, assert_whole, open_trainer,
    reference, wait_whole)


@pytest.mark.parametrize("after", [replica_soak.CKPT_EVERY, replica_soak.CKPT_EVERY - 1],
                         ids=["after_a_checkpoint", "without_a_checkpoint"])
def test_a_primary_restarted_before_any_call_saw_it_die_rejoins(after):
    want, _ = reference()
    with ReplicaCluster(SHARDS, 2, failover_ms=replica_soak.SERVER_FAILOVER_MS) as rc:
        tr = open_trainer(rc)
        try:
            while tr.step_no <= after:
                tr.step()
            assert_whole(rc, 0)
            p = rc.primary(0)
            term = rc.info(0, p).replica.term
            rc.kill(0, p)
            rc.restart(0, p)
            seen = rc.roles(0)
            tr.step()
            wait_whole(rc, tr, 0)
            assert_whole(rc, 0)
            now = rc.primary(0)
            info = rc.info(0, now).replica
            assert now != p and info.term > term, (seen, rc.roles(0))
            while tr.step_no <= replica_soak.STEPS:
                tr.step()
            assert_members_identical(rc, tr, 0)
            assert_bit_identical(tr.final_state(), want)
            print("\n  after the restart %s, at the end %s" % (seen, rc.roles(0)),
                  file=sys.stderr)
        finally:
            tr.close()
