#!/usr/bin/python3
"""Where a step's time went, from the traces of `tests/bench/netsim --trace DIR`.

    netsim.d/timeline.py DIR [--json]

Every zshard run of netsim's W = 4 set left DIR/<seq>-<run>-s<k>.<pid>.trace
(shard k; -s.<pid> where the shards share one prefix) and
DIR/<seq>-<run>-t.<pid>.trace (each trainer): one record per
piece event (common/base/trace.h), on the host's one monotonic clock. For
every run and measured step (the first step is the warm-up) this prints, in
seconds from the step's first push (median over the measured steps):

  push_in_last   the last contribution in at any shard: the push phase as the
                 shards saw it (the trainers' acknowledgements come later)
  ready_last     the last piece complete, applied_last the last applied
  pull_in_med / pull_in_last  when the pulls' requests reached the shards
  pull_out_last  the last answer handed to a connection's writer
  pull_done_last the last piece in at a trainer: the step's end
  spread_med / spread_max  per piece, from its first contribution to its
                 last: how far apart the four trainers' pushes of it arrive
  apply_med / apply_max  per piece, from complete to applied
  wait_med / wait_max    per piece and pull, from applied (or the request's
                 arrival, if later) to its answer handed to the writer
  fly_med / fly_max      per piece and trainer, from the answer handed to the
                 writer to the piece in at the trainer
  pulled_at_push_end     the share of the pull answers handed to the writers
                 by push_in_last: what the down links could carry while the
                 pushes went up

With --json one object per run on stdout instead.
"""
import glob
import json
import os
import re
import statistics
import sys
from collections import defaultdict

PUSH_IN, READY, APPLIED, PULL_IN, PULL_GO, PULL_OUT = 1, 2, 3, 4, 5, 6
C_PUSH, C_PUSH_ACK, C_PULL, C_PULL_DONE = 16, 17, 18, 19


def read_trace(path):
    """The records of one trace file as (ns, kind, step, tensor, slice, who)."""
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 6:
                continue  # a record cut off at exit
            out.append(tuple(int(x) for x in parts))
    return out


def runs_in(d):
    """{run name: {"shards": [records of shard k], "trainers": [records]}}."""
    runs = defaultdict(lambda: {"shards": {}, "trainers": []})
    for path in sorted(glob.glob(os.path.join(d, "*.trace"))):
        # Shard k's prefix ends in -s<k>; shards that share a prefix (-s)
        # are told apart by their pids.
        m = re.match(r"(.*)-(s(\d*)|t)\.(\d+)\.trace$", os.path.basename(path))
        if not m:
            continue
        run = runs[m.group(1)]
        if m.group(3) is not None:
            run["shards"][int(m.group(3) or m.group(4))] = read_trace(path)
        else:
            run["trainers"].append(read_trace(path))
    return runs


def q(v, f):
    """The value at quantile f of v (nearest rank), or None."""
    if not v:
        return None
    v = sorted(v)
    return v[min(len(v) - 1, int(f * len(v)))]


def step_figures(shards, trainers, step):
    """The figures of one step (see the module's text), in seconds."""
    cp = [r[0] for t in trainers for r in t if r[1] == C_PUSH and r[2] == step]
    if not cp:
        return None
    t0 = min(cp)
    sec = lambda ns: (ns - t0) / 1e9  # noqa: E731
    push_in = defaultdict(list)  # (shard, tensor, slice) -> times
    ready, applied, pull_in, pull_out = {}, {}, defaultdict(list), defaultdict(list)
    for k, recs in shards.items():
        for ns, kind, st, tensor, sl, who in recs:
            key = (k, tensor, sl)
            if kind == PUSH_IN and st == step:
                push_in[key].append(ns)
            elif kind == READY and st == step:
                ready[key] = ns
            elif kind == APPLIED and st == step:
                applied[key] = ns
            elif kind == PULL_IN and st == step:
                pull_in[key].append(ns)
            elif kind == PULL_OUT and st == step:
                pull_out[key].append(ns)
    done = [r[0] for t in trainers for r in t if r[1] == C_PULL_DONE and r[2] == step]
    acks = [r[0] for t in trainers for r in t if r[1] == C_PUSH_ACK and r[2] == step]
    if not push_in or not done:
        return None
    push_in_last = max(max(v) for v in push_in.values())
    spread = [(max(v) - min(v)) / 1e9 for v in push_in.values()]
    apply_s = [(applied[k] - ready[k]) / 1e9 for k in applied if k in ready]
    wait = []
    for key, outs in pull_out.items():
        ins = sorted(pull_in.get(key, []))
        for i, o in enumerate(sorted(outs)):
            start = max(applied.get(key, 0), ins[i] if i < len(ins) else 0)
            wait.append((o - start) / 1e9)
    # The answer handed over for (tensor, slice) against the piece's arrival
    # at each trainer: matched in time order, piece by piece.
    outs_by_piece = defaultdict(list)
    for (k, tensor, sl), v in pull_out.items():
        outs_by_piece[(tensor, sl)] += v
    done_by_piece = defaultdict(list)
    for t in trainers:
        for ns, kind, st, tensor, sl, who in t:
            if kind == C_PULL_DONE and st == step:
                done_by_piece[(tensor, sl)].append(ns)
    fly = []
    for key, ds in done_by_piece.items():
        for o, d in zip(sorted(outs_by_piece.get(key, [])), sorted(ds)):
            fly.append((d - o) / 1e9)
    all_out = [ns for v in pull_out.values() for ns in v]
    all_in = [ns for v in pull_in.values() for ns in v]
    r3 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {
        "push_in_last": r3(sec(push_in_last)),
        "push_ack_last": r3(sec(max(acks))) if acks else None,
        "ready_last": r3(sec(max(ready.values()))) if ready else None,
        "applied_last": r3(sec(max(applied.values()))) if applied else None,
        "pull_in_med": r3(sec(q(all_in, 0.5))) if all_in else None,
        "pull_in_last": r3(sec(max(all_in))) if all_in else None,
        "pull_out_last": r3(sec(max(all_out))) if all_out else None,
        "pull_done_last": r3(sec(max(done))),
        "spread_med": r3(q(spread, 0.5)), "spread_max": r3(max(spread)),
        "apply_med": r3(q(apply_s, 0.5)), "apply_max": r3(max(apply_s) if apply_s else None),
        "wait_med": r3(q(wait, 0.5)), "wait_max": r3(max(wait) if wait else None),
        "fly_med": r3(q(fly, 0.5)), "fly_max": r3(max(fly) if fly else None),
        "pulled_at_push_end": r3(sum(1 for ns in all_out if ns <= push_in_last) / len(all_out))
        if all_out else None,
    }


def run_figures(run):
    """The median over the run's measured steps of every step figure."""
    steps = sorted({r[2] for t in run["trainers"] for r in t if r[1] == C_PUSH})
    per = [f for f in (step_figures(run["shards"], run["trainers"], s) for s in steps[1:]) if f]
    if not per:
        return None
    out = {"steps": len(per)}
    for key in per[0]:
        v = [p[key] for p in per if p[key] is not None]
        out[key] = round(statistics.median(v), 4) if v else None
    return out


def main():
    args = sys.argv[1:]
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if len(args) != 1 or not os.path.isdir(args[0]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = runs_in(args[0])
    if not runs:
        print("timeline.py: no trace in %s (netsim --trace DIR writes them)" % args[0],
              file=sys.stderr)
        return 1
    for name in sorted(runs):
        f = run_figures(runs[name])
        if f is None:
            print("%s: no whole step in its traces" % name, file=sys.stderr)
            continue
        if as_json:
            print(json.dumps(dict(f, run=name)))
        else:
            print("%s (%d steps, seconds from the step's first push, medians over steps)" %
                  (name, f.pop("steps")))
            for k, v in f.items():
                print("  %-20s %s" % (k, v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
