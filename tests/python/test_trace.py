"""The piece trace (ZSHARD_TRACE, common/base/trace.h) and its reader
(tests/bench/netsim.d/timeline.py): a pipelined job's shard and trainer,
each given a path prefix, write at exit one record per piece event of every
step, on one clock, in the order the events happen; the reader turns them
into the step's timeline; without the variable nothing is written. A real
zshard-server on loopback and a trainer in its own process (the library
reads the variable when it loads)."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMELINE = os.path.join(SRC, "tests", "bench", "netsim.d", "timeline.py")

PUSH_IN, READY, APPLIED, PULL_IN, PULL_GO, PULL_OUT = 1, 2, 3, 4, 5, 6
C_PUSH, C_PUSH_ACK, C_PULL, C_PULL_DONE = 16, 17, 18, 19

STEPS = 3
TRAINER = r"""
import os, sys
sys.path.insert(0, os.environ["ZSHARD_PYTHONPATH"])
import numpy as np
import zshard
c = zshard.Client(sys.argv[1], rank=0, world_size=1, job="trace", pipelined=1,
                  split_threshold=512, prefetch_depth=0)
c.add_group("sgd")
ids = [c.add_tensor("w%d" % k, n) for k, n in enumerate((4096, 1000, 100))]
c.open_job([np.full(n, 0.5, np.float32) for n in (4096, 1000, 100)])
grads = [np.full(n, 0.25, np.float32) for n in (4096, 1000, 100)]
params = [np.empty(n, np.float32) for n in (4096, 1000, 100)]
for s in range(int(sys.argv[2])):
    pushes = c.push_many(ids, grads)
    c.step(lr=0.5, max_grad_norm=0.0)
    pulls = c.pull_many(ids, params)
    for r in pushes + pulls:
        r.wait()
c.close()
print(float(params[0][0]))
"""


def records(path):
    with open(path) as f:
        head = f.readline()
        assert head.startswith("# zshard trace pid %d " % int(path.split(".")[-2])), head
        assert head.rstrip().endswith("dropped 0"), head
        return [tuple(int(x) for x in line.split()) for line in f]


def test_a_traced_pipelined_job_records_every_piece_event_in_order():
    tmp = tempfile.mkdtemp(prefix="zshard-trace-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_TRACE")}
    env["ZSHARD_PYTHONPATH"] = os.path.abspath(
        env.get("ZSHARD_PYTHONPATH") or os.path.join(SRC, "build", "python"))
    shards = zshard_servers.Shards(2)
    shards.env["ZSHARD_TRACE"] = os.path.join(tmp, "01-job-s")
    with shards:
        tenv = dict(env, ZSHARD_TRACE=os.path.join(tmp, "01-job-t"))
        out = subprocess.run([sys.executable, "-c", TRAINER, shards.addresses, str(STEPS)],
                             env=tenv, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    # The shard wrote its file when SIGTERM ended it, the trainer at its exit.
    files = sorted(os.listdir(tmp))
    shard_files = [f for f in files if f.startswith("01-job-s.")]
    trainer_files = [f for f in files if f.startswith("01-job-t.")]
    assert len(shard_files) == 2 and len(trainer_files) == 1, files
    # Each piece lives on one shard: the two files together hold them all.
    srv = sorted(records(os.path.join(tmp, shard_files[0])) +
                 records(os.path.join(tmp, shard_files[1])))
    cli = records(os.path.join(tmp, trainer_files[0]))

    # Every piece of the three tensors: w0 (4096) and w1 (1000) split over
    # both shards (split_threshold 512), w2 (100) whole.
    pieces = {(r[3], r[4]) for r in cli if r[1] == C_PUSH}
    assert {t for t, _ in pieces} == {0, 1, 2}
    assert len(pieces) > 3, pieces
    for step in range(1, STEPS + 1):
        for kind in (PUSH_IN, READY, APPLIED, PULL_IN, PULL_GO, PULL_OUT):
            got = {(r[3], r[4]) for r in srv if r[1] == kind and r[2] == step}
            # A pull batch is recorded once (PULL_GO) under its first piece.
            if kind == PULL_GO:
                assert got and got <= pieces, (step, kind, got)
            else:
                assert got == pieces, (step, kind, got)
        for kind in (C_PUSH, C_PUSH_ACK, C_PULL, C_PULL_DONE):
            got = {(r[3], r[4]) for r in cli if r[1] == kind and r[2] == step}
            assert got == pieces, (step, kind, got)
        for piece in pieces:
            # One clock: each piece's events in the order they must happen.
            def at(recs, kind):
                return min(r[0] for r in recs if r[1] == kind and r[2] == step
                           and (r[3], r[4]) == piece)
            seq = [at(cli, C_PUSH), at(srv, PUSH_IN), at(srv, READY), at(srv, APPLIED),
                   at(srv, PULL_OUT), at(cli, C_PULL_DONE)]
            assert seq == sorted(seq), (step, piece, seq)
            assert at(cli, C_PULL) <= at(srv, PULL_IN) <= at(srv, PULL_OUT)
            assert at(srv, PUSH_IN) <= at(cli, C_PUSH_ACK)
    # The rank is recorded with the trainer's events and the pushes.
    assert {r[5] for r in cli} == {0}
    assert {r[5] for r in srv if r[1] == PUSH_IN} == {0}

    rep = subprocess.run([sys.executable, TIMELINE, tmp, "--json"], capture_output=True,
                         text=True, timeout=60)
    assert rep.returncode == 0, rep.stderr
    fig = json.loads(rep.stdout.strip().splitlines()[-1])
    assert fig["run"] == "01-job" and fig["steps"] == STEPS - 1
    assert 0 < fig["push_in_last"] <= fig["ready_last"] <= fig["applied_last"]
    assert fig["applied_last"] <= fig["pull_out_last"] <= fig["pull_done_last"]
    assert fig["pulled_at_push_end"] is not None and 0 <= fig["pulled_at_push_end"] <= 1


def test_nothing_is_written_without_the_variable():
    tmp = tempfile.mkdtemp(prefix="zshard-trace-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_TRACE")}
    env["ZSHARD_PYTHONPATH"] = os.path.abspath(
        env.get("ZSHARD_PYTHONPATH") or os.path.join(SRC, "build", "python"))
    cwd_before = set(os.listdir(tmp))
    with zshard_servers.Shards(2) as shards:
        out = subprocess.run([sys.executable, "-c", TRAINER, shards.addresses, "2"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=tmp)
        assert out.returncode == 0, out.stderr
    assert set(os.listdir(tmp)) == cwd_before
    rep = subprocess.run([sys.executable, TIMELINE, tmp], capture_output=True, text=True,
                         timeout=60)
    assert rep.returncode == 1 and "no trace" in rep.stderr
