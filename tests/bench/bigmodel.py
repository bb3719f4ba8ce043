#!/usr/bin/python3
"""bigmodel: a decoder-only transformer larger than any trainer holds,
trained through zshard by W trainers built on the meta device (deferred
initialisation, release_after_forward), each optionally inside a memory
cgroup. See docs/PERFORMANCE.md, "A model bigger than a trainer".

    PYTHONPATH=build/python /usr/bin/python3 tests/bench/bigmodel.py \\
        --build-dir build [--d-model 2048 --layers 10] [--limit-mib 1536] [--json]
    ... --sweep 512:4,1024:4,2048:4     peak RSS against model size (d:layers each)

(tests/bench/run --only bigmodel runs the 0.5-billion-parameter case.)

Figures (bench "bigmodel"), per configuration:
  trainer_peak_rss    the largest trainer's VmHWM, MiB; limit: the model's fp32
                      size (what every DDP trainer holds before its gradients
                      and Adam's moments: 16 bytes per parameter in all);
                      ratio = peak / fp32 size.
  trainer_growth      that peak minus an idle interpreter's with torch
                      imported (measured in the same run), MiB.
  cgroup_max_usage    the cgroup's memory.max_usage_in_bytes (page cache
                      included), MiB, when --limit-mib is set.
  step_s              median step time of rank 0 (forward, backward, step).
  loss_first, loss_last  rank 0's loss at the first and last step (the same
                      batch every step, so the loss must fall).
  init_s              shard() on rank 0: the deferred initialisation.
The shards are real zshard-server processes started here and stopped at the
end; each trainer is this file with --worker. Trainers run with one torch
thread and OPENBLAS_NUM_THREADS=1.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
MiB = 1 << 20
CGROUP = "/sys/fs/cgroup/memory"


sys.path.insert(0, HERE)
from bench_torch import note, start_shards, vmhwm  # noqa: E402  (one copy of each)


# ---------------------------------------------------------------- the trainer

def build_model(a):
    import math
    import torch
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x, mask):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for z in (q, k, v))
            att = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads) + mask[:t, :t],
                            dim=-1)
            x = x + self.out((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.proj(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab, block, d, layers, heads):
            super().__init__()
            self.block = block
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight
            self.register_buffer("mask", torch.full((block, block), float("-inf"),
                                                    device="cpu").triu(1), persistent=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for b in self.blocks:
                x = b(x, self.mask)
            return self.head(self.ln(x))

    return GPT(a.vocab, a.block, a.d_model, a.layers, a.heads)


def init_fn(m):
    """GPT-2's initialisation, module by module (param_init_fn)."""
    from torch import nn
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif hasattr(m, "reset_parameters"):
        m.reset_parameters()  # LayerNorm


def worker(a):
    import torch
    import torch.nn.functional as F
    import zshard.torch
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    with zshard.torch.init_empty():
        model = build_model(a)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    t0 = time.perf_counter()
    opt = zshard.torch.shard(model, opt, addresses=a.addresses, wire_dtype=torch.bfloat16,
                             rank=a.rank, world_size=a.world, release_after_forward=True,
                             param_init_fn=init_fn, job="bigmodel", mmap_threshold=1 << 20,
                             step_timeout_ms=600000, rpc_timeout_ms=600000)
    init_s = time.perf_counter() - t0
    built = vmhwm()
    gen = torch.Generator().manual_seed(100 + a.rank)
    x = torch.randint(0, a.vocab, (a.batch, a.block), generator=gen)
    y = torch.randint(0, a.vocab, (a.batch, a.block), generator=gen)
    times, losses = [], []
    for step in range(a.steps):
        t = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
        if a.rank == 0:
            note("step %d loss %.4f %.1f s (VmHWM %.0f MiB)" % (step + 1, losses[-1], times[-1],
                                                                 vmhwm() / MiB))
    peak = vmhwm()
    # The weights stay on the shards: gathering them would hold the whole
    # model, which is what this trainer cannot.
    opt.close(gather=False)
    print(json.dumps({"params": nparams, "vmhwm": peak, "built": built, "init_s": init_s,
                      "times": times, "losses": losses}), flush=True)


# ---------------------------------------------------------------- the driver

def report(a, metric, value, unit, limit=None, **extra):
    ratio = value / limit if limit else None
    r = {"bench": "bigmodel", "metric": metric, "value": value, "unit": unit,
         "limit": limit, "ratio": ratio}
    r.update(extra)
    if a.json:
        print(json.dumps(r), flush=True)
    else:
        lim = "" if not limit else "  limit %10.4g  ratio %6.3f" % (limit, ratio)
        print("%-9s %-24s %12.4g %-5s%s" % ("bigmodel", metric, value, unit, lim), flush=True)


def cgroup_enter(path):
    """preexec_fn: the child joins the memory cgroup before it runs."""
    def enter():
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    return enter


def make_cgroup(name, limit):
    if not os.path.isdir(CGROUP) or not os.access(CGROUP, os.W_OK):
        return None
    path = os.path.join(CGROUP, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    # No swap here; were there any, the limit must bound it too.
    try:
        with open(os.path.join(path, "memory.memsw.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError:
        pass
    return path


def read_int(path):
    with open(path) as f:
        return int(f.read().strip())


def run_config(a, tmp, procs, d, layers):
    server = os.path.join(a.build_dir, "server", "zshard-server")
    # A folder per configuration: start_shards names its port files by the
    # number of processes started, which restarts at 0 here.
    tmp = tempfile.mkdtemp(dir=tmp)
    addrs = start_shards(server, a.shards, tmp, procs)
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--addresses", addrs,
            "--world", str(a.world), "--d-model", str(d), "--layers", str(layers),
            "--heads", str(a.heads), "--vocab", str(a.vocab), "--block", str(a.block),
            "--batch", str(a.batch), "--steps", str(a.steps), "--seed", str(a.seed),
            "--lr", str(a.lr)]
    groups, ps = [], []
    try:
        for r in range(a.world):
            g = make_cgroup("zshard-bigmodel-%d" % r, a.limit_mib * MiB) if a.limit_mib else None
            groups.append(g)
            ps.append(subprocess.Popen(args + ["--rank", str(r)], stdout=subprocess.PIPE,
                                       text=True, preexec_fn=cgroup_enter(g) if g else None))
        outs = []
        for r, p in enumerate(ps):
            o, _ = p.communicate()
            if p.returncode != 0:
                oom = ""
                if groups[r]:
                    oom = " (cgroup failcnt %d)" % read_int(os.path.join(groups[r],
                                                                         "memory.failcnt"))
                raise SystemExit("bigmodel: trainer %d failed (exit %d)%s" % (r, p.returncode, oom))
            outs.append(json.loads(o.strip().splitlines()[-1]))
        usage = [read_int(os.path.join(g, "memory.max_usage_in_bytes")) for g in groups if g]
        return outs, usage
    finally:
        for p in ps:
            if p.poll() is None:
                p.kill()
                p.wait()
        for g in groups:
            if g:
                try:
                    os.rmdir(g)
                except OSError:
                    pass
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        del procs[:]


def driver(a):
    idle_p = subprocess.run([sys.executable, "-c", "import torch, sys; sys.path.insert(0, %r);"
                             "import bench_torch; print(bench_torch.vmhwm())" % HERE],
                            capture_output=True, text=True, check=True)
    idle = int(idle_p.stdout.strip())
    note("idle python3 + torch: VmHWM %.1f MiB" % (idle / MiB))
    configs = [tuple(int(v) for v in c.split(":")) for c in a.sweep.split(",")] if a.sweep \
        else [(a.d_model, a.layers)]
    with tempfile.TemporaryDirectory(prefix="bigmodel.") as tmp:
        procs = []
        for d, layers in configs:
            note("d_model %d, %d layers, W=%d, N=%d, limit %s (load average %s)" % (
                d, layers, a.world, a.shards, "%d MiB" % a.limit_mib if a.limit_mib else "none",
                open("/proc/loadavg").read().split()[0]))
            outs, usage = run_config(a, tmp, procs, d, layers)
            o = outs[0]
            fp32 = 4 * o["params"] / MiB
            peak = max(x["vmhwm"] for x in outs) / MiB
            cfg = {"params": o["params"], "d_model": d, "layers": layers, "trainers": a.world,
                   "shards": a.shards, "batch": a.batch, "block": a.block, "steps": a.steps,
                   "limit_mib": a.limit_mib}
            report(a, "trainer_peak_rss", peak, "MiB", fp32, **cfg)
            report(a, "trainer_growth", peak - idle / MiB, "MiB", fp32, idle_mib=idle / MiB,
                   **cfg)
            if usage:
                report(a, "cgroup_max_usage", max(usage) / MiB, "MiB", a.limit_mib, **cfg)
            report(a, "step_s", statistics.median(o["times"]), "s", None, **cfg)
            report(a, "init_s", o["init_s"], "s", None, **cfg)
            report(a, "loss_first", o["losses"][0], "", None, **cfg)
            report(a, "loss_last", o["losses"][-1], "", None, **cfg)


def main():
    ap = argparse.ArgumentParser(description="a model bigger than a trainer (see the docstring)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="2 steps")
    ap.add_argument("--build-dir", default=os.path.join(SRC, "build"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="per trainer")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit-mib", type=int, default=0,
                    help="each trainer in a memory cgroup of this size (cgroup v1, root)")
    ap.add_argument("--sweep", default="", help="d_model:layers,... configurations in turn")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--addresses")
    a = ap.parse_args()
    if a.quick:
        a.steps = min(a.steps, 2)
    if a.worker:
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
