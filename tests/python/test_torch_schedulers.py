"""Every group hyper-parameter a scheduler sets takes effect from the next step.

OneCycleLR and CyclicLR with their defaults (cycle_momentum=True) change
beta1 (Adam, AdamW) or momentum (SGD) at every step, starting in their
constructors; zshard.torch sends every group's current lr, betas, eps,
weight_decay, momentum and dampening with each step (zs_step_ex's group_*
arrays), so the weights equal plain torch.optim's bit for bit (W=1, fp32 on
the wire). A value outside torch's ranges is refused before anything is
applied, by zshard.torch and by the shards.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_schedulers.py
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

STEPS = 10


def make_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                         nn.Linear(48, 4))


def two_groups(m):
    """Weights and biases in two param groups, so every array has two values."""
    return [{"params": [p for p in m.parameters() if p.dim() > 1]},
            {"params": [p for p in m.parameters() if p.dim() <= 1]}]


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def loss_of(model, step):
    x, y = batch(step)
    return nn.functional.mse_loss(model(x), y)


def shard_weights(opt, ref):
    """The shards' fp32 master of every parameter, by name, shaped as ref's."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for P in opt._params:
        w = torch.empty_like(ref_params[P.name])
        opt.client.pull(P.idx, zshard.torch._buffer(w)).wait()
        out[P.name] = w
    return out


class SchedulersLikeTorch(unittest.TestCase):

    def train(self, make_opt, make_sched=None, before_step=None, steps=STEPS):
        """Trains a copy with plain torch and one through zshard.torch, the
        same scheduler on each, and compares the weights after every step.
        before_step(step, optimizer) may change param_groups on both."""
        model = make_model()
        ref = copy.deepcopy(model)
        ref_opt = make_opt(ref)
        ref_sched = make_sched(ref_opt) if make_sched else None
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, make_opt(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=512, job="schedulers")
            try:
                sched = make_sched(opt) if make_sched else None
                for step in range(1, steps + 1):
                    if before_step:
                        before_step(step, opt)
                        before_step(step, ref_opt)
                    opt.zero_grad()
                    loss_of(model, step).backward()
                    opt.step()
                    ref_opt.zero_grad()
                    loss_of(ref, step).backward()
                    ref_opt.step()
                    if sched:
                        sched.step()
                        ref_sched.step()
                    self.assertEqual(opt.last_result.step, step)
                    for n, w in shard_weights(opt, ref).items():
                        q = dict(ref.named_parameters())[n].detach()
                        self.assertTrue(torch.equal(w, q),
                                        "step %d: %s differs from torch.optim's by up to %g" %
                                        (step, n, (w - q).abs().max().item()))
            finally:
                opt.close()
        return ref_opt

    def test_one_cycle_lr_defaults_over_adamw_cycles_beta1(self):
        def sched(o):
            return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 5e-3], total_steps=STEPS)
        ref_opt = self.train(lambda m: torch.optim.AdamW(two_groups(m), lr=1e-3,
                                                         weight_decay=0.05), sched)
        # beta1 did cycle: 0.95 at the start, lower at the peak.
        self.assertNotEqual(ref_opt.param_groups[0]["betas"][0], 0.9)

    def test_one_cycle_lr_defaults_over_sgd_cycles_momentum(self):
        def sched(o):
            return torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)
        self.train(lambda m: torch.optim.SGD(two_groups(m), lr=0.01, momentum=0.9,
                                             weight_decay=1e-3), sched)

    def test_cyclic_lr_over_sgd_cycles_momentum(self):
        def sched(o):
            return torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3)
        self.train(lambda m: torch.optim.SGD(two_groups(m), lr=0.01, momentum=0.9,
                                             dampening=0.1), sched)

    def test_weight_decay_and_eps_changed_mid_run(self):
        def change(step, o):
            if step == 4:
                o.param_groups[0]["weight_decay"] = 0.2
                o.param_groups[1]["eps"] = 1e-3
            if step == 7:
                o.param_groups[1]["betas"] = (0.5, 0.99)
        self.train(lambda m: torch.optim.Adam(two_groups(m), lr=1e-2, weight_decay=0.01),
                   before_step=change)

    def test_sgd_weight_decay_and_dampening_changed_mid_run(self):
        def change(step, o):
            if step == 3:
                o.param_groups[0]["weight_decay"] = 0.05
                o.param_groups[1]["dampening"] = 0.5
        self.train(lambda m: torch.optim.SGD(two_groups(m), lr=0.05, momentum=0.8),
                   before_step=change, steps=6)


class InvalidValuesRefused(unittest.TestCase):

    def test_beta1_out_of_range_is_refused_with_nothing_applied(self):
        model = make_model()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, torch.optim.AdamW(two_groups(model), lr=1e-2),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     split_threshold=512, job="bad-hparams")
            try:
                ref = copy.deepcopy(model)
                before = shard_weights(opt, ref)
                opt.zero_grad()
                loss_of(model, 1).backward()
                # zshard.torch refuses it before anything is sent.
                opt.param_groups[1]["betas"] = (1.5, 0.999)
                with self.assertRaisesRegex(ValueError, "group 1's beta1 is 1.5"):
                    opt.step()
                # The shards refuse it too (a trainer using the C API);
                # grad_norm() first sends the step's pushes.
                opt.grad_norm()
                with self.assertRaises(zshard.Error) as e:
                    opt.client.step(1e-2, group_lr=[1e-2, 1e-2], group_beta1=[0.9, 1.5])
                self.assertEqual(e.exception.status, zshard.EINVAL)
                self.assertIn("group_beta1[1] is 1.5", str(e.exception))
                with self.assertRaises(zshard.Error) as e:
                    opt.client.step(1e-2, group_dampening=[0.0, -1.0])
                self.assertIn("group_dampening[1]", str(e.exception))
                with self.assertRaisesRegex(ValueError, "3 values but the job has 2"):
                    opt.client.step(1e-2, group_eps=[1e-8, 1e-8, 1e-8])
                self.assertEqual(opt.client.current_step, 1)
                for n, w in shard_weights(opt, ref).items():
                    self.assertTrue(torch.equal(w, before[n]), n)
                # A valid value then steps as usual.
                opt.param_groups[1]["betas"] = (0.8, 0.999)
                opt.step()
                self.assertEqual(opt.last_result.step, 1)
                self.assertTrue(opt.last_result.applied)
            finally:
                opt.close()

    def test_sgd_momentum_cannot_start_or_stop_the_buffer(self):
        model = make_model()
        with zshard_servers.Shards(1) as shards:
            opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     job="momentum-zero")
            try:
                opt.zero_grad()
                loss_of(model, 1).backward()
                opt.param_groups[0]["momentum"] = 0.9
                with self.assertRaisesRegex(ValueError, "momentum changed from 0.0 to 0.9"):
                    opt.step()
                opt.grad_norm()
                with self.assertRaises(zshard.Error) as e:
                    opt.client.step(0.1, group_momentum=[0.9])
                self.assertEqual(e.exception.status, zshard.EINVAL)
                self.assertIn("has no momentum buffer", str(e.exception))
                opt.param_groups[0]["momentum"] = 0.0
                opt.step()
                self.assertEqual(opt.last_result.step, 1)
            finally:
                opt.close()


if __name__ == "__main__":
    unittest.main()
