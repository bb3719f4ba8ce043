"""One zshard trainer with simulated accelerator compute (run inside its
namespace): the step of step_overlap_W<W>_N<N>.

    overlap.py --addresses A,B,.. --rank R --world W --params P --tensors T
               --steps S --forward F --backward B [--depth D] [--clip C]
               [--pipelined]

The model is T layers of P/T parameters. Each step runs, as a trainer on a
GPU would, with the compute taking no CPU (time.sleep):

  forward   pulls of layers 0 .. D-1 go out at once; then for each layer i
            in order: wait for its pull, start the pull of layer i + D,
            sleep F/T seconds (the layer's forward)
  backward  for each layer from the last: sleep B/T seconds (its backward),
            then push its bf16 gradient without waiting for it
  drain     wait for every push
  gate      zs_step (the gated step: clipping to C when C > 0)

so the pulls overlap the forward and the pushes the backward. With
--pipelined the job is pipelined and the client prefetches (prefetch_depth
D; issue 25, "overlap"): the backward ends in zs_step, which sends the
step's lr and at once starts the pulls of layers 0 .. D-1 of the next step,
each answered as soon as its last piece is applied, while the last pushes
drain; the forward then pulls in order (from the prefetch slots, the client
starting layer i + D after layer i). The phases are then forward,
backward, gate (zs_step, no wait) and drain. S + 1 steps,
the first a warm-up. Prints one JSON object like trainer.py's: per measured
step the forward, backward, drain and gate times and the whole cycle, the
bytes each way, and the CPU seconds this process, the shards
(NETSIM_SHARD_PIDS) and the machine spent in the measured steps.
"""
import argparse
import json
import os
import sys
import time

import cpu


def forward(c, ids, params, depth, per_layer):
    """The forward pass: pulls prefetched `depth` layers ahead."""
    pending = {}
    for i in range(min(depth, len(ids))):
        pending[i] = c.pull(ids[i], params[i], dtype="bf16")
    for i in range(len(ids)):
        pending.pop(i).wait()
        if i + depth < len(ids):
            pending[i + depth] = c.pull(ids[i + depth], params[i + depth], dtype="bf16")
        time.sleep(per_layer)


def backward(c, ids, grads, per_layer):
    """The backward pass: each layer's gradient pushed as soon as it is
    computed; returns the requests, not waited."""
    reqs = []
    for i in reversed(range(len(ids))):
        time.sleep(per_layer)
        reqs.append(c.push(ids[i], grads[i], dtype="bf16"))
    return reqs


def forward_prefetched(c, ids, params, per_layer):
    """The forward pass of a client that prefetches: each pull in order,
    served from the slot the client filled ahead."""
    for i in range(len(ids)):
        c.pull(ids[i], params[i], dtype="bf16").wait()
        time.sleep(per_layer)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addresses", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--tensors", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--forward", type=float, required=True, help="seconds per step")
    ap.add_argument("--backward", type=float, required=True, help="seconds per step")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--job", default="netsim-overlap")
    ap.add_argument("--pipelined", action="store_true")
    a = ap.parse_args()

    sys.path.insert(0, os.environ["ZSHARD_PYTHONPATH"])
    import numpy as np
    import zshard

    numel = a.params // a.tensors
    c = zshard.Client(a.addresses, rank=a.rank, world_size=a.world,
                      job=a.job + ("-pipelined" if a.pipelined else ""), push_dtype="bf16",
                      pull_dtype="bf16", prefetch_depth=a.depth if a.pipelined else 0,
                      open_mode="either", pipelined=1 if a.pipelined else 0)
    c.add_group("sgd")
    ids = [c.add_tensor("w%d" % k, numel) for k in range(a.tensors)]
    if a.rank == 0:
        c.open_job([np.full(numel, 0.01, np.float32) for _ in ids])
    else:
        c.open_job()
    grads = [np.full(numel, 0x3c00, np.uint16) for _ in ids]  # bf16 2^-7
    params = [np.empty(numel, np.uint16) for _ in ids]

    pids = [int(p) for p in os.environ.get("NETSIM_SHARD_PIDS", "").split(",") if p]
    window = cpu.Window(pids)
    steps = []
    start = time.monotonic()
    for s in range(a.steps + 1):
        t0 = time.monotonic()
        if a.pipelined:
            forward_prefetched(c, ids, params, a.forward / a.tensors)
        else:
            forward(c, ids, params, a.depth, a.forward / a.tensors)
        t1 = time.monotonic()
        reqs = backward(c, ids, grads, a.backward / a.tensors)
        t2 = time.monotonic()
        if a.pipelined:
            # The lr goes out and the next step's first layers are asked
            # for at once; the pushes drain behind them.
            c.step(lr=1e-3, max_grad_norm=0.0)
            t3 = time.monotonic()
            for r in reqs:
                r.wait()
            t4 = time.monotonic()
            gate, drain = t3 - t2, t4 - t3
        else:
            for r in reqs:
                r.wait()
            t3 = time.monotonic()
            c.step(lr=1e-3, max_grad_norm=a.clip)
            t4 = time.monotonic()
            drain, gate = t3 - t2, t4 - t3
        if s == 0:
            window.start()
            start = time.monotonic()
            continue
        steps.append({"forward": t1 - t0, "backward": t2 - t1, "drain": drain, "gate": gate,
                      "cycle": t4 - t0})
    used = window.stop(time.monotonic() - start)
    c.close()
    print(json.dumps(dict(used, rank=a.rank, steps=steps, push_bytes=numel * a.tensors * 2,
                          pull_bytes=numel * a.tensors * 2)), flush=True)


if __name__ == "__main__":
    main()
