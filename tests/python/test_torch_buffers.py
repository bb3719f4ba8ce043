"""broadcast_buffers: with two trainer processes (W=2), rank 0's module
buffers reach rank 1 through the shards before each forward, as DDP's
broadcast_buffers=True does, bit for bit, for every buffer dtype (BatchNorm's
fp32 running stats and int64 num_batches_tracked, a float64 and an odd-sized
uint8 buffer); broadcast_buffers=False leaves each rank's buffers its own; a
single trainer adds nothing to the job.

The reference is DDP's semantics replayed in one process: two replicas,
rank 1's buffers overwritten by rank 0's before every forward, the
gradients summed in rank order (grad_reduce="sum", fp32 wire: bit for bit,
as in test_torch_two_trainers.py).

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_buffers.py
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

STEPS = 8
HALF = 6


class Stats(nn.Module):
    """Buffers of other dtypes that change in forward as the batch says: a
    float64 running mean and a uint8 counter of 3 bytes (an odd size)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean64", torch.zeros(4, dtype=torch.float64, device="cpu"))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.uint8, device="cpu"))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean64.mul_(0.75).add_(x.detach().double().mean(0)[:4], alpha=0.25)
                self.seen.add_((x.detach().abs().sum() * 1000).long().remainder(251).to(
                    torch.uint8))
        return x


def make_model():
    torch.manual_seed(5)
    return nn.Sequential(nn.Conv2d(2, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                         Stats(), nn.Linear(6 * 4 * 4, 10), nn.BatchNorm1d(10), nn.ReLU(),
                         nn.Linear(10, 3))


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def half_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(HALF, 2, 6, 6, generator=g) * (1 + rank), \
        torch.randint(0, 3, (HALF,), generator=g)


def loss_of(model, step, rank):
    x, y = half_batch(step, rank)
    return nn.functional.cross_entropy(model(x), y)


def buffers(model):
    return {n: b.detach().clone() for n, b in model.named_buffers()}


# Worker modes: the shard() options of each.
MODES = {
    "on": dict(wire_dtype=torch.float32, grad_reduce="sum"),
    "off": dict(wire_dtype=torch.float32, grad_reduce="sum", broadcast_buffers=False),
    # The payload's scale on the shards is the step's (mean over 2, a
    # clipping coefficient far below 1): the buffers still arrive whole.
    # The model is built on meta (deferred initialisation: rank 0 writes
    # the buffers' first values with init_tensor).
    "clipped": dict(wire_dtype=torch.bfloat16, grad_reduce="mean", max_grad_norm=1e-3),
}


def worker(addresses, out, mode):
    import zshard.torch
    if mode == "clipped":
        with zshard.torch.init_empty():
            model = make_model()
    else:
        model = make_model()
    seen = []
    # The buffers every forward starts from (the first module's pre-hook
    # runs inside the wrapped forward, after rank 0's buffers were taken).
    model[0].register_forward_pre_hook(lambda m, i: seen.append(buffers(model)))
    opt = zshard.torch.shard(model, make_opt(model), addresses=addresses, split_threshold=64,
                             job="bufs", **MODES[mode])
    rank = int(os.environ["RANK"])
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_of(model, step, rank).backward()
        opt.step()
    opt.close()
    torch.save({"seen": seen, "buffers": buffers(model),
                "params": {n: p.detach() for n, p in model.named_parameters()}}, out)


def reference(broadcast):
    """DDP replayed: per rank, the buffers each forward starts from, the
    final buffers; and the final parameters."""
    replicas = [make_model(), make_model()]
    opt = make_opt(replicas[0])
    seen = [[], []]
    for step in range(1, STEPS + 1):
        if broadcast:
            with torch.no_grad():
                for b1, b0 in zip(replicas[1].buffers(), replicas[0].buffers()):
                    b1.copy_(b0)
        grads = []
        for rank, m in enumerate(replicas):
            seen[rank].append(buffers(m))
            m.zero_grad()
            loss_of(m, step, rank).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for p, g0, g1 in zip(replicas[0].parameters(), *grads):
            p.grad = g0 + g1
        opt.step()
        with torch.no_grad():
            for p1, p0 in zip(replicas[1].parameters(), replicas[0].parameters()):
                p1.copy_(p0)
    return seen, [buffers(m) for m in replicas], dict(replicas[0].named_parameters())


def run_two(mode):
    tmp = tempfile.mkdtemp(prefix="zshard-bufs-")
    with zshard_servers.Shards(2) as shards:
        procs = []
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "worker", shards.addresses,
                 os.path.join(tmp, "rank%d.pt" % rank), mode], env=env))
        try:
            codes = [p.wait(300) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(30)
    return codes, [torch.load(os.path.join(tmp, "rank%d.pt" % r)) for r in range(2)
                   if os.path.exists(os.path.join(tmp, "rank%d.pt" % r))]


class Buffers(unittest.TestCase):

    def assert_same(self, got, want, what):
        self.assertEqual(sorted(got), sorted(want), what)
        for n, w in want.items():
            g = got[n]
            self.assertEqual(g.dtype, w.dtype, "%s: %s" % (what, n))
            self.assertTrue(torch.equal(g, w), "%s: %s differs: %s vs %s" % (what, n, g, w))

    def test_rank_0s_buffers_reach_rank_1_before_every_forward_as_ddp(self):
        codes, ranks = run_two("on")
        self.assertEqual(codes, [0, 0])
        seen, final, params = reference(True)
        for step in range(STEPS):
            # Every rank's forward starts from rank 0's buffers.
            self.assert_same(ranks[1]["seen"][step], ranks[0]["seen"][step],
                             "step %d, rank 1 against rank 0" % (step + 1))
            for rank in range(2):
                self.assert_same(ranks[rank]["seen"][step], seen[rank][step],
                                 "step %d, rank %d against DDP" % (step + 1, rank))
        for rank in range(2):
            self.assert_same(ranks[rank]["buffers"], final[rank], "rank %d's final buffers" % rank)
            self.assert_same(ranks[rank]["params"],
                             {n: p.detach() for n, p in params.items()},
                             "rank %d's parameters" % rank)
        # The counters did change (the test covers non-float bits).
        self.assertGreater(final[0]["4.seen"].sum().item(), 0)
        self.assertEqual(final[0]["1.num_batches_tracked"].item(), STEPS)

    def test_broadcast_buffers_false_keeps_each_ranks_own(self):
        codes, ranks = run_two("off")
        self.assertEqual(codes, [0, 0])
        seen, final, _ = reference(False)
        for rank in range(2):
            self.assert_same(ranks[rank]["buffers"], final[rank], "rank %d's final buffers" % rank)
        self.assertFalse(torch.equal(final[0]["1.running_mean"], final[1]["1.running_mean"]))

    def test_buffers_arrive_whole_whatever_the_steps_gradient_scale_and_from_meta(self):
        codes, ranks = run_two("clipped")
        self.assertEqual(codes, [0, 0])
        for step in range(STEPS):
            self.assert_same(ranks[1]["seen"][step], ranks[0]["seen"][step],
                             "step %d, rank 1 against rank 0" % (step + 1))
        self.assertFalse(torch.equal(ranks[0]["seen"][-1]["1.running_var"],
                                     ranks[0]["seen"][0]["1.running_var"]))

    def test_one_trainer_adds_no_tensor_to_the_job(self):
        import zshard.torch
        with zshard_servers.Shards(1) as shards:
            model = make_model()
            opt = zshard.torch.shard(model, make_opt(model), addresses=shards.addresses,
                                     job="bufs1", rank=0, world_size=1)
            try:
                self.assertEqual(opt.client.num_tensors, len(list(model.parameters())))
            finally:
                opt.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        unittest.main(verbosity=2)
