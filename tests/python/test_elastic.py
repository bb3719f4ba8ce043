"""Issue 26, elastic trainers: with --trainer-timeout-ms a trainer that stops
contributing (SIGKILLed before, during or after its pushes of a step, or
SIGSTOPped past the timeout) is left out of that step on every shard alike,
and the others go on without restarting. Three trainers (W = 3) train two
tensors spread over two shards; rank 2 goes away at step K:

- the final weights of every kill are bit-identical to the replay of the same
  membership log (rank 2 scripted to stop before step K), and to torch's SGD
  fed, each step, the sum over that step's members in rank order;
- a stalled trainer is refused politely (ZS_ELEFT) when it wakes up, the
  step it was part of is not corrupted, and it rejoins in join mode;
- a trainer that closes leaves at once (the replay: no timeout is waited);
- determinism: rank 2 killed at step K and a new rank-2 trainer joining at
  step M ends bit-identical to the replay where rank 2 closes at K and joins
  at M, and to torch's SGD over that membership log.

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
M = 5  # the step a new rank 2 joins at (the join tests)
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

def client(cfg, rank, open_mode="either"):
    import zshard
    c = zshard.Client(cfg["addresses"], rank=rank, world_size=W, job="elastic",
                      grad_reduce="sum", push_dtype="fp32", split_threshold=256, transport=cfg["transport"],
                      step_timeout_ms=60000, open_mode=open_mode)
    c.add_group("sgd", momentum=MOMENTUM)
    for t, n in enumerate(NUMELS):
        c.add_tensor("t%d" % t, n)
    c.open_job([init_weights(t) for t in range(len(NUMELS))] if open_mode != "join" else None)
    return c


def trainer(cfg):
    zshard_servers.use_build_tree_package()
    import zshard
    rank, mode = cfg["rank"], cfg["mode"]
    if mode == "joiner":
        return joiner(cfg)
    c = client(cfg, rank)
    log = {"rank": rank, "steps": []}
    for step in range(1, STEPS + 1):
        if cfg.get("hold_at") == step and rank != VICTIM:
            # The test lets a joiner in while the survivors wait here, before
            # any push of the step: it is admitted at this very step.
            print("holding", flush=True)
            sys.stdin.readline()
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
            # It comes back in join mode (the others closed meanwhile: the
            # job waited for a member), and trains a step alone.
            c2 = client(cfg, rank, open_mode="join")
            step = c2.current_step
            for t in range(len(NUMELS)):
                c2.push(t, grad(step, rank, t)).wait()
            r = c2.step(LR)
            log["rejoined"] = [r.step, r.num_members, r.member_rank]
            c2.close()
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


def joiner(cfg):
    """A new trainer of rank VICTIM: opens in join mode while the others hold
    before step M, and trains to the end."""
    c = client(cfg, VICTIM, open_mode="join")
    log = {"rank": VICTIM, "joined_at": c.current_step, "steps": []}
    print("joined", flush=True)
    if cfg.get("hold_after_join"):
        sys.stdin.readline()  # test_elastic_replica.py kills a primary first
    for step in range(c.current_step, STEPS + 1):
        for t in range(len(NUMELS)):
            c.push(t, grad(step, VICTIM, t)).wait()
        r = c.step(LR)
        log["steps"].append([r.step, r.num_members, r.member_rank, 0])
    c.close()
    print(json.dumps(log), flush=True)


# ------------------------------------------------------------------ the test's side

def spawn(cfg):
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "trainer", json.dumps(cfg)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run(transport, mode, join=None):
    """Starts 2 shards and W trainers, rank VICTIM going away at step K as
    `mode` says, and with join = M a new rank-VICTIM trainer joining at step
    M (the survivors hold before it); returns the survivors' logs (and the
    victim's or the joiner's, if any)."""
    with zshard_servers.Shards(2, extra_args=["--trainer-timeout-ms", str(TIMEOUT_MS)]) as s:
        procs = []
        for rank in range(W):
            cfg = {"addresses": s.addresses, "rank": rank, "mode": mode, "transport": transport,
                   "hold_at": join}
            procs.append(spawn(cfg))
        joiner_proc = None
        if join:
            held = [procs[r] for r in range(W) if r != VICTIM]
            for p in held:
                line = p.stdout.readline().strip()
                assert line == "holding", line + p.stderr.read()[-3000:]
            joiner_proc = spawn({"addresses": s.addresses, "rank": VICTIM, "mode": "joiner",
                                 "transport": transport})
            line = joiner_proc.stdout.readline().strip()
            assert line == "joined", line + joiner_proc.stderr.read()[-3000:]
            for p in held:
                p.stdin.write("go\n")
                p.stdin.flush()
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
            if joiner_proc:
                out, err = joiner_proc.communicate(timeout=120)
                assert joiner_proc.returncode == 0, err[-3000:]
                logs["joiner"] = json.loads(out.strip().splitlines()[-1])
            logs["status"] = status(s.addresses)
            out, err = procs[VICTIM].communicate(input="go\n", timeout=120)
            if mode in ("before", "during", "after"):
                assert procs[VICTIM].returncode == -signal.SIGKILL, err[-3000:]
            else:
                assert procs[VICTIM].returncode == 0, err[-3000:]
                logs[VICTIM] = json.loads(out.strip().splitlines()[-1])
        finally:
            for p in procs + ([joiner_proc] if joiner_proc else []):
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


def reference(leave=K, join=None):
    """torch's SGD fed the sum over each step's members, in rank order, rank
    VICTIM a member of the steps before `leave` and from `join` on."""
    import torch
    params = [torch.tensor(list(init_weights(t)), dtype=torch.float32)
              for t in range(len(NUMELS))]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for step in range(1, STEPS + 1):
        members = (range(W) if step < leave or (join and step >= join)
                   else [r for r in range(W) if r != VICTIM])
        for t, p in enumerate(params):
            acc = torch.zeros(NUMELS[t], dtype=torch.float32)
            for r in members:
                acc = acc + torch.tensor(list(grad(step, r, t)), dtype=torch.float32)
            p.grad = acc
        opt.step()
    return [p.detach().numpy().tobytes().hex() for p in params]


def check_survivors(logs, expected, leave=K, join=None, timeouts=True):
    for rank in range(W):
        if rank == VICTIM:
            continue
        log = logs[rank]
        assert [s[0] for s in log["steps"]] == list(range(1, STEPS + 1)), log["steps"]
        for step, num_members, member_rank, _ in log["steps"]:
            member = step < leave or (join and step >= join)
            assert num_members == (W if member else W - 1), log["steps"]
            assert member_rank == rank, log["steps"]
        assert log["weights"] == expected, "rank %d's weights differ" % rank
    if join:
        log = logs["joiner"]
        assert log["joined_at"] == join, log
        assert [s[:3] for s in log["steps"]] == [[s, W, VICTIM] for s in range(join, STEPS + 1)], log
    # What an operator sees once every trainer closed: no member left (each
    # left at its close, rank VICTIM earlier), each change an epoch, and at
    # least one shard decided a step at the timeout when a trainer died.
    rows = logs["status"]
    changes = W + (2 if join else 0)  # every leave, and a join and its leave
    assert [(r["members"], r["world_size"], r["membership_epoch"], r["member_leaves"])
            for r in rows] == [(0, W, changes, W + (1 if join else 0))] * 2, rows
    assert all(r["trainer_timeout_ms"] == TIMEOUT_MS for r in rows), rows
    assert all(r["member_joins"] == (1 if join else 0) for r in rows), rows
    # The membership log: which ranks contributed to which step, the same on
    # every shard, and the same for a run and its replay.
    log = "1:0,1,2;%d:0,1" % leave + (";%d:0,1,2" % join if join else "")
    assert [r["member_log"] for r in rows] == [log] * 2, rows
    assert (sum(r["trainer_timeouts"] for r in rows) >= 1) == timeouts, rows


def test_a_killed_trainer_leaves_and_the_run_matches_its_replay_on_the_data_plane():
    expected = reference()
    replay = run("data", "leave")
    check_survivors(replay, expected, timeouts=False)  # a close leaves at once
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
    assert "rank 2" in message and "join mode" in message, message
    # Rejoined in join mode after everyone else closed: the job waited, then
    # went on with it alone.
    assert logs[VICTIM]["rejoined"] == [STEPS + 1, 1, 0], logs[VICTIM]


def test_a_kill_and_a_join_end_bit_identical_to_their_replay_on_both_transports():
    """Rank 2 killed at step K, a new rank 2 joining at step M: the same bits
    as rank 2 closing at K and joining at M, and as torch over that log."""
    expected = reference(leave=K, join=M)
    replay = run("data", "leave", join=M)
    check_survivors(replay, expected, join=M, timeouts=False)
    check_survivors(run("data", "during", join=M), expected, join=M)
    check_survivors(run("grpc", "before", join=M), expected, join=M)


def test_the_timeout_as_a_job_option_a_clean_close_and_a_join_in_process():
    """Shards without --trainer-timeout-ms: the job's trainer_timeout_ms makes
    it elastic; a close leaves at once (W = 1: the job then has no member and
    waits), and a trainer opening in join mode is admitted at the next step
    and pulls the current weights."""
    zshard_servers.use_build_tree_package()
    import zshard
    with zshard_servers.Shards(2) as s:

        def one(open_mode, **kw):
            c = zshard.Client(s.addresses, rank=0, world_size=1, job="option", grad_reduce="sum",
                              push_dtype="fp32", split_threshold=256, transport="grpc",
                              open_mode=open_mode, **kw)
            c.add_group("sgd")
            c.add_tensor("t", NUMELS[0])
            c.open_job([init_weights(0)] if open_mode != "join" else None)
            return c

        a = one("either", trainer_timeout_ms=4321)
        a.push(0, grad(1, 0, 0)).wait()
        r = a.step(LR)
        assert (r.step, r.num_members, r.member_rank) == (1, 1, 0)
        rows = status(s.addresses)
        assert [(x["members"], x["trainer_timeout_ms"]) for x in rows] == [(1, 4321)] * 2, rows
        after_one = array.array("f", [0.0] * NUMELS[0])
        a.pull(0, after_one).wait()
        a.close()
        rows = status(s.addresses)
        assert [(x["members"], x["member_leaves"]) for x in rows] == [(0, 1)] * 2, rows
        b = one("join")
        assert b.current_step == 2
        pulled = array.array("f", [0.0] * NUMELS[0])
        b.pull(0, pulled).wait()
        assert pulled.tobytes() == after_one.tobytes()
        b.push(0, grad(2, 0, 0)).wait()
        r = b.step(LR)
        assert (r.step, r.num_members) == (2, 1)
        rows = status(s.addresses)
        assert [(x["members"], x["member_joins"], x["membership_epoch"], x["member_log"])
                for x in rows] == [(1, 1, 2, "1:0")] * 2, rows
        b.close()


def test_the_membership_survives_a_checkpoint_and_a_restart_of_every_shard():
    """Issue 26's follow-up: checkpoints record the membership. W = 2 on
    shards without --trainer-timeout-ms (the job's own timeout makes it
    elastic); rank 1 closes at step 3, rank 0 trains step 4 alone, and the
    job is checkpointed at version 4. Every shard is then SIGKILLed and
    restarted from its --state-dir: rank 1 is still out (rank 0 trains step
    5 alone, with no timeout to wait), the job's timeout and the membership
    log came back, rank 1 rejoins in join mode at step 6, and the weights
    are bit-identical to the same run without the restart."""
    zshard_servers.use_build_tree_package()
    import threading
    import zshard

    def both(fns):
        out, errors = [None] * len(fns), []

        def one(i):
            try:
                out[i] = fns[i]()
            except Exception as e:  # reported below, with the traceback's text
                errors.append(repr(e))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive(), "a trainer's step did not return"
        assert not errors, errors
        return out

    def run(restart):
        with zshard_servers.Shards(2, state_dirs=True) as s:

            def open_(rank, open_mode="either"):
                c = zshard.Client(s.addresses, rank=rank, world_size=2, job="restart",
                                  grad_reduce="sum", push_dtype="fp32", split_threshold=256,
                                  transport="grpc", open_mode=open_mode, trainer_timeout_ms=4321,
                                  step_timeout_ms=60000)
                c.add_group("sgd", momentum=MOMENTUM)
                for t, n in enumerate(NUMELS):
                    c.add_tensor("t%d" % t, n)
                c.open_job([init_weights(t) for t in range(len(NUMELS))]
                           if open_mode != "join" else None)
                return c

            def train(c, rank):
                step = c.current_step
                for t in range(len(NUMELS)):
                    c.push(t, grad(step, rank, t)).wait()
                r = c.step(LR)
                return (r.step, r.num_members, r.member_rank)

            a, b = open_(0), open_(1)
            for step in (1, 2):
                assert both([lambda: train(a, 0), lambda: train(b, 1)]) == [(step, 2, 0),
                                                                            (step, 2, 1)]
            b.close()  # rank 1 leaves at step 3
            assert [train(a, 0) for _ in (3, 4)] == [(3, 1, 0), (4, 1, 0)]
            before = status(s.addresses)
            if restart:
                assert a.checkpoint() == 5
                s.restart_all()
            rows = status(s.addresses)
            # What the checkpoint brought back (or what the shards kept).
            keys = ("members", "world_size", "trainer_timeout_ms", "membership_epoch",
                    "member_leaves", "member_joins", "member_log")
            assert [[r[k] for k in keys] for r in rows] == \
                [[r[k] for k in keys] for r in before], (rows, before)
            assert [(r["members"], r["trainer_timeout_ms"], r["member_log"]) for r in rows] == \
                [(1, 4321, "1:0,1;3:0")] * 2, rows
            # Rank 0 goes on in a new process's handle (a resume: its rank
            # is a member of step 5); rank 1 is still out.
            a2 = open_(0)
            assert a2.current_step == 5
            assert train(a2, 0) == (5, 1, 0)
            b2 = open_(1, open_mode="join")
            assert b2.current_step == 6
            assert both([lambda: train(a2, 0), lambda: train(b2, 1)]) == [(6, 2, 0), (6, 2, 1)]
            rows = status(s.addresses)
            assert [r["member_log"] for r in rows] == ["1:0,1;3:0;6:0,1"] * 2, rows
            weights = []
            for t, n in enumerate(NUMELS):
                buf = array.array("f", [0.0] * n)
                a2.state_read(t, zshard.MASTER, buf)
                weights.append(buf.tobytes())
            b2.close()
            a2.close()
            a.close()  # a stale handle's: ignored (its step is past)
            return weights

    expected = [bytes.fromhex(h) for h in reference_members([[0, 1], [0, 1], [0], [0], [0],
                                                             [0, 1]])]
    assert run(restart=False) == expected
    assert run(restart=True) == expected


def flag_job_client(addresses, rank, open_mode="either", step_timeout_ms=60000,
                    transport="grpc"):
    """W = 2, no trainer timeout of the job's own: elastic only through the
    server's --trainer-timeout-ms."""
    import zshard
    c = zshard.Client(addresses, rank=rank, world_size=2, job="flag-only", grad_reduce="sum",
                      push_dtype="fp32", split_threshold=256, transport=transport,
                      open_mode=open_mode, step_timeout_ms=step_timeout_ms)
    c.add_group("sgd", momentum=MOMENTUM)
    for t, n in enumerate(NUMELS):
        c.add_tensor("t%d" % t, n)
    c.open_job([init_weights(t) for t in range(len(NUMELS))] if open_mode != "join" else None)
    return c


def flag_job_victim(cfg):
    """Rank 1 of the flag-only job in a process of its own: resumes, pushes
    tensor 0 of its step, says so and waits to be SIGKILLed."""
    zshard_servers.use_build_tree_package()
    c = flag_job_client(cfg["addresses"], 1)
    step = c.current_step
    c.push(0, grad(step, 1, 0)).wait()
    print(json.dumps({"step": step}), flush=True)
    sys.stdin.readline()


def test_a_job_elastic_only_through_the_flag_stays_elastic_after_a_restart_without_it():
    """Issue 26's follow-up: W = 2 on shards started with --trainer-timeout-ms
    (the job has no timeout of its own), checkpointed at version 2; every
    shard is SIGKILLed and restarted from its --state-dir WITHOUT the flag.
    The checkpoint (format 3) recorded the flag's timeout, so the job is
    still elastic: rank 1, in a process of its own, pushes part of step 3
    and is SIGKILLed; rank 0 trains step 3 on alone once the recorded
    timeout left rank 1 out (its partial pushes discarded), then step 4, and
    the weights are torch's SGD over that membership log, bit for bit.
    Before the fix the restored job had a fixed membership and rank 0's
    step 3 waited for rank 1 until its step timeout."""
    zshard_servers.use_build_tree_package()
    import threading
    import zshard

    with zshard_servers.Shards(2, state_dirs=True,
                               extra_args=["--trainer-timeout-ms", str(TIMEOUT_MS)]) as s:
        a, b = flag_job_client(s.addresses, 0), flag_job_client(s.addresses, 1)

        def train(c, rank):
            step = c.current_step
            for t in range(len(NUMELS)):
                c.push(t, grad(step, rank, t)).wait()
            r = c.step(LR)
            return (r.step, r.num_members, r.member_rank)

        for step in (1, 2):
            out = [None, None]
            threads = [threading.Thread(target=lambda i=i, c=c: out.__setitem__(i, train(c, i)))
                       for i, c in enumerate((a, b))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert out == [(step, 2, 0), (step, 2, 1)], out
        assert [r["trainer_timeout_ms"] for r in status(s.addresses)] == [TIMEOUT_MS] * 2
        assert a.checkpoint() == 3
        s.restart_all(without=["--trainer-timeout-ms"])
        assert all("--trainer-timeout-ms" not in args for args in s.args)
        rows = status(s.addresses)
        assert [(r["members"], r["trainer_timeout_ms"]) for r in rows] == \
            [(2, TIMEOUT_MS)] * 2, rows

        victim = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "flag-victim",
             json.dumps({"addresses": s.addresses})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = victim.stdout.readline()
            assert line, victim.stderr.read()[-3000:]
            assert json.loads(line) == {"step": 3}
            victim.kill()
            victim.wait()
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait()
        a2 = flag_job_client(s.addresses, 0, step_timeout_ms=20000)
        assert a2.current_step == 3
        assert [train(a2, 0) for _ in (3, 4)] == [(3, 1, 0), (4, 1, 0)]
        rows = status(s.addresses)
        # Rank 1 left on every shard; at least one decided it at the timeout
        # (the others may follow that shard's decision).
        assert [(r["members"], r["member_leaves"], r["trainer_timeout_ms"], r["member_log"])
                for r in rows] == [(1, 1, TIMEOUT_MS, "1:0,1;3:0")] * 2, rows
        assert sum(r["trainer_timeouts"] for r in rows) >= 1, rows
        weights = []
        for t, n in enumerate(NUMELS):
            buf = array.array("f", [0.0] * n)
            a2.state_read(t, zshard.MASTER, buf)
            weights.append(buf.tobytes())
        a2.close()
    expected = [bytes.fromhex(h) for h in reference_members([[0, 1], [0, 1], [0], [0]])]
    assert weights == expected


def reference_members(members):
    """torch's SGD fed, at step k + 1, the sum over members[k] in rank order."""
    import torch
    params = [torch.tensor(list(init_weights(t)), dtype=torch.float32)
              for t in range(len(NUMELS))]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    for k, ranks in enumerate(members):
        for t, p in enumerate(params):
            acc = torch.zeros(NUMELS[t], dtype=torch.float32)
            for r in ranks:
                acc = acc + torch.tensor(list(grad(k + 1, r, t)), dtype=torch.float32)
            p.grad = acc
        opt.step()
    return [p.detach().numpy().tobytes().hex() for p in params]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "trainer":
    trainer(json.loads(sys.argv[2]))
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "flag-victim":
    flag_job_victim(json.loads(sys.argv[2]))
