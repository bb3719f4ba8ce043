"""Lion through the shards: the optimizer added by one entry in each
descriptor table (common/model/spec_optim.c, server/optim/optim.c).

A tensor split over two shards is trained with Lion for several steps, with
the lr and both betas scheduled per step and weight decay on, and every step's
weights equal, bit for bit, the paper's update (Chen et al. 2023, Algorithm 2)
written here in torch ops; the momentum reads back as Lion's exp_avg, Lion has
no exp_avg_sq, and a checkpoint restores both.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_lion.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import numpy as np  # noqa: E402
import torch  # noqa: E402

import zshard  # noqa: E402

N = 5000


def lion_reference(p, m, g, lr, beta1, beta2, wd):
    """One Lion step in place, as its paper states it, in the torch ops whose
    rounding the shards reproduce."""
    p.mul_(1 - lr * wd)
    c = m.mul(beta1).add_(g, alpha=1 - beta1)
    p.add_(c.sign(), alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)


class Lion(unittest.TestCase):

    def test_lion_matches_the_paper_update_bit_for_bit_and_checkpoints(self):
        rng = np.random.default_rng(11)
        w0 = rng.standard_normal(N, dtype=np.float32)
        p = torch.from_numpy(w0.copy())
        m = torch.zeros(N)
        wd = 0.1
        with zshard_servers.Shards(2, state_dirs=True) as shards:
            with zshard.Client(shards.addresses, split_threshold=1000, push_dtype="fp32",
                               pull_dtype="fp32", job="lion", open_mode="create") as c:
                grp = c.add_group("lion", weight_decay=wd)
                w = c.add_tensor("w", N, group=grp)
                c.open_job([w0])
                self.assertEqual(sorted(s for s, _, _ in c.tensor_slices(w)), [0, 1])
                got = np.empty(N, np.float32)
                for step in range(1, 9):
                    g = rng.standard_normal(N, dtype=np.float32)
                    if step == 3:
                        g[:100] = 0.0  # sign(0) is 0: these move by decay alone
                    lr = 1e-3 * step
                    # Lion's betas, sent per step as a scheduler would.
                    b1, b2 = 0.9 - 0.01 * step, 0.99 - 0.001 * step
                    c.push(w, g).wait()
                    c.step(lr=lr, group_beta1=[b1], group_beta2=[b2])
                    lion_reference(p, m, torch.from_numpy(g), lr, b1, b2, wd)
                    c.pull(w, got).wait()
                    self.assertTrue(np.array_equal(got.view(np.uint32),
                                                   p.numpy().view(np.uint32)),
                                    "step %d: %d of %d weights differ" %
                                    (step, int((got != p.numpy()).sum()), N))
                # Every step moved the weights.
                self.assertFalse(np.array_equal(got, w0))
                moment = np.empty(N, np.float32)
                c.state_read(w, zshard.EXP_AVG, moment)
                self.assertTrue(np.array_equal(moment.view(np.uint32),
                                               m.numpy().view(np.uint32)))
                with self.assertRaises(zshard.Error) as cm:
                    c.state_read(w, zshard.EXP_AVG_SQ, moment)
                self.assertEqual(cm.exception.status, zshard.EINVAL)
                self.assertIn("Lion", str(cm.exception))

                # A checkpoint keeps the momentum: two more steps after a
                # restore repeat the two steps taken after the checkpoint.
                nxt = c.checkpoint()  # the checkpoint of version nxt - 1
                p_ck, m_ck = p.clone(), m.clone()
                grads = [rng.standard_normal(N, dtype=np.float32) for _ in range(2)]
                for g in grads:
                    c.push(w, g).wait()
                    c.step(lr=1e-3)
                c.pull(w, got).wait()
                first = got.copy()
                self.assertEqual(c.restore(nxt - 1), nxt)
                for g in grads:
                    c.push(w, g).wait()
                    c.step(lr=1e-3)
                c.pull(w, got).wait()
                self.assertTrue(np.array_equal(got.view(np.uint32), first.view(np.uint32)))
                for g in grads:
                    lion_reference(p_ck, m_ck, torch.from_numpy(g), 1e-3, 0.9, 0.99, wd)
                self.assertTrue(np.array_equal(got.view(np.uint32),
                                               p_ck.numpy().view(np.uint32)))

    def test_lion_hyper_parameters_are_checked(self):
        with zshard_servers.Shards(1) as shards:
            with zshard.Client(shards.addresses, job="lion-bad", open_mode="create") as c:
                with self.assertRaises(zshard.Error) as cm:
                    c.add_group("lion", beta2=1.0)
                    c.add_tensor("w", 10)
                    c.open_job([np.zeros(10, np.float32)])
                self.assertEqual(cm.exception.status, zshard.EINVAL)
                self.assertIn("beta2", str(cm.exception))


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
