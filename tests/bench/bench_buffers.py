"""What broadcast_buffers costs: two trainer processes (W=2) train a small
CNN with BatchNorm on two local shards, with broadcast_buffers on and off;
prints each rank's median step time (zero_grad, forward, backward, step)
and the bytes the buffers add per step.

    ZSHARD_SERVER_BIN=build/server/zshard-server ZSHARD_PYTHONPATH=build/python \\
        OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/bench/bench_buffers.py [--steps 40]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402


def make_model():
    torch.manual_seed(0)

    def block(i, o):
        return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]
    return nn.Sequential(*block(3, 32), *block(32, 32), nn.MaxPool2d(2), *block(32, 64),
                         *block(64, 64), nn.MaxPool2d(2), *block(64, 128), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(128, 10))


def worker(addresses, steps, broadcast, out):
    import zshard.torch
    torch.set_num_threads(1)
    model = make_model()
    opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                             addresses=addresses, job="bench-buffers",
                             broadcast_buffers=broadcast == "1")
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    times, spent = [], [0.0]
    if opt._bufs is not None:
        # The time the buffers add: rank 0's encode and push, the other
        # ranks' push of "no gradient" and their read and decode.
        def timed(f):
            def run(*a):
                t = time.perf_counter()
                try:
                    return f(*a)
                finally:
                    spent[0] += time.perf_counter() - t
            return run
        opt._bufs.push = timed(opt._bufs.push)
        opt._bufs.take = timed(opt._bufs.take)
    extra = []
    for _ in range(steps):
        x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        t = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
        extra.append(spent[0])
        spent[0] = 0.0
    nbytes = opt._bufs.bytes if opt._bufs is not None else 0
    opt.close()
    with open(out, "w") as f:
        f.write("%r %d %r\n" % (statistics.median(times[5:]), nbytes,
                                 statistics.median(extra[5:])))


def run(steps, broadcast):
    tmp = tempfile.mkdtemp(prefix="zshard-bench-bufs-")
    with zshard_servers.Shards(2) as shards:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker",
                                   shards.addresses, str(steps), broadcast,
                                   os.path.join(tmp, "r%d" % r)],
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE="2"))
                 for r in range(2)]
        codes = [p.wait(600) for p in procs]
    if codes != [0, 0]:
        raise SystemExit("workers exited with %s" % codes)
    res = []
    for r in range(2):
        with open(os.path.join(tmp, "r%d" % r)) as f:
            t, n, e = f.read().split()
            res.append((float(t), int(n), float(e)))
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    model = make_model()
    print("model: %d parameters (%d bytes fp32), buffers %d bytes" % (
        sum(p.numel() for p in model.parameters()),
        4 * sum(p.numel() for p in model.parameters()),
        sum(b.numel() * b.element_size() for b in model.buffers())))
    for broadcast in ("0", "1", "0", "1"):
        res = run(a.steps, broadcast)
        print("broadcast_buffers=%s: median step rank 0 %.1f ms, rank 1 %.1f ms; buffer tensor "
              "%d bytes; of a step, in the buffers' push and read: rank 0 %.2f ms, rank 1 "
              "%.2f ms" % ("True " if broadcast == "1" else "False", 1e3 * res[0][0],
                           1e3 * res[1][0], res[0][1], 1e3 * res[0][2], 1e3 * res[1][2]))
    print("load average: %.1f %.1f %.1f" % os.getloadavg())


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
