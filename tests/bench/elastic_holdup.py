"""How long the survivors are held up when a trainer dies (issue 26): runs
tests/python/test_elastic.py's three-trainer job (two shards,
--trainer-timeout-ms 1000, rank 2 SIGKILLed at step 3 in each of the given
modes) and prints each survivor's zs_step time per step, so that the step
the kill happened in can be compared with the others and with the timeout
(goal: at most the timeout plus one step).

    ZSHARD_SERVER_BIN=build/server/zshard-server ZSHARD_PYTHONPATH=build/python \\
      /usr/bin/python3 tests/bench/elastic_holdup.py [--runs N] [--transport data|grpc]
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
import test_elastic as te  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--transport", default="data", choices=("data", "grpc"))
    ap.add_argument("--modes", default="before,during")
    args = ap.parse_args()
    print("timeout_ms=%d W=%d kill_step=%d transport=%s" % (te.TIMEOUT_MS, te.W, te.K,
                                                             args.transport))
    for mode in args.modes.split(","):
        held, others = [], []
        for _ in range(args.runs):
            logs = te.run(args.transport, mode)
            for rank in range(te.W):
                if rank == te.VICTIM:
                    continue
                for step, _, _, ms in logs[rank]["steps"]:
                    (held if step == te.K else others).append(ms)
        print("mode=%-7s kill-step zs_step ms: median %.1f max %.1f | other steps: median %.1f "
              "max %.1f (n=%d)" % (mode, statistics.median(held), max(held),
                                   statistics.median(others), max(others), len(held)))


if __name__ == "__main__":
    main()
