"""Parameters without a gradient, bit for bit like torch.optim.

torch skips a parameter whose .grad is None at step(): no weight decay, no
moment change, no step count. zshard.torch pushes "no gradient" for such a
parameter and the shards skip it when no trainer had one (a trainer without
one counts as zeros when another has one, as DDP's find_unused_parameters),
and they keep a step count per parameter, so that Adam's bias corrections
and state_dict()'s 'step' follow torch's per-parameter state['step'].

Each case trains the same model with zshard.torch (fp32 on the wire, two
shards) and with plain torch.optim and compares every parameter after every
step with torch.equal.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_nograd.py
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


class Net(nn.Module):
    """A backbone, a head, a branch (used on some steps only) and a late
    parameter (unused before `late_from`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.backbone = nn.Linear(6, 32)
        self.head = nn.Linear(32, 3)
        self.branch = nn.Linear(32, 3)
        self.late = nn.Parameter(torch.randn(3))

    def forward(self, x, step, use_branch, late_from):
        h = torch.tanh(self.backbone(x))
        out = self.head(h)
        if use_branch(step):
            out = out + self.branch(h)
        if step >= late_from:
            out = out * self.late
        return out


def batch(step, rank=0):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def loss_of(model, step, rank, use_branch, late_from):
    x, y = batch(step, rank)
    return nn.functional.cross_entropy(model(x, step, use_branch, late_from), y)


def always(step):
    return True


def odd(step):
    return step % 2 == 1


def pulled(opt, P):
    import zshard.torch
    w = torch.empty(P.p.shape)
    opt.client.pull(P.idx, zshard.torch._buffer(w)).wait()
    return w


class WithoutGradients(unittest.TestCase):

    def run_case(self, make_opt, freeze=False, use_branch=always, late_from=0, set_to_none=True,
                 check_state=None):
        import zshard.torch
        model, ref = Net(), Net()
        for m in (model, ref):
            if freeze:
                for p in m.backbone.parameters():
                    p.requires_grad_(False)
        ref_opt = make_opt(ref)
        frozen0 = copy.deepcopy(ref.backbone.state_dict())
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, make_opt(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=64, job="nograd")
            try:
                for step in range(STEPS):
                    opt.zero_grad(set_to_none=set_to_none)
                    loss_of(model, step, 0, use_branch, late_from).backward()
                    opt.step()
                    ref_opt.zero_grad(set_to_none=set_to_none)
                    loss_of(ref, step, 0, use_branch, late_from).backward()
                    ref_opt.step()
                    want = dict(ref.named_parameters())
                    for P in opt._params:
                        w, q = pulled(opt, P), want[P.name].detach()
                        self.assertTrue(torch.equal(w, q), "step %d: %s differs from torch's by "
                                        "up to %g" % (step, P.name, (w - q).abs().max().item()))
                    if check_state:
                        check_state(opt, ref_opt, step)
            finally:
                opt.close()
        if freeze:
            for n, t in ref.backbone.state_dict().items():
                self.assertTrue(torch.equal(t, frozen0[n]), n)
        return model, ref

    def test_frozen_backbone_left_in_adamw_is_not_decayed(self):
        self.run_case(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
                      freeze=True)

    def test_frozen_backbone_left_in_sgd_with_momentum_and_decay(self):
        self.run_case(lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                weight_decay=0.01), freeze=True)

    def test_branch_used_on_odd_steps_with_set_to_none(self):
        self.run_case(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
                      use_branch=odd)

    def test_branch_used_on_odd_steps_sgd_nesterov(self):
        self.run_case(lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                nesterov=True, weight_decay=0.01),
                      use_branch=odd)

    def test_parameter_first_used_at_step_1_has_its_own_step_count(self):
        self.run_case(lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), late_from=1)


# ---- state_dict: a step count per parameter ---------------------------------------------

def same_state(test, got, want, what):
    """torch.optim state_dicts equal: the same parameters with state, the
    same keys, steps and tensors (torch.equal), the same groups."""
    test.assertEqual(sorted(got["state"]), sorted(want["state"]), what)
    for i, w in want["state"].items():
        g = got["state"][i]
        test.assertEqual(sorted(g), sorted(w), "%s: parameter %d" % (what, i))
        for k, v in w.items():
            if isinstance(v, torch.Tensor):
                test.assertTrue(torch.equal(g[k], v), "%s: parameter %d's %s (%r, %r)" %
                                (what, i, k, g[k] if k == "step" else "", v if k == "step" else ""))
            else:
                test.assertEqual(g[k], v, "%s: parameter %d's %s" % (what, i, k))
    test.assertEqual([sorted(g["params"]) for g in got["param_groups"]],
                     [sorted(g["params"]) for g in want["param_groups"]], what)


class StateDictPerParameterStep(unittest.TestCase):

    def test_state_dict_steps_equal_torchs_per_parameter_steps(self):
        def check(opt, ref_opt, step):
            same_state(self, opt.state_dict(), ref_opt.state_dict(), "after step %d" % step)
        WithoutGradients.run_case(self, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                                    weight_decay=0.01),
                                  use_branch=odd, late_from=3, check_state=check)

    def round_trip(self, make_opt):
        """torch trains 3 steps (branch on odd steps, `late` unused): zshard
        loads its state (parameters at different steps, some without state)
        and both go on; then a fresh torch optimizer loads zshard's state and
        both go on again, every parameter compared after every step."""
        import zshard.torch
        model, ref = Net(), Net()
        ref_opt = make_opt(ref)
        late_from = 5

        def train(m, o, step):
            o.zero_grad(set_to_none=True)
            loss_of(m, step, 0, odd, late_from).backward()
            o.step()
        for step in range(3):
            train(ref, ref_opt, step)
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, make_opt(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=64, job="nograd-sd")
            try:
                model.load_state_dict(ref.state_dict())
                opt.load_state_dict(ref_opt.state_dict())
                same_state(self, opt.state_dict(), ref_opt.state_dict(), "loaded")
                for step in range(3, 8):
                    train(model, opt, step)
                    train(ref, ref_opt, step)
                    want = dict(ref.named_parameters())
                    for P in opt._params:
                        w, q = pulled(opt, P), want[P.name].detach()
                        self.assertTrue(torch.equal(w, q), "step %d: %s differs from torch's by "
                                        "up to %g" % (step, P.name, (w - q).abs().max().item()))
                    same_state(self, opt.state_dict(), ref_opt.state_dict(), "step %d" % step)
                sd = opt.state_dict()
                ref2 = Net()
                ref2.load_state_dict(model.state_dict())
                ref2_opt = make_opt(ref2)
                ref2_opt.load_state_dict(sd)
                for step in range(8, 11):
                    train(model, opt, step)
                    train(ref2, ref2_opt, step)
                    want = dict(ref2.named_parameters())
                    for P in opt._params:
                        w, q = pulled(opt, P), want[P.name].detach()
                        self.assertTrue(torch.equal(w, q), "step %d: %s differs from torch's by "
                                        "up to %g" % (step, P.name, (w - q).abs().max().item()))
            finally:
                opt.close()

    def test_checkpoint_and_restore_keep_per_parameter_steps(self):
        # The checkpoint files carry the counts (the branch and `late` are
        # behind the job): after a restore both runs go on from step 4.
        import zshard.torch
        model, ref = Net(), Net()

        def make(m):
            return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        ref_opt = make(ref)

        def train(m, o, step):
            o.zero_grad(set_to_none=True)
            loss_of(m, step, 0, odd, 6).backward()
            o.step()
        with zshard_servers.Shards(2, state_dirs=True) as shards:
            opt = zshard.torch.shard(model, make(model), addresses=shards.addresses,
                                     wire_dtype=torch.float32, rank=0, world_size=1,
                                     split_threshold=64, job="nograd-ckpt")
            try:
                for step in range(4):
                    train(model, opt, step)
                    train(ref, ref_opt, step)
                opt.checkpoint()
                saved = copy.deepcopy((ref, ref_opt))
                for step in range(4, 7):
                    train(model, opt, step)
                self.assertEqual(opt.restore(), 5)
                ref, ref_opt = saved
                same_state(self, opt.state_dict(), ref_opt.state_dict(), "restored")
                for step in range(4, 8):
                    train(model, opt, step)
                    train(ref, ref_opt, step)
                    want = dict(ref.named_parameters())
                    for P in opt._params:
                        w, q = pulled(opt, P), want[P.name].detach()
                        self.assertTrue(torch.equal(w, q), "step %d: %s differs from torch's by "
                                        "up to %g" % (step, P.name, (w - q).abs().max().item()))
                same_state(self, opt.state_dict(), ref_opt.state_dict(), "at the end")
            finally:
                opt.close()

    def test_load_state_dict_round_trip_adamw(self):
        self.round_trip(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01))

    def test_load_state_dict_round_trip_sgd_momentum(self):
        self.round_trip(lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9,
                                                  weight_decay=0.01))


# ---- two trainers -----------------------------------------------------------------------

def rank_uses_branch(rank, step):
    # Rank 0 uses the branch on even steps, rank 1 on steps divisible by 3:
    # some steps both, some one, some neither.
    return step % 2 == 0 if rank == 0 else step % 3 == 0


def make_opt2(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def worker(addresses, out, reduce):
    import zshard.torch
    rank = int(os.environ["RANK"])
    model = Net()
    opt = zshard.torch.shard(model, make_opt2(model), addresses=addresses,
                             wire_dtype=torch.float32, split_threshold=64, grad_reduce=reduce,
                             job="nograd2")
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss_of(model, step, rank, lambda s: rank_uses_branch(rank, s), STEPS).backward()
        opt.step()
    opt.close()
    torch.save({n: p.detach() for n, p in model.named_parameters()}, out)


class TwoTrainers(unittest.TestCase):

    def test_a_rank_without_a_gradient_counts_as_zeros_and_nobody_skips(self):
        self.run_two("sum")

    def test_the_same_with_the_mean_of_the_ranks(self):
        self.run_two("mean")

    def run_two(self, reduce):
        tmp = tempfile.mkdtemp(prefix="zshard-nograd-")
        with zshard_servers.Shards(2) as shards:
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "worker", shards.addresses,
                     os.path.join(tmp, "rank%d.pt" % rank), reduce], env=env))
            codes = [p.wait(300) for p in procs]
        self.assertEqual(codes, [0, 0])

        # torch fed the rank-ordered sum (times 1/2 for the mean, as DDP
        # averages), a rank without a gradient as zeros, and None where
        # neither rank had one (DDP find_unused_parameters gives zeros there
        # instead; torch's own step skips None).
        ref = Net()
        opt = make_opt2(ref)
        for step in range(STEPS):
            grads = []
            for rank in range(2):
                m = copy.deepcopy(ref)
                loss_of(m, step, rank, lambda s: rank_uses_branch(rank, s), STEPS).backward()
                grads.append([p.grad for p in m.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads):
                if g0 is None and g1 is None:
                    p.grad = None
                else:
                    p.grad = (g0 if g0 is not None else torch.zeros_like(p)) + \
                        (g1 if g1 is not None else torch.zeros_like(p))
                    if reduce == "mean":
                        p.grad = p.grad * 0.5
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
    if len(sys.argv) == 5 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        unittest.main(verbosity=2)
