#!/usr/bin/python3
"""Step time of a replicated shard against a plain one, on loopback.

Starts a plain zshard-server and a replica set of two (promoted by hand), runs
the example trainer (zshard-mlp, synthetic data) for the same steps against
each, alternating, and prints the median step time of each and their ratio,
as JSON lines like tests/bench/run's.

    tests/bench/replica_overhead.py [--build build] [--steps 200] [--hidden 256,256] [--runs 3]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(SRC, "tests", "python"))
os.environ.setdefault("ZS_SOURCE_DIR", SRC)


def run_mlp(build, shards, steps, hidden, job):
    t0 = time.monotonic()
    out = subprocess.run([os.path.join(build, "client", "zshard-mlp"), "--shards", shards,
                          "--steps", str(steps), "--synthetic", "--hidden", hidden,
                          "--log-every", "1", "--job", job],
                         capture_output=True, text=True, timeout=900, check=True).stdout
    wall = time.monotonic() - t0
    totals = [float(m) for m in re.findall(r"ms: total ([0-9.]+)", out)]
    final = [l for l in out.splitlines() if l.startswith("final:")]
    return statistics.median(totals[len(totals) // 5:]), wall, final[-1] if final else ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(SRC, "build"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", default="256,256")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    os.environ["ZSHARD_SERVER_BIN"] = os.path.join(a.build, "server", "zshard-server")
    import hostile
    from test_hostile_replica import ReplicaSet, promote
    plain_ms, repl_ms, finals = [], [], set()
    with hostile.Shard() as plain, ReplicaSet() as rs:
        promote(rs, 0, 1)
        assert hostile.wait_for(lambda: rs.role(1) == "backup")
        for run in range(a.runs):
            ms, _, f1 = run_mlp(a.build, plain.address, a.steps, a.hidden, "plain%d" % run)
            plain_ms.append(ms)
            ms, _, f2 = run_mlp(a.build, rs.addrs[0], a.steps, a.hidden, "repl%d" % run)
            repl_ms.append(ms)
            finals.add((f1, f2))
            # A shard keeps one job: the next run's needs a fresh one.
            for c in (plain.client("admin"), rs.client(0)):
                c.call("CloseJob", hostile.stubs().pb.CloseJobRequest())
        info = rs.info(0).replica
    p, r = statistics.median(plain_ms), statistics.median(repl_ms)
    for metric, value, limit in (("step_plain_ms", p, None), ("step_replicated_ms", r, None),
                                 ("replicated_over_plain", r / p, 1.0)):
        print(json.dumps({"bench": "replica_overhead", "metric": metric, "value": round(value, 3),
                          "unit": "ms" if limit is None else "ratio", "limit": limit,
                          "ratio": round(value / limit, 3) if limit else None,
                          "steps": a.steps, "hidden": a.hidden, "runs": a.runs}))
    same = all(f1.split(" after")[0] == f2.split(" after")[0] for f1, f2 in finals)
    print(json.dumps({"bench": "replica_overhead", "metric": "same_final_line",
                      "value": same, "forwards": info.forwards,
                      "forwarded_bytes": info.forwarded_bytes}))


if __name__ == "__main__":
    main()
