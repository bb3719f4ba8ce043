"""Hostile clients against the shard core's limits: Apply's lr, the
size of a job, checkpoint retention and queue, state files that are not
files. One test per attack, named in its docstring; the harness is
tests/python/hostile.py.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_hostile_core.py
"""

import os

import grpc

import hostile
from hostile import SERVER_RSS_CEILING, Shard, stubs
from zshard_servers import Shards

NUMELS = [1000, 24]


def test_apply_lr_1e300_refused_weights_unchanged():
    """The attack "Apply with lr = 1e300 (finite double, infinite float)": refused
    with INVALID_ARGUMENT, the step not taken, the weights as they were."""
    pb = stubs().pb
    with Shard() as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        hostile.push_all(c, h, 1, NUMELS)
        hostile.grad_stats(c, h, 1)
        before = [hostile.pull(c, h, t).data for t in range(len(NUMELS))]
        for bad in (pb.ApplyRequest(spec_hash=h, step=1, lr=1e300, coef=1.0),
                    pb.ApplyRequest(spec_hash=h, step=1, lr=1e-3, coef=1.0, group_lr=[1e300]),
                    pb.ApplyRequest(spec_hash=h, step=1, lr=-1e300, coef=1.0)):
            code = c.code("Apply", bad)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, bad)
        info = c.call("GetInfo", pb.GetInfoRequest())
        assert (info.version, info.optimizer_steps) == (0, 0)
        after = [hostile.pull(c, h, t).data for t in range(len(NUMELS))]
        assert after == before, "a refused Apply changed the weights"
        # The step itself is still there to be applied properly.
        applied = c.call("Apply", pb.ApplyRequest(spec_hash=h, step=1, lr=1e-3, coef=1.0))
        assert (applied.version, applied.skipped) == (1, False)


def _checkpoint_bytes(state_dir):
    total = 0
    for root, _, files in os.walk(state_dir):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def test_uncommitted_checkpoints_respect_keep_checkpoints():
    """The attack "30 Checkpoints into new directories ... uncommitted checkpoints
    escape --keep-checkpoints", same directory: 30 steps each checkpointed
    and never committed keep the disk at a few checkpoints, not 30."""
    pb = stubs().pb
    numels = [65536]
    with Shard(args=["--keep-checkpoints", "2"], tokens=True, state_dir=True) as s:
        c, admin = s.client(), s.client("admin")
        h = hostile.open_job(c, numels)
        hostile.init_params(c, h, numels)
        one = None
        for k in range(1, 31):
            hostile.step(c, h, k, numels)
            r = admin.call("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=k))
            one = one or r.file.bytes
        total = _checkpoint_bytes(s.state_dir)
        assert total <= 4 * one, "%d checkpoints' worth on disk (%d bytes, one is %d)" % (
            total // one, total, one)


def test_checkpoints_into_new_directories_bounded():
    """The attack "30 Checkpoints into new directories": each into its own
    directory, never committed, with --keep-checkpoints 2; the disk holds a
    few checkpoints' worth, not 31."""
    pb = stubs().pb
    numels = [65536]
    with Shard(args=["--keep-checkpoints", "2"], tokens=True, state_dir=True) as s:
        c, admin = s.client(), s.client("admin")
        h = hostile.open_job(c, numels)
        hostile.init_params(c, h, numels)
        one = None
        for k in range(30):
            try:
                r = admin.call("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=0,
                                                                  dir="d%02d" % k))
                one = one or r.file.bytes
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        total = _checkpoint_bytes(s.state_dir)
        assert one and total <= 4 * one, "%d checkpoints' worth on disk (%d bytes)" % (
            total // one, total)


def test_open_80m_params_refused():
    """The attack "an Open of 80M parameters from a 70-byte request": beyond
    --max-params it is RESOURCE_EXHAUSTED, nothing is allocated, and a job
    within the limit still opens."""
    pb = stubs().pb
    with Shard(args=["--max-params", "10000000", "--max-tensors", "1000"]) as s:
        c = s.client()
        hostile.reset_peak(s.pid)
        spec = pb.ModelSpec(job="squat", world_size=1, grad_accum=1, num_shards=1,
                            groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_ADAMW, lr_scale=1.0,
                                                  beta1=0.9, beta2=0.999, eps=1e-8)],
                            tensors=[pb.TensorSpec(name="w", numel=80_000_000, group=0)])
        request = pb.OpenRequest(spec=spec)
        assert len(request.SerializeToString()) < 100
        code = c.code("Open", request)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
        assert s.memory()[1] < SERVER_RSS_CEILING
        assert c.call("GetInfo", pb.GetInfoRequest()).job == ""
        hostile.open_job(c, NUMELS)


def test_open_1m_tensors_refused():
    """The attack "an Open of 1M tensors" (300k here, to keep the test short; the
    limit is 1000): beyond --max-tensors it is RESOURCE_EXHAUSTED and the
    server's memory stays bounded."""
    pb = stubs().pb
    with Shard(args=["--max-params", "10000000", "--max-tensors", "1000"]) as s:
        c = s.client()
        hostile.reset_peak(s.pid)
        spec = pb.ModelSpec(job="squat", world_size=1, grad_accum=1, num_shards=1,
                            groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_SGD, lr_scale=1.0)],
                            tensors=[pb.TensorSpec(name="t%d" % i, numel=16, group=0)
                                     for i in range(300_000)])
        code = c.code("Open", pb.OpenRequest(spec=spec), timeout=120)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
        assert s.memory()[1] < SERVER_RSS_CEILING
        assert c.call("GetInfo", pb.GetInfoRequest()).job == ""


def test_far_ahead_checkpoints_do_not_block_real_ones():
    """The attack "3 Checkpoints for step 1e9, then cancelled": the real Checkpoint,
    its commit and a Restore still go through."""
    pb = stubs().pb
    with Shard(tokens=True, state_dir=True) as s:
        c, admin = s.client(), s.client("admin")
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        far = [admin.future("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=10**9), timeout=60)
               for _ in range(3)]
        # Each is either refused at once or parked; the attacker gives up.
        hostile.wait_for(lambda: all(f.done() for f in far), seconds=1)
        for f in far:
            f.cancel()
        hostile.step(c, h, 1, NUMELS)
        r = admin.call("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=1),
                       timeout=hostile.OUTCOME_SECONDS)
        admin.call("CommitCheckpoint", pb.CommitCheckpointRequest(
            spec_hash=h, step=1, optimizer_steps=1, files=[r.file]),
            timeout=hostile.OUTCOME_SECONDS)
        hostile.step(c, h, 2, NUMELS)
        restored = admin.call("Restore", pb.RestoreRequest(spec_hash=h, step=1),
                              timeout=hostile.OUTCOME_SECONDS)
        assert (restored.version, restored.changed) == (1, True)


def _fifo_startup(tmp, name):
    """Takes a real checkpoint of step 0 in tmp/state, replaces its file
    `name` (the shard file or MANIFEST) with a FIFO, and starts a server on
    that state directory. Returns "serving", or the exit code of a server
    that refused to start; a server that hangs fails the test."""
    pb = stubs().pb
    state = os.path.join(tmp, "state")
    with Shard(state_dir=state) as s:
        c = s.client()
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        r = c.call("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=0))
        c.call("CommitCheckpoint", pb.CommitCheckpointRequest(spec_hash=h, step=0,
                                                              files=[r.file]))
    path = os.path.join(state, "step-0", name if name == "MANIFEST" else r.file.name)
    assert os.path.exists(path), os.listdir(os.path.dirname(path))
    os.unlink(path)
    os.mkfifo(path)
    shards = Shards(1, extra_args=["--state-dir", state])
    try:
        with shards:
            return "serving"
    except RuntimeError as e:
        code = shards.procs[0].returncode
        # Shards stops a server that did not get ready with SIGTERM, then
        # SIGKILL: a negative code is a server that hung.
        assert code is not None and code > 0, "startup hung on the FIFO %s: %s" % (path, e)
        return code


def test_fifo_named_like_a_checkpoint_file(tmp_path):
    """The attack "a FIFO named like a checkpoint file ... in the state directory":
    the server starts (or refuses to start) instead of hanging in open()."""
    _fifo_startup(str(tmp_path), "shard")


def test_fifo_named_manifest(tmp_path):
    """The attack "a FIFO named like ... MANIFEST in the state directory"."""
    _fifo_startup(str(tmp_path), "MANIFEST")


def test_the_default_job_limits_honour_the_address_space_limit(tmp_path):
    """A server under `ulimit -v` (RLIMIT_AS) of 4 GiB (or half the machine's
    memory) derives its default --max-params from that, not from the machine:
    an Open that would not fit in its address space is refused at once."""
    import resource
    import subprocess
    import time

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    limit = min(4 << 30, total // 2 // 4096 * 4096)  # below the machine's memory

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    port_file = tmp_path / "port"
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen([os.environ["ZSHARD_SERVER_BIN"], "--listen", "127.0.0.1:0",
                             "--port-file", str(port_file), "--data-listen", "off"],
                            stderr=log, preexec_fn=cap)
    try:
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        text = (tmp_path / "log").read_text()
        assert "memory_limit_bytes=%d" % limit in text, text
        pb = stubs().pb
        c = hostile.Client("127.0.0.1:" + port_file.read_text().strip())
        try:
            spec = pb.ModelSpec(job="big", world_size=1, grad_accum=1, num_shards=1,
                                groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_ADAMW,
                                                      lr_scale=1.0, beta1=0.9, beta2=0.999,
                                                      eps=1e-8)],
                                tensors=[pb.TensorSpec(name="w", numel=300_000_000, group=0)])
            code = c.code("Open", pb.OpenRequest(spec=spec))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, code
        finally:
            c.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
