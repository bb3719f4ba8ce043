"""A job's life from Python, and the batch and layout calls.

zshard (no torch): push_many / pull_many submit several transfers at once and
a refused batch submits nothing; tensor_slices tells where a tensor lives;
grad_norm reports the step's norm without stepping; step's group_lr and
clip_coef are applied as given. zshard.torch: two different models trained
one after the other on the same shards (the first closes its job, the second
creates its own and trains bit for bit like torch.optim from its own initial
weights); a new run refuses shards that hold another job; open_mode="resume"
is refused by fresh shards and resumes a job left open; grad_norm() equals
clip_grad_norm_'s norm and step(clip_coef=) scales the gradient like torch.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_torch_jobs.py
"""

import copy
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


class Batches(unittest.TestCase):

    def test_batches_layout_grad_norm_group_lr_and_clip_coef(self):
        rng = np.random.default_rng(5)
        a0 = rng.standard_normal(100, dtype=np.float32)
        b0 = rng.standard_normal(5000, dtype=np.float32)
        with zshard_servers.Shards(2) as shards:
            with zshard.Client(shards.addresses, split_threshold=1000, push_dtype="fp32",
                               pull_dtype="fp32", job="batches", open_mode="create") as c:
                c.add_group("sgd")
                c.add_group("sgd")
                a = c.add_tensor("a", 100, group=0)
                b = c.add_tensor("b", 5000, group=1)
                c.open_job([a0, b0])

                # The layout: a whole on one shard, b split over both.
                self.assertEqual(len(c.tensor_slices(a)), 1)
                sl = c.tensor_slices(b)
                self.assertEqual(sorted(s for s, _, _ in sl), [0, 1])
                self.assertEqual(sum(n for _, _, n in sl), 5000)
                self.assertEqual(sl[0][1], 0)
                self.assertEqual(sl[1][1], sl[0][2])
                with self.assertRaises(zshard.Error) as cm:
                    c.tensor_slices(7)
                self.assertEqual(cm.exception.status, zshard.ENOTFOUND)
                # Ids and counts outside their C types are refused, not
                # wrapped around onto another tensor or step count.
                for bad in (2**32 + a, -1):
                    for call in (c.tensor_slices, c.tensor_steps,
                                 lambda t: c.set_tensor_steps(t, 0)):
                        with self.assertRaises(OverflowError):
                            call(bad)
                with self.assertRaises(OverflowError):
                    c.set_tensor_steps(a, -1)
                self.assertEqual(c.tensor_steps(a), 0)

                x, y = np.empty_like(a0), np.empty_like(b0)
                reqs = c.pull_many([a, b], [x, y])
                self.assertEqual(len(reqs), 2)
                for r in reqs:
                    r.wait()
                self.assertTrue(np.array_equal(x, a0) and np.array_equal(y, b0))
                self.assertEqual(c.pull_many([], []), [])

                ga = np.full(100, 3.0, np.float32)
                gb = np.full(5000, 4.0, np.float32)
                # Refused batches submit nothing: a wrong size names its entry,
                # a tensor twice is refused, mismatched lengths never reach C.
                with self.assertRaises(zshard.Error) as cm:
                    c.push_many([a, b], [ga, gb[:10]])
                self.assertEqual(cm.exception.status, zshard.ESIZE)
                self.assertIn("entry 1", str(cm.exception))
                self.assertIn("'b'", str(cm.exception))
                with self.assertRaises(zshard.Error) as cm:
                    c.push_many([a, a], [ga, ga])
                self.assertEqual(cm.exception.status, zshard.EEXIST)
                with self.assertRaises(ValueError):
                    c.push_many([a, b], [ga])
                with self.assertRaises(TypeError):
                    c.push_many([a, b], [ga, gb.astype(np.float16)])
                # ... so the same tensors can be pushed now, once.
                for r in c.push_many([a, b], [ga, gb]):
                    r.wait()
                with self.assertRaises(zshard.Error) as cm:
                    c.push_many([b], [gb])
                self.assertEqual(cm.exception.status, zshard.EEXIST)

                norm, overflow = c.grad_norm()
                want = float(np.sqrt(100 * 9.0 + 5000 * 16.0))
                self.assertAlmostEqual(norm, want, places=3)
                self.assertFalse(overflow)
                self.assertEqual(c.current_step, 1)

                # Group lrs as given (group 1's is not lr x lr_scale), and the
                # gradient multiplied by the clip coefficient given.
                r = c.step(0.5, group_lr=[0.5, 0.25], clip_coef=0.5)
                self.assertEqual(r.step, 1)
                self.assertEqual(r.clip_coef, 0.5)
                c.pull(a, x).wait()
                c.pull(b, y).wait()
                self.assertTrue(np.array_equal(x, a0 - np.float32(0.5) * (np.float32(0.5) * ga)))
                self.assertTrue(np.array_equal(y, b0 - np.float32(0.25) * (np.float32(0.5) * gb)))
                with self.assertRaises(zshard.Error) as cm:
                    c.step(0.5, group_lr=[0.5])  # one lr for two groups
                self.assertEqual(cm.exception.status, zshard.EINVAL)


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def train(test, model, opt, ref, ref_opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        for o, m in ((opt, model), (ref_opt, ref)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        opt.gather()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            test.assertTrue(torch.equal(p.detach(), q.detach()), "step %d: %s" % (step + 1, n))


class JobLife(unittest.TestCase):

    def shard(self, model, opt, addresses, **kw):
        return zshard.torch.shard(model, opt, addresses=addresses, wire_dtype=torch.float32,
                                  rank=0, world_size=1, **kw)

    def test_two_models_one_after_the_other_on_the_same_shards(self):
        with zshard_servers.Shards(2) as shards:
            torch.manual_seed(1)
            m1 = Mlp(32)
            r1 = copy.deepcopy(m1)
            opt1 = self.shard(m1, torch.optim.AdamW(m1.parameters(), lr=1e-2), shards.addresses,
                              job="first", open_mode="create")
            train(self, m1, opt1, r1, torch.optim.AdamW(r1.parameters(), lr=1e-2), 3, 1)

            # A new run cannot take shards that hold another job.
            torch.manual_seed(2)
            m2 = Mlp(24)
            with self.assertRaises(zshard.Error) as cm:
                self.shard(m2, torch.optim.SGD(m2.parameters(), lr=0.1), shards.addresses,
                           job="second", open_mode="create")
            self.assertIn(cm.exception.status, (zshard.EEXIST, zshard.EHASH))

            opt1.close(close_job=True)
            for (n, p), (_, q) in zip(m1.named_parameters(), r1.named_parameters()):
                self.assertTrue(torch.equal(p.detach(), q.detach()), n)

            # The shards are empty again: a different model starts from its
            # own initial weights and trains like torch.optim.
            r2 = copy.deepcopy(m2)
            opt2 = self.shard(m2, torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9),
                              shards.addresses, job="second", open_mode="create",
                              release_after_forward=True)
            try:
                self.assertEqual(opt2.client.current_step, 1)
                train(self, m2, opt2, r2,
                      torch.optim.SGD(r2.parameters(), lr=0.1, momentum=0.9), 3, 2)
            finally:
                opt2.close(close_job=True)

    def test_grad_norm_and_an_external_clip_coefficient(self):
        with zshard_servers.Shards(2) as shards:
            torch.manual_seed(5)
            m = Mlp(32)
            r = copy.deepcopy(m)
            ref_opt = torch.optim.SGD(r.parameters(), lr=0.1)
            opt = self.shard(m, torch.optim.SGD(m.parameters(), lr=0.1), shards.addresses,
                             job="clip", open_mode="create")
            try:
                g = torch.Generator().manual_seed(5)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
                nn.functional.mse_loss(m(x), y).backward()
                nn.functional.mse_loss(r(x), y).backward()
                want = torch.nn.utils.clip_grad_norm_(r.parameters(), 1e9).item()
                norm, overflow = opt.grad_norm()
                self.assertFalse(overflow)
                self.assertAlmostEqual(norm, want, delta=1e-5 * want)
                # The coefficient a trainer computed from this norm and others.
                coef = 0.25
                for q in r.parameters():
                    q.grad.mul_(coef)
                ref_opt.step()
                opt.step(clip_coef=coef)
                self.assertEqual(opt.last_result.clip_coef, coef)
                opt.gather()
                for (n, p), (_, q) in zip(m.named_parameters(), r.named_parameters()):
                    self.assertTrue(torch.equal(p.detach(), q.detach()), n)
            finally:
                opt.close(close_job=True)

    def test_resume_is_refused_by_fresh_shards_and_resumes_a_job_left_open(self):
        with zshard_servers.Shards(2) as shards:
            torch.manual_seed(3)
            m = Mlp(8)
            with self.assertRaises(zshard.Error) as cm:
                self.shard(m, torch.optim.SGD(m.parameters(), lr=0.1), shards.addresses,
                           job="resumed", open_mode="resume")
            self.assertEqual(cm.exception.status, zshard.ENOTOPEN)
            self.assertEqual(cm.exception.name, "ZS_ENOTOPEN")
            self.assertIn("shard", str(cm.exception))

            r = copy.deepcopy(m)
            ref_opt = torch.optim.SGD(r.parameters(), lr=0.1)
            opt = self.shard(m, torch.optim.SGD(m.parameters(), lr=0.1), shards.addresses,
                             job="resumed", open_mode="create")
            train(self, m, opt, r, ref_opt, 2, 3)
            opt.close()  # the job stays on the shards

            # The same model again, from other weights: it resumes at step 3
            # with the shards' weights, not these.
            torch.manual_seed(4)
            m2 = Mlp(8)
            opt = self.shard(m2, torch.optim.SGD(m2.parameters(), lr=0.1), shards.addresses,
                             job="resumed", open_mode="resume")
            try:
                self.assertEqual(opt.client.current_step, 3)
                opt.gather()
                for (n, p), (_, q) in zip(m2.named_parameters(), r.named_parameters()):
                    self.assertTrue(torch.equal(p.detach(), q.detach()), n)
            finally:
                opt.close(close_job=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
