"""Replicated shards keep each tensor's step count through a join and a failover.

A tensor that no trainer gave a gradient in a step is skipped by the shards,
so its step count falls behind the job's. A backup that joins copies the
primary's state, counts included (ReplicaFetch META), and applies the later
steps itself; when the primary dies the backup carries on with the right
bias corrections. The run ends bit-identical to the same run on one
unreplicated shard: weights, moments and every tensor's count.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_replica_nograd.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replica_cluster  # noqa: E402
import replica_soak  # noqa: E402
import zshard_servers  # noqa: E402
from replica_cluster import ReplicaCluster  # noqa: E402

import numpy as np  # noqa: E402

import zshard  # noqa: E402

TENSORS = (("always", 300), ("sometimes", 40))
STEPS = 6


def uses(step):
    """Whether "sometimes" gets a gradient at `step`."""
    return step % 2 == 1


def run(addresses, before_step=lambda s: None):
    """STEPS steps of one trainer; returns weights, moments and counts."""
    c = zshard.Client(addresses, job="nograd-replica", open_mode="create",
                      **replica_soak.CLIENT_OPTIONS)
    try:
        c.add_group("adamw", weight_decay=0.01)
        ids = [c.add_tensor(name, n) for name, n in TENSORS]
        c.open_job([np.linspace(-1, 1, n, dtype=np.float32) for _, n in TENSORS])
        for s in range(1, STEPS + 1):
            before_step(s)
            reqs = []
            for i, (t, (name, n)) in enumerate(zip(ids, TENSORS)):
                rng = np.random.default_rng([s, i])
                g = rng.standard_normal(n, dtype=np.float32)
                reqs.append(c.push(t, None if name == "sometimes" and not uses(s) else g))
            replica_soak.wait_all(reqs)
            assert c.step(replica_soak.LR).step == s
        out = {}
        for t, (name, n) in zip(ids, TENSORS):
            w = np.empty(n, dtype=np.float32)
            c.pull(t, w).wait()
            out[name] = w.tobytes()
            for label, array in (("exp_avg", zshard.EXP_AVG), ("exp_avg_sq", zshard.EXP_AVG_SQ)):
                buf = np.empty(n, dtype=np.float32)
                c.state_read(t, array, buf)
                out[name + "." + label] = buf.tobytes()
            out[name + ".steps"] = c.tensor_steps(t)
        return out
    finally:
        c.close()


def test_a_joined_backup_that_takes_over_keeps_the_tensors_counts():
    with zshard_servers.Shards(1) as shards:
        want = run(shards.addresses)
    assert want["always.steps"] == STEPS
    assert want["sometimes.steps"] == sum(uses(s) for s in range(1, STEPS + 1))

    with ReplicaCluster(1, 2, failover_ms=replica_soak.SERVER_FAILOVER_MS,
                        state_dirs=False) as rc:
        killed = []

        def before_step(s):
            if s == 1:
                # Members take their places once the job is open.
                assert rc.wait_joined(0), rc.roles(0)
            elif s == 3:
                # The backup leaves and comes back empty: it joins with a
                # copy of the primary's state at the next applied step.
                backup = 1 - rc.wait_primary(0)
                rc.kill(0, backup)
                rc.restart(0, backup)
                assert rc.wait_joined(0), rc.roles(0)
            elif s == 5:
                # The joined backup is in sync; the primary dies and the
                # backup carries on from its own copy.
                assert replica_cluster.wait_for(lambda: rc.whole(0)[0], 10), rc.roles(0)
                primary = rc.wait_primary(0)
                rc.kill(0, primary)
                killed.append(primary)
        got = run(rc.addresses, before_step)
        assert killed
    differ = sorted(k for k in want if got[k] != want[k])
    assert not differ, "differs from the unreplicated run: %s (counts %s)" % (
        differ, {k: (got[k], want[k]) for k in want if k.endswith(".steps")})
