#!/usr/bin/python3
"""Draws the benchmark figures from the JSON lines of tests/bench/run.

    /usr/bin/python3 tests/bench/plot.py RESULTS.json [MORE.json ...] [--out DIR]
                                         [--markdown]

Writes into DIR (default docs/perf):
  transfer.png  push and pull throughput against size, both transports and
                1/2/4 shards, with the raw TCP bandwidth measured in the same
                run (the same number of connections) for reference;
  step.png      the cost of a whole step per parameter against model size, per
                shard count and transport, with the loopback bound.
With --markdown it also prints the tables of docs/PERFORMANCE.md (every
figure with its limit and ratio) on stdout; with --compare it draws nothing
and prints each figure's ratio in every given run, side by side. Needs matplotlib (Debian:
python3-matplotlib).
"""
import argparse
import collections
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"grpc": "tab:blue", "data": "tab:orange", "tcp": "0.45"}
MARKERS = {1: "o", 2: "s", 4: "^", 8: "D"}


def load(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit("%s:%d: not JSON: %s" % (p, n, e))
    return rows


def size_label(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            v = b / div
            return ("%d %s" if v == int(v) else "%.1f %s") % (v, unit)
    return "%d B" % b


def plot_transfer(rows, out):
    t = [r for r in rows if r.get("bench") == "transfer"]
    if not t:
        return None
    # (op, transport, shards) -> {bytes: GB/s}; raw TCP by connection count.
    series = collections.defaultdict(dict)
    raw = collections.defaultdict(dict)
    for r in t:
        if r["transport"] == "tcp":
            raw[int(r["conns"])][int(r["bytes"])] = r["value"]
        else:
            series[(r["op"], r["transport"], int(r["shards"]))][int(r["bytes"])] = r["value"]
    sizes = sorted({int(r["bytes"]) for r in t})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, op in zip(axes, ("push", "pull")):
        for (o, tr, n), pts in sorted(series.items()):
            if o != op:
                continue
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], color=COLORS[tr], marker=MARKERS.get(n, "x"),
                    alpha=0.45 + 0.55 * (n / 4 if n <= 4 else 1),
                    label="%s, %d shard%s" % ("data plane" if tr == "data" else "gRPC", n,
                                               "" if n == 1 else "s"))
        for conns, pts in sorted(raw.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], color=COLORS["tcp"], linestyle="--",
                    marker=MARKERS.get(conns, "x"), markerfacecolor="none",
                    label="raw TCP, %d conn%s" % (conns, "" if conns == 1 else "s"))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_label(s) for s in sizes])
        ax.set_xlabel("bytes of bf16 per %s phase" % op)
        ax.set_title("%s throughput, loopback" % op)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].set_ylim(bottom=0)
    axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    path = os.path.join(out, "transfer.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_step(rows, out):
    s = [r for r in rows if r.get("bench") == "scaling"]
    if not s:
        return None
    series = collections.defaultdict(dict)
    bound = collections.defaultdict(dict)
    for r in s:
        key = (r["transport"], int(r["shards"]))
        series[key][int(r["params"])] = r["value"]
        bound[(int(r["shards"]), int(r["conns"]))][int(r["params"])] = r["limit"]
    params = sorted({int(r["params"]) for r in s})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for (tr, n), pts in sorted(series.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], color=COLORS[tr], marker=MARKERS.get(n, "x"),
                label="%s, N=%d" % ("data plane" if tr == "data" else "gRPC", n))
    for (n, conns), pts in sorted(bound.items()):
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], color=COLORS["tcp"], linestyle="--",
                marker=MARKERS.get(n, "x"), markerfacecolor="none",
                label="loopback bound, N=%d (%d conns)" % (n, conns))
    ax.set_xscale("log", base=2)
    ax.set_xticks(params)
    ax.set_xticklabels(["%dM" % (p >> 20) for p in params])
    ax.set_xlabel("parameters (W = 2 trainers)")
    ax.set_ylabel("step time per parameter (ns)")
    ax.set_ylim(bottom=0)
    ax.set_title("one step without compute: flat = cost linear in size")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    path = os.path.join(out, "step.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def fmt(v, digits=3):
    if v is None:
        return "-"
    if abs(v) >= 100:
        return "%.0f" % v
    return ("%%.%dg" % digits) % v


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def markdown(rows):
    by = collections.defaultdict(list)
    for r in rows:
        by[r["bench"]].append(r)
    parts = []
    if by["machine"]:
        parts.append("Load average (1 min) of the machine: " + ", ".join(
            "%s %s" % (r["when"], fmt(r["value"])) for r in by["machine"]) + ".")
    if by["optim"]:
        parts.append("### optim\n\n" + table(
            ["figure", "median", "unit", "limit (paired stream)", "ratio", "best round: ratio"],
            [[r["metric"], fmt(r["value"]), r["unit"], fmt(r["limit"]), fmt(r["ratio"]),
              "%s / %s = %s" % (fmt(r["best"]), fmt(r["limit_best"]), fmt(r["ratio_best"]))
              if "best" in r else "-"]
             for r in by["optim"]]))
    if by["transfer"]:
        raw = {(int(r["conns"]), int(r["bytes"])): r["value"]
               for r in by["transfer"] if r["transport"] == "tcp"}
        fig = {(r["transport"], r["op"], int(r["shards"]), int(r["bytes"])): r
               for r in by["transfer"] if r["transport"] != "tcp"}
        keys = sorted({(k[2], k[3]) for k in fig})
        lines = []
        for n, b in keys:
            cells = [str(n), size_label(b)]
            conns = None
            for tr in ("grpc", "data"):
                for op in ("push", "pull"):
                    r = fig.get((tr, op, n, b))
                    if not r:
                        cells.append("-")
                    elif "ratio_best" in r:
                        cells.append("%s (%s; best %s)" % (fmt(r["value"]), fmt(r["ratio"], 2),
                                                          fmt(r["ratio_best"], 2)))
                    else:
                        cells.append("%s (%s)" % (fmt(r["value"]), fmt(r["ratio"], 2)))
                    conns = int(r["conns"]) if r else conns
            cells.insert(2, fmt(raw.get((conns, b))))
            lines.append(cells)
        parts.append("### transfer (GB/s, median; ratio to the paired raw TCP pumps; the best "
                     "round's ratio)\n\n" + table(
            ["shards", "size", "raw TCP", "gRPC push", "gRPC pull", "data push", "data pull"],
            lines))
    # The percentiles; the context-switch figures beside them have none.
    quantiles = [r for r in by["latency"] if "quantile" in r]
    if quantiles:
        lat = {(r["op"], r["metric"].rsplit("_", 1)[0][len(r["op"]) + 1:], r["quantile"]): r
               for r in quantiles}
        names = []
        for r in quantiles:
            n = r["metric"].rsplit("_", 1)[0][len(r["op"]) + 1:]
            if n not in names:
                names.append(n)
        lines = []
        for op in ("push", "pull"):
            for n in names:
                p50, p99 = lat.get((op, n, "p50")), lat.get((op, n, "p99"))
                if not p50:
                    continue
                lines.append([op, n, fmt(p50["value"]), fmt(p50["ratio"], 2),
                              fmt(p99["value"]), fmt(p99["ratio"], 2)])
        parts.append("### latency (us; ratio to the raw TCP ping-pong)\n\n" + table(
            ["op", "client", "p50", "ratio", "p99", "ratio"], lines))
    if by["step"]:
        parts.append("### step (W = 2 trainers)\n\n" + table(
            ["N", "params", "transport", "step s", "bound s", "ratio", "best round",
             "push ms", "zs_step ms", "pull ms", "optimizer ms (sum over shards)"],
            [[int(r["shards"]), "%dM" % (int(r["params"]) >> 20), r["transport"],
              fmt(r["value"]), fmt(r["limit"]), fmt(r["ratio"], 2),
              "%s / %s = %s" % (fmt(r["best"]), fmt(r["limit_best"]), fmt(r["ratio_best"], 2))
              if "best" in r else "-", fmt(r["push_ms"]),
              fmt(r["zs_step_ms"]), fmt(r["pull_ms"]), fmt(r["apply_ms_sum"])]
             for r in by["step"]]))
    if by["scaling"]:
        sc = {(r["transport"], int(r["shards"]), int(r["params"])): r for r in by["scaling"]}
        params = sorted({k[2] for k in sc})
        lines = []
        for tr in ("grpc", "data"):
            for n in sorted({k[1] for k in sc}):
                cells = [tr, str(n)]
                for p in params:
                    r = sc.get((tr, n, p))
                    cells.append("%s (bound %s)" % (fmt(r["value"]), fmt(r["limit"])) if r else "-")
                lines.append(cells)
        parts.append("### scaling (ns per parameter per step)\n\n" + table(
            ["transport", "N"] + ["%dM" % (p >> 20) for p in params], lines))
        # Least squares of step time against parameters: a straight line
        # (fixed cost + cost per parameter) is what linear in size means.
        fits = []
        for tr in ("grpc", "data"):
            for n in sorted({k[1] for k in sc}):
                pts = [(p, sc[(tr, n, p)]["value"] * p * 1e-9) for p in params
                       if (tr, n, p) in sc]
                if len(pts) < 3:
                    continue
                xs, ys = [p for p, _ in pts], [t for _, t in pts]
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                sxx = sum((x - mx) ** 2 for x in xs)
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
                icpt = my - slope * mx
                ss = sum((y - my) ** 2 for y in ys)
                res = sum((y - icpt - slope * x) ** 2 for x, y in zip(xs, ys))
                fits.append([tr, str(n), fmt(slope * 1e9), fmt(icpt * 1e3),
                             fmt(1 - res / ss if ss > 0 else 1.0, 4)])
        if fits:
            parts.append("Straight-line fit of step time against parameters:\n\n" + table(
                ["transport", "N", "ns per parameter", "fixed ms", "R²"], fits))
    if by["memory"]:
        def met(v, r):
            if v is None:
                return "-"
            return "%s (%s)" % (fmt(v), "met" if v <= 1.1 * r["limit"] + 64 else "missed")
        parts.append("### memory (shard peak RSS, MiB)\n\n" + table(
            ["N", "params", "peak", "18Φ/N", "ratio", "goal 1.1x+64", "met",
             "peak once open", "data-plane rounds", "gRPC rounds", "resident at end"],
            [[int(r["shards"]), "%dM" % (int(r["params"]) >> 20), fmt(r["value"]),
              fmt(r["limit"]), fmt(r["ratio"]), fmt(1.1 * r["limit"] + 64),
              "yes" if r["value"] <= 1.1 * r["limit"] + 64 else "no",
              fmt(r.get("peak_after_open_mib")), met(r.get("peak_data_mib"), r),
              met(r.get("peak_grpc_mib"), r), fmt(r.get("rss_at_end_mib"))]
             for r in by["memory"]]))
    print("\n\n".join(parts))


def compare(paths):
    """The ratio of every figure in every run, side by side."""
    runs = [load([p]) for p in paths]
    order, cells = [], collections.defaultdict(dict)
    loads = []
    for i, rows in enumerate(runs):
        ld = [r["value"] for r in rows if r.get("bench") == "machine"]
        loads.append("%s-%s" % (fmt(min(ld)), fmt(max(ld))) if ld else "?")
        for r in rows:
            if r.get("bench") == "machine" or r.get("ratio") is None:
                continue
            key = (r["bench"], r["metric"])
            if key not in cells:
                order.append(key)
            cells[key][i] = r["ratio"]
    lines = []
    for key in order:
        vals = [cells[key].get(i) for i in range(len(runs))]
        got = [v for v in vals if v is not None]
        lines.append([key[0], key[1]] + [fmt(v, 2) for v in vals] +
                     ["%s-%s" % (fmt(min(got), 2), fmt(max(got), 2))])
    head = ["bench", "figure"] + ["run %d (load %s)" % (i + 1, loads[i])
                                  for i in range(len(runs))] + ["range"]
    print(table(head, lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="JSON lines from tests/bench/run --json")
    ap.add_argument("--markdown", action="store_true", help="print the tables")
    ap.add_argument("--compare", action="store_true",
                    help="print every figure's ratio in each of the given runs, side by side")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..",
                                                  "docs", "perf"))
    a = ap.parse_args()
    if a.compare:
        compare(a.json)
        return
    rows = load(a.json)
    os.makedirs(a.out, exist_ok=True)
    made = [p for p in (plot_transfer(rows, a.out), plot_step(rows, a.out)) if p]
    if not made and not a.markdown:
        sys.exit("no transfer or scaling figures in the input")
    if a.markdown:
        markdown(rows)
    else:
        for p in made:
            print(os.path.normpath(p))


if __name__ == "__main__":
    main()
