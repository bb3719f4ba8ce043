"""One zshard trainer of the emulated cluster (run inside its namespace).

    trainer.py --addresses A,B,.. --rank R --world W --params P --tensors T
               --steps S [--clip C] [--pipelined] [--wire bf16|int8]

Opens the job (rank 0 gives the initial weights), pushes every tensor's
bf16 gradient (zs_push_many), steps (zs_step: the gated step, clipping to C
when C > 0) and pulls every tensor back in bf16 (zs_pull_many), S + 1 times;
the first step is a warm-up. With --pipelined the job is pipelined
(zs_client_options.pipelined): the pushes are not waited for before the
step, which sends the lr ahead and returns at once, and the pulls, sent
right after it, wait on the shards for each piece, so they overlap the
pushes on the full-duplex link; the push phase then ends when the pushes
are acknowledged and the pull phase when the pulls are in. Buffers are bf16 already, so no conversion
runs on the trainer. With --wire int8 both directions travel as int8 blocks
(push_dtype and pull_dtype "int8": 0.52 of bf16's bytes), from and into fp32
buffers, so the trainer quantizes its pushes and decodes its pulls. The
client's schedule and the data plane's congestion control come from the
environment (ZSHARD_SCHEDULE, ZSHARD_TCP_CONGESTION), as netsim sets them. Prints one JSON object: per measured step the push,
step and pull phase times and the whole cycle, the bytes each way, and the
CPU seconds this process, the shards (NETSIM_SHARD_PIDS) and the machine
spent in the measured steps.
"""
import argparse
import json
import os
import sys
import time

import cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--addresses", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--tensors", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--job", default="netsim")
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--wire", choices=("bf16", "int8"), default="bf16")
    ap.add_argument("--buckets", default=None,
                    help="PUSH,PULL: reduce_bucket_size and allgather_bucket_size in bytes")
    a = ap.parse_args()

    sys.path.insert(0, os.environ["ZSHARD_PYTHONPATH"])
    import numpy as np
    import zshard

    numel = a.params // a.tensors
    buckets = {}
    if a.buckets:
        push_b, pull_b = (int(x) for x in a.buckets.split(","))
        buckets = dict(reduce_bucket_size=push_b, allgather_bucket_size=pull_b)
    c = zshard.Client(a.addresses, rank=a.rank, world_size=a.world, job=a.job, push_dtype=a.wire,
                      pull_dtype=a.wire, prefetch_depth=0, open_mode="either",
                      pipelined=1 if a.pipelined else 0, **buckets)
    c.add_group("sgd")
    ids = [c.add_tensor("w%d" % k, numel) for k in range(a.tensors)]
    if a.rank == 0:
        c.open_job([np.full(numel, 0.01, np.float32) for _ in ids])
    else:
        c.open_job()
    # 0x3c00 is bf16 for 2^-7: small, so that many SGD steps change nothing
    # that matters.
    if a.wire == "int8":
        buf = "fp32"
        grads = [np.full(numel, 2.0 ** -7, np.float32) for _ in ids]
        params = [np.empty(numel, np.float32) for _ in ids]
        # Blocks of 128 int8 elements and a 4-byte scale (common/base/dtype.h).
        wire_bytes = (numel + (numel + 127) // 128 * 4) * a.tensors
    else:
        buf = "bf16"
        grads = [np.full(numel, 0x3c00, np.uint16) for _ in ids]
        params = [np.empty(numel, np.uint16) for _ in ids]
        wire_bytes = numel * a.tensors * 2

    # The shards' processes, whose CPU the measured steps cost.
    pids = [int(p) for p in os.environ.get("NETSIM_SHARD_PIDS", "").split(",") if p]
    window = cpu.Window(pids)
    steps = []
    start = time.monotonic()
    for s in range(a.steps + 1):
        if a.pipelined:
            t0 = time.monotonic()
            pushes = c.push_many(ids, grads, dtype=buf)
            c.step(lr=1e-3, max_grad_norm=0.0)
            t2 = time.monotonic()
            pulls = c.pull_many(ids, params, dtype=buf)
            for r in pushes:
                r.wait()
            t1 = time.monotonic()
            for r in pulls:
                r.wait()
            t3 = time.monotonic()
            phases = {"push": t1 - t0, "step": t2 - t0, "pull": t3 - t2, "cycle": t3 - t0}
        else:
            t0 = time.monotonic()
            for r in c.push_many(ids, grads, dtype=buf):
                r.wait()
            t1 = time.monotonic()
            c.step(lr=1e-3, max_grad_norm=a.clip)
            t2 = time.monotonic()
            for r in c.pull_many(ids, params, dtype=buf):
                r.wait()
            t3 = time.monotonic()
            phases = {"push": t1 - t0, "step": t2 - t1, "pull": t3 - t2, "cycle": t3 - t0}
        if s == 0:
            # The warm-up step ends at the same moment (give or take a pull)
            # on every trainer: the gate lines them up.
            window.start()
            start = time.monotonic()
            continue
        steps.append(phases)
    used = window.stop(time.monotonic() - start)
    c.close()
    print(json.dumps(dict(used, rank=a.rank, steps=steps, push_bytes=wire_bytes,
                          pull_bytes=wire_bytes, wire=a.wire)), flush=True)


if __name__ == "__main__":
    main()
