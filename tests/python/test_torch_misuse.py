"""The zshard Python package refuses misuse with clear exceptions.

zshard (no torch): zshard.Error carries zs_last_error()'s text, .status and
.name; buffers of the wrong size or kind, waiting twice, stepping without
every gradient, a closed client. zshard.torch: unsupported optimizer options,
backward twice per step, group options that change, a negative lr, and backward
through a graph older than the parameters (state_dict misuse:
test_torch_state_dict.py).

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_misuse.py
"""

import gc
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402


class ClientMisuse(unittest.TestCase):

    def test_client_api_and_its_errors(self):
        rng = np.random.default_rng(3)
        a0 = rng.standard_normal(100, dtype=np.float32)
        b0 = rng.standard_normal((50, 100), dtype=np.float32)
        with zshard_servers.Shards(2) as shards:
            with zshard.Client(shards.addresses, split_threshold=1000, push_dtype="fp32",
                               pull_dtype="fp32", job="misuse") as c:
                self.assertEqual(c.add_group("sgd", momentum=0.5), 0)
                a = c.add_tensor("a", 100)
                b = c.add_tensor("b", 5000, shape=(50, 100))
                self.assertEqual((a, b, c.num_tensors), (0, 1, 2))
                self.assertEqual(c.find_tensor("b"), 1)
                with self.assertRaises(ValueError):
                    c.open_job([a0, a0])  # b's buffer has the wrong size
                c.open_job([a0, b0])
                self.assertEqual(c.current_step, 1)

                # Pulls into any writable buffer, without copying.
                b1 = np.empty_like(b0)
                c.pull(b, b1).wait()
                self.assertTrue(np.array_equal(b1, b0))
                raw = bytearray(400)
                c.pull(a, memoryview(raw), dtype="fp32").wait()
                self.assertEqual(bytes(raw), a0.tobytes())
                with self.assertRaises(BufferError):
                    c.pull(a, bytes(400), dtype="fp32")  # read-only
                with self.assertRaises(TypeError):
                    c.pull(a, np.empty(400, np.uint8))  # no dtype to infer

                # A wrong-sized gradient is refused, naming the tensor.
                with self.assertRaises(zshard.Error) as cm:
                    c.push(a, np.zeros(99, np.float32))
                e = cm.exception
                self.assertIn(e.status, (zshard.EINVAL, zshard.ESIZE))
                self.assertEqual(e.name, zshard.err_name(e.status))
                self.assertIn("'a'", str(e))

                # Stepping without every gradient names the missing one.
                ga = np.ones(100, np.float32)
                req = c.push(a, ga)
                self.assertTrue(req.pending)
                req.wait()
                self.assertFalse(req.pending)
                with self.assertRaises(RuntimeError):
                    req.wait()
                with self.assertRaises(zshard.Error) as cm:
                    c.step(0.1)
                self.assertEqual(cm.exception.status, zshard.ENOTREADY)
                self.assertIn("'b'", str(cm.exception))
                self.assertEqual(c.current_step, 1)

                # A Request dropped unwaited waits for its transfer.
                gb = np.full(5000, 2.0, np.float32)
                c.push(b, gb.tobytes(), dtype="fp32")
                gc.collect()
                r = c.step(0.1)
                self.assertEqual((r.step, r.version, r.applied), (1, 1, True))
                self.assertGreater(r.timing.bytes_pushed, 0)
                self.assertEqual(c.last_timing().bytes_pushed, r.timing.bytes_pushed)
                c.pull(a, b1.reshape(-1)[:100]).wait()
                self.assertTrue(np.array_equal(b1.reshape(-1)[:100],
                                               (a0 - np.float32(0.1) * ga)))

                # Stepping twice: step 2 has no gradients yet.
                with self.assertRaises(zshard.Error) as cm:
                    c.step(0.1)
                self.assertEqual(cm.exception.status, zshard.ENOTREADY)
            self.assertTrue(c.closed)
            with self.assertRaises(zshard.Error):
                c.pull(a, b1)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def loss_of(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    return model(torch.randn(5, 8, generator=g)).square().mean()


class TorchMisuse(unittest.TestCase):

    def test_unsupported_optimizers_and_options_are_named(self):
        m = Mlp()
        for opt, word in ((torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad"),
                          (torch.optim.Adam(m.parameters(), foreach=True), "foreach"),
                          (torch.optim.SGD(m.parameters(), lr=0.1, maximize=True), "maximize")):
            with self.assertRaisesRegex(ValueError, word):
                zshard.torch.shard(m, opt, addresses="127.0.0.1:1")
        with self.assertRaisesRegex(TypeError, "Adagrad"):
            zshard.torch.shard(m, torch.optim.Adagrad(m.parameters()), addresses="127.0.0.1:1")

    def test_backward_twice_per_step_raises(self):
        torch.manual_seed(1)
        m = Mlp()
        with zshard_servers.Shards(1) as shards:
            opt = zshard.torch.shard(m, torch.optim.AdamW(m.parameters()),
                                     addresses=shards.addresses, wire_dtype=torch.float32)
            try:
                loss_of(m).backward()
                with self.assertRaisesRegex(RuntimeError, "already pushed"):
                    loss_of(m).backward()
                # Readable mid-step; torch's empty state before the first step.
                self.assertEqual(opt.state_dict()["state"], {})
            finally:
                opt.close()

    def test_step_before_every_micro_batch_raises(self):
        torch.manual_seed(1)
        m = Mlp()
        with zshard_servers.Shards(1) as shards:
            opt = zshard.torch.shard(m, torch.optim.SGD(m.parameters(), lr=0.1),
                                     addresses=shards.addresses, grad_accum=2)
            try:
                loss_of(m, 1).backward()
                with self.assertRaisesRegex(RuntimeError, "1 backward pass"):
                    opt.step()
                loss_of(m, 2).backward()
                opt.step()
                self.assertEqual(opt.last_result.step, 1)
                for s in range(2):
                    loss_of(m, s).backward()
                with self.assertRaisesRegex(RuntimeError, "already pushed 2"):
                    loss_of(m, 3).backward()
            finally:
                opt.close()

    def test_a_submodule_called_on_its_own_uses_current_weights(self):
        for release in (False, True):
            torch.manual_seed(1)
            m, ref = Mlp(), Mlp()
            ref.load_state_dict(m.state_dict())
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
            with zshard_servers.Shards(1) as shards:
                opt = zshard.torch.shard(m, torch.optim.SGD(m.parameters(), lr=0.1),
                                         addresses=shards.addresses, wire_dtype=torch.float32,
                                         release_after_forward=release)
                try:
                    for o, model in ((opt, m), (ref_opt, ref)):
                        loss_of(model).backward()
                        o.step()
                    h = torch.ones(2, 16)
                    self.assertTrue(torch.equal(m.fc2(h), ref.fc2(h)), "release=%s" % release)
                finally:
                    opt.close()

    def test_group_option_change_bad_lr_and_stateless_state_dict(self):
        torch.manual_seed(1)
        m = Mlp()
        sgd = torch.optim.SGD([{"params": m.fc1.parameters()},
                               {"params": m.fc2.parameters(), "lr": 0.2}], lr=0.1)
        with zshard_servers.Shards(1) as shards:
            opt = zshard.torch.shard(m, sgd, addresses=shards.addresses, wire_dtype=torch.float32)
            try:
                sd = opt.state_dict()
                self.assertEqual(sd["state"], {})
                self.assertEqual([g["lr"] for g in sd["param_groups"]], [0.1, 0.2])
                opt.load_state_dict(sd)
                loss_of(m).backward()
                # Group lrs and hyper-parameters change freely (each is sent
                # every step, test_torch_schedulers.py); nesterov is fixed
                # when the job opens, and an lr the shards cannot use is
                # refused before anything happens.
                opt.param_groups[1]["nesterov"] = True
                with self.assertRaisesRegex(ValueError, "group 1's nesterov changed"):
                    opt.step()
                opt.param_groups[1]["nesterov"] = False
                opt.param_groups[1]["lr"] = -0.3
                with self.assertRaisesRegex(ValueError, "group 1's lr"):
                    opt.step()
                opt.param_groups[1]["lr"] = 0.3
                opt.step()
                self.assertEqual(opt.last_result.step, 1)
            finally:
                opt.close()

    def test_backward_through_a_graph_older_than_the_weights_raises(self):
        for release in (False, True):
            torch.manual_seed(1)
            m = Mlp()
            with zshard_servers.Shards(1) as shards:
                opt = zshard.torch.shard(m, torch.optim.SGD(m.parameters(), lr=0.1),
                                         addresses=shards.addresses, wire_dtype=torch.float32,
                                         release_after_forward=release)
                try:
                    old = loss_of(m, 1)
                    loss_of(m, 2).backward()
                    opt.step()
                    opt.zero_grad()
                    opt.gather()  # pulls version 1: bumps the version counters
                    expect = "before step" if release else "modified by an inplace operation"
                    with self.assertRaisesRegex(RuntimeError, expect):
                        old.backward()
                finally:
                    opt.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
