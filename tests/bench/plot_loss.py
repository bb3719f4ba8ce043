#!/usr/bin/python3
"""Draws training-loss curves from the logs of the examples (zshard-mlp and
client/examples/train_gpt.py print "step S loss L ..." lines).

    /usr/bin/python3 tests/bench/plot_loss.py --out docs/perf/int8-digits.png \\
        --title "digits MLP" bf16=mlp-bf16.log "int8 + error feedback"=mlp-int8.log ...

Each LABEL=LOG argument is one curve. A curve of many points is also drawn
as a moving average over --smooth steps (default 1: none), so that the
difference between curves is not hidden by the noise of single batches.
Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE = re.compile(r"^step (\d+) loss ([0-9.]+)")
STYLES = ["-", "--", ":", "-."]


def losses(path):
    steps, values = [], []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                steps.append(int(m.group(1)))
                values.append(float(m.group(2)))
    return steps, values


def smooth(values, k):
    if k <= 1:
        return values
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--out", required=True)
    a.add_argument("--title", default="")
    a.add_argument("--smooth", type=int, default=1)
    a.add_argument("--logy", action="store_true", help="logarithmic loss axis")
    a.add_argument("curves", nargs="+", metavar="LABEL=LOG")
    args = a.parse_args()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, c in enumerate(args.curves):
        label, path = c.split("=", 1)
        steps, values = losses(path)
        if not steps:
            raise SystemExit("plot_loss.py: no 'step S loss L' lines in %s" % path)
        ax.plot(steps, smooth(values, args.smooth), STYLES[i % len(STYLES)], label=label,
                linewidth=1.4)
    if args.logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss" + (" (moving average of %d steps)" % args.smooth
                                     if args.smooth > 1 else ""))
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
