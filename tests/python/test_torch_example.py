"""client/examples/train_gpt.py runs: two trainer processes (RANK and
WORLD_SIZE set as torchrun sets them) against two real shards, a few steps.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_example.py
"""

import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(SOURCE_DIR, "client", "examples", "train_gpt.py")


class TrainGpt(unittest.TestCase):

    def test_two_ranks_train_and_print_the_time_breakdown(self):
        import zshard
        package = os.path.dirname(os.path.dirname(zshard.__file__))
        with zshard_servers.Shards(2) as shards:
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", PYTHONPATH=package)
                procs.append(subprocess.Popen(
                    [sys.executable, EXAMPLE, "--shards", shards.addresses, "--steps", "10",
                     "--layers", "1", "--dim", "32", "--ctx", "16"],
                    env=env, stdout=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=300)[0] for p in procs]
            self.assertEqual([p.returncode for p in procs], [0, 0], outs)
        self.assertIn("2 rank(s)", outs[0])
        losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", outs[0])]
        self.assertEqual(len(losses), 2, outs[0])  # steps 1 and 10
        self.assertLess(losses[1], losses[0])
        self.assertIn("pull wait", outs[0])


if __name__ == "__main__":
    unittest.main(verbosity=2)
