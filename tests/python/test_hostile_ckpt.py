"""Checkpoints confined to the state directory: a symbolic
link at any level below it (a checkpoint directory, a component on its way,
a step directory, a shard file, the MANIFEST) is never followed by
Checkpoint, CommitCheckpoint, Restore, ListCheckpoints or the retention that
removes old checkpoints. Each is refused with PERMISSION_DENIED naming the
link (or, for a listing, leaves the link out), and nothing outside the state
directory is written, read as state, or removed.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_hostile_ckpt.py
"""

import os
import shutil

import grpc
import pytest

import hostile
from hostile import Shard, stubs

NUMELS = [1000, 24]
LINK_WORDS = "symbolic link"


def _tree(path):
    """Every file and directory under path with its size and mtime: what
    "nothing outside was touched" compares."""
    out = {}
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.lstat(p)
            out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns)
    return out


def _refused(client, method, request):
    try:
        client.call(method, request, timeout=hostile.OUTCOME_SECONDS)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED, (method, e.code(), e.details())
        assert LINK_WORDS in e.details(), e.details()
        return e.details()
    raise AssertionError("%s %s was not refused" % (method, request))


class Setup:
    """A shard with tokens and a state directory, a job at version 1, a
    committed checkpoint of step 1 in <state>/src, and `outside`: a
    directory beside the state directory holding a copy of that checkpoint
    (outside/step-1) for links to point at."""

    def __init__(self, shard):
        pb = stubs().pb
        self.pb = pb
        self.s = shard
        self.c, self.admin = shard.client(), shard.client("admin")
        self.h = hostile.open_job(self.c, NUMELS)
        hostile.init_params(self.c, self.h, NUMELS)
        hostile.step(self.c, self.h, 1, NUMELS)
        r = self.admin.call("Checkpoint", pb.CheckpointRequest(spec_hash=self.h, step=1, dir="src"))
        self.file = r.file
        self.admin.call("CommitCheckpoint", pb.CommitCheckpointRequest(
            spec_hash=self.h, step=1, optimizer_steps=1, files=[r.file], dir="src"))
        self.state = shard.state_dir
        self.outside = os.path.join(os.path.dirname(self.state), "outside")
        os.makedirs(self.outside)
        shutil.copytree(os.path.join(self.state, "src", "step-1"),
                        os.path.join(self.outside, "step-1"))
        self.before = _tree(self.outside)

    def untouched(self):
        assert _tree(self.outside) == self.before, "something outside the state directory changed"

    def checkpoint(self, d, step=1):
        return self.pb.CheckpointRequest(spec_hash=self.h, step=step, dir=d)

    def restore(self, d, step=1):
        return self.pb.RestoreRequest(spec_hash=self.h, step=step, dir=d)

    def listed(self, d):
        r = self.c.call("ListCheckpoints", self.pb.ListCheckpointsRequest(dir=d))
        return [(e.step, e.complete) for e in r.checkpoints]


@pytest.fixture
def setup():
    with Shard(tokens=True, state_dir=True) as s:
        yield Setup(s)


def test_checkpoint_directory_that_is_a_link(setup):
    """<state>/lnk -> outside: Checkpoint into lnk and lnk/sub, Restore from
    and ListCheckpoints of lnk are all refused."""
    os.symlink(setup.outside, os.path.join(setup.state, "lnk"))
    _refused(setup.admin, "Checkpoint", setup.checkpoint("lnk/sub"))
    _refused(setup.admin, "Checkpoint", setup.checkpoint("lnk"))
    _refused(setup.admin, "Restore", setup.restore("lnk"))
    _refused(setup.c, "ListCheckpoints", setup.pb.ListCheckpointsRequest(dir="lnk"))
    setup.untouched()
    assert not os.path.exists(os.path.join(setup.outside, "sub"))


def test_intermediate_component_that_is_a_link(setup):
    """<state>/real/lnk -> outside: a link in the middle of the path."""
    os.makedirs(os.path.join(setup.state, "real"))
    os.symlink(setup.outside, os.path.join(setup.state, "real", "lnk"))
    _refused(setup.admin, "Checkpoint", setup.checkpoint("real/lnk/x"))
    _refused(setup.admin, "Restore", setup.restore("real/lnk"))
    _refused(setup.c, "ListCheckpoints", setup.pb.ListCheckpointsRequest(dir="real/lnk"))
    setup.untouched()


def test_step_directory_that_is_a_link(setup):
    """<state>/d/step-1 -> outside/step-1: not listed, not restored, not
    written into (the old code wrote the new shard file outside)."""
    os.makedirs(os.path.join(setup.state, "d"))
    os.symlink(os.path.join(setup.outside, "step-1"), os.path.join(setup.state, "d", "step-1"))
    assert setup.listed("d") == []
    _refused(setup.admin, "Restore", setup.restore("d"))
    _refused(setup.admin, "Checkpoint", setup.checkpoint("d"))
    setup.untouched()


def test_shard_file_that_is_a_link(setup):
    """<state>/d/step-1 holds the real MANIFEST and a link for the shard
    file: Restore refuses to read it."""
    step = os.path.join(setup.state, "d", "step-1")
    os.makedirs(step)
    shutil.copy(os.path.join(setup.outside, "step-1", "MANIFEST"), step)
    os.symlink(os.path.join(setup.outside, "step-1", setup.file.name),
               os.path.join(step, setup.file.name))
    hostile.step(setup.c, setup.h, 2, NUMELS)
    _refused(setup.admin, "Restore", setup.restore("d"))
    assert [e[0] for e in setup.listed("d")] == [1]
    info = setup.c.call("ListCheckpoints", setup.pb.ListCheckpointsRequest(dir="d"))
    assert not info.checkpoints[0].loadable, "a linked shard file counted as loadable"
    setup.untouched()


def test_manifest_that_is_a_link(setup):
    """<state>/d/step-1/MANIFEST -> outside: the checkpoint is not complete
    and Restore refuses it."""
    step = os.path.join(setup.state, "d", "step-1")
    os.makedirs(step)
    shutil.copy(os.path.join(setup.outside, "step-1", setup.file.name), step)
    os.symlink(os.path.join(setup.outside, "step-1", "MANIFEST"), os.path.join(step, "MANIFEST"))
    hostile.step(setup.c, setup.h, 2, NUMELS)
    assert setup.listed("d") == [(1, False)]
    _refused(setup.admin, "Restore", setup.restore("d"))
    setup.untouched()


def test_retention_never_removes_through_a_link(tmp_path):
    """--keep-checkpoints 1 and <state>/step-0 -> outside/step-0, a link
    named like the oldest checkpoint: committing newer checkpoints removes
    old real ones but never the files the link points at."""
    pb = stubs().pb
    state = str(tmp_path / "state")
    outside = str(tmp_path / "outside")
    os.makedirs(os.path.join(outside, "step-0"))
    for n in ("MANIFEST", "shard-0-of-1.zsc", "keep-me"):
        with open(os.path.join(outside, "step-0", n), "w") as f:
            f.write("not the server's\n")
    before = _tree(outside)
    os.makedirs(state)
    os.symlink(os.path.join(outside, "step-0"), os.path.join(state, "step-0"))
    with Shard(args=["--keep-checkpoints", "1"], tokens=True, state_dir=state) as s:
        c, admin = s.client(), s.client("admin")
        h = hostile.open_job(c, NUMELS)
        hostile.init_params(c, h, NUMELS)
        for k in (1, 2, 3):
            hostile.step(c, h, k, NUMELS)
            r = admin.call("Checkpoint", pb.CheckpointRequest(spec_hash=h, step=k))
            admin.call("CommitCheckpoint", pb.CommitCheckpointRequest(
                spec_hash=h, step=k, optimizer_steps=k, files=[r.file]))
        steps = [e.step for e in c.call("ListCheckpoints", pb.ListCheckpointsRequest()).checkpoints]
        assert steps == [3], steps
    assert _tree(outside) == before, "retention removed files outside the state directory"
    assert os.path.islink(os.path.join(state, "step-0"))
