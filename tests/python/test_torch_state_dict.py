"""A run moves from torch.optim to zshard and back through state_dict(), bit for bit.

W=1, fp32 on the wire, 2 shards, split threshold 4096 (the large weights are
split over both shards). opt.state_dict() has torch.optim's format exactly
(compared with torch's own dict), torch.optim.AdamW / SGD load it and go on
as if they had trained all along, and opt.load_state_dict() /
model.load_state_dict() write torch's state and weights to the shards. Every
parameter is compared (torch.equal) after every step; a dict with other betas
goes on with them. Misuse: a nesterov that differs from the shards', a state
they cannot hold and a load in the middle of a step are refused, changing
nothing.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_state_dict.py
"""

import copy
import os
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import test_torch_bits as bits  # noqa: E402
import zshard  # noqa: E402
import zshard.torch  # noqa: E402

LOSS = nn.CrossEntropyLoss()


def train_step(model, opt, x, y):
    opt.zero_grad()
    LOSS(model(x).reshape(-1, bits.VOCAB), y.reshape(-1)).backward()
    opt.step()


def adamw(m, lr=3e-3, betas=(0.9, 0.999)):
    return torch.optim.AdamW(m.parameters(), lr=lr, betas=betas, weight_decay=0.05)


def sgd(m, lr=0.05):
    decay = [p for p in m.parameters() if p.dim() > 1]
    other = [p for p in m.parameters() if p.dim() <= 1]
    return torch.optim.SGD([{"params": decay, "weight_decay": 1e-3},
                            {"params": other, "lr": lr / 2}], lr=lr, momentum=0.9)


def shard(model, opt, shards):
    return zshard.torch.shard(model, opt, addresses=shards.addresses, wire_dtype=torch.float32,
                              rank=0, world_size=1, split_threshold=4096, job="sd")


class StateDictMovesRuns(unittest.TestCase):

    def assertSameState(self, got, want):
        """Two optimizer state_dicts are equal: structure, keys, values, bits."""
        self.assertEqual(got["param_groups"], want["param_groups"])
        self.assertEqual(sorted(got["state"]), sorted(want["state"]))
        for i, s in want["state"].items():
            self.assertEqual(list(got["state"][i]), list(s), i)
            for k, v in s.items():
                g = got["state"][i][k]
                if v is None:
                    self.assertIsNone(g, (i, k))
                    continue
                self.assertEqual((g.dtype, g.shape), (v.dtype, v.shape), (i, k))
                self.assertTrue(torch.equal(g, v), (i, k))

    def assertSameWeights(self, model, ref, what):
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            self.assertTrue(torch.equal(p.detach(), q.detach()),
                            "%s: %s differs by up to %g" % (what, n,
                                                            (p - q).abs().max().item()))

    def continue_both(self, model, opt, ref, ref_opt, seed, steps):
        for step, (x, y) in enumerate(bits.batches(seed, steps), 1):
            train_step(model, opt, x, y)
            train_step(ref, ref_opt, x, y)
            opt.gather()
            self.assertSameWeights(model, ref, "step %d after the move" % step)

    def torch_to_zshard(self, make_opt, shards):
        """Trains plain torch 3 steps, loads model and optimizer into a
        sharded copy built from other weights, goes on 4 steps on both."""
        torch.manual_seed(7)
        ref = bits.TinyTransformer()
        ref_opt = make_opt(ref)
        for x, y in bits.batches(1, 3):
            train_step(ref, ref_opt, x, y)
        torch.manual_seed(8)
        model = bits.TinyTransformer()
        # Another lr than torch's: the dict's lr wins (sent every step).
        opt = shard(model, make_opt(model) if make_opt is sgd else adamw(model, lr=1e-4), shards)
        self.assertEqual(opt.state_dict()["state"], {})  # before the first step, as torch
        model.load_state_dict(ref.state_dict())
        opt.load_state_dict(ref_opt.state_dict())
        # Read back from the shards: torch's dict, key for key and bit for bit.
        self.assertSameState(opt.state_dict(), ref_opt.state_dict())
        for n, q in model.state_dict().items():
            self.assertTrue(torch.equal(q, ref.state_dict()[n]), n)
        self.continue_both(model, opt, ref, ref_opt, 2, 4)
        return model, opt, ref, ref_opt

    def zshard_to_torch(self, make_opt, shards):
        """Trains with zshard 3 steps, hands model and optimizer to plain
        torch, goes on 4 steps on both."""
        torch.manual_seed(7)
        model = bits.TinyTransformer()
        opt = shard(model, make_opt(model), shards)
        fresh = make_opt(copy.deepcopy(model)).state_dict()
        got = opt.state_dict()
        self.assertEqual(got, {"state": {}, "param_groups": fresh["param_groups"]})
        for x, y in bits.batches(3, 3):
            train_step(model, opt, x, y)
        sd, weights = opt.state_dict(), model.state_dict()
        torch.manual_seed(9)
        ref = bits.TinyTransformer()
        ref.load_state_dict(weights)
        ref_opt = make_opt(ref)
        ref_opt.load_state_dict(sd)
        self.assertSameState(ref_opt.state_dict(), sd)
        self.continue_both(model, opt, ref, ref_opt, 4, 4)
        return model, opt, ref, ref_opt

    def test_adamw_torch_to_zshard(self):
        with zshard_servers.Shards(2) as shards:
            model, opt, ref, ref_opt = self.torch_to_zshard(adamw, shards)
            try:
                self.assertEqual(opt.client.optimizer_steps(), 7)
                self.assertEqual(float(opt.state_dict()["state"][0]["step"]), 7.0)
                self.assertEqual(opt.param_groups[0]["lr"], 3e-3)
            finally:
                opt.close()

    def test_adamw_zshard_to_torch(self):
        with zshard_servers.Shards(2) as shards:
            model, opt, ref, ref_opt = self.zshard_to_torch(adamw, shards)
            opt.close()
        self.assertEqual(float(ref_opt.state_dict()["state"][0]["step"]), 7.0)

    def test_sgd_momentum_round_trip(self):
        with zshard_servers.Shards(2) as shards:
            _, opt, _, _ = self.torch_to_zshard(sgd, shards)
            opt.close(close_job=True)
            _, opt, _, _ = self.zshard_to_torch(sgd, shards)
            opt.close()

    def test_sgd_without_momentum_has_torchs_state(self):
        torch.manual_seed(7)
        model = bits.TinyTransformer()
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        with zshard_servers.Shards(1) as shards:
            opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1), shards)
            try:
                self.assertSameState(opt.state_dict(), ref_opt.state_dict())
                x, y = next(bits.batches(5, 1))
                train_step(model, opt, x, y)
                train_step(ref, ref_opt, x, y)
                # torch 1.13 records {'momentum_buffer': None} per stepped parameter.
                self.assertSameState(opt.state_dict(), ref_opt.state_dict())
                opt.load_state_dict(ref_opt.state_dict())
            finally:
                opt.close()

    def test_model_load_state_dict_after_shard_with_release(self):
        # The parameters are released (ZeRO-3) when the weights are loaded:
        # the load allocates them, writes them, and releases them again.
        torch.manual_seed(7)
        ref = bits.TinyTransformer()
        torch.manual_seed(8)
        model = bits.TinyTransformer()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     rank=0, world_size=1, split_threshold=4096,
                                     release_after_forward=True)
            try:
                model.load_state_dict(ref.state_dict())
                held = [n for n, p in model.named_parameters() if p.storage().size() != 0]
                self.assertEqual(held, [])
                for P in opt._params:
                    w = torch.empty_like(P.p)
                    opt.client.state_read(P.idx, zshard.MASTER, zshard.torch._buffer(w))
                    self.assertTrue(torch.equal(w, dict(ref.named_parameters())[P.name]), P.name)
                opt.gather()
                self.assertSameWeights(model, ref, "after the load")
            finally:
                opt.close()

    def test_model_load_state_dict_then_pulls_the_wire_copy(self):
        # bf16 on the wire: after a load the trainer computes with what the
        # shards serve (the master rounded to bf16, as every other trainer
        # pulls it), not with the fp32 values it copied in.
        torch.manual_seed(7)
        ref = bits.TinyTransformer()
        torch.manual_seed(8)
        model = bits.TinyTransformer()
        with zshard_servers.Shards(2) as shards:
            opt = zshard.torch.shard(model, adamw(model), addresses=shards.addresses,
                                     wire_dtype=torch.bfloat16, rank=0, world_size=1,
                                     split_threshold=4096)
            try:
                model.load_state_dict(ref.state_dict())
                opt.gather()
                for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                    want = q.detach().to(torch.bfloat16).float()
                    self.assertTrue(torch.equal(p.detach(), want), n)
                    w = torch.empty_like(q)
                    opt.client.state_read(opt._by_id[id(p)].idx, zshard.MASTER,
                                          zshard.torch._buffer(w))
                    self.assertTrue(torch.equal(w, q.detach()), n)
            finally:
                opt.close()

    def test_other_betas_load_and_apply_from_the_next_step(self):
        # The dict's betas become param_groups' and every step sends them
        # (zs_step_ex's group_beta1, group_beta2), so the run goes on as
        # torch's does.
        torch.manual_seed(7)
        ref = bits.TinyTransformer()
        ref_opt = adamw(ref, betas=(0.8, 0.99))
        for x, y in bits.batches(6, 2):
            train_step(ref, ref_opt, x, y)
        model = copy.deepcopy(ref)
        with zshard_servers.Shards(2) as shards:
            opt = shard(model, adamw(model), shards)
            try:
                opt.load_state_dict(ref_opt.state_dict())
                self.assertEqual(opt.param_groups[0]["betas"], (0.8, 0.99))
                self.continue_both(model, opt, ref, ref_opt, 9, 3)
            finally:
                opt.close()


class StateDictMisuse(unittest.TestCase):

    def test_other_nesterov_is_refused(self):
        # nesterov is fixed when the job opens; momentum and the rest are
        # sent with every step (StateDictMovesRuns).
        torch.manual_seed(7)
        model = bits.TinyTransformer()
        ref_opt = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1, momentum=0.9,
                                  nesterov=True)
        with zshard_servers.Shards(1) as shards:
            opt = shard(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), shards)
            try:
                with self.assertRaisesRegex(ValueError, "param group 0's nesterov"):
                    opt.load_state_dict(ref_opt.state_dict())
                self.assertFalse(opt.param_groups[0]["nesterov"])
            finally:
                opt.close()

    def test_a_bad_state_and_a_load_mid_step_are_refused(self):
        torch.manual_seed(7)
        model = bits.TinyTransformer()
        ref = copy.deepcopy(model)
        x, y = next(bits.batches(6, 1))
        train_step(ref, adamw(ref), x, y)
        with zshard_servers.Shards(1) as shards:
            opt = shard(model, adamw(model), shards)
            try:
                ref2 = copy.deepcopy(ref)
                ref2_opt = adamw(ref2)
                train_step(ref2, ref2_opt, x, y)
                sd = ref2_opt.state_dict()
                # A state the shards cannot hold is refused before any write.
                # (Parameters at different steps, or without state, are
                # fine: the shards keep a count per parameter,
                # test_torch_nograd.py.)
                for edit, word in (
                        (lambda b: b["state"][0].update(exp_avg=torch.zeros(3)), "shape"),
                        (lambda b: b["param_groups"][0].update(amsgrad=True), "amsgrad")):
                    bad = copy.deepcopy(sd)
                    edit(bad)
                    with self.assertRaisesRegex(ValueError, word):
                        opt.load_state_dict(bad)
                self.assertEqual(opt.state_dict()["state"], {})
                # After backward pushed this step's gradients, before step().
                opt.zero_grad()
                LOSS(model(x).reshape(-1, bits.VOCAB), y.reshape(-1)).backward()
                with self.assertRaisesRegex(RuntimeError, "between steps only"):
                    opt.load_state_dict(sd)
                with self.assertRaisesRegex(RuntimeError, "between steps only"):
                    model.load_state_dict(ref2.state_dict())
                self.assertEqual(opt.client.optimizer_steps(), 0)
                opt.step()
                # Between steps the same dict loads.
                opt.load_state_dict(sd)
                self.assertEqual(opt.client.optimizer_steps(), 1)
            finally:
                opt.close()


# ---- two trainers load the same dict ----------------------------------------------------

W2_STEPS = 4


def w2_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 200), nn.GELU(), nn.LayerNorm(200), nn.Linear(200, 5))


def w2_loss(model, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 12, generator=g), torch.randint(0, 5, (4,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def w2_worker(addresses, tmp):
    """One of two trainers: loads torch's model and optimizer state (the same
    file on both ranks), then trains W2_STEPS steps. Rank 0 loads first and
    pushes its first gradients; only then does rank 1 load, so every write
    of rank 1 meets a step in progress on the shards (ENOTREADY) and must
    find rank 0's equal values there."""
    rank = int(os.environ["RANK"])
    model = w2_model(99)
    opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-4,
                                                      weight_decay=0.02),
                             addresses=addresses, wire_dtype=torch.float32, split_threshold=1000,
                             grad_reduce="sum", job="w2")
    saved = torch.load(os.path.join(tmp, "torch.pt"))
    pushed = os.path.join(tmp, "rank0-pushed")
    if rank == 1:
        # Rank 0 failing instead ends this wait too (see __main__).
        while not os.path.exists(pushed) and not os.path.exists(os.path.join(tmp, "failed")):
            time.sleep(0.01)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    for step in range(1, W2_STEPS + 1):
        opt.zero_grad()
        w2_loss(model, step, rank).backward()
        if rank == 0 and step == 1:
            opt._wait_pushes()
            open(pushed, "w").close()
        opt.step()
    opt.close()
    torch.save({n: p.detach() for n, p in model.named_parameters()},
               os.path.join(tmp, "rank%d.pt" % rank))


class TwoTrainersLoad(unittest.TestCase):

    def test_both_ranks_load_the_same_dict_without_a_barrier(self):
        ref = w2_model(21)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=5e-3, weight_decay=0.02)
        for step in range(1, 3):
            ref_opt.zero_grad()
            w2_loss(ref, -step, 0).backward()
            ref_opt.step()
        tmp = tempfile.mkdtemp(prefix="zshard-sd-w2-")
        torch.save({"model": ref.state_dict(), "opt": ref_opt.state_dict()},
                   os.path.join(tmp, "torch.pt"))
        with zshard_servers.Shards(2) as shards:
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2")
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "w2", shards.addresses, tmp],
                    env=env))
            codes = [p.wait(300) for p in procs]
        self.assertEqual(codes, [0, 0])
        # torch goes on from its own state, fed the rank-ordered sum.
        for step in range(1, W2_STEPS + 1):
            grads = []
            for rank in range(2):
                m = copy.deepcopy(ref)
                w2_loss(m, step, rank).backward()
                grads.append([p.grad for p in m.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads):
                p.grad = g0 + g1
            ref_opt.step()
        want = dict(ref.named_parameters())
        for rank in range(2):
            got = torch.load(os.path.join(tmp, "rank%d.pt" % rank))
            for n, w in got.items():
                self.assertTrue(torch.equal(w, want[n].detach()),
                                "rank %d: %s differs by up to %g" %
                                (rank, n, (w - want[n].detach()).abs().max().item()))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if len(sys.argv) == 4 and sys.argv[1] == "w2":
        try:
            w2_worker(sys.argv[2], sys.argv[3])
        except BaseException:
            open(os.path.join(sys.argv[3], "failed"), "w").close()
            raise
    else:
        unittest.main(verbosity=2)
