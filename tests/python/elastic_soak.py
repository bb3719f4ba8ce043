"""Issue 26's chaos run (not in CI: it takes a while).

    ZSHARD_SERVER_BIN=build/server/zshard-server ZSHARD_PYTHONPATH=build/python \\
        /usr/bin/python3 tests/python/elastic_soak.py --runs N --seed S [--steps 200] \\
        [--kills 3] [--timeout-ms 500] [--compute-ms 20]

Each run starts 2 shards with --trainer-timeout-ms and 4 trainer processes
that minimise a least-squares loss (rank r's gradient at step s is
w - target(s, r), from the weights it pulled). A driver SIGKILLs a random
trainer at random moments (one dead at a time) and restarts it in join mode
a little later. At the end every run must:

- end bit-identical to the replay of its membership log (the shards' log,
  `zshard status --json`): torch's SGD fed, each step, the sum over that
  step's members of their gradients;
- end with a loss close to the uninterrupted run's (every rank every step);

and the survivors' held-up time per kill (their slowest step around each
kill) is reported against the goal of the timeout plus one step.
"""

import argparse
import array
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

W = 4
NUMEL = 512
LR = 0.05


def target(step, rank):
    """Rank r's data at step s: noisy around a fixed point, a little off for
    each rank (so that who contributed shows in the bits)."""
    rnd = random.Random(step * 7919 + rank)
    return array.array("f", [((i * 37) % 101) / 101.0 - 0.5 + 0.01 * rank + rnd.uniform(-0.05, 0.05)
                             for i in range(NUMEL)])


def init_weights():
    return array.array("f", [0.0] * NUMEL)


def trainer(cfg):
    zshard_servers.use_build_tree_package()
    import numpy as np
    import zshard
    rank = cfg["rank"]
    c = zshard.Client(cfg["addresses"], rank=rank, world_size=W, job="soak", grad_reduce="sum",
                      push_dtype="fp32", split_threshold=128, step_timeout_ms=120000,
                      open_mode=cfg["open_mode"])
    c.add_group("sgd")
    c.add_tensor("w", NUMEL)
    c.open_job([init_weights()] if cfg["open_mode"] != "join" else None)
    print("ready", flush=True)
    times = []
    w = array.array("f", [0.0] * NUMEL)
    while c.current_step <= cfg["steps"]:
        step = c.current_step
        c.pull(0, w).wait()  # the weights of version step - 1
        g = (np.frombuffer(w, dtype=np.float32) -
             np.frombuffer(target(step, rank), dtype=np.float32)).astype(np.float32)
        time.sleep(cfg["compute_ms"] / 1000.0)  # the forward and backward it stands for
        t0 = time.monotonic()
        c.push(0, g).wait()
        r = c.step(LR)
        times.append([r.step, round((time.monotonic() - t0) * 1000.0, 1)])
    c.state_read(0, zshard.MASTER, w)
    c.close()
    print(json.dumps({"rank": rank, "times": times, "weights": w.tobytes().hex()}), flush=True)


COMPUTE_MS = 20


def spawn(addresses, rank, open_mode, steps):
    cfg = {"addresses": addresses, "rank": rank, "open_mode": open_mode, "steps": steps,
           "compute_ms": COMPUTE_MS}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "trainer", json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def parse_log(text, steps):
    """'1:0,1,2,3;40:0,2,3' -> the member list of every step 1..steps."""
    entries = []
    for part in text.split(";"):
        start, ranks = part.split(":")
        entries.append((int(start), [int(r) for r in ranks.split(",") if r]))
    out = {}
    for k, (start, ranks) in enumerate(entries):
        end = entries[k + 1][0] if k + 1 < len(entries) else steps + 1
        for s in range(start, end):
            out[s] = ranks
    return [out[s] for s in range(1, steps + 1)]


def replay(members, steps):
    return replay_to(members, steps, steps)


def replay_to(members, steps, loss_step):
    """torch's SGD over the membership log; returns (weights bytes, loss)."""
    import torch
    p = torch.tensor(list(init_weights()), dtype=torch.float32)
    opt = torch.optim.SGD([p], lr=LR)
    for step in range(1, steps + 1):
        acc = torch.zeros(NUMEL, dtype=torch.float32)
        with torch.no_grad():
            for r in members[step - 1]:
                acc = acc + (p - torch.tensor(list(target(step, r)), dtype=torch.float32))
        p.grad = acc
        opt.step()
    with torch.no_grad():
        loss = statistics.mean(
            float(0.5 * ((p - torch.tensor(list(target(loss_step, r)))) ** 2).mean())
            for r in range(W))
    return p.detach().numpy().tobytes(), loss


def one_run(seed, steps, timeout_ms, kills):
    import test_elastic
    rnd = random.Random(seed)
    with zshard_servers.Shards(2, extra_args=["--trainer-timeout-ms", str(timeout_ms)]) as s:
        procs = {r: spawn(s.addresses, r, "either", steps) for r in range(W)}
        # Kills start once every trainer opened (rank 0 wrote the initial
        # weights: a job never initialised has nothing to join).
        for r, p in procs.items():
            line = p.stdout.readline().strip()
            assert line == "ready", line + p.stderr.read()[-3000:]
        done, killed_at = {}, []
        for _ in range(kills):
            time.sleep(rnd.uniform(0.3, 1.0))
            alive = [r for r, p in procs.items() if p.poll() is None]
            if len(alive) < W:
                break  # someone finished: the run is near its end
            victim = rnd.choice(alive)
            procs[victim].kill()
            procs[victim].wait()
            killed_at.append(time.monotonic())
            time.sleep(rnd.uniform(0.1, 0.5))
            procs[victim] = spawn(s.addresses, victim, "join", steps)
        for r, p in procs.items():
            out, err = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit("rank %d failed: %s" % (r, err[-3000:]))
            done[r] = json.loads(out.strip().splitlines()[-1])
        rows = test_elastic.status(s.addresses)
    logs = {r["member_log"] for r in rows}
    assert len(logs) == 1, rows
    members = parse_log(logs.pop(), steps)
    bits, loss = replay(members, steps)
    _, loss_full = replay([list(range(W))] * steps, steps)
    _, loss_init = replay_to([], 0, steps)
    weights = {d["weights"] for d in done.values()}
    assert weights == {bits.hex()}, "run %d: the weights differ from the replay of its log" % seed
    step_ms = [t for d in done.values() for _, t in d["times"]]
    normal = statistics.median(step_ms)
    held = sorted((t for t in step_ms if t > timeout_ms / 2), reverse=True)
    return {"seed": seed, "kills": len(killed_at), "member_log": rows[0]["member_log"],
            "loss": loss, "loss_uninterrupted": loss_full, "loss_initial": loss_init,
            "median_step_ms": normal,
            "held_up_ms": held[:2 * max(1, len(killed_at))]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout-ms", type=int, default=500)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--compute-ms", type=int, default=COMPUTE_MS)
    a = ap.parse_args()
    globals()["COMPUTE_MS"] = a.compute_ms
    zshard_servers.use_build_tree_package()
    for i in range(a.runs):
        r = one_run(a.seed + i, a.steps, a.timeout_ms, a.kills)
        # Close: within 5 % of what the uninterrupted run gained from the
        # initial weights.
        gain = r["loss_initial"] - r["loss_uninterrupted"]
        rel = abs(r["loss"] - r["loss_uninterrupted"]) / gain
        print(json.dumps(dict(r, loss_gap_of_gain=round(rel, 4))), flush=True)
        assert rel < 0.05, "run %d: loss %g far from the uninterrupted %g" % (
            r["seed"], r["loss"], r["loss_uninterrupted"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "trainer":
        trainer(json.loads(sys.argv[2]))
    else:
        main()
