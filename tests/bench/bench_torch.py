#!/usr/bin/python3
"""bench_torch: a >= 20M-parameter GPT trained from PyTorch through zshard
(W = 2 trainer processes, N = 2 shards, bf16 on the wire) against torch DDP
over gloo with torch.optim.AdamW (W = 2), on the same machine, with the same
model, data and batch. See docs/PERFORMANCE.md, "PyTorch: zshard against DDP".

    PYTHONPATH=build-bench/python /usr/bin/python3 tests/bench/bench_torch.py \\
        --build-dir build-bench [--json] [--quick]

(tests/bench/run --only torch builds what it needs and runs this.)

Figures (bench "torch"; JSON lines as the other benchmarks print them):
  step_s_ddp, step_s_zshard, step_s_zshard_raf, step_s_zshard_meta   median
      step time of rank 0
      (zero_grad, forward, backward, optimizer step), s. The zshard lines
      have DDP's figure as `limit`: goal ratio <= 1.0.
  rss_growth_ddp, rss_growth_zshard, rss_growth_zshard_raf,
  rss_growth_zshard_meta   the largest trainer's peak resident set (VmHWM)
      minus the peak of an idle process that imported torch (measured in the
      same run), MiB. Limit: DDP's growth; goal for release_after_forward:
      ratio <= 0.25; for zshard_meta (the model built on the meta device,
      initialised by shard(), with release_after_forward): ratio <= 0.1.
  submit_us_per_tensor_zshard[_raf]   time spent inside the package's
      client.push()/client.pull() calls (the submissions; the waits are
      elsewhere) divided by the number of tensors submitted, rank 0, timed
      steps, us; with p50_us and max_us per call (a batch call's time
      divided by its tensors). Goal <= 5 us. preempted_calls of the
      submit_ncalls calls saw the thread preempted (an involuntary context
      switch, getrusage RUSAGE_THREAD), preempted_share is their part of the
      submission time, blocked_calls how many slept in the call (a
      voluntary switch: a lock or condition waited for), and
      p50_unpreempted_us the median over the unpreempted
      calls (what a submission costs while the trainer keeps its core: on
      the shared 2-vCPU machine the plain median moves with the load).
Every mode runs --rounds times (2), the modes in turn, and each figure pools
the rounds (the median of all timed steps, the highest peak). Each trainer
is a process of its own (this file with --worker); the shards
are real zshard-server processes started here and stopped at the end.
OPENBLAS_NUM_THREADS=1 and one torch thread per process.
"""

import argparse
import json
import os
import socket
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


def vmhwm():
    """This process's peak resident set, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------------- worker

def gpt_init(m):
    """train_gpt.GPT's initialisation as a param_init_fn: N(0, 0.02) weights
    and zero biases for Linear and Embedding, LayerNorm's own reset, and the
    causal mask buffer."""
    import torch
    from torch import nn
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if getattr(m, "bias", None) is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        m.reset_parameters()
    if "mask" in m._buffers:
        m.mask.copy_(torch.full(m.mask.shape, float("-inf")).triu(1))


def worker(a):
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(1)
    if a.worker == "idle":
        # The baseline: an interpreter with torch (and torch.distributed)
        # imported and nothing else.
        import torch.distributed  # noqa: F401
        print(json.dumps({"vmhwm": vmhwm()}), flush=True)
        return
    sys.path.insert(0, os.path.join(SRC, "client", "examples"))
    from train_gpt import GPT, batch, load_text

    rank, world = a.rank, a.world
    torch.manual_seed(a.seed)
    train, _, vocab = load_text("/usr/share/common-licenses/GPL-3")
    if a.worker == "zshard_meta":
        # Built on the meta device: shard() initialises it module by module
        # (rank 0 only) with GPT's own rule, written as a param_init_fn.
        import zshard.torch
        with zshard.torch.init_empty():
            model = GPT(vocab, a.block, a.d_model, a.layers, a.heads, "manual")
    else:
        model = GPT(vocab, a.block, a.d_model, a.layers, a.heads, "manual")
    nparams = sum(p.numel() for p in model.parameters())
    base = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    sub = {"n": 0, "s": 0.0, "each": [], "each_quiet": []}
    if a.worker == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", init_method="file://" + a.store, rank=rank,
                                world_size=world)
        net, opt = DDP(model), base
    else:
        import zshard.torch
        net = model
        opt = zshard.torch.shard(model, base, addresses=a.addresses, wire_dtype=torch.bfloat16,
                                 rank=rank, world_size=world,
                                 release_after_forward=(a.worker != "zshard"),
                                 param_init_fn=gpt_init if a.worker == "zshard_meta" else None,
                                 job="bench-torch")
        # Time every submission the package makes (client.push / client.pull
        # return at once with a request; the waits happen elsewhere). Batch
        # calls, should the package use them, count one per tensor: their
        # first argument is taken to be the sequence of tensors (an
        # assumption: no batch call exists in the package as measured).
        c = opt.client

        import resource

        def switches():
            """(involuntary, voluntary) context switches of this thread."""
            r = resource.getrusage(resource.RUSAGE_THREAD)
            return r.ru_nivcsw, r.ru_nvcsw

        def timed(fn, batched):
            def call(*args, **kw):
                pre = switches()
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kw)
                finally:
                    dt = time.perf_counter() - t0
                    post = switches()
                    preempted = post[0] != pre[0]
                    if sub.get("on") and post[1] != pre[1]:
                        # The thread slept during the call (a lock or a
                        # condition it waited for): a voluntary switch.
                        sub["blocked_n"] = sub.get("blocked_n", 0) + 1
                    if sub.get("on") and preempted:
                        # The thread was preempted during the call (an
                        # involuntary context switch): how much of the
                        # submission time such calls account for.
                        sub["preempted_n"] = sub.get("preempted_n", 0) + 1
                        sub["preempted_s"] = sub.get("preempted_s", 0.0) + dt
                    if sub.get("on"):
                        n = len(args[0]) if batched and args else 1
                        sub["n"] += n
                        sub["s"] += dt
                        sub["each"].append(dt / max(1, n))
                        if not preempted:
                            sub["each_quiet"].append(dt / max(1, n))
                        k = fn.__name__
                        sub[k + "_n"] = sub.get(k + "_n", 0) + n
                        sub[k + "_s"] = sub.get(k + "_s", 0.0) + dt
            return call
        for name in ("push", "pull", "push_many", "pull_many"):
            if hasattr(c, name):
                setattr(c, name, timed(getattr(c, name), name.endswith("_many")))

    built = vmhwm()  # the model, its optimizer and (zshard) the client: before any step
    per = a.batch // world
    times, losses = [], []
    for step in range(1, a.warmup + a.steps + 1):
        gen = torch.Generator().manual_seed(a.seed * 1000003 + step)
        x, y = batch(train, a.batch, a.block, gen)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        sub["on"] = step > a.warmup
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x).view(-1, vocab), y.reshape(-1))
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if step > a.warmup:
            times.append(dt)
            losses.append(loss.item())
    out = {"rank": rank, "params": nparams, "tensors": len(list(model.parameters())),
           "times": times, "built": built,
           "loss_last": losses[-1], "vmhwm": vmhwm()}
    if a.worker != "ddp":
        out["submit_calls"] = sub["n"]
        out["submit_s"] = sub["s"]
        out["submit_each"] = sub["each"]
        out["submit_each_quiet"] = sub["each_quiet"]
        out["by_call"] = {k: v for k, v in sub.items()
                          if k.endswith(("_n", "_s")) and not k.startswith("preempted")}
        out["preempted_calls"] = sub.get("preempted_n", 0)
        out["preempted_s"] = sub.get("preempted_s", 0.0)
        out["blocked_calls"] = sub.get("blocked_n", 0)
        out["submit_ncalls"] = len(sub["each"])
        opt.close()
    else:
        import torch.distributed as dist
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------- driver

def report(a, metric, value, unit, limit=None, **extra):
    ratio = value / limit if limit else None
    r = {"bench": "torch", "metric": metric, "value": value, "unit": unit,
         "limit": limit if limit else None, "ratio": ratio}
    r.update(extra)
    if a.json:
        print(json.dumps(r), flush=True)
    else:
        lim = "" if not limit else "  limit %10.4g  ratio %6.3f" % (limit, ratio)
        print("%-9s %-40s %12.4g %-9s%s" % ("torch", metric, value, unit, lim), flush=True)


def note(msg):
    print("# " + msg, file=sys.stderr, flush=True)


def start_shards(server, n, tmp, procs):
    addrs = []
    for i in range(n):
        pf = os.path.join(tmp, "port-%d-%d" % (len(procs), i))
        log = open(os.path.join(tmp, "shard-%d-%d.log" % (len(procs), i)), "w")
        procs.append(subprocess.Popen([server, "--listen", "127.0.0.1:0", "--shard-id", str(i),
                                       "--shards", str(n), "--threads", "1",
                                       "--port-file", pf], stderr=log))
        log.close()
        for _ in range(400):
            if os.path.exists(pf) and os.path.getsize(pf) > 0:
                break
            if procs[-1].poll() is not None:
                sys.exit("bench_torch: shard %d exited (%s)" % (i, log.name))
            time.sleep(0.05)
        else:
            sys.exit("bench_torch: shard %d did not start (%s)" % (i, log.name))
        with open(pf) as f:
            addrs.append("127.0.0.1:" + f.read().strip())
    return ",".join(addrs)


def run_workers(a, mode, extra):
    """Runs W worker processes of `mode` at once; returns their results by rank."""
    args = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--world", str(a.world),
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--batch", str(a.batch),
            "--block", str(a.block), "--d-model", str(a.d_model), "--layers", str(a.layers),
            "--heads", str(a.heads), "--seed", str(a.seed)] + extra
    ps = [subprocess.Popen(args + ["--rank", str(r)], stdout=subprocess.PIPE, text=True)
          for r in range(a.world)]
    outs = []
    for r, p in enumerate(ps):
        o, _ = p.communicate()
        if p.returncode != 0:
            for q in ps:
                q.kill()
            sys.exit("bench_torch: %s rank %d failed (exit %d)" % (mode, r, p.returncode))
        outs.append(json.loads(o.strip().splitlines()[-1]))
    return outs


def driver(a):
    server = os.path.join(a.build_dir, "server", "zshard-server")
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in ("ddp", "zshard", "zshard_raf", "zshard_meta"):
            sys.exit("bench_torch: unknown mode %r (ddp, zshard, zshard_raf, zshard_meta)" % m)
    if any(m.startswith("zshard") for m in modes):
        if not os.access(server, os.X_OK):
            sys.exit("bench_torch: no %s (--build-dir)" % server)
        try:
            import zshard.torch  # noqa: F401
        except ImportError as e:
            sys.exit("bench_torch: cannot import zshard.torch (%s); PYTHONPATH=%s/python" %
                     (e, a.build_dir))
    procs = []
    res = {}
    with tempfile.TemporaryDirectory(prefix="bench-torch.") as tmp:
        try:
            base = run_workers(a, "idle", [])
            idle = max(o["vmhwm"] for o in base[:1])
            note("idle python3 + torch: VmHWM %.1f MiB" % (idle / MiB))
            # Rounds of every mode in turn, so that a neighbour's load
            # drifting over the run falls on every contender alike.
            for rnd in range(a.rounds):
                for m in modes:
                    note("%s round %d: W=%d, %d warm-up + %d timed steps (load average %s)" %
                         (m, rnd + 1, a.world, a.warmup, a.steps,
                          open("/proc/loadavg").read().split()[0]))
                    if m == "ddp":
                        extra = ["--store", os.path.join(tmp, "store-%d-%d" % (rnd, len(res)))]
                    else:
                        # A fresh pair of shards per run: a shard holds one job.
                        extra = ["--addresses", start_shards(server, a.shards, tmp, procs)]
                    outs = run_workers(a, m, extra)
                    o = outs[0]
                    note("%s round %d: %d parameters in %d tensors, median step %.3f s, last "
                         "loss %.4f" % (m, rnd + 1, o["params"], o["tensors"],
                                        statistics.median(o["times"]), o["loss_last"]))
                    if m not in res:
                        res[m] = outs
                    else:  # rank by rank: all the step times, the highest peaks
                        for x, y in zip(res[m], outs):
                            x["times"] += y["times"]
                            x["vmhwm"] = max(x["vmhwm"], y["vmhwm"])
                            x["built"] = max(x["built"], y["built"])
                            if "submit_each" in x:
                                x["submit_each"] += y["submit_each"]
                                x["submit_each_quiet"] += y["submit_each_quiet"]
                                x["submit_calls"] += y["submit_calls"]
                                x["submit_s"] += y["submit_s"]
                                for k in ("preempted_calls", "preempted_s", "submit_ncalls",
                                          "blocked_calls"):
                                    x[k] += y[k]
                                for k, v in y["by_call"].items():
                                    x["by_call"][k] = x["by_call"].get(k, 0) + v
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait()

    cfg = {"params": res[modes[0]][0]["params"], "trainers": a.world, "batch": a.batch,
           "block": a.block, "steps": a.steps}
    ddp = res.get("ddp")
    for o in res.values():
        o[0]["step_s"] = statistics.median(o[0]["times"])
        o[0]["step_best_s"] = min(o[0]["times"])
    for m in modes:
        o = res[m]
        step = o[0]["step_s"]
        growth = (max(x["vmhwm"] for x in o) - idle) / MiB
        lim_step = ddp[0]["step_s"] if ddp and m != "ddp" else None
        lim_rss = (max(x["vmhwm"] for x in ddp) - idle) / MiB if ddp and m != "ddp" else None
        sh = {} if m == "ddp" else {"shards": a.shards, "wire": "bf16"}
        report(a, "step_s_" + m, step, "s", lim_step, best=o[0]["step_best_s"],
               limit_best=ddp[0]["step_best_s"] if lim_step else None, goal="<= 1.0"
               if lim_step else None, **cfg, **sh)
        report(a, "rss_growth_" + m, growth, "MiB", lim_rss, idle_mib=idle / MiB,
               built_growth_mib=(max(x["built"] for x in o) - idle) / MiB,
               goal={"zshard_raf": "<= 0.25", "zshard_meta": "<= 0.1"}.get(m) if lim_rss
               else None, **cfg, **sh)
        if m != "ddp" and o[0]["submit_calls"]:
            report(a, "submit_us_per_tensor_" + m, 1e6 * o[0]["submit_s"] / o[0]["submit_calls"],
                   "us", None, calls=o[0]["submit_calls"],
                   p50_us=1e6 * statistics.median(o[0]["submit_each"]),
                   p50_unpreempted_us=1e6 * statistics.median(o[0]["submit_each_quiet"])
                   if o[0]["submit_each_quiet"] else None,
                   max_us=1e6 * max(o[0]["submit_each"]),
                   submit_ncalls=o[0]["submit_ncalls"],
                   preempted_calls=o[0]["preempted_calls"],
                   blocked_calls=o[0]["blocked_calls"],
                   preempted_share=o[0]["preempted_s"] / max(1e-12, o[0]["submit_s"]),
                   **{k[:-2] + "_us": 1e6 * v / max(1, o[0]["by_call"][k[:-2] + "_n"])
                      for k, v in o[0]["by_call"].items() if k.endswith("_s")},
                   goal="<= 5", **cfg, **sh)


def main():
    ap = argparse.ArgumentParser(description="zshard.torch against DDP (see the docstring)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--build-dir", default=os.path.join(SRC, "build-bench"))
    ap.add_argument("--modes", default="ddp,zshard,zshard_raf,zshard_meta")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 12, quick 5)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=None, help="runs of each mode (default 2, "
                    "quick 1)")
    ap.add_argument("--batch", type=int, default=4, help="global batch, split over the trainers")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    # Internal: one trainer process.
    ap.add_argument("--worker", choices=("idle", "ddp", "zshard", "zshard_raf", "zshard_meta"))
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--store")
    ap.add_argument("--addresses")
    a = ap.parse_args()
    if a.steps is None:
        a.steps = 5 if a.quick else 10
    if a.rounds is None:
        a.rounds = 1 if a.quick else 2
    if a.worker:
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
