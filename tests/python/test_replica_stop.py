"""Replicated shards: a primary silent for longer than the client's RPC timeout fails over.

A primary SIGSTOPped (a long GC pause, a frozen VM, a partition) answers
nothing: the trainer's calls of zs_step after the pushes (GradStats, whose
deadline is step_timeout_ms + rpc_timeout_ms, then Apply, rpc_timeout_ms)
reach their deadline. That must lead to the failover search, as a refused
connection does, and not to ZS_ETIMEDOUT: the backup, which holds every acknowledged push, is promoted
once the primary has been silent for failover_ms, the Apply is repeated on
it, and the run ends bit-identical to the uninterrupted one. The stopped
member is continued later (a Timer, and the cluster's teardown in any
case), finds a newer term, and joins again as a backup.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_replica_stop.py
"""

import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replica_soak  # noqa: E402
from replica_cluster import ReplicaCluster  # noqa: E402
from replica_soak import Team  # noqa: E402
from test_replica_failover import (  # noqa: E402
    SEED, SHARDS, assert_bit_identical, assert_members_identical, assert_whole, wait_whole)

STEPS = 10
RPC_TIMEOUT_MS = 1500
STEP_TIMEOUT_MS = 2000
# Longer than the step's calls' deadlines plus the client's failover time:
# the primary is still stopped when the backup is promoted.
STOP_SECONDS = (STEP_TIMEOUT_MS + RPC_TIMEOUT_MS + replica_soak.CLIENT_FAILOVER_MS) / 1000.0 + 2.5

_refs = {}


def reference(world):
    if world not in _refs:
        _refs[world] = replica_soak.reference(SEED, SHARDS, STEPS, world)[0]
    return _refs[world]


@pytest.mark.parametrize("world", [1, 2], ids=["W1", "W2"])
def test_a_primary_stopped_during_apply_longer_than_the_rpc_timeout_fails_over(world):
    want = reference(world)
    with ReplicaCluster(SHARDS, 2, failover_ms=replica_soak.SERVER_FAILOVER_MS) as rc:
        tr = Team(rc.addresses, SEED, world, options=dict(rpc_timeout_ms=RPC_TIMEOUT_MS,
                                                          step_timeout_ms=STEP_TIMEOUT_MS))
        timer = None
        try:
            for shard in range(SHARDS):
                assert rc.wait_joined(shard), rc.roles(shard)
            tr.step()
            wait_whole(rc, tr, 0)
            p = rc.primary(0)
            term = rc.info(0, p).replica.term

            def stop(point):
                nonlocal timer
                if point == "between_stats_apply" and timer is None:
                    rc.pause(0, p)
                    timer = threading.Timer(STOP_SECONDS, rc.resume, (0, p))
                    timer.start()
            tr.step(hook=stop)
            assert timer is not None
            timer.join(STOP_SECONDS + 30)
            now = rc.primary(0)
            assert now is not None and now != p, rc.roles(0)
            assert rc.info(0, now).replica.term > term
            wait_whole(rc, tr, 0)
            assert tr.step_no <= STEPS
            while tr.step_no <= STEPS:
                tr.step()
            assert_whole(rc, 0)
            assert_members_identical(rc, tr, 0)
            assert_bit_identical(tr.final_state(), want)
        finally:
            if timer is not None:
                timer.cancel()
            tr.close()
