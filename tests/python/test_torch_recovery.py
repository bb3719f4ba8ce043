"""zshard.torch: checkpoint/restore from Python, and a dead shard is an exception.

A run checkpointed at step 3 and restored after step 5 continues from the
checkpoint's weights; a shard killed during training makes the next transfer
raise zshard.Error naming the shard.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_recovery.py
"""

import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402

FAST_FAIL = dict(max_retries=2, retry_initial_ms=10, retry_max_ms=20, rpc_timeout_ms=3000,
                 step_timeout_ms=3000)
# Retries long enough (about 13 s) for gRPC's channel to reconnect to a
# restarted shard, short enough that a test can wait for them to run out.
RESTART_RETRIES = dict(max_retries=10, retry_initial_ms=100, retry_max_ms=2000,
                       rpc_timeout_ms=3000, step_timeout_ms=20000)


def make_model():
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 3))


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(6, 16, generator=g)).square().mean().backward()
    opt.step()


def shard_weights(opt):
    out = []
    for P in opt._params:
        w = torch.empty_like(P.p)
        opt.client.pull(P.idx, zshard.torch._buffer(w)).wait()
        out.append(w)
    return out


def close_worker(addresses, pid):
    """Trains a step, SIGKILLs shard 1 (its pid), then close(): prints what
    close() raised. With release_after_forward and no prefetch the trainer
    holds no weights after step(), so close() must pull from shard 1 (with
    weights pulled ahead it could return without asking the dead shard)."""
    model = make_model()
    opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             addresses=addresses, wire_dtype=torch.float32, split_threshold=1000,
                             release_after_forward=True, prefetch=0, rpc_timeout_ms=2000)
    train_step(model, opt, 1)
    os.kill(pid, signal.SIGKILL)
    try:
        opt.close()
        print("close() returned")
    except zshard.Error as e:
        print("close() raised %s: %s" % (e.name, e))


class Recovery(unittest.TestCase):

    def test_restore_continues_from_the_checkpoint(self):
        model = make_model()
        with zshard_servers.Shards(2, state_dirs=True) as shards:
            opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     split_threshold=1000, release_after_forward=True)
            try:
                for s in range(1, 4):
                    train_step(model, opt, s)
                opt.checkpoint()
                at3 = shard_weights(opt)
                for s in range(4, 6):
                    train_step(model, opt, s)
                self.assertFalse(all(torch.equal(a, b) for a, b in zip(at3, shard_weights(opt))))
                self.assertEqual(opt.restore(), 4)
                opt.gather()
                for P, w in zip(opt._params, at3):
                    self.assertTrue(torch.equal(P.p.detach(), w), P.name)
                train_step(model, opt, 4)
                self.assertEqual(opt.last_result.step, 4)
            finally:
                opt.close()

    def test_restore_after_restarting_a_killed_shard_works_the_first_time(self):
        # The pulls step() started (prefetch) were bound for the killed
        # shard's data port and failed once their retries ran out; the
        # restarted shard listens on another data port.
        model = make_model()
        with zshard_servers.Shards(2, state_dirs=True) as shards:
            opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     split_threshold=1000, **RESTART_RETRIES)
            try:
                for s in range(1, 4):
                    train_step(model, opt, s)
                opt.checkpoint()
                at3 = shard_weights(opt)
                train_step(model, opt, 4)
                self.assertTrue(any(P.pull is not None for P in opt._params))
                shards.kill(1)
                # The operator restarts the shard once the pulls have failed
                # (a bounded wait: the retries end after about 13 s).
                deadline = time.monotonic() + 120
                while any(P.pull is not None and not P.pull.test() for P in opt._params):
                    self.assertLess(time.monotonic(), deadline, "pulls still in flight")
                    time.sleep(0.1)
                shards.restart(1)
                self.assertEqual(opt.restore(), 4)
                opt.gather()
                for P, w in zip(opt._params, at3):
                    self.assertTrue(torch.equal(P.p.detach(), w), P.name)
                train_step(model, opt, 4)
                self.assertEqual(opt.last_result.step, 4)
            finally:
                opt.close()

    def test_close_after_a_shard_is_killed_ends_within_the_rpc_timeout(self):
        # The library retries a lost connection for about 30 s; close() gives
        # up once nothing has completed for rpc_timeout_ms (2 s here). The
        # bound is the subprocess's timeout, well below those 30 s.
        with zshard_servers.Shards(2) as shards:
            try:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "close-worker",
                                      shards.addresses, str(shards.procs[1].pid)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     timeout=25, text=True).stdout
            finally:
                shards.kill(1)
        print("\n  " + out.strip().splitlines()[-1], file=sys.stderr)
        dead = shards.addresses.split(",")[1]
        self.assertIn("close() raised ZS_ETIMEDOUT", out)
        # The error names the shard's index and the address it was given.
        self.assertIn("from shard 1 (%s)" % dead, out)
        self.assertNotIn("unwaited", out)

    def test_a_killed_shard_raises_naming_it(self):
        model = make_model()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     split_threshold=1000, **FAST_FAIL)
            try:
                train_step(model, opt, 1)
                shards.kill(1)
                dead = shards.addresses.split(",")[1]
                with self.assertRaises(zshard.Error) as cm:
                    train_step(model, opt, 2)
                # The shard's index and the address it was given, not only
                # the data-plane port that refused.
                self.assertIn("shard 1 (%s)" % dead, str(cm.exception))
                print("\n  raised: %s: %s" % (cm.exception.name, cm.exception), file=sys.stderr)
                self.assertIn(cm.exception.status, (zshard.ECONN, zshard.ETIMEDOUT,
                                                    zshard.ECLOSED))
            finally:
                opt._closed = True  # nothing to gather from a dead shard
                opt.client.close()
                opt._forget_requests()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 4 and sys.argv[1] == "close-worker":
        close_worker(sys.argv[2], int(sys.argv[3]))
    else:
        unittest.main(verbosity=2)
