"""The data-parallel baseline: the same gradient bytes through gloo's ring
all-reduce (torch.distributed), one process per trainer namespace.

    ring.py --master ADDR --port P --rank R --world W --params P --steps S
            [--iface IF] [--dtype half|fp32]

Each step all-reduces P parameters in bf16, or fp16 where gloo has no bf16
sum (the bytes zshard pushes; an all-reduce also returns the sum, the bytes
zshard pulls), or with --dtype fp32 P/2 fp32 elements: the same bytes. The first step
is a warm-up. Prints one JSON object: the per-step times, the dtype used
and the CPU seconds this process and the machine spent in them.
"""
import argparse
import json
import os
import time

import cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--master", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--iface", default="eth0")
    ap.add_argument("--dtype", choices=("half", "fp32"), default="half")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()

    # Gloo binds the interface's address: the namespace's veth end.
    os.environ["GLOO_SOCKET_IFNAME"] = a.iface
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="tcp://%s:%d" % (a.master, a.port), rank=a.rank,
                            world_size=a.world, timeout=datetime.timedelta(seconds=a.timeout))
    if a.dtype == "fp32":
        # Half as many fp32 elements: the same bytes, summed by gloo's
        # vectorised fp32 kernels rather than its 16-bit ones.
        dtype, numel = torch.float32, a.params // 2
    else:
        dtype, numel = torch.bfloat16, a.params
    x = torch.full((numel,), 2.0 ** -7, dtype=dtype)
    try:
        dist.all_reduce(x)
    except RuntimeError:
        # A gloo without bf16 sums: fp16 moves the same bytes.
        dtype = torch.float16
        x = torch.full((numel,), 2.0 ** -7, dtype=dtype)
        dist.all_reduce(x)
    times = []
    window = cpu.Window().start()
    start = time.monotonic()
    for _ in range(a.steps):
        x.fill_(2.0 ** -7)
        dist.barrier()
        t0 = time.monotonic()
        dist.all_reduce(x)
        times.append(time.monotonic() - t0)
    used = window.stop(time.monotonic() - start)
    dist.destroy_process_group()
    print(json.dumps(dict(used, rank=a.rank, steps=times, dtype=str(dtype).replace("torch.", ""),
                          bytes=a.params * 2)), flush=True)


if __name__ == "__main__":
    main()
