"""zshard.torch with two trainer processes (W=2, rank and world size from
$RANK / $WORLD_SIZE as torchrun sets them).

With grad_reduce="sum" the shards add the two ranks' gradients in rank order
and apply them once, so the weights after every step equal single-process
torch.optim fed p.grad = g0 + g1, the half-batch gradients summed in rank
order, bit for bit. (With the default "mean" the sum is multiplied by 1/W in
fp32 first: torch's DDP averages.)

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_two_trainers.py
"""

import copy
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

STEPS = 20
HALF = 4


def make_model():
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(12, 200), nn.GELU(), nn.LayerNorm(200), nn.Linear(200, 5))


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.02)


def half_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(HALF, 12, generator=g), torch.randint(0, 5, (HALF,), generator=g)


def loss_of(model, step, rank):
    x, y = half_batch(step, rank)
    return nn.functional.cross_entropy(model(x), y)


def worker(addresses, out):
    import zshard.torch
    model = make_model()
    opt = zshard.torch.shard(model, make_opt(model), addresses=addresses,
                             wire_dtype=torch.float32, split_threshold=1000, grad_reduce="sum",
                             job="two")
    rank = int(os.environ["RANK"])
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
    opt.close()
    torch.save({n: p.detach() for n, p in model.named_parameters()}, out)


class TwoTrainers(unittest.TestCase):

    def test_equals_torch_fed_the_rank_ordered_sum(self):
        tmp = tempfile.mkdtemp(prefix="zshard-w2-")
        with zshard_servers.Shards(2) as shards:
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "worker", shards.addresses,
                     os.path.join(tmp, "rank%d.pt" % rank)], env=env))
            codes = [p.wait(300) for p in procs]
        self.assertEqual(codes, [0, 0])

        ref = make_model()
        opt = make_opt(ref)
        for step in range(1, STEPS + 1):
            grads = []
            for rank in range(2):
                m = copy.deepcopy(ref)
                loss_of(m, step, rank).backward()
                grads.append([p.grad for p in m.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads):
                p.grad = g0 + g1
            opt.step()
        want = dict(ref.named_parameters())
        for rank in range(2):
            got = torch.load(os.path.join(tmp, "rank%d.pt" % rank))
            for n, w in got.items():
                self.assertTrue(torch.equal(w, want[n].detach()),
                                "rank %d: %s differs by up to %g" %
                                (rank, n, (w - want[n].detach()).abs().max().item()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        unittest.main(verbosity=2)
