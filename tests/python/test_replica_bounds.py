"""Replicated shards: how long a forward may hold a trainer's write.

A primary forwards every write it accepted to its backups and answers the
trainer once each acknowledged it or was dropped. The bound is the
forward's, all its attempts together (DESIGN.md "Replica sets", forwards):
a backup that refuses fast and then goes silent holds the write the bound
once, not once per attempt; a large write is given its bytes' time at
REPLICA_MIN_RATE on top, so a slow backup is not dropped for its size,
and a Restore 4 times the primary's own restore. An Apply waits for pushes
still on their way to a backup, queued ones too; at shutdown a forward
stops, its attempt in flight too. The members are real zshard-server
processes on loopback (test_hostile_replica.ReplicaSet), the trainer a raw
gRPC client.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_replica_bounds.py
"""

import os
import signal
import struct
import sys
import threading
import time

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostile  # noqa: E402
from test_hostile_replica import (  # noqa: E402
    NUMELS, ReplicaSet, promote, read_state, zs_status)

FAILOVER_MS = 3000
# How long the backup refuses the write at once before it goes silent.
REFUSE_SECONDS = 1.5
# What the write may take beyond the failover time: the retries' pauses and
# the loopback round trips, far below the REFUSE_SECONDS that a fresh
# failover time per attempt added.
MARGIN_SECONDS = 0.8


def _open_request(job):
    """The OpenRequest of hostile.open_job's job (NUMELS, rank 0), to send
    as a future."""
    pb = hostile.stubs().pb
    spec = pb.ModelSpec(
        job=job, world_size=1, grad_accum=1, num_shards=1, grad_reduce=pb.GRAD_REDUCE_MEAN,
        param_dtype=pb.DTYPE_BF16,
        groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_ADAMW, lr_scale=1.0, beta1=0.9, beta2=0.999,
                              eps=1e-8, weight_decay=0.01)],
        tensors=[pb.TensorSpec(name="t%d" % i, numel=n, group=0) for i, n in enumerate(NUMELS)])
    return pb.OpenRequest(spec=spec, rank=0)


def _primary_with_job(rs, world_size=1):
    """Member 0 promoted, member 1 its backup, a job of NUMELS opened and
    initialised on the primary; returns (the primary's client, the hash)."""
    promote(rs, 0, 1)
    assert hostile.wait_for(lambda: rs.role(1) == "backup")
    p = rs.client(0)
    h = hostile.open_job(p, NUMELS, world_size=world_size)
    hostile.init_params(p, h, NUMELS)
    return p, h


def test_a_backup_that_refuses_then_goes_silent_holds_a_write_the_failover_time_once():
    """The backup refuses the job's Open at once (ZS_ELIMIT: its
    --max-tensors is below the job's; a refusal that may pass, so the
    primary retries), and 1.5 s into the write it is SIGSTOPped: the next
    attempt waits only what is left of the forward's failover time, so the
    Open is answered about --failover-ms after it began (not 1.5 s +
    --failover-ms) and the backup is dropped."""
    rs = ReplicaSet(failover_ms=FAILOVER_MS)
    rs.env[1] = {"ZSHARD_MAX_TENSORS": "1"}
    with rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        backup = rs.procs[1].pid
        timer = threading.Timer(REFUSE_SECONDS, os.kill, (backup, signal.SIGSTOP))
        try:
            t0 = time.monotonic()
            timer.start()
            hostile.open_job(p, NUMELS)  # two tensors: refused by the backup
            took = time.monotonic() - t0
        finally:
            timer.cancel()
            timer.join()
            os.kill(backup, signal.SIGCONT)
        log = rs.log(0)
        assert "replica_dropped" in log, log[-3000:]
        assert took > REFUSE_SECONDS, "the Open ended before the backup went silent"
        assert took < FAILOVER_MS / 1000.0 + MARGIN_SECONDS, took


# One InitParams of 8M float32 elements (32 MiB, 32 of the protocol's chunks
# in one message): its forward gets 2 s at REPLICA_MIN_RATE (16 MiB/s) on top
# of the failover time (1 s here).
BIG = 8 << 20
# Longer than the failover time, shorter than the failover time and the
# bytes' time together.
STOP_SECONDS = 1.8


def test_a_large_write_to_a_backup_slower_than_the_failover_time_does_not_drop_it():
    """The backup is SIGSTOPped (a slow link, a loaded machine) while the
    primary forwards a 32 MiB InitParams, and continued 1.8 s later: the
    forward waits the failover time plus the bytes at REPLICA_MIN_RATE, so
    the backup takes the write and stays in the set with the same weights
    (before, each attempt waited the failover time alone and the backup was
    dropped, to rejoin by a copy)."""
    pb = hostile.stubs().pb
    with ReplicaSet() as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        h = hostile.open_job(p, [BIG])
        data = struct.pack("<f", 0.5) * BIG
        backup = rs.procs[1].pid
        os.kill(backup, signal.SIGSTOP)
        timer = threading.Timer(STOP_SECONDS, os.kill, (backup, signal.SIGCONT))
        try:
            timer.start()
            t0 = time.monotonic()
            p.call("InitParams", pb.InitParamsRequest(spec_hash=h, tensor=0, slice=0, offset=0,
                                                      data=data))
            took = time.monotonic() - t0
        finally:
            timer.cancel()
            timer.join()
            os.kill(backup, signal.SIGCONT)
        assert took > STOP_SECONDS, "the write did not wait for the stopped backup"
        assert "replica_dropped" not in rs.log(0), rs.log(0)[-3000:]
        assert rs.role(1) == "backup"
        b = rs.client(1)
        assert read_state(b, h, 0, 1000) == read_state(p, h, 0, 1000)


ZS_ECLOSED = -12
# gsrv's grace for calls in flight at shutdown (GSRV_DEFAULT_GRACE_MS).
GRACE_SECONDS = 10.0
# A failover time far beyond the grace: a forward that retried until it
# dropped the backup would hold the shutdown that long.
LONG_FAILOVER_MS = 30000


def _terminate_during_open(rs, p, job):
    """Sends the job's Open to the primary (client p) and, once the primary
    opened it and its forward has waited 0.5 s, SIGTERM; checks that the
    Open was answered ZS_ECLOSED and returns how long the primary took to
    exit."""
    fut = p.future("Open", _open_request(job), timeout=LONG_FAILOVER_MS / 1e3 + 30)
    assert hostile.wait_for(lambda: "job_opened" in rs.log(0), seconds=10)
    time.sleep(0.5)  # the forward waits meanwhile
    assert not fut.done()
    t0 = time.monotonic()
    rs.procs[0].send_signal(signal.SIGTERM)
    rs.procs[0].wait(timeout=LONG_FAILOVER_MS / 1e3 + 30)
    took = time.monotonic() - t0
    try:
        fut.result()
        raise AssertionError("the Open succeeded")
    except grpc.RpcError as e:
        assert zs_status(e) == ZS_ECLOSED, (e.code(), e.details())
    return took


def test_a_primary_shut_down_during_a_forward_stops_retrying_and_answers_closed():
    """The backup refuses the job's Open at once, again and again (ZS_ELIMIT,
    a refusal that may pass), and the primary is sent SIGTERM while it
    retries: after the grace for calls in flight the forward makes no
    further attempt, the trainer's Open is answered ZS_ECLOSED, and the
    primary exits within the grace and a margin, not after the forward's
    failover time (30 s here)."""
    rs = ReplicaSet(failover_ms=LONG_FAILOVER_MS)
    rs.env[1] = {"ZSHARD_MAX_TENSORS": "1"}
    with rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        took = _terminate_during_open(rs, p, "closing")
        assert took < GRACE_SECONDS + 4.0, took
        assert "replica_dropped" not in rs.log(0)


# Each Push's forward waits this long in the primary's forwarding pool before
# it begins (ZSHARD_TEST_PUSH_FWD_STALL_MS), longer than the failover time
# (1 s): a pool busy with other forwards, a loaded machine.
PUSH_STALL_MS = 2000


def test_an_apply_waits_for_a_push_still_queued_for_its_forward():
    """World 2. Rank 1's last Push is accepted by the primary, which then
    holds every contribution: rank 0's GradStats completes and its Apply
    is applied and forwarded while that Push still waits for a forwarding
    thread (2 s here, against --failover-ms 1000). The backup answers the
    Apply ZS_ENOTREADY (it misses the push); the primary must wait for the
    push on its way rather than drop the backup after the failover time
    (the soak's "Apply: step N still misses 1 of 4 contributions" drop).
    The backup stays in the set with the primary's weights."""
    pb = hostile.stubs().pb
    rs = ReplicaSet(failover_ms=1000)
    rs.env[0] = {"ZSHARD_TEST_PUSH_FWD_STALL_MS": str(PUSH_STALL_MS)}
    with rs:
        p, h = _primary_with_job(rs, world_size=2)
        hostile.push_all(p, h, 1, NUMELS, rank=0)
        failed = []

        def rank1():
            try:
                hostile.push_all(rs.client(0), h, 1, NUMELS, rank=1, value=0.5)
            except Exception as e:  # noqa: BLE001 (reported below)
                failed.append(e)

        t = threading.Thread(target=rank1)
        t.start()
        try:
            hostile.grad_stats(p, h, 1)
            p.call("Apply", pb.ApplyRequest(spec_hash=h, step=1, lr=1e-3, coef=1.0))
        finally:
            t.join()
        assert not failed, failed
        log = rs.log(0)
        assert "ZSHARD_TEST_PUSH_FWD_STALL_MS" in log, log[-3000:]
        assert "replica_dropped" not in log, log[-3000:]
        assert rs.role(1) == "backup"
        b = rs.client(1)
        for t_idx, n in enumerate(NUMELS):
            assert read_state(b, h, t_idx, n) == read_state(p, h, t_idx, n)


def test_a_primary_shut_down_while_a_forward_waits_on_a_silent_backup_exits_within_the_grace():
    """The backup is SIGSTOPped, so the forward of the job's Open waits in
    one attempt that the backup never answers (the failover time is 30 s),
    and the primary is sent SIGTERM: after the grace for calls in flight the
    attempt in flight is cancelled, the trainer's Open is answered
    ZS_ECLOSED and the primary exits well before the forward's bound; the
    backup is not dropped for it. Measured: 20.4 s after the SIGTERM,
    where the stopped backup's own gRPC connection to the primary, which
    never acknowledges the close, holds the server's shutdown; before the
    cancel the attempt held it to the forward's bound (30 s)."""
    rs = ReplicaSet(failover_ms=LONG_FAILOVER_MS)
    with rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        p = rs.client(0)
        backup = rs.procs[1].pid
        os.kill(backup, signal.SIGSTOP)
        try:
            took = _terminate_during_open(rs, p, "silent")
        finally:
            os.kill(backup, signal.SIGCONT)
        assert took < LONG_FAILOVER_MS / 1e3 - 5.0, took
        assert "replica_dropped" not in rs.log(0)


# How long each member's Restore takes beyond its reading and verifying
# (ZSHARD_TEST_RESTORE_STALL_MS on both), longer than the failover time (1 s).
RESTORE_STALL_MS = 1500


def test_a_restore_slower_than_the_failover_time_does_not_drop_the_backup():
    """Both members share a state directory (the shared volume a replicated
    shard restores from) and each takes 1.5 s to restore, longer than
    --failover-ms 1000: the Restore's forward is given 4 times the
    primary's own restore on top (REPLICA_FWD_RESTORE), so the backup,
    which restores as slowly, is not dropped, and both members hold the
    checkpoint's weights afterwards."""
    pb = hostile.stubs().pb
    rs = ReplicaSet()
    state = os.path.join(rs.tmp, "state")
    for i in range(2):
        rs.env[i] = {"ZSHARD_STATE_DIR": state,
                     "ZSHARD_TEST_RESTORE_STALL_MS": str(RESTORE_STALL_MS)}
    with rs:
        p, h = _primary_with_job(rs)
        hostile.step(p, h, 1, NUMELS)
        r = p.call("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=1, dir="ck"))
        p.call("CommitCheckpoint", pb.CommitCheckpointRequest(
            spec_hash=h, step=1, optimizer_steps=1, files=[r.file], dir="ck"))
        at_checkpoint = read_state(p, h, 0, NUMELS[0])
        hostile.step(p, h, 2, NUMELS)
        assert read_state(p, h, 0, NUMELS[0]) != at_checkpoint
        t0 = time.monotonic()
        p.call("Restore", pb.RestoreRequest(spec_hash=h, step=1, dir="ck"), timeout=60)
        took = time.monotonic() - t0
        log = rs.log(0)
        assert "ZSHARD_TEST_RESTORE_STALL_MS" in rs.log(1), rs.log(1)[-3000:]
        assert "replica_dropped" not in log, log[-3000:]
        assert took > 2 * RESTORE_STALL_MS / 1e3, "the members did not restore one after the other"
        assert rs.role(1) == "backup"
        b = rs.client(1)
        assert read_state(p, h, 0, NUMELS[0]) == at_checkpoint
        assert read_state(b, h, 0, NUMELS[0]) == at_checkpoint
