"""zshard.torch behaves like torch where users reach for torch's own tools:
clip_grad_norm_, copy.deepcopy (an EMA copy), optimizer subclasses,
add_param_group, and a script re-run against trained shards.

Run with Debian's interpreter (CTest does):
    /usr/bin/python3 -m pytest tests/python/test_torch_semantics.py
"""

import contextlib
import copy
import io
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard.torch  # noqa: E402


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def loss_of(model, step):
    x, y = data(step)
    return ((model(x) - y) ** 2).mean()


def shard(model, opt, shards, **kw):
    kw.setdefault("job", "sem")
    return zshard.torch.shard(model, opt, addresses=shards.addresses, wire_dtype=torch.float32,
                              rank=0, world_size=1, **kw)


def same(a, b):
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a.parameters(),
                                                                   b.parameters()))


class Clipping(unittest.TestCase):

    def test_torch_clip_grad_norm_on_sharded_parameters_clips_like_torch(self):
        # SGD: Adam(W) would hide a missing clip (its update barely depends
        # on the gradient's scale).
        ref, model = net(), net()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        with zshard_servers.Shards(1) as shards:
            opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), shards)
            try:
                for step in range(4):
                    ropt.zero_grad()
                    loss_of(ref, step).backward()
                    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
                    ropt.step()
                    opt.zero_grad()
                    loss_of(model, step).backward()
                    got = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    opt.step()
                    self.assertAlmostEqual(float(got), float(want), delta=1e-6 * float(want))
                    self.assertGreater(float(want), 0.05)  # the clipping did something
                opt.gather()
                # Not bit for bit: the norms may differ in their last bits
                # (torch sums fp32 per-tensor norms, the shards round once).
                for p, q in zip(model.parameters(), ref.parameters()):
                    self.assertTrue(torch.allclose(p.detach(), q.detach(), rtol=1e-5, atol=1e-7))
                    self.assertFalse(torch.equal(p.detach(), p.detach() * 0))
            finally:
                opt.close()

    def test_clipping_sharded_and_plain_parameters_together_is_refused(self):
        model, other = net(), nn.Linear(2, 2)
        with zshard_servers.Shards(1) as shards:
            opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), shards)
            try:
                loss_of(model, 0).backward()
                with self.assertRaisesRegex(RuntimeError, "sharded and unsharded"):
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()) +
                                                   list(other.parameters()), 1.0)
                opt.step()
            finally:
                opt.close()
        # Plain parameters still go to torch's own function.
        other.weight.grad = torch.ones(2, 2)
        self.assertEqual(float(torch.nn.utils.clip_grad_norm_(other.parameters(), 10.0)), 2.0)


class DeepCopy(unittest.TestCase):

    def test_a_deep_copy_is_an_ordinary_model_with_the_current_weights(self):
        ref, model = net(), net()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        with zshard_servers.Shards(1) as shards:
            opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                        shards, release_after_forward=True)
            try:
                for step in range(2):
                    for m, o in ((ref, ropt), (model, opt)):
                        o.zero_grad()
                        loss_of(m, step).backward()
                        o.step()
                ema = copy.deepcopy(model)
                self.assertNotIn("forward", ema.__dict__)
                self.assertTrue(same(ema, ref))
                snapshot = copy.deepcopy(ref)
                # Training goes on; the copy keeps its weights...
                for step in range(2, 4):
                    for m, o in ((ref, ropt), (model, opt)):
                        o.zero_grad()
                        loss_of(m, step).backward()
                        o.step()
                self.assertTrue(same(ema, snapshot))
                # ...and computes with its own weights once they change.
                with torch.no_grad():
                    for p in ema.parameters():
                        p.mul_(0.5)
                    for p in snapshot.parameters():
                        p.mul_(0.5)
                x, _ = data(9)
                self.assertTrue(torch.equal(ema(x), snapshot(x)))
                opt.gather()
                self.assertTrue(same(model, ref))
            finally:
                opt.close()


class Optimizers(unittest.TestCase):

    def test_a_subclass_that_keeps_step_is_accepted(self):
        class MyAdamW(torch.optim.AdamW):
            pass

        class Stepping(torch.optim.SGD):
            def step(self, closure=None):
                return super().step(closure)

        with zshard_servers.Shards(1) as shards:
            model = net()
            opt = shard(model, MyAdamW(model.parameters(), lr=1e-3), shards, job="sub")
            opt.close()
            model = net()
            with self.assertRaisesRegex(TypeError, "Stepping overrides step"):
                shard(model, Stepping(model.parameters(), lr=0.1), shards, job="sub2")
            with self.assertRaisesRegex(TypeError, "not supported.*AdamW, Adam or SGD"):
                shard(model, torch.optim.RMSprop(model.parameters()), shards, job="sub3")

    def test_add_param_group_names_the_alternative(self):
        with zshard_servers.Shards(1) as shards:
            model = net()
            opt = shard(model, torch.optim.AdamW(model.parameters()), shards)
            try:
                with self.assertRaisesRegex(NotImplementedError, "every param group before"):
                    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
            finally:
                opt.close()

    def test_sparse_gradients_and_complex_parameters_are_refused_by_name(self):
        with zshard_servers.Shards(1) as shards:
            model = nn.Sequential(nn.Embedding(10, 4, sparse=True))
            opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), shards)
            try:
                with self.assertRaisesRegex(RuntimeError, "sparse.*sparse=False"):
                    model(torch.tensor([1, 2])).sum().backward()
            finally:
                opt.close()
            model = nn.Linear(2, 2).to(torch.complex64)
            with self.assertRaisesRegex(ValueError, "complex64 on cpu; fp32 parameters only"):
                shard(model, torch.optim.SGD(model.parameters(), lr=0.1), shards)


class Resume(unittest.TestCase):

    def test_rerunning_against_trained_shards_says_it_resumed(self):
        with zshard_servers.Shards(1) as shards:
            for run in range(2):
                model = net()
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    opt = shard(model, torch.optim.AdamW(model.parameters()), shards,
                                job="again")
                try:
                    loss_of(model, 0).backward()
                    opt.step()
                finally:
                    opt.close()
                if run == 0:
                    self.assertNotIn("resumed", err.getvalue())
                else:
                    self.assertIn("resumed job 'again' at step 2", err.getvalue())
                    self.assertIn("open_mode='create'", err.getvalue())


if __name__ == "__main__":
    unittest.main()
