#!/usr/bin/python3
"""bench_import: `zshard import` of a ~1 GiB fp32 safetensors file, and of the
same tensors torch.save'd (.pt), against the data plane's push throughput,
measured in the same run on the same shards and the same model (issue 21's
goal: import >= 0.5 of push).

    ZSHARD_SERVER_BIN=build/server/zshard-server PYTHONPATH=build/python \\
        /usr/bin/python3 tests/bench/bench_import.py --build-dir build [--gib 1] [--json]
        [--formats safetensors,pt]

The model: --tensors tensors (default 64) of equal size, --gib GiB of fp32 in
all, one SGD group (10 bytes of shard memory per parameter), N = 2 shards
(real zshard-server processes started here on port 0, stopped at the end).

Figures (JSON lines as the other benchmarks print them, bench "import"):
  push_gbps     one trainer pushes every tensor's fp32 gradient (the whole
                model's bytes) through the data plane and waits for them;
                the best of --rounds rounds, GB/s of fp32 bytes.
  import_gbps   `zshard import` of the file: its own figure (fp32 masters
                written per second, from the write of the first tensor to
                the last; the file is in the page cache, read once before),
                the best of --rounds imports. `limit` is 0.5 * push_gbps:
                goal ratio >= 1.
  import_wall_gbps  the same bytes over the command's whole wall time
                (asking the spec, joining the job, mapping and checking).
  import_peak_rss_mib  the command's own peak resident set (VmHWM, from its
                last line), the highest of the rounds; one tensor is
                --gib / --tensors GiB.
  import_pt_gbps, import_pt_wall_gbps, import_pt_peak_rss_mib  the same for
                the .pt file (torch.save of the same tensors; needs torch),
                imported in the same rounds as the safetensors file, turn
                about, so that both see the same machine.
"""

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "tests", "python"))


def write_file(path, names, numel):
    """A safetensors file of len(names) random fp32 tensors of numel each,
    written one tensor at a time."""
    header, off = {}, 0
    for n in names:
        header[n] = {"dtype": "F32", "shape": [numel], "data_offsets": [off, off + numel * 4]}
        off += numel * 4
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for _ in names:
            f.write(rng.standard_normal(numel, dtype=np.float32).tobytes())


def write_pt(path, names, numel):
    """The same tensors as write_file's (the same generator), torch.save'd:
    the whole dict is built in memory first, as torch.save needs it."""
    import torch
    rng = np.random.default_rng(0)
    torch.save({n: torch.from_numpy(rng.standard_normal(numel, dtype=np.float32))
                for n in names}, path)


def emit(args, metric, value, unit, limit=None):
    r = {"bench": "import", "metric": metric, "value": round(value, 4), "unit": unit}
    if limit:
        r["limit"] = round(limit, 4)
        r["ratio"] = round(value / limit, 3)
    if args.json:
        print(json.dumps(r), flush=True)
    else:
        extra = " (limit %.3f, ratio %.2f)" % (limit, value / limit) if limit else ""
        print("%-18s %10.3f %s%s" % (metric, value, unit, extra), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(SRC, "build"))
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--formats", default="safetensors,pt",
                    help="files to import, comma-separated: safetensors, pt")
    args = ap.parse_args()
    os.environ.setdefault("ZSHARD_SERVER_BIN", os.path.join(args.build_dir, "server",
                                                            "zshard-server"))
    sys.path.insert(0, os.path.join(args.build_dir, "python"))
    import zshard
    import zshard_servers

    cli = os.path.join(args.build_dir, "client", "zshard")
    numel = int(args.gib * (1 << 30) / 4 / args.tensors) // 16 * 16
    names = ["layer%d.weight" % i for i in range(args.tensors)]
    nbytes = numel * 4 * args.tensors
    with tempfile.TemporaryDirectory(prefix="zshard-bench-import-") as tmp, \
            zshard_servers.Shards(2, threads=2) as shards:
        paths = {}
        for fmt in args.formats.split(","):
            paths[fmt] = os.path.join(tmp, "model." + fmt)
            (write_file if fmt == "safetensors" else write_pt)(paths[fmt], names, numel)
            with open(paths[fmt], "rb") as f:   # into the page cache, as for every import below
                while f.read(64 << 20):
                    pass
        c = zshard.Client(shards.addresses, job="bench-import", rank=0, world_size=1)
        c.add_group(optimizer=zshard.SGD)
        for n in names:
            c.add_tensor(n, numel, 0, (numel,))
        # One buffer serves as every tensor's initial weights and gradient.
        buf = np.zeros(numel, dtype=np.float32)
        c.open_job([buf] * args.tensors)
        push = 0.0
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            reqs = c.push_many(list(range(args.tensors)), [buf] * args.tensors)
            for r in reqs:
                r.wait()
            push = max(push, nbytes / (time.perf_counter() - t0) / 1e9)
            c.step(lr=0.0)
        emit(args, "push_gbps", push, "GB/s")
        best, wall, rss = ({fmt: 0.0 for fmt in paths}, {fmt: 0.0 for fmt in paths},
                           {fmt: 0 for fmt in paths})
        for _ in range(args.rounds):
            for fmt, path in paths.items():
                t0 = time.perf_counter()
                out = subprocess.run([cli, "import", "--shards", shards.addresses, "--quiet",
                                      path], capture_output=True, text=True, check=True).stdout
                wall[fmt] = max(wall[fmt], nbytes / (time.perf_counter() - t0) / 1e9)
                best[fmt] = max(best[fmt], float(re.search(r"([0-9.]+) GB/s", out).group(1)))
                rss[fmt] = max(rss[fmt], int(re.search(r"peak resident set .* \(([0-9]+) bytes\)",
                                                       out).group(1)))
        for fmt in paths:
            name = "import" if fmt == "safetensors" else "import_" + fmt
            emit(args, name + "_gbps", best[fmt], "GB/s", 0.5 * push)
            emit(args, name + "_wall_gbps", wall[fmt], "GB/s")
            emit(args, name + "_peak_rss_mib", rss[fmt] / 2**20, "MiB")
        c.close()


if __name__ == "__main__":
    main()
