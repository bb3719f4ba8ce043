"""zshard.torch trains a small transformer bit for bit like torch.optim.

W=1, fp32 on the wire, 2 shards, split threshold 4096 so the attention and
feed-forward weights are split over both shards. After every step every
parameter must equal (torch.equal) the one plain torch.optim produced from the
same data: the shards' kernels follow torch 1.13's single-tensor AdamW / SGD
to the bit, and the gradient pushed is the one backward accumulated, in fp32.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_bits.py
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

STEPS = int(os.environ.get("ZSHARD_TEST_STEPS", "200"))
VOCAB, D, HEADS, FF, SEQ, BATCH = 40, 64, 4, 128, 12, 8


class TinyTransformer(nn.Module):
    def __init__(self, tied=False, unused=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(D, VOCAB)
        if tied:
            self.head.weight = self.emb.weight
        # A parameter the loss never reaches: it gets no gradient.
        self.unused = nn.Parameter(torch.randn(5)) if unused else None

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def batches(seed, n):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        yield x, torch.roll(x, 1, dims=1)


class TrainsLikeTorch(unittest.TestCase):

    def run_case(self, make_opt, release=False, tied=False, unused=False, steps=STEPS, accum=1,
                 make_sched=None):
        torch.manual_seed(7)
        model = TinyTransformer(tied=tied, unused=unused)
        ref = copy.deepcopy(model)
        ref_opt = make_opt(ref)
        ref_sched = make_sched(ref_opt) if make_sched else None
        loss_fn = nn.CrossEntropyLoss()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, make_opt(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=4096, release_after_forward=release,
                                     grad_accum=accum, job="bits")
            sched = make_sched(opt) if make_sched else None
            # The package submits transfers that start together as batches
            # (zs_push_many / zs_pull_many): count them, so that these bits
            # are known to have travelled that way.
            batched = {"push_many": 0, "pull_many": 0}

            def counted(name, fn):
                def call(tensors, *args, **kw):
                    batched[name] += len(tensors) > 1
                    return fn(tensors, *args, **kw)
                return call
            for name in batched:
                setattr(opt.client, name, counted(name, getattr(opt.client, name)))
            try:
                split = [P.name for P in opt._params if P.numel >= 4096]
                self.assertGreaterEqual(len(split), 4)
                total_bytes = 4 * sum(P.numel for P in opt._params)
                for step, (x, y) in enumerate(batches(11, steps), 1):
                    opt.zero_grad()
                    for micro in range(accum):
                        out = model(x[micro::accum])
                        if release:
                            # ZeRO-3: after forward the trainer holds no weights.
                            held = [P.name for P in opt._params if P.p.storage().size() != 0]
                            self.assertEqual(held, [])
                        loss = loss_fn(out.reshape(-1, VOCAB), y[micro::accum].reshape(-1))
                        (loss / accum).backward()
                    opt.step()
                    if step > 2:
                        # Each step pulls every weight once (and once more for
                        # the check below); with release also again for
                        # backward.
                        pulled = opt.timing().bytes_pulled
                        if release:
                            self.assertGreater(pulled, 2.5 * total_bytes)
                        elif accum == 1:
                            self.assertEqual(pulled, 2 * total_bytes)
                    self.assertTrue(opt.last_result.applied)
                    self.assertEqual(opt.last_result.step, step)

                    ref_opt.zero_grad()
                    for micro in range(accum):
                        ref_loss = loss_fn(ref(x[micro::accum]).reshape(-1, VOCAB),
                                           y[micro::accum].reshape(-1))
                        (ref_loss / accum).backward()
                    ref_opt.step()
                    if sched:
                        sched.step()
                        ref_sched.step()
                        self.assertEqual([g["lr"] for g in opt.param_groups],
                                         [g["lr"] for g in ref_opt.param_groups])
                    self.assertTrue(torch.equal(loss.detach(), ref_loss.detach()),
                                    "step %d: loss %r != torch's %r" % (step, loss.item(),
                                                                      ref_loss.item()))
                    # The shards' weights, pulled beside the trainer's own
                    # parameters so that its prefetching is left alone.
                    ref_params = dict(ref.named_parameters())
                    for P in opt._params:
                        n, q = P.name, ref_params[P.name]
                        w = torch.empty_like(q)
                        opt.client.pull(P.idx, zshard.torch._buffer(w)).wait()
                        self.assertTrue(torch.equal(w, q.detach()),
                                        "step %d: %s differs from torch.optim's by up to %g" %
                                        (step, n, (w - q.detach()).abs().max().item()))
                # state_dict() makes released parameters current first.
                sd = model.state_dict()
                for n, q in ref.state_dict().items():
                    self.assertTrue(torch.equal(sd[n], q), n)
                # Loading writes the weights to the shards (the same ones
                # here: nothing changes, as the comparison after close()
                # shows).
                model.load_state_dict(sd)
                self.assertGreater(batched["pull_many"], steps, batched)
                self.assertGreater(batched["push_many"], steps, batched)
                t = opt.timing()
                self.assertGreater(t.bytes_pushed, 0)
                self.assertGreater(t.bytes_pulled, 0)
            finally:
                opt.close()
        # close() leaves the trained weights in the model.
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()), n)
        return model

    def test_adamw(self):
        self.run_case(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.05))

    def test_adamw_release_after_forward_same_bits(self):
        self.run_case(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.05),
                      release=True)

    def test_adamw_two_micro_batches_per_step(self):
        self.run_case(lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.05),
                      accum=2, steps=STEPS // 2)

    def test_sgd_momentum_two_groups_tied_and_unused(self):
        def make(m):
            decay = [p for n, p in m.named_parameters() if p.dim() > 1]
            other = [p for n, p in m.named_parameters() if p.dim() <= 1]
            return torch.optim.SGD([{"params": decay, "weight_decay": 1e-3},
                                    {"params": other, "lr": 0.025}], lr=0.05, momentum=0.9)
        self.run_case(make, tied=True, unused=True)

    def test_adamw_two_groups_lambda_lr_per_group(self):
        # Each group's lr follows its own lambda, so their ratio changes every
        # step: every step sends each group's lr as torch's param_groups hold
        # it (zs_step_ex's group_lr).
        def make(m):
            decay = [p for n, p in m.named_parameters() if p.dim() > 1]
            other = [p for n, p in m.named_parameters() if p.dim() <= 1]
            return torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                                      {"params": other, "weight_decay": 0.0, "lr": 1e-3}],
                                     lr=3e-3)

        def sched(o):
            return torch.optim.lr_scheduler.LambdaLR(
                o, [lambda s: min(1.0, (s + 1) / 10) * 0.97 ** s, lambda s: 1.0 / (1 + 0.3 * s)])
        self.run_case(make, make_sched=sched)

    def test_sgd_nesterov_with_scheduler(self):
        torch.manual_seed(7)
        model = TinyTransformer()
        ref = copy.deepcopy(model)

        def make(m):
            return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                   dampening=0)
        ref_opt = make(ref)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
        loss_fn = nn.CrossEntropyLoss()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, make(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=4096, release_after_forward=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            try:
                for step, (x, y) in enumerate(batches(5, 8), 1):
                    for o, m in ((opt, model), (ref_opt, ref)):
                        o.zero_grad(set_to_none=True)
                        loss_fn(m(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
                        o.step()
                    sched.step()
                    ref_sched.step()
                    self.assertEqual(opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"])
                    opt.gather()
                    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                        self.assertTrue(torch.equal(p.detach(), q.detach()),
                                        "step %d: %s differs" % (step, n))
            finally:
                opt.close()
        self.assertEqual(opt.param_groups[0]["lr"], 0.05 * 0.5 ** 2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
