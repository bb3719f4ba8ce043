"""zshard.torch under the launcher users run: two trainer processes started by
`python3 -m torch.distributed.run` (torch 1.13's torchrun), rank and world
size taken from the environment it sets.

- grad_reduce="sum": after 20 steps both ranks hold exactly the weights of
  single-process torch.optim.AdamW fed p.grad = g0 + g1, the two half-batch
  gradients summed in rank order.
- grad_reduce="mean" (the default, DDP's semantics): the shards multiply that
  sum by 1/W in fp32. Single-process training on the whole batch computes
  the mean gradient in another order, so the bits differ; the losses must not:
  after 20 steps the full-batch loss of the zshard-trained model is within
  1e-4 (relative) of single-process torch's on the whole batch.

Run with Debian's interpreter (CTest does).
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
HALF = 8
LOSS_RTOL = 1e-4


def make_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.LayerNorm(96), nn.Linear(96, 4))


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def half_batch(step, rank):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(HALF, 16, generator=g), torch.randint(0, 4, (HALF,), generator=g)


def full_batch(step):
    xs, ys = zip(*(half_batch(step, r) for r in range(2)))
    return torch.cat(xs), torch.cat(ys)


def worker(addresses, reduce, out):
    import zshard.torch
    model = make_model()
    opt = zshard.torch.shard(model, make_opt(model), addresses=addresses,
                             wire_dtype=torch.float32, split_threshold=1000, grad_reduce=reduce,
                             job="torchrun-" + reduce)
    rank = int(os.environ["RANK"])
    assert int(os.environ["WORLD_SIZE"]) == 2
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = half_batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.close()
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out)


def launch(addresses, reduce, tmp):
    """Both ranks under torch.distributed.run; returns their saved weights."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           # torch 1.13's launcher fails on Python 3.11 unless its output is
           # redirected (scripts/demo says more).
           "--redirects", "2", "--tee", "2", "--log_dir", os.path.join(tmp, "logs-" + reduce),
           os.path.abspath(__file__), "worker", addresses, reduce,
           os.path.join(tmp, reduce + "-%s.pt")]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True, timeout=300)
    return [torch.load(os.path.join(tmp, "%s-%d.pt" % (reduce, r))) for r in range(2)]


class UnderTorchrun(unittest.TestCase):

    def test_sum_equals_torch_fed_the_rank_ordered_sum(self):
        tmp = tempfile.mkdtemp(prefix="zshard-torchrun-")
        with zshard_servers.Shards(2) as shards:
            got = launch(shards.addresses, "sum", tmp)
        ref = make_model()
        opt = make_opt(ref)
        for step in range(1, STEPS + 1):
            grads = []
            for rank in range(2):
                m = copy.deepcopy(ref)
                x, y = half_batch(step, rank)
                nn.functional.cross_entropy(m(x), y).backward()
                grads.append([p.grad for p in m.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads):
                p.grad = g0 + g1
            opt.step()
        for rank in range(2):
            for n, w in ref.named_parameters():
                self.assertTrue(torch.equal(got[rank][n], w.detach()),
                                "rank %d: %s differs by up to %g" %
                                (rank, n, (got[rank][n] - w.detach()).abs().max().item()))

    def test_mean_trains_like_single_process_on_the_whole_batch(self):
        tmp = tempfile.mkdtemp(prefix="zshard-torchrun-")
        with zshard_servers.Shards(2) as shards:
            got = launch(shards.addresses, "mean", tmp)
        self.assertTrue(all(torch.equal(got[0][n], got[1][n]) for n in got[0]))
        ref = make_model()
        opt = make_opt(ref)
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            x, y = full_batch(step)
            nn.functional.cross_entropy(ref(x), y).backward()
            opt.step()
        trained = make_model()
        trained.load_state_dict(got[0])
        x, y = full_batch(STEPS + 1)
        with torch.no_grad():
            want = nn.functional.cross_entropy(ref(x), y).item()
            have = nn.functional.cross_entropy(trained(x), y).item()
        print("full-batch loss after %d steps: zshard W=2 %.7f, single process %.7f" %
              (STEPS, have, want))
        self.assertLess(abs(have - want), LOSS_RTOL * abs(want))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4] % os.environ["RANK"])
    else:
        unittest.main(verbosity=2)
