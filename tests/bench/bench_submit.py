#!/usr/bin/python3
"""bench_submit: the cost of one submission (client.push / pull / push_many /
pull_many of the zshard package) per tensor, without torch and without
training, in the pattern zshard.torch submits them: the tensors of
bench_torch.py's GPT (d_model 512, 7 layers: 88 tensors, 22M parameters),
pulled and pushed module by module (a module's two tensors, weight and bias,
as one batch call; a module with one tensor as a single call) against N real
zshard-server processes started here, bf16 on the wire, fp32 buffers given
as ctypes arrays over the memory (as zshard.torch's _buffer makes them).

    PYTHONPATH=build/python /usr/bin/python3 tests/bench/bench_submit.py \\
        --build-dir build [--steps 20] [--json]

Per step: every module's pulls are submitted, then waited; every module's
pushes are submitted, then waited; then step(). Figures (bench "submit"),
over the timed steps (after --warmup steps):
  submit_us_per_tensor   median over the calls of (wall time of the call /
                         its tensors), us; with the mean, p90, the number of
                         calls, and the same split by call (push, pull,
                         push_many, pull_many).
  submit_cpu_us_per_tensor  the same with the calling thread's CPU time
                         (CLOCK_THREAD_CPUTIME_ID) instead of the wall
                         time: what the call itself costs, without the
                         time the thread spent preempted (this machine is
                         shared; the wall figure moves with its load).
The 1-minute load average is recorded beside each figure.

--evict-kib N: before every timed call, write N KiB of other memory (what
a layer's forward or backward does between two submissions of the
trainer), so that the call runs with the caches cold, as in zshard.torch;
the writing is not timed. 0 (default): back to back, the caches warm.

--calls-only: no timing and no waits between calls beyond what the pattern
needs, for instruction counts: run under `valgrind --tool=callgrind
--toggle-collect=<the extension's entry points>` (see docs/PERFORMANCE.md,
"Submission cost").
"""

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))


def gpt_tensors(vocab, block, d, layers):
    """(name, numel) of train_gpt.GPT's parameters, grouped by module."""
    mods = [[("tok.weight", vocab * d)], [("pos.weight", block * d)]]
    for i in range(layers):
        p = "blocks.%d." % i
        mods += [[(p + "ln1.weight", d), (p + "ln1.bias", d)],
                 [(p + "attn.qkv.weight", 3 * d * d), (p + "attn.qkv.bias", 3 * d)],
                 [(p + "attn.proj.weight", d * d), (p + "attn.proj.bias", d)],
                 [(p + "ln2.weight", d), (p + "ln2.bias", d)],
                 [(p + "mlp.fc.weight", 4 * d * d), (p + "mlp.fc.bias", 4 * d)],
                 [(p + "mlp.proj.weight", 4 * d * d), (p + "mlp.proj.bias", d)]]
    mods += [[("ln_f.weight", d), ("ln_f.bias", d)], [("head.weight", vocab * d)]]
    return mods


def main():
    ap = argparse.ArgumentParser(description="submission cost per tensor (see the docstring)")
    ap.add_argument("--build-dir", default=os.path.join(SRC, "build"))
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--calls-only", action="store_true")
    ap.add_argument("--evict-kib", type=int, default=0)
    a = ap.parse_args()
    evict = (ctypes.c_char * (a.evict_kib << 10))() if a.evict_kib > 0 else None
    sys.path.insert(0, os.path.join(a.build_dir, "python"))
    sys.path.insert(0, os.path.join(SRC, "tests", "python"))
    os.environ.setdefault("ZSHARD_SERVER_BIN", os.path.join(a.build_dir, "server",
                                                            "zshard-server"))
    import zshard
    import zshard_servers

    mods = gpt_tensors(96, 32, a.d_model, a.layers)
    with zshard_servers.Shards(a.shards) as sh:
        c = zshard.Client(sh.addresses, push_dtype="bf16", pull_dtype="bf16", job="bench-submit")
        c.add_group("adamw", weight_decay=0.01)
        ids, bufs, grads = [], [], []
        for m in mods:
            ids.append([c.add_tensor(name, n) for name, n in m])
            bufs.append([(ctypes.c_float * n)() for _, n in m])
            grads.append([(ctypes.c_float * n)(*([1e-3] * min(n, 16))) for _, n in m])
        c.open_job([b for bs in bufs for b in bs])
        each = {"push": [], "pull": [], "push_many": [], "pull_many": []}
        cpu = {k: [] for k in each}
        clock, tclock = time.perf_counter, time.thread_time
        loads = []
        for step in range(a.warmup + a.steps):
            timed = step >= a.warmup and not a.calls_only
            if timed:
                loads.append(float(open("/proc/loadavg").read().split()[0]))
            for kind in ("pull", "push"):
                reqs = []
                for t, b, g in zip(ids, bufs, grads):
                    src = g if kind == "push" else b
                    if len(t) == 1:
                        name, fn, args = kind, getattr(c, kind), (t[0], src[0])
                    else:
                        name, fn, args = kind + "_many", getattr(c, kind + "_many"), (t, src)
                    if not timed:
                        r = fn(*args)
                    else:
                        if evict is not None:
                            ctypes.memset(evict, step & 0xFF, len(evict))
                        c0, t0 = tclock(), clock()
                        r = fn(*args)
                        t1, c1 = clock(), tclock()
                        each[name].append((t1 - t0) / len(t))
                        cpu[name].append((c1 - c0) / len(t))
                    reqs.extend(r if isinstance(r, list) else [r])
                for r in reqs:
                    r.wait()
            c.step(lr=1e-3)
        c.close()
    if a.calls_only:
        return
    load = "%.1f-%.1f" % (min(loads), max(loads))

    def report(metric, d):
        allv = [x for v in d.values() for x in v]
        r = {"bench": "submit", "metric": metric, "value": 1e6 * statistics.median(allv),
             "unit": "us", "limit": 5.0, "ratio": 1e6 * statistics.median(allv) / 5.0,
             "mean_us": 1e6 * statistics.mean(allv),
             "p90_us": 1e6 * statistics.quantiles(allv, n=10)[-1], "calls": len(allv),
             "load_average_1m": load, "shards": a.shards, "evict_kib": a.evict_kib,
             "tensors": sum(len(t) for t in ids)}
        for k, v in d.items():
            if v:
                r[k + "_p50_us"] = 1e6 * statistics.median(v)
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print("submit    %-28s %8.3f us  (mean %.3f, p90 %.3f, %d calls; %s; load %s)" %
                  (metric, r["value"], r["mean_us"], r["p90_us"], r["calls"],
                   ", ".join("%s %.3f" % (k[:-7], v) for k, v in r.items()
                             if k.endswith("_p50_us")), load), flush=True)

    report("submit_us_per_tensor", each)
    report("submit_cpu_us_per_tensor", cpu)


if __name__ == "__main__":
    main()
