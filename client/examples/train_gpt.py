#!/usr/bin/python3
"""A small character-level GPT trained with zshard.torch.

The text is the GNU GPL version 3 as every Debian system ships it
(/usr/share/common-licenses/GPL-3, about 35 kB). The weights and the AdamW
state live on the zshard shards; each trainer holds only what it computes
with (release_after_forward). Run one trainer per rank, e.g. with torchrun:

    python3 -m torch.distributed.run --nproc_per_node 2 --redirects 1 --tee 1 \\
        client/examples/train_gpt.py --shards 127.0.0.1:7070,127.0.0.1:7071

(`--redirects 1 --tee 1` works around torch 1.13's launcher on Python 3.11,
whose default redirect setting fails with "'NoneType' object has no attribute
'get'".)

(torchrun only sets RANK and WORLD_SIZE here: the shards do the reduction,
no process group is created.) Every rank trains on its own slice of each
batch; the shards average the ranks' gradients. Each step prints the loss and
where the step's time went (zshard.Timing).

The build tree's package is found with PYTHONPATH=build/python.
"""

import argparse
import math
import os
import time

import torch
from torch import nn

import zshard.torch

TEXT = "/usr/share/common-licenses/GPL-3"


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, ctx):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        nn.init.normal_(self.tok.weight, std=0.02)  # small logits at the start
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", required=True, help="shard addresses, h0:7070,h1:7070")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step, all ranks")
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wire", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--job", default="train-gpt")
    args = ap.parse_args()

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    with open(TEXT, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    torch.manual_seed(0)  # the same initial model on every rank
    model = GPT(len(chars), args.dim, args.heads, args.layers, args.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    wire = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.wire]
    opt = zshard.torch.shard(model, opt, addresses=args.shards, wire_dtype=wire,
                             release_after_forward=True, max_grad_norm=1.0, job=args.job)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    nparams = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print("train_gpt: %d parameters, %d characters of %s, %d rank(s), %s on the wire, "
              "starting at step %d" % (nparams, len(data), TEXT, world, args.wire,
                                       opt.client.current_step))

    per_rank = max(1, args.batch // world)
    g = torch.Generator().manual_seed(1234)
    while opt.client.current_step <= args.steps:
        step = opt.client.current_step
        starts = torch.randint(0, len(data) - args.ctx - 1, (per_rank * world,), generator=g)
        mine = starts[rank * per_rank:(rank + 1) * per_rank]
        x = torch.stack([data[s:s + args.ctx] for s in mine])
        y = torch.stack([data[s + 1:s + args.ctx + 1] for s in mine])
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        ms = (time.perf_counter() - t0) * 1e3
        if rank == 0 and (step % 10 == 0 or step == 1):
            t = opt.timing()
            print("step %4d  loss %.4f  %.1f ms (compute %.1f, push %.1f, pull wait %.1f, "
                  "step %.1f)  norm %.3f" % (step, loss.item(), ms, t.compute_ms, t.push_ms,
                                             t.pull_wait_ms, t.step_ms,
                                             opt.last_result.grad_norm))
    opt.close()


if __name__ == "__main__":
    main()
