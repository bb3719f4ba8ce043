"""Issue 26, elastic trainers: with --trainer-timeout-ms a trainer that stops
contributing (SIGKILLed before, during or after its pushes of a step, or
SIGSTOPped past the timeout) is left out of that step on every shard alike,
and the others go on without restarting. Three trainers (W = 3) train two
tensors spread over two shards; rank 2 goes away at step K:

- the final weights of every kill are bit-identical to the replay of the same
  membership log (rank 2 scripted to stop before step K), and to torch's SGD
  fed, each step, the sum over that step's members in rank order;
- a stalled trainer is refused politely (ZS_ELEFT) when it wakes up, and the
  step it was part of is not corrupted.

Both transports (the data plane and gRPC). Each trainer is a process of its
own (this file, run as `python3 test_elastic.py trainer CONFIG`), so that a
SIGKILL really takes its connections away mid-step.

Run with Debian's interpreter: /usr/bin/python3 -m pytest tests/python/test_elastic.py
"""

import array
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

W = 3
STEPS = 6
K = 3  # the step rank 2 goes away at
VICTIM = 2
LR = 0.05
MOMENTUM = 0.9
TIMEOUT_MS = 1000
NUMELS = [1000, 48]  # the first is split over both shards
ZS_ELEFT = -28


def init_weights(t):
    n = NUMELS[t]
    return array.array("f", [((i * 7919 + 13 * t) % 1000) / 1000.0 - 0.5 for i in range(n)])


def grad(step, rank, t):
    n = NUMELS[t]
    return array.array("f", [((i * 31 + step * 17 + rank * 101 + t * 7) % 97) / 97.0 - 0.5
                             for i in range(n)])


# ------------------------------------------------------------------ trainer

def trainer(cfg):
    zshard_servers.use_build_tree_package()
    import zshard
    rank, mode = cfg["rank"], cfg["mode"]
    c = zshard.Client(cfg["addresses"], rank=rank, world_size=W, job="elastic",
                      grad_reduce="sum", push_dtype="fp32", split_threshold=256, transport=cfg["transport"],
                      step_timeout_ms=60000)
    c.add_group("sgd", momentum=MOMENTUM)
    for t, n in enumerate(NUMELS):
        c.add_tensor("t%d" % t, n)
    c.open_job([init_weights(t) for t in range(len(NUMELS))])
    log = {"rank": rank, "steps": []}
    for step in range(1, STEPS + 1):
        going = rank == VICTIM and step == K
        if going and mode == "leave":
            c.close()  # the replay: this rank simply stops before step K
            print(json.dumps(log), flush=True)
            return
        if going and mode == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        c.push(0, grad(step, rank, 0)).wait()
        if going and mode == "during":
            os.kill(os.getpid(), signal.SIGKILL)
        if going and mode == "stall":
            print("stalled", flush=True)
            sys.stdin.readline()  # the test SIGSTOPs us here, then lets us go
            try:
                c.push(1, grad(step, rank, 1)).wait()
                c.step(LR)
            except zshard.Error as e:
                log["refused"] = [e.status, str(e)]
            print(json.dumps(log), flush=True)
            return
        c.push(1, grad(step, rank, 1)).wait()
        if going and mode == "after":
            c.wait_pushes()
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        r = c.step(LR)
        log["steps"].append([r.step, r.num_members, r.member_rank,
                             round((time.monotonic() - t0) * 1000.0, 1)])
    weights = []
    for t, n in enumerate(NUMELS):
        buf = array.array("f", [0.0] * n)
        c.state_read(t, zshard.MASTER, buf)  # the fp32 master weights, exactly
        weights.append(buf.tobytes().hex())
    log["weights"] = weights
    c.close()
    print(json.dumps(log), flush=True)


# ------------------------------------------------------------------ the test's side

def run(transport, mode):
    """Starts 2 shards and W trainers, rank VICTIM going away at step K as
    `mode` says; returns the survivors' logs (and the victim's, if any)."""
    with zshard_servers.Shards(2, extra_args=["--trainer-timeout-ms", str(TIMEOUT_MS)]) as s:
        procs = []
        for rank in range(W):
            cfg = {"addresses": s.addresses, "rank": rank, "mode": mode, "transport": transport}
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "trainer", json.dumps(cfg)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        if mode == "stall":
            victim = procs[VICTIM]
            assert victim.stdout.readline().strip() == "stalled"
            os.kill(victim.pid, signal.SIGSTOP)
        logs = {}
        try:
            for rank in range(W):
                if rank == VICTIM:
                    continue
                out, err = procs[rank].communicate(timeout=120)
                assert procs[rank].returncode == 0, "rank %d: %s" % (rank, err[-3000:])
                logs[rank] = json.loads(out.strip().splitlines()[-1])
            if mode == "stall":
                # The others finished every step while it slept; it wakes up.
                os.kill(procs[VICTIM].pid, signal.SIGCONT)
            logs["status"] = status(s.addresses)
            out, err = procs[VICTIM].communicate(input="go\n", timeout=120)
            if mode in ("before", "during", "after"):
                assert procs[VICTIM].returncode == -signal.SIGKILL, err[-3000:]
            else:
                assert procs[VICTIM].returncode == 0, err[-3000:]
                logs[VICTIM] = json.loads(out.strip().splitlines()[-1])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return logs


def status(addresses):
    """`zshard status --json`: every shard's membership counters."""
    cli = os.path.join(os.path.dirname(os.path.dirname(os.environ["ZSHARD_SERVER_BIN"])),
                       "client", "zshard")
    out = subprocess.run([cli, "status", "--shards", addresses, "--sample-ms", "0", "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)["shards"]


def reference(leave=K):
    """torch's SGD fed the sum over each step's members, in rank order, rank
    VICTIM a member of the steps before `leave`."""
    import torch
    params = [torch.tensor(list(init_weights(t)), dtype=torch.float32)
              for t in range(len(NUMELS))]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for step in range(1, STEPS + 1):
        members = range(W) if step < leave else [r for r in range(W) if r != VICTIM]
        for t, p in enumerate(params):
            acc = torch.zeros(NUMELS[t], dtype=torch.float32)
            for r in members:
                acc = acc + torch.tensor(list(grad(step, r, t)), dtype=torch.float32)
            p.grad = acc
        opt.step()
    return [p.detach().numpy().tobytes().hex() for p in params]


def check_survivors(logs, expected, leave=K):
    for rank in range(W):
        if rank == VICTIM:
            continue
        log = logs[rank]
        assert [s[0] for s in log["steps"]] == list(range(1, STEPS + 1)), log["steps"]
        for step, num_members, member_rank, _ in log["steps"]:
            assert num_members == (W if step < leave else W - 1), log["steps"]
            assert member_rank == rank, log["steps"]
        assert log["weights"] == expected, "rank %d's weights differ" % rank
    # What an operator sees: every shard goes on with W - 1 members, one rank
    # left out, and at least one shard decided a step at the timeout.
    rows = logs["status"]
    assert [(r["members"], r["world_size"], r["membership_epoch"], r["member_leaves"])
            for r in rows] == [(W - 1, W, 1, 1)] * 2, rows
    assert all(r["trainer_timeout_ms"] == TIMEOUT_MS for r in rows), rows
    assert sum(r["trainer_timeouts"] for r in rows) >= 1, rows


def test_a_killed_trainer_leaves_and_the_run_matches_its_replay_on_the_data_plane():
    expected = reference()
    replay = run("data", "leave")
    check_survivors(replay, expected)
    # Killed before or during its pushes of step K: left out of step K, its
    # partial pushes discarded on both shards.
    for mode in ("before", "during"):
        check_survivors(run("data", mode), expected)
    # Killed after every push of step K was acknowledged: step K had all of
    # it, so it is left out from step K + 1.
    check_survivors(run("data", "after"), reference(leave=K + 1), leave=K + 1)


def test_a_killed_trainer_leaves_on_grpc():
    expected = reference()
    check_survivors(run("grpc", "during"), expected)


def test_a_stalled_trainer_is_refused_politely_and_corrupts_nothing():
    expected = reference()
    logs = run("data", "stall")
    check_survivors(logs, expected)
    status, message = logs[VICTIM]["refused"]
    assert status == ZS_ELEFT, (status, message)
    assert "rank 2" in message and "rejoin" in message, message


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "trainer":
    trainer(json.loads(sys.argv[2]))
