#!/usr/bin/python3
"""A small character-level GPT trained through zshard shards from PyTorch.

    # two trainer processes (torch 1.13 has no `torchrun` on PATH: the module form)
    PYTHONPATH=build/python /usr/bin/python3 -m torch.distributed.run --nproc_per_node 2 \\
        client/examples/train_gpt.py --shards 127.0.0.1:7070,127.0.0.1:7071 --steps 300
    # one trainer, no torchrun
    PYTHONPATH=build/python /usr/bin/python3 client/examples/train_gpt.py --shards ...

The text is the GNU GPL version 3 as Debian ships it in every installation
(/usr/share/common-licenses/GPL-3, base-files, about 35 KB of English): no
download, the same bytes on every Debian 12 machine. The first 90 % of its
characters train, the last 10 % are held out.

The model is a GPT in miniature: token and position embeddings, --layers
pre-LayerNorm blocks (causal self-attention, then a 4x MLP), a final
LayerNorm and an output layer that shares the token embedding's weight (tied
parameters). --attention mha uses nn.MultiheadAttention, whose forward reads
out_proj.weight without calling out_proj; --attention manual spells attention
out with nn.Linear layers.

The optimizer is torch.optim.AdamW handed to zshard.torch.shard(): the shards
keep the weights and Adam's state, sum the ranks' gradients and run the update.
There is no DDP and no all-reduce. Every rank draws the same global batch of
--batch sequences (from a generator seeded by --seed and the step) and trains
on its own contiguous slice of it; the shards average the W pushed gradients
(grad_reduce="mean", zshard's default), and since each rank's loss is the mean
over its slice, the update is the one single-process torch makes on the whole
batch. Everything is seeded: two runs with the same arguments print the same
losses (the shards add contributions in a fixed order, whatever the timing).

Rank 0 prints its slice's loss and where the step's time went every
--log-every steps (libzshard's timing: compute is the trainer's own work
between zshard calls, push the time spent pushing gradients and waiting for
them, pull wait the time waiting for parameters, step the shards' statistics
and update), and at the end the held-out loss and the average breakdown.
"""

import argparse
import math
import os
import sys
import time

# One BLAS thread per process unless the caller says otherwise: several
# trainer processes share the machine, and oversubscription only adds noise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:
    import zshard.torch  # noqa: E402
except ImportError as e:
    sys.exit("train_gpt.py: cannot import zshard.torch (%s): build the project and run with "
             "PYTHONPATH=build/python /usr/bin/python3" % e)

TEXT = "/usr/share/common-licenses/GPL-3"
WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8}


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--shards", default=os.environ.get("ZSHARD_SHARDS"),
                   help="host:port of every shard, in shard-id order (default $ZSHARD_SHARDS)")
    a.add_argument("--steps", type=int, default=300)
    a.add_argument("--wire", choices=sorted(WIRE), default="bf16",
                   help="dtype of gradients and parameters on the wire (fp16 turns on dynamic "
                        "loss scaling)")
    a.add_argument("--error-feedback", choices=("on", "off"), default="on",
                   help="with --wire int8: keep what quantization loses and add it to the next "
                        "push (4 bytes per parameter)")
    a.add_argument("--release-after-forward", action="store_true",
                   help="free each layer's parameters after forward, pull them again for backward")
    a.add_argument("--prefetch", type=int, default=2, help="modules pulled ahead of use")
    a.add_argument("--batch", type=int, default=16, help="global batch (sequences), split over ranks")
    a.add_argument("--block", "--ctx", type=int, default=64, help="context length (characters)")
    a.add_argument("--layers", type=int, default=2)
    a.add_argument("--d-model", "--dim", type=int, default=128, help="width of the model")
    a.add_argument("--heads", type=int, default=4)
    a.add_argument("--attention", choices=("mha", "manual"), default="mha")
    a.add_argument("--lr", type=float, default=3e-3)
    a.add_argument("--warmup", type=int, default=20, help="linear warm-up steps, then cosine")
    a.add_argument("--weight-decay", type=float, default=0.01)
    a.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    a.add_argument("--log-every", type=int, default=20)
    a.add_argument("--val-batches", type=int, default=8)
    a.add_argument("--seed", type=int, default=1234)
    a.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    a.add_argument("--job", default="train-gpt", help="zshard job name")
    a.add_argument("--data", default=TEXT, help="text file to learn (default %(default)s)")
    args = a.parse_args(argv)
    if not args.shards:
        a.error("--shards host:port,... is required (or set ZSHARD_SHARDS)")
    return args


# ---------------------------------------------------------------------- model

class CausalSelfAttention(nn.Module):
    """Multi-head causal attention from plain nn.Linear layers."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = F.softmax(att + mask[:t, :t], dim=-1)
        return self.out((att @ v).transpose(1, 2).reshape(b, t, d))


class MHA(nn.Module):
    """nn.MultiheadAttention with a causal mask. Its forward reads
    out_proj.weight directly (F.multi_head_attention_forward), never calling
    the out_proj module: what per-module hooks would miss."""

    def __init__(self, d, heads):
        super().__init__()
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x, mask):
        t = x.shape[1]
        return self.mha(x, x, x, attn_mask=mask[:t, :t], need_weights=False)[0]


class Block(nn.Module):
    def __init__(self, d, heads, attention):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = MHA(d, heads) if attention == "mha" else CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        x = x + self.attn(self.ln1(x), mask)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, block, d, layers, heads, attention):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, used twice
        # Additive causal mask (a buffer, not a parameter: it stays on the trainer).
        self.register_buffer("mask", torch.full((block, block), float("-inf")).triu(1),
                             persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t))
        for b in self.blocks:
            x = b(x, self.mask)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------- data

def load_text(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    n = int(0.9 * len(data))
    return data[:n], data[n:], len(chars)


def batch(data, n, block, gen):
    """n random windows of block+1 characters: inputs and next-character targets."""
    ix = torch.randint(len(data) - block - 1, (n,), generator=gen)
    win = torch.stack([data[i:i + block + 1] for i in ix.tolist()])
    return win[:, :-1], win[:, 1:]


def lr_at(step, args):
    """Linear warm-up, then cosine decay to a tenth (steps count from 1)."""
    if step <= args.warmup:
        return args.lr * step / max(1, args.warmup)
    p = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, p))))


# ---------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch % world:
        sys.exit("train_gpt.py: --batch %d is not a multiple of the %d ranks" % (args.batch, world))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train, val, vocab = load_text(args.data)
    # Every rank builds the same initial weights; rank 0's are the ones the
    # shards start from.
    model = GPT(vocab, args.block, args.d_model, args.layers, args.heads, args.attention)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    base = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr_at(1, args), betas=(0.9, 0.95))
    extra = {"loss_scaling": "dynamic"} if args.wire == "fp16" else {}
    if args.wire == "int8":
        extra["error_feedback"] = int(args.error_feedback == "on")
    opt = zshard.torch.shard(model, base, addresses=args.shards, wire_dtype=WIRE[args.wire],
                             rank=rank, world_size=world, prefetch=args.prefetch,
                             release_after_forward=args.release_after_forward,
                             max_grad_norm=args.max_grad_norm or None, job=args.job, **extra)
    start = opt.client.current_step
    if rank == 0 and start != 1:
        # A shard keeps its job: the same model on the same shards resumes it.
        print("note: the shards already hold job %r at step %d; training continues from its "
              "weights (for a new run, close it first: `zshard close-job`)" % (args.job, start),
              flush=True)
    # A plain LambdaLR drives the schedule through opt.param_groups, as it
    # would drive torch's own optimizer.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_at(s + 1, args) / lr_at(1, args))
    if rank == 0:
        print("train_gpt: %d rank(s); %s, %d characters (%d train, %d held out), vocabulary %d; "
              "GPT %d layers "
              "d=%d heads=%d attention=%s, %d parameters; batch %d (%d per rank) x %d characters, "
              "%s on the wire%s" % (world, args.data, len(train) + len(val), len(train), len(val),
                                    vocab, args.layers, args.d_model, args.heads, args.attention,
                                    nparams, args.batch, args.batch // world, args.block,
                                    args.wire, ", release after forward"
                                    if args.release_after_forward else ""), flush=True)

    per = args.batch // world
    keys = ("total_ms", "compute_ms", "push_ms", "pull_wait_ms", "step_ms")
    sums = dict.fromkeys(keys, 0.0)
    timed = 0
    wall = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            gen = torch.Generator().manual_seed(args.seed * 1000003 + step)
            x, y = batch(train, args.batch, args.block, gen)
            x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, vocab), y.reshape(-1))
            if args.wire == "fp16":
                # fp16 gradients need the loss scaled; the shards unscale
                # (and skip the step on overflow, lowering the scale).
                (loss * opt.loss_scale).backward()
            else:
                loss.backward()
            lr = opt.param_groups[0]["lr"]
            opt.step()
            sched.step()
            r = opt.last_result
            t = r.timing
            if step > 1:  # the first step also traces the model: not typical
                for k in keys:
                    sums[k] += getattr(t, k)
                timed += 1
            if rank == 0 and (step == 1 or step % args.log_every == 0 or step == args.steps):
                print("step %d loss %.4f lr %.2e grad_norm %.3f%s | ms: total %.1f compute %.1f "
                      "push %.1f pull wait %.1f step %.1f | KiB pushed %.0f pulled %.0f" %
                      (step, loss.item(), lr, r.grad_norm,
                       "" if r.applied else " skipped", t.total_ms, t.compute_ms, t.push_ms,
                       t.pull_wait_ms, t.step_ms, t.bytes_pushed / 1024, t.bytes_pulled / 1024),
                      flush=True)
    finally:
        # The model keeps the trained weights; the shards keep the job.
        opt.close()
    wall = time.perf_counter() - wall

    if rank == 0:
        model.eval()
        gen = torch.Generator().manual_seed(args.seed)
        with torch.no_grad():
            losses = []
            for _ in range(args.val_batches):
                x, y = batch(val, args.batch, args.block, gen)
                losses.append(F.cross_entropy(model(x).view(-1, vocab), y.reshape(-1)).item())
        avg = {k: sums[k] / max(1, timed) for k in keys}
        print("final: held-out cross-entropy %.4f after %d steps (%.1f s); average step, steps "
              "2..%d: total %.1f ms = compute %.1f + push %.1f + pull wait %.1f + step %.1f" %
              (sum(losses) / len(losses), args.steps, wall, args.steps, avg["total_ms"],
               avg["compute_ms"], avg["push_ms"], avg["pull_wait_ms"], avg["step_ms"]),
              flush=True)


if __name__ == "__main__":
    main()
