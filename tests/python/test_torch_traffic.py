"""zshard.torch with the traffic keywords and the pipelined step: shard()
passes schedule, schedule_window and tcp_congestion to its client (a bad one
is refused by shard()), and a pipelined job under the rotated schedule
trains a small MLP bit for bit like torch.optim.AdamW, with the first
layer's parameters of step k+1 already being pulled when step() returns
(before the next forward asks for them; the shards answer each piece once
it is applied). W=1, fp32 on the wire, 2 real shards on loopback.

Run with Debian's interpreter (CTest does)."""
import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402

STEPS = 6


def mlp():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def batches(n):
    g = torch.Generator().manual_seed(5)
    for _ in range(n):
        yield torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def test_shard_refuses_a_bad_traffic_option():
    model = mlp()
    with zshard_servers.Shards(1) as shards:
        with pytest.raises(ValueError, match="schedule"):
            zshard.torch.shard(model, torch.optim.AdamW(model.parameters()), shards.addresses,
                               rank=0, world_size=1, schedule="pairwise")
        with pytest.raises(zshard.Error, match="schedule_window"):
            zshard.torch.shard(model, torch.optim.AdamW(model.parameters()), shards.addresses,
                               rank=0, world_size=1, schedule="rotated", schedule_window=65)


def test_pipelined_rotated_training_prefetches_the_first_layer_and_keeps_the_bits():
    model = mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.05)
    loss_fn = nn.MSELoss()
    first_layer = {id(model[0].weight), id(model[0].bias)}
    with zshard_servers.Shards(2) as shards:
        opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                          weight_decay=0.05),
                                 shards.addresses, wire_dtype=torch.float32, rank=0,
                                 world_size=1, split_threshold=1024, prefetch=1, pipelined=1,
                                 schedule="rotated", schedule_window=1, job="traffic")
        try:
            for step, (x, y) in enumerate(batches(STEPS), 1):
                opt.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                # step() returned without waiting for the shards' apply; the
                # first layer of the next forward is already on its way.
                issued = {id(P.p) for P in opt._params if P.pull is not None}
                assert first_layer <= issued, "step %d: first layer not prefetched" % step
                ref_opt.zero_grad()
                ref_loss = loss_fn(ref(x), y)
                ref_loss.backward()
                ref_opt.step()
                assert torch.equal(loss.detach(), ref_loss.detach()), step
            # One more forward pulls every weight of the last step.
            with torch.no_grad():
                model(torch.zeros(1, 16))
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                assert torch.equal(p.detach(), q.detach()), n
        finally:
            opt.close()
