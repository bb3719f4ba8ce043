#!/usr/bin/python3
"""Times torch.optim.AdamW on one flat tensor, for bench_optim's comparison.

A co-process, so that the benchmark can interleave torch's steps with its own
passes (the machine's memory bandwidth drifts as its other tenants come and
go, and interleaving exposes every contender to the same drift). Reads
commands from stdin, one a line:
  step   runs one optimizer step and prints the seconds it took
  quit   exits
After set-up (and one untimed step, which allocates exp_avg and exp_avg_sq) it
prints "ready <torch version>". Run with Debian's /usr/bin/python3, which has
python3-torch.
"""
import argparse
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.empty(a.params).uniform_(-0.1, 0.1))
    p.grad = torch.empty(a.params).uniform_(-0.01, 0.01)
    # torch 1.13's defaults (the single-tensor path on the CPU), with the same
    # hyper-parameters as the shard's pass.
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt.step()
    print("ready", torch.__version__, flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            t0 = time.perf_counter()
            opt.step()
            print(time.perf_counter() - t0, flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
