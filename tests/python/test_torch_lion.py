"""zshard.torch.Lion: the same optimizer in plain torch and on the shards.

A model trained through zshard.torch.shard() with zshard.torch.Lion (two
param groups, weight decay, a frozen parameter left in the optimizer,
OneCycleLR cycling lr and beta1) equals, bit for bit after every step, the
same model trained in plain torch with zshard.torch.Lion; state_dict() gives
Lion's state (step, exp_avg) as the plain optimizer keeps it, and it loads
back into both.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_torch_lion.py
"""

import copy
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402

STEPS = 8


def make_model():
    torch.manual_seed(9)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                         nn.Linear(48, 4))


def make_opt(m):
    m[2].bias.requires_grad_(False)  # frozen, but left in the optimizer
    return zshard.torch.Lion([{"params": [p for p in m.parameters() if p.dim() > 1],
                               "weight_decay": 0.1},
                              {"params": [p for p in m.parameters() if p.dim() <= 1]}],
                             lr=3e-4, betas=(0.9, 0.99))


def loss_of(model, step):
    g = torch.Generator().manual_seed(200 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return nn.functional.mse_loss(model(x), y)


def sched(o):
    return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-3, 2e-3], total_steps=STEPS + 2)


class LionLikeTorch(unittest.TestCase):

    def test_sharded_lion_equals_plain_lion_and_state_dict_round_trips(self):
        model = make_model()
        ref = copy.deepcopy(model)
        ref_opt = make_opt(ref)
        ref_sched = sched(ref_opt)
        frozen0 = ref[2].bias.detach().clone()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, make_opt(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=512, job="lion")
            try:
                s = sched(opt)
                for step in range(1, STEPS + 1):
                    opt.zero_grad()
                    loss_of(model, step).backward()
                    opt.step()
                    ref_opt.zero_grad()
                    loss_of(ref, step).backward()
                    ref_opt.step()
                    s.step()
                    ref_sched.step()
                    opt.gather()
                    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                        self.assertTrue(torch.equal(p.detach(), q.detach()),
                                        "step %d: %s differs by up to %g" %
                                        (step, n, (p - q).abs().max().item()))
                # The frozen bias never moved (no decay: torch skips None
                # gradients), and beta1 did cycle.
                self.assertTrue(torch.equal(ref[2].bias.detach(), frozen0))
                self.assertNotEqual(ref_opt.param_groups[0]["betas"][0], 0.9)

                mine, theirs = opt.state_dict(), ref_opt.state_dict()
                self.assertEqual(sorted(mine["state"]), sorted(theirs["state"]))
                for i, st in theirs["state"].items():
                    self.assertEqual(sorted(mine["state"][i]), ["exp_avg", "step"])
                    self.assertEqual(float(mine["state"][i]["step"]), float(st["step"]))
                    self.assertTrue(torch.equal(mine["state"][i]["exp_avg"], st["exp_avg"]))

                # Loaded back (into the shards and into a fresh plain Lion),
                # the next step is the same on both sides.
                opt.load_state_dict(theirs)
                again = make_opt(copy.deepcopy(ref))
                again.load_state_dict(mine)
                opt.zero_grad()
                loss_of(model, 99).backward()
                opt.step()
                ref_opt.zero_grad()
                loss_of(ref, 99).backward()
                ref_opt.step()
                opt.gather()
                for p, q in zip(model.parameters(), ref.parameters()):
                    self.assertTrue(torch.equal(p.detach(), q.detach()))
            finally:
                opt.close()

    def test_a_subclass_with_its_own_step_is_refused(self):
        class Mine(zshard.torch.Lion):
            def step(self, closure=None):
                return None
        model = make_model()
        with self.assertRaises(TypeError) as cm:
            zshard.torch.shard(model, Mine(model.parameters()), addresses="127.0.0.1:1")
        self.assertIn("zshard.torch.Lion", str(cm.exception))


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
