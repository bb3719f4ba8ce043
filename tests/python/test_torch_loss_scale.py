"""zshard.torch with fp16 on the wire and the client's dynamic loss scaler.

The trainer multiplies its loss by opt.loss_scale; a step whose gradient
overflows is skipped on every shard (weights unchanged) and, once the
hysteresis is used up, halves the scale (DeepSpeed's rules, docs/CLIENT.md).

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_loss_scale.py
"""

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


def shard_weights(opt):
    out = []
    for P in opt._params:
        w = torch.empty_like(P.p)
        opt.client.pull(P.idx, zshard.torch._buffer(w)).wait()
        out.append(w)
    return out


class DynamicLossScale(unittest.TestCase):

    def test_overflow_skips_the_step_and_then_halves_the_scale(self):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        x = torch.randn(4, 8)
        with zshard_servers.Shards(1) as shards:
            opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                     addresses=shards.addresses, wire_dtype=torch.float16,
                                     loss_scaling="dynamic", initial_loss_scale=1024.0)
            try:
                def step(blow_up=False):
                    opt.zero_grad()
                    loss = model(x).square().mean() * opt.loss_scale
                    if blow_up:
                        loss = loss * 1e30  # inf in fp16 on the wire
                    loss.backward()
                    opt.step()
                    return opt.last_result

                self.assertEqual(opt.loss_scale, 1024.0)
                r = step()
                self.assertTrue(r.applied)
                self.assertFalse(r.overflow)
                before = shard_weights(opt)
                r = step(blow_up=True)
                self.assertTrue(r.overflow)
                self.assertFalse(r.applied)
                self.assertEqual(r.next_loss_scale, 1024.0)  # hysteresis 2: not yet
                for a, b in zip(before, shard_weights(opt)):
                    self.assertTrue(torch.equal(a, b))
                r = step(blow_up=True)
                self.assertFalse(r.applied)
                self.assertEqual(r.next_loss_scale, 512.0)
                self.assertEqual(opt.loss_scale, 512.0)
                r = step()
                self.assertTrue(r.applied)
                self.assertEqual(r.loss_scale, 512.0)
                self.assertEqual(r.step, 4)
            finally:
                opt.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
