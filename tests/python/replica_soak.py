"""The kill -9 matrix of replicated shards: a deterministic trainer, kill points, and the soak.

A seeded run trains a small model (AdamW, fp32 on the wire, gradient
clipping, a checkpoint every CKPT_EVERY steps) through the zshard package's
low-level Client, one step at a time, on a ReplicaCluster; the gradient of a
step is a function of the weights it pulled and of (seed, step) only, so two
runs that end with the same bits went through the same steps. At planned
points of a step the primary of a shard (as GetInfo.replica names it) gets
SIGKILL:

    before_push          the step's gradients are computed, nothing pushed
    mid_push             some of the step's pushes issued (not yet waited)
    between_stats_apply  after grad_norm() (GradStats answered), before step()
    during_apply         from another thread, a calibrated moment after step()
                         was called (the Apply in flight on the primary)
    mid_pull             some of the step's pulls issued (not yet waited)
    during_checkpoint    from another thread while checkpoint() runs; that
                         checkpoint may fail, training goes on

The killed member is restarted RESTART_AFTER steps later (once another
member is primary), with the same flags, and rejoins. No run restores: it
must end with the weights, moments and optimizer step count of the
uninterrupted run of the same seed on unreplicated shards, bit for bit.

The soak (issue 13: >= 30 seeded runs with random kill points):
    /usr/bin/python3 tests/python/replica_soak.py --runs 30 --seed 1
prints one line per run and a summary line; ZSHARD_SERVER_BIN and
ZSHARD_PYTHONPATH as CTest sets them (by default build/server/zshard-server and
build/python under the source directory).
"""

import argparse
import os
import random
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replica_cluster  # noqa: E402
from replica_cluster import ReplicaCluster  # noqa: E402

import numpy as np  # noqa: E402

import zshard  # noqa: E402

# Tensors of the model: split_threshold cuts the big ones into pieces over
# the shards, the small ones stay whole on one shard.
TENSORS = (("embed", 96000), ("w1", 160000), ("b1", 400), ("w2", 120000), ("b2", 10))
SPLIT = 40000
STEPS = 12
CKPT_EVERY = 3
LR = 1e-2
MAX_GRAD_NORM = 50.0
RESTART_AFTER = 1

# Failure detection: the servers drop a silent backup after SERVER_FAILOVER_MS;
# the client promotes a backup CLIENT_FAILOVER_MS after the primary's first
# failure (zs_client_options.failover_ms, ZSHARD_FAILOVER_MS).
SERVER_FAILOVER_MS = 1000
CLIENT_FAILOVER_MS = 1000
# A failover search is one of max_retries attempts, and the backoff is cut to
# wake when a dead primary's failover_ms ends (docs/CLIENT.md): a generous
# budget, as a loaded 2-core machine may need several searches.
CLIENT_OPTIONS = dict(push_dtype="fp32", pull_dtype="fp32", split_threshold=SPLIT,
                      rpc_timeout_ms=5000, step_timeout_ms=20000, max_retries=60,
                      retry_initial_ms=20, retry_max_ms=500, checkpoint_timeout_ms=20000,
                      failover_ms=CLIENT_FAILOVER_MS)

SEQUENTIAL_POINTS = ("before_push", "mid_push", "between_stats_apply", "mid_pull")
TIMED_POINTS = ("during_apply", "during_checkpoint")
KILL_POINTS = SEQUENTIAL_POINTS + TIMED_POINTS
ROLE_WAIT_SECONDS = 30
WHOLE_WAIT_SECONDS = 3


class Kill:
    """One planned SIGKILL: at `point` of `step`, of `shard`'s primary (or
    its backup with backup=True); `frac` places a mid_* kill among the
    transfers and a timed kill within the call's calibrated duration."""

    def __init__(self, step, point, shard, frac=0.5, backup=False):
        self.step, self.point, self.shard, self.frac, self.backup = (step, point, shard, frac,
                                                                     backup)
        self.victim = None   # the member index killed
        self.landed = None   # timed kills: True if before the call returned

    def __repr__(self):
        who = "backup" if self.backup else "primary"
        return "%s@%d:%s(s%d,%.2f)" % (self.point, self.step, who, self.shard, self.frac)


class Timed(threading.Thread):
    """Runs fn() `delay` seconds after go() and notes when."""

    def __init__(self, delay, fn):
        super().__init__(daemon=True)
        self.delay, self.fn, self.at, self.error = delay, fn, None, None
        self.armed = threading.Event()

    def go(self):
        self.armed.set()

    def run(self):
        self.armed.wait(60)
        time.sleep(self.delay)
        self.at = time.monotonic()
        try:
            self.fn()
        except BaseException as e:  # reported by the caller
            self.error = e


def init_weights(seed):
    rng = np.random.default_rng([seed, 0])
    return [(rng.standard_normal(n, dtype=np.float32) * np.float32(0.1)) for _, n in TENSORS]


def gradient(seed, step, i, w, rank=0):
    """The gradient of tensor i at `step` from its pulled weights w: every
    bit follows from (seed, step, w) and the trainer's rank."""
    rng = np.random.default_rng([seed, step, i] + ([rank] if rank else []))
    noise = rng.standard_normal(w.size, dtype=np.float32)
    return (w * np.float32(0.5) + noise * np.float32(0.05)).astype(np.float32)


def wait_all(reqs):
    """Waits for every request, then raises the first one's error."""
    first = None
    for r in reqs:
        try:
            r.wait()
        except zshard.Error as e:
            first = first or e
    if first is not None:
        raise first


class Trainer:
    """One trainer (rank 0 of 1) driven step by step; `hook(point)` is
    called at the sequential kill points, `timed(point)` gives the Timed
    killer to start around a call (or None)."""

    def __init__(self, addresses, seed, job="replica-kill", rank=0, world=1, options=None):
        self.seed, self.rank, self.world = seed, rank, world
        opts = dict(CLIENT_OPTIONS, **(options or {}))
        if world > 1:
            opts.update(rank=rank, world_size=world)
        self.c = zshard.Client(addresses, job=job, open_mode="create" if rank == 0 else "either",
                               **opts)
        self.c.add_group("adamw", weight_decay=0.01)
        self.ids = [self.c.add_tensor(name, n) for name, n in TENSORS]
        self.c.open_job(init_weights(seed) if rank == 0 else None)
        self.w = [np.empty(n, dtype=np.float32) for _, n in TENSORS]
        self.step_no = 1
        self.durations = {"apply": [], "checkpoint": []}
        self.failed_checkpoints = []

    def close(self):
        self.c.close()

    def _pull(self, hook, frac):
        reqs, cut = [], int(len(self.ids) * frac)
        for k, (t, w) in enumerate(zip(self.ids, self.w)):
            if k == cut:
                hook("mid_pull")
            reqs.append(self.c.pull(t, w))
        wait_all(reqs)

    def _push(self, grads, hook, frac):
        reqs, cut = [], int(len(self.ids) * frac)
        for k, (t, g) in enumerate(zip(self.ids, grads)):
            if k == cut:
                hook("mid_push")
            reqs.append(self.c.push(t, g))
        wait_all(reqs)

    def _call_timed(self, name, fn, killer):
        t0 = time.monotonic()
        if killer:
            killer.go()
        try:
            return fn()
        finally:
            t1 = time.monotonic()
            self.durations[name].append(t1 - t0)
            if killer:
                killer.join(30)
                killer.kill.landed = killer.at is not None and killer.at < t1
                if killer.error is not None:
                    raise killer.error

    def step(self, hook=lambda p: None, timed=lambda p: None, frac=0.5):
        s = self.step_no
        self._pull(hook, frac)
        grads = [gradient(self.seed, s, i, w, self.rank) for i, w in enumerate(self.w)]
        hook("before_push")
        self._push(grads, hook, frac)
        self.c.grad_norm()
        hook("between_stats_apply")
        # beta1 and weight_decay change every step, as a scheduler's would
        # (OneCycleLR cycles beta1): a forwarded Apply carries them, so a
        # backup applies the primary's bits.
        hp = dict(group_beta1=[0.9 - 0.05 * (s % 3)], group_weight_decay=[0.01 * (1 + s % 2)])
        r = self._call_timed("apply",
                             lambda: self.c.step(LR, max_grad_norm=MAX_GRAD_NORM, **hp),
                             timed("during_apply"))
        if r.step != s:
            raise AssertionError("step() completed step %d, expected %d" % (r.step, s))
        if s % CKPT_EVERY == 0 and self.rank == 0:
            killer = timed("during_checkpoint")
            try:
                self._call_timed("checkpoint", lambda: self.c.checkpoint(), killer)
            except zshard.Error as e:
                if killer is None:
                    raise
                self.failed_checkpoints.append((s, "%s: %s" % (e.name, e)))
        self.step_no += 1
        return r

    def final_state(self):
        """The job's state as the client reads it: weights (fp32 pulls),
        both AdamW moments and the optimizer step count."""
        out = {}
        self._pull(lambda p: None, 0.0)
        for (name, n), t, w in zip(TENSORS, self.ids, self.w):
            out[name] = w.tobytes()
            for label, array in (("exp_avg", zshard.EXP_AVG), ("exp_avg_sq", zshard.EXP_AVG_SQ)):
                buf = np.empty(n, dtype=np.float32)
                self.c.state_read(t, array, buf)
                out[name + "." + label] = buf.tobytes()
        out["optimizer_steps"] = self.c.optimizer_steps()
        return out


# A step of several trainers runs one thread each; a step that has not ended
# after this long (every client call is bounded by its own timeouts and
# retries, far below it) is a hang.
TEAM_STEP_SECONDS = 180


def run_parallel(fns, seconds=TEAM_STEP_SECONDS):
    """Runs every fn() in a thread of its own; returns their results once
    all ended, raises the first error, or AssertionError if one is still
    running after `seconds` (its thread is left behind, a daemon)."""
    out, errors = [None] * len(fns), [None] * len(fns)

    def one(k):
        try:
            out[k] = fns[k]()
        except BaseException as e:  # re-raised below
            errors[k] = e
    threads = [threading.Thread(target=one, args=(k,), daemon=True) for k in range(len(fns))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [k for k, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise AssertionError("trainers %s still in their call after %d s" % (hung, seconds))
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return out


class Team:
    """`world` trainers of one job (ranks 0..world-1) that run each step
    together, one thread each, as data-parallel trainers do; rank 0's calls
    carry the kill points and its view is the team's (step_no, c, ids,
    durations, final_state). world=1 is one Trainer, called directly."""

    def __init__(self, addresses, seed, world=1, job="replica-kill", options=None):
        if world == 1:
            self.trainers = [Trainer(addresses, seed, job, options=options)]
        else:
            # Every rank's open waits for the others' (the job is opened by
            # all of them), so they open at once.
            self.trainers = run_parallel(
                [lambda k=k: Trainer(addresses, seed, job, k, world, options)
                 for k in range(world)])

    def __getattr__(self, name):  # step_no, c, ids, durations, failed_checkpoints
        return getattr(self.trainers[0], name)

    def step(self, hook=lambda p: None, timed=lambda p: None, frac=0.5):
        if len(self.trainers) == 1:
            return self.trainers[0].step(hook, timed, frac)
        fns = [lambda: self.trainers[0].step(hook, timed, frac)]
        fns += [lambda t=t: t.step(frac=frac) for t in self.trainers[1:]]
        return run_parallel(fns)[0]

    def final_state(self):
        return self.trainers[0].final_state()

    def close(self):
        for t in reversed(self.trainers):
            t.close()


# ------------------------------------------------------------------ runs


def reference(seed, nshards, steps=STEPS, world=1):
    """The uninterrupted run on unreplicated shards: (final state, the
    median durations of step() and checkpoint() for placing timed kills)."""
    with ReplicaCluster(nshards, 1) as rc:
        tr = Team(rc.addresses, seed, world)
        try:
            for _ in range(steps):
                tr.step()
            state = tr.final_state()
        finally:
            tr.close()
    med = {k: sorted(v)[len(v) // 2] for k, v in tr.durations.items() if v}
    return state, med


class Run:
    """One replicated run with planned kills; .stats after run()."""

    def __init__(self, seed, nshards, kills, calib, replicas=2, steps=STEPS,
                 restart_after=RESTART_AFTER, world=1, wait_whole=True, join_kill_rate=0.0):
        self.seed, self.nshards, self.kills, self.calib = seed, nshards, kills, calib
        self.world = world
        # wait_whole=False fires a kill whatever the set's state (a member
        # may still be joining); join_kill_rate: the chance that a restarted
        # member is SIGKILLed again as soon as it is JOINING (and restarted
        # at the next step).
        self.wait_whole, self.join_kill_rate = wait_whole, join_kill_rate
        self.rng = random.Random(seed * 7919 + len(kills))
        self.join_kills = 0
        self.join_ms = []         # the joiners' took_ms (replica_loaded with a copy)
        self.drops_after_join = []  # replica_dropped lines not caused by a kill
        self.replicas, self.steps, self.restart_after = replicas, steps, restart_after
        self.pending_restarts = []  # (step, shard, index)
        self.unsettled = set()      # shards with a restarted member not yet joining
        self.rc = self.tr = None
        self.log = []

    def _victim(self, kill):
        """The member to kill, or None when the shard's set is not whole
        (a member joins only at the next applied step, which waiting here
        would hold up): the kill moves to the same point of the next step."""
        whole = not self.wait_whole or replica_cluster.wait_for(
            lambda: self._set_whole(kill.shard), WHOLE_WAIT_SECONDS)
        if not whole:
            later = kill.step + (CKPT_EVERY if kill.point == "during_checkpoint" else 1)
            self.log.append("step %d %s: s%d not whole (%s), the kill moves to step %d" %
                            (kill.step, kill.point, kill.shard, self.rc.whole(kill.shard)[1],
                             later))
            kill.step = later
            return None
        p = self.rc.wait_primary(kill.shard)
        if p is None:
            raise AssertionError("no primary of shard %d to kill: %s" %
                                 (kill.shard, self.rc.roles(kill.shard)))
        if not kill.backup:
            return p
        return next((k for k in range(self.replicas) if k != p and self.rc.alive(kill.shard, k)),
                    p)

    def _kill(self, kill, index):
        self.rc.kill(kill.shard, index)
        kill.victim = index
        self.pending_restarts.append((kill.step + self.restart_after, kill.shard, index))
        self.log.append("step %d %s: killed s%dr%d" % (kill.step, kill.point, kill.shard, index))

    def _hook(self, step):
        def hook(point):
            for k in self.kills:
                if k.step == step and k.point == point and k.victim is None:
                    index = self._victim(k)
                    if index is not None:
                        self._kill(k, index)
        return hook

    def _timed(self, step):
        def timed(point):
            for k in self.kills:
                if k.step == step and k.point == point and k.victim is None:
                    index = self._victim(k)
                    if index is None:
                        return None
                    base = self._duration("apply" if point == "during_apply" else "checkpoint")
                    killer = Timed(base * k.frac, lambda k=k, i=index: self._kill(k, i))
                    killer.kill = k
                    killer.start()
                    return killer
            return None
        return timed

    def _duration(self, call):
        """The call's median duration in this run so far (replicated calls
        take longer than the reference's), else the reference's."""
        seen = sorted(self.tr.durations[call]) if self.tr else []
        if seen:
            return seen[len(seen) // 2]
        return self.calib.get(call, 0.005)

    def _restarts(self, step):
        """Restarts the members due. A killed primary comes back only once
        another member is primary: when the kill came after the step's last
        answer, no call has seen it yet, and that case (a primary back before
        any trainer noticed) is test_replica_restart.py's."""
        due = [r for r in self.pending_restarts if r[0] <= step]
        due = [r for r in due if self.rc.primary(r[1]) not in (None, r[2])]
        for r in due:
            self.pending_restarts.remove(r)
            self.rc.restart(r[1], r[2])
            self.log.append("step %d: restarted s%dr%d" % (step, r[1], r[2]))
            if self.join_kill_rate and self.rng.random() < self.join_kill_rate and \
                    self._kill_when_joining(step, r[1], r[2]):
                continue
            self.unsettled.add(r[1])
        for shard in sorted(self.unsettled):
            # No primary yet: the killed one's death was not seen by any call
            # (a kill after the step's last answer); the trainer's next call
            # to the shard promotes a backup, and the member joins after.
            if self.rc.primary(shard) is not None:
                self._wait_joining(shard)
                self.unsettled.discard(shard)

    def _kill_when_joining(self, step, shard, index):
        """SIGKILLs the restarted member as soon as GetInfo shows it JOINING
        (it waits for the primary's next applied step, so it stays so until
        the step runs) and plans its restart at the next step. False when it
        was not seen joining within ROLE_WAIT_SECONDS."""
        joining = replica_cluster.wait_for(
            lambda: (lambda i: i is not None and i.HasField("replica") and
                     i.replica.role == replica_cluster.ROLE_JOINING)(
                         self.rc.info(shard, index, timeout=0.5)), ROLE_WAIT_SECONDS, poll=0.005)
        if not joining:
            return False
        self.rc.kill(shard, index)
        self.join_kills += 1
        self.pending_restarts.append((step + 1, shard, index))
        self.log.append("step %d: killed s%dr%d while it joined" % (step, shard, index))
        return True

    def _join_stats(self):
        """join_ms and drops_after_join from every member's log: a drop
        whose reason is not a silence (a kill: ZS_ECONN, ZS_ETIMEDOUT,
        ZS_ECLOSED, ZS_ECANCELED) is a member dropped while it answered, as
        the ZS_ESTEP drops right after a join were."""
        silent = ("error=ZS_ECONN", "error=ZS_ETIMEDOUT", "error=ZS_ECLOSED", "error=ZS_ECANCELED")
        for m in self.rc.all_members():
            try:
                with open(m.log_path, errors="replace") as f:
                    for line in f:
                        if "event=replica_loaded" in line and "copy=yes" in line:
                            self.join_ms.append(int(line.rsplit("took_ms=", 1)[1].split()[0]))
                        elif "event=replica_dropped" in line and not any(k in line for k in silent):
                            self.drops_after_join.append(line.strip())
            except (OSError, ValueError, IndexError):
                pass

    def _wait_joining(self, shard):
        """Waits until every member of the shard has a role in the set
        (PRIMARY, BACKUP or JOINING): a member that asked to join is copied
        at the primary's next applied step, so after the next step the set
        is whole. Without this wait a member could ask only after the steps
        before a kill, and the kill would find its set not whole."""
        if not self.rc.wait_joined(shard, ROLE_WAIT_SECONDS):
            raise AssertionError("shard %d: a member has not asked to join: %s" %
                                 (shard, self.rc.roles(shard)))

    def _set_whole(self, shard):
        """Before a kill the shard's set must be whole again (ReplicaCluster.whole;
        a restarted member joins at the primary's next applied step, and the
        kills are planned steps apart). Before the first write no member has
        a role yet: all STARTING counts (and NONE: unreplicated shards)."""
        roles = self.rc.roles(shard)
        if all(r is not None and r[0] in ("STARTING", "NONE") for r in roles):
            return True
        return self.rc.whole(shard)[0]

    def run(self):
        with ReplicaCluster(self.nshards, self.replicas,
                            failover_ms=SERVER_FAILOVER_MS) as rc:
            self.rc = rc
            try:
                tr = self.tr = Team(rc.addresses, self.seed, self.world)
                try:
                    if self.replicas > 1:
                        for shard in range(self.nshards):
                            self._wait_joining(shard)
                    for s in range(1, self.steps + 1):
                        self._restarts(s)
                        frac = next((k.frac for k in self.kills if k.step == s), 0.5)
                        tr.step(self._hook(s), self._timed(s), frac)
                    state = tr.final_state()
                    self.failed_checkpoints = tr.failed_checkpoints
                finally:
                    tr.close()
                    self._join_stats()
                # Promotions after each set's first one: its term beyond 1
                # (a restarted member's own failover counter starts again).
                self.failovers = sum(max(r[1] for r in rc.roles(s) if r) - 1
                                     for s in range(self.nshards))
                self.roles = [rc.roles(s) for s in range(self.nshards)]
            except BaseException:
                sys.stderr.write("run seed %d kills %s\n%s\n" %
                                 (self.seed, self.kills, "\n".join(self.log)))
                raise
        return state


def random_kills(rng, nshards, steps=STEPS, restart_after=RESTART_AFTER):
    """1 or 2 kills of random points from step 2 on (the backups that asked
    to join at the job's open are copied at step 1's apply); a second one
    comes after the first's restart plus two steps (the restarted member has
    rejoined by then)."""
    kills = []
    step = rng.randint(2, 3)
    while step <= steps - 1 and len(kills) < 2:
        point = rng.choice(KILL_POINTS)
        if point == "during_checkpoint":
            step = max(CKPT_EVERY, step + (-step) % CKPT_EVERY)
            if step > steps:
                break
        kills.append(Kill(step, point, rng.randrange(nshards), frac=rng.uniform(0.1, 0.9),
                          backup=rng.random() < 0.15))
        step += restart_after + 3
    return kills


def diff(a, b):
    return [k for k in a if a[k] != b.get(k)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--replicas", default="2",
                    help="members per set, or a list to pick from per run (\"2,3\")")
    ap.add_argument("--world", type=int, default=1, help="trainers of the job (ranks)")
    ap.add_argument("--no-wait-whole", action="store_true",
                    help="fire each kill whatever the set's state (a member may be joining)")
    ap.add_argument("--join-kills", type=float, default=0.0,
                    help="chance that a restarted member is killed again while JOINING")
    args = ap.parse_args()
    choices = [int(x) for x in args.replicas.split(",")]
    os.environ.setdefault("ZSHARD_SERVER_BIN", os.path.join(
        replica_cluster.SOURCE_DIR, "build", "server", "zshard-server"))
    # SIGTERM (a timeout's) unwinds like ^C: the clusters stop their servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rng = random.Random(args.seed)
    refs = {}
    runs = kills = failovers = join_kills = documented = 0
    bad, join_ms, drops = [], [], 0
    t0 = time.monotonic()
    for i in range(args.runs):
        seed = rng.randrange(1 << 30)
        model_seed = seed % 4  # a few models, so the references are reused
        if model_seed not in refs:
            refs[model_seed] = reference(model_seed, args.shards, world=args.world)
        want, calib = refs[model_seed]
        plan = random_kills(random.Random(seed), args.shards)
        replicas = random.Random(seed).choice(choices)
        run = Run(model_seed, args.shards, plan, calib, replicas=replicas, world=args.world,
                  wait_whole=not args.no_wait_whole, join_kill_rate=args.join_kills)
        try:
            got = run.run()
            d = diff(want, got)
            verdict = "bit-identical" if not d else "DIFFERS in %s" % d[:4]
        except zshard.Error as e:
            # A set that lost every member holding its state (a kill before
            # the set was whole again): the trainers are told to restore
            # (docs/OPERATIONS.md, "Replica sets").
            if e.name in ("ZS_EBEHIND", "ZS_ENOTOPEN", "EBEHIND", "ENOTOPEN"):
                d, verdict = [], "documented error %s: %s" % (e.name, str(e)[:200])
                documented += 1
            else:
                d = ["error: %s: %s" % (e.name, e)]
                verdict = "FAILED: %s" % d[0]
        except Exception as e:  # noqa: BLE001 - the summary counts it
            d = ["error: %s: %s" % (type(e).__name__, e)]
            verdict = "FAILED: %s" % d[0]
        join_kills += run.join_kills
        join_ms += run.join_ms
        drops += len(run.drops_after_join)
        runs += 1
        kills += sum(1 for k in plan if k.victim is not None)
        failovers += getattr(run, "failovers", 0)
        landed = ["%s%s" % (k, "" if k.landed is None else (" in" if k.landed else " after"))
                  for k in plan]
        print("run %2d seed %d R=%d W=%d kills %s join-kills %d joins %d drops-after-join %d%s: "
              "%s (%.0f s)" %
              (i + 1, seed, replicas, args.world, landed, run.join_kills, len(run.join_ms),
               len(run.drops_after_join),
               " (%s)" % run.drops_after_join[:2] if run.drops_after_join else "", verdict,
               time.monotonic() - t0), flush=True)
        if d:
            bad.append((i + 1, seed, d[:4]))
    js = sorted(join_ms)
    print("summary: runs %d, kills %d, kills during joins %d, failovers %d, joins %d "
          "(join time median %s ms, max %s ms), drops after a join %d, documented errors %d, "
          "failed or differing %d, all bit-identical or documented %s (%.0f s)" %
          (runs, kills, join_kills, failovers, len(js), js[len(js) // 2] if js else "-",
           js[-1] if js else "-", drops, documented, len(bad), "yes" if not bad else "no",
           time.monotonic() - t0))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
