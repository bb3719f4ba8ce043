"""Deferred initialisation: a model built on the meta device gets, on the
shards, the same bits as the same model built on the CPU with the same seed,
initialised one unit at a time by rank 0 alone.

Run with Debian's interpreter (CTest does): /usr/bin/python3 -m pytest tests/python/test_torch_deferred.py
"""

import os
import subprocess
import sys
import textwrap
import unittest
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402
from zshard.torch import _deferred  # noqa: E402


class Tied(nn.Module):
    """A language model whose head shares the embedding's weight."""

    def __init__(self, device=None):
        super().__init__()
        self.emb = nn.Embedding(50, 16, device=device)
        self.lstm = nn.LSTM(16, 24, device=device)
        self.proj = nn.Linear(24, 16, device=device)
        self.head = nn.Linear(16, 50, device=device)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.head(self.proj(h))


class Zoo(nn.Module):
    """torch's own modules, as the issue lists them."""

    def __init__(self, device=None):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 8, 3, device=device)
        self.conv2 = nn.Conv2d(3, 4, 3, device=device)
        self.bn = nn.BatchNorm1d(8, device=device)
        self.mha = nn.MultiheadAttention(16, 2, device=device)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, device=device)
        self.norm = nn.LayerNorm(16, device=device)
        self.emb = nn.Embedding(30, 16, device=device)
        self.out = nn.Linear(16, 5, device=device)

    def forward(self, x1, x2, tok):
        a = self.bn(self.conv1(x1)).mean()
        b = self.conv2(x2).mean()
        e = self.emb(tok)
        h, _ = self.mha(e, e, e)
        h = self.norm(self.enc(h))
        return self.out(h).sum() + a + b


def masters(opt):
    """Every parameter's fp32 master on the shards, by name."""
    out = {}
    for P in opt._params:
        w = torch.empty(P.numel, dtype=torch.float32)
        opt.client.state_read(P.idx, zshard.MASTER, zshard.torch._buffer(w))
        out[P.name] = w.view(P.p.shape)
    return out


def open_sharded(model, shards, job, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return zshard.torch.shard(model, opt, addresses=shards.addresses, wire_dtype=torch.float32,
                              rank=0, world_size=1, split_threshold=4096, job=job, **kw)


class DeferredInit(unittest.TestCase):

    def check_bits(self, build, job, use_context=False):
        torch.manual_seed(1234)
        ref = build(None)
        next_draw = torch.rand(4)
        torch.manual_seed(1234)
        if use_context:
            with zshard.torch.init_empty():
                model = build(None)
        else:
            model = build("meta")
        self.assertTrue(all(p.is_meta for p in model.parameters()))
        with zshard_servers.Shards(2) as shards:
            opt = open_sharded(model, shards, job)
            # The replay moved the generator exactly as the CPU build did.
            self.assertTrue(torch.equal(torch.rand(4), next_draw), "generator state")
            try:
                got = masters(opt)
                want = dict(ref.named_parameters())
                self.assertEqual(sorted(got), sorted(want))
                for n, w in want.items():
                    self.assertTrue(torch.equal(got[n], w.detach()), n)
                # The model's buffers hold what the CPU build holds.
                for (n, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
                    self.assertFalse(b.is_meta, n)
                    self.assertTrue(torch.equal(b, rb), n)
            finally:
                opt.close()
        return model, ref

    def test_torch_modules_get_the_bits_of_a_cpu_build(self):
        self.check_bits(lambda d: Zoo(d), "zoo")

    def test_tied_weights_and_an_lstm_get_the_bits_of_a_cpu_build(self):
        self.check_bits(lambda d: Tied(d), "tied")

    def test_init_empty_builds_any_model_on_meta(self):
        self.check_bits(lambda d: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4),
                                                nn.LayerNorm(4)), "seq", use_context=True)

    def test_training_after_deferred_init_matches_a_cpu_build(self):
        """The sharded model trains like the CPU-built one, step for step.
        The replay draws from the generator at shard(), not when the model
        is built: the input is drawn before either."""
        x = torch.randint(0, 50, (5, 3))
        torch.manual_seed(7)
        ref = Tied()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        torch.manual_seed(7)
        model = Tied("meta")
        with zshard_servers.Shards(1) as shards:
            opt = open_sharded(model, shards, "train", release_after_forward=True)
            try:
                for _ in range(3):
                    for m, o in ((ref, ropt), (model, opt)):
                        o.zero_grad()
                        m(x).square().mean().backward()
                        o.step()
                got = masters(opt)
                for n, w in ref.named_parameters():
                    self.assertTrue(torch.equal(got[n], w.detach()), n)
            finally:
                opt.close()
        for n, w in ref.named_parameters():
            self.assertTrue(torch.equal(dict(model.named_parameters())[n], w.detach()), n)

    def test_a_custom_module_without_reset_needs_param_init_fn(self):
        class Scale(nn.Module):
            def __init__(self):
                super().__init__()
                self.s = nn.Parameter(torch.ones(6, device="meta"))

        with zshard_servers.Shards(1) as shards:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with self.assertRaisesRegex(ValueError, r"module s? ?.*Scale.*param_init_fn"):
                    open_sharded(nn.Sequential(Scale()), shards, "custom1")

        def init(m):
            if isinstance(m, Scale):
                m.s.fill_(0.5)
        with zshard_servers.Shards(1) as shards:
            opt = open_sharded(nn.Sequential(Scale()), shards, "custom2", param_init_fn=init)
            try:
                self.assertTrue(torch.equal(masters(opt)["0.s"], torch.full((6,), 0.5)))
            finally:
                opt.close()

    def test_units_are_modules_children_first_and_mha_with_its_subtree(self):
        model = Zoo("meta")
        ids = {id(p) for p in model.parameters()}
        names = {id(m): n for n, m in model.named_modules()}
        units = [[names[id(m)] for m in u] for u in _deferred.plan_units(model, ids)]
        self.assertIn(["mha.out_proj", "mha"], units)
        self.assertIn(["enc.self_attn.out_proj", "enc.self_attn"], units)
        self.assertLess(units.index(["conv1"]), units.index(["bn"]))
        self.assertLess(units.index(["enc.linear1"]), units.index(["enc.linear2"]))


TWO_RANKS = textwrap.dedent("""
    import os, sys, resource
    sys.path.insert(0, os.environ["ZSHARD_PYTHONPATH"])
    import torch
    from torch import nn
    import zshard, zshard.torch
    rank = int(sys.argv[1])
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(256, 256, device="meta") for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    resets = [0]
    orig = nn.Linear.reset_parameters
    def counted(self):
        resets[0] += 1
        orig(self)
    nn.Linear.reset_parameters = counted
    opt = zshard.torch.shard(model, opt, addresses=sys.argv[2], wire_dtype=torch.float32,
                             rank=rank, world_size=2, job="two", release_after_forward=True)
    x = torch.ones(4, 256)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    w = torch.empty(256 * 256)
    opt.client.state_read(0, zshard.MASTER, zshard.torch._buffer(w))
    print("resets", resets[0], "w0", float(w[:8].sum()))
    opt.close()
""")


class TwoRanks(unittest.TestCase):

    def test_only_rank_0_initialises_and_the_other_waits(self):
        env = dict(os.environ)
        env.setdefault("ZSHARD_PYTHONPATH", os.path.join(
            os.path.dirname(__file__), "..", "..", "build", "python"))
        with zshard_servers.Shards(2) as shards:
            addrs = ",".join(shards.addresses) if isinstance(shards.addresses, list) \
                else shards.addresses
            procs = [subprocess.Popen([sys.executable, "-c", TWO_RANKS, str(r), addrs],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env) for r in (1, 0)]
            outs = [p.communicate(timeout=240) for p in procs]
            for p, (out, err) in zip(procs, outs):
                self.assertEqual(p.returncode, 0, err)
        r1, r0 = [o.split() for o, _ in outs]
        self.assertEqual(r0[1], "8")   # rank 0 ran every Linear's reset
        self.assertEqual(r1[1], "0")   # rank 1 none
        self.assertEqual(r0[3], r1[3])


if __name__ == "__main__":
    unittest.main()
