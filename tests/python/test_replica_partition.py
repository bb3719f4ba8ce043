"""Replicated shards: a replica cut off by a partition, then healed.

On loopback a process cannot be disconnected, so a partition is emulated by
SIGSTOP of a member for longer than --failover-ms (its sockets stay open and
its peers' packets go unanswered, as when a network drops them), then
SIGCONT; the compose test disconnects a container from its Docker network
instead. Two shards of two replicas train the model of replica_soak.py:

- the primary cut off: training goes on after a failover to the backup, at a
  higher term; the healed old primary must not take writes of its stale
  term, steps down and rejoins as BACKUP with the new primary's bits;
- a backup cut off: the primary drops it (in_sync false) after
  --failover-ms and keeps its term; healed, it rejoins as BACKUP.

Either way the run ends bit-identical to the uninterrupted run, without a
restore, and the members hold the same bits (ReadState from each).

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_replica_partition.py
"""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replica_cluster  # noqa: E402
import replica_soak  # noqa: E402
from replica_cluster import ReplicaCluster  # noqa: E402
from test_replica_failover import (  # noqa: E402
    SHARDS, assert_bit_identical, assert_members_identical, assert_whole, open_trainer,
    reference, wait_whole)

PARTITION_SECONDS = 2.5 * replica_soak.SERVER_FAILOVER_MS / 1000


@pytest.mark.parametrize("who", ["primary", "backup"])
def test_a_partitioned_replica_heals_and_rejoins(who):
    want, _ = reference()
    with ReplicaCluster(SHARDS, 2, failover_ms=replica_soak.SERVER_FAILOVER_MS) as rc:
        tr = open_trainer(rc)
        try:
            tr.step()
            tr.step()
            assert_whole(rc, 0)
            p = rc.primary(0)
            old = rc.info(0, p).replica
            cut = p if who == "primary" else 1 - p
            rc.pause(0, cut)
            t0 = time.monotonic()
            tr.step()  # goes on without the cut-off member
            time.sleep(max(0.0, PARTITION_SECONDS - (time.monotonic() - t0)))
            other = 1 - cut
            oinfo = rc.info(0, other).replica
            if who == "primary":
                assert oinfo.role == replica_cluster.ROLE_PRIMARY and oinfo.term > old.term, \
                    oinfo
            else:
                assert oinfo.role == replica_cluster.ROLE_PRIMARY and oinfo.term == old.term
                assert not oinfo.members[cut].in_sync, oinfo
            rc.resume(0, cut)
            tr.step()
            wait_whole(rc, tr, 0)
            assert rc.primary(0) == other
            assert_whole(rc, 0)
            while tr.step_no <= replica_soak.STEPS:
                tr.step()
            assert_members_identical(rc, tr, 0)
            assert_bit_identical(tr.final_state(), want)
            print("\n  after the partition: %s" % rc.roles(0), file=sys.stderr)
        finally:
            tr.close()
