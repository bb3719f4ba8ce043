#!/usr/bin/python3
"""Draws the figures of the emulated network (tests/bench/netsim) from its JSON lines.

    /usr/bin/python3 tests/bench/plot_netsim.py RUN.json [MORE.json ...] [--label L ...]
                                                [--scaling SCALING.json] [--out DIR]

Writes into DIR (default docs/perf):
  netsim.png          every figure issue 11 sets a goal for, as its ratio to its
                      limit (throughput over B; a step's time over its bound),
                      one bar per run given, with the goal drawn on each row;
                      each run's label says how busy the machine was during
                      the four-trainer step (cpu_busy_zshard_W4_N4);
  netsim-scaling.png  with --scaling: the gated step for every W and N of a
                      `netsim --scaling` run against what `zshard estimate
                      --link-gbit` predicts (gated, and overlapped: the bound
                      a pipelined step could reach) and the ring's time.
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (metric prefix, what the bar shows, goal, "<=" when lower is better).
# Throughputs are drawn as limit / value, so that every bar reads the same
# way: 1 is the limit, shorter is better.
ROWS = [
    ("push_W1_N4", "push, W1 N4: B / throughput", 1 / 0.9),
    ("pull_W1_N4", "pull, W1 N4: B / throughput", 1 / 0.9),
    ("step_zshard_W4_N4", "gated step, W4 N4 / bound", 1.15),
    ("step_pipelined_W4_N4", "pipelined step, W4 N4 / bound", 1.25),
    ("step_overlap_W4_N4", "overlapped step, W4 N4 / bound", 1.1),
    ("speedup_vs_ring_W4", "1.3 x ring time / pipelined step", 1.0),
]


def load(path):
    rows = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit("%s:%d: not JSON: %s" % (path, n, e))
            if r.get("bench") == "netsim":
                rows[r["metric"]] = r
    return rows


def find(rows, prefix):
    """The row whose metric is prefix_<B>gbit (any B)."""
    for m, r in rows.items():
        if m.startswith(prefix + "_") and m.endswith("gbit") and "W" in prefix:
            rest = m[len(prefix) + 1:]
            if rest[:-4].replace("p", "").isdigit():
                return r
    return None


def bar_value(prefix, r):
    if prefix.startswith(("push_", "pull_")):
        return r["limit"] / r["value"]
    if prefix.startswith("speedup_"):
        return 1.3 / r["value"]
    return r["ratio"]


def plot_goals(runs, labels, out):
    fig, ax = plt.subplots(figsize=(9, 4.8))
    height = 0.8 / len(runs)
    ymax = 1.0
    for k, (rows, label) in enumerate(zip(runs, labels)):
        ys, xs = [], []
        for i, (prefix, _, _) in enumerate(ROWS):
            r = find(rows, prefix)
            if r is None:
                continue
            ys.append(i + (k - (len(runs) - 1) / 2) * height)
            xs.append(bar_value(prefix, r))
        busy = find(rows, "cpu_busy_zshard_W4_N4")
        if busy:
            label = "%s (machine %.0f %% busy in the W4 step)" % (label, 100 * busy["value"])
        ax.barh(ys, xs, height=height * 0.9, label=label)
        for y, x in zip(ys, xs):
            ax.text(x, y, " %.2f" % x, va="center", fontsize=7)
        ymax = max([ymax] + xs)
    for i, (_, _, goal) in enumerate(ROWS):
        ax.plot([goal, goal], [i - 0.45, i + 0.45], color="black", lw=1.5)
    ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
    ax.set_yticks(range(len(ROWS)))
    ax.set_yticklabels([t for _, t, _ in ROWS], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, ymax * 1.15)
    ax.set_xlabel("ratio to the limit (1 = the link's limit; black bar = the goal; shorter is better)")
    ax.set_title("tests/bench/netsim: 16M parameters, bf16, 1 Gbit/s emulated links", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = os.path.join(out, "netsim.png")
    fig.savefig(path, dpi=110)
    return path


def plot_scaling(rows, out):
    cells = sorted((r["trainers"], r["shards"], r) for m, r in rows.items()
                   if m.startswith("step_zshard_W") and r.get("mode") == "scaling")
    if not cells:
        sys.exit("no step_zshard_W<W>_N<N> rows of a --scaling run")
    fig, ax = plt.subplots(figsize=(9, 4.2))
    x = range(len(cells))
    w = 0.2
    ax.bar([i - 1.5 * w for i in x], [r["value"] for _, _, r in cells], w, label="measured step")
    ax.bar([i - 0.5 * w for i in x], [r["limit"] for _, _, r in cells], w,
           label="estimate, gated (push then pull)")
    ax.bar([i + 0.5 * w for i in x], [r["estimate_overlap_s"] for _, _, r in cells], w,
           label="estimate, overlapped (pipelined)")
    ax.bar([i + 1.5 * w for i in x], [r["estimate_ring_s"] for _, _, r in cells], w,
           label="estimate, ring all-reduce")
    for i, (_, _, r) in zip(x, cells):
        ax.text(i - 1.5 * w, r["value"], "%.2f" % r["ratio"], ha="center", va="bottom",
                fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels(["W%d N%d" % (t, s) for t, s, _ in cells])
    ax.set_ylabel("seconds per step")
    ax.set_title("netsim --scaling: the gated step against zshard estimate --link-gbit "
                 "(label: measured / gated estimate)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = os.path.join(out, "netsim-scaling.png")
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", help="JSON lines of tests/bench/netsim --json")
    ap.add_argument("--label", action="append", default=[], help="one per run, in order")
    ap.add_argument("--scaling", help="JSON lines of tests/bench/netsim --scaling --json")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "..", "docs", "perf"))
    a = ap.parse_args()
    if not a.runs and not a.scaling:
        ap.error("give at least one run or --scaling")
    if a.label and len(a.label) != len(a.runs):
        ap.error("give one --label per run, or none")
    os.makedirs(a.out, exist_ok=True)
    if a.runs:
        labels = a.label or [os.path.basename(p) for p in a.runs]
        print(plot_goals([load(p) for p in a.runs], labels, a.out))
    if a.scaling:
        print(plot_scaling(load(a.scaling), a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
