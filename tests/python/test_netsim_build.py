"""tests/bench/netsim's build tree check (issue 25, "a newcomer's run").

netsim runs its trainers with the build tree's Python package. A tree that
lacks the server, the CLI or a package this interpreter imports with its
Client used to surface deep inside a run (`module 'zshard' has no attribute
'Client'`); now netsim builds what is missing or, with --no-build, refuses
at once with a sentence that says what is missing and what to pass.
--check-build does only that check, without root. Building itself is not
run here (minutes of compiling); these are the cheap paths around it.
"""

import os
import stat
import subprocess
import sys
import tempfile
import unittest

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NETSIM = os.path.join(SRC, "tests", "bench", "netsim")


def netsim(*args):
    r = subprocess.run([sys.executable, NETSIM] + list(args), stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr


def executable(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexit 0\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


class NetsimBuildTree(unittest.TestCase):

    def test_an_empty_tree_is_refused_with_what_to_pass(self):
        with tempfile.TemporaryDirectory(prefix="zshard-netsim-build-") as tmp:
            rc, err = netsim("--check-build", "--no-build", "--build-dir", tmp)
        self.assertEqual(rc, 2, err)
        self.assertIn("no zshard-server at " + os.path.join(tmp, "server", "zshard-server"), err)
        self.assertIn("no zshard CLI", err)
        self.assertIn("Pass --build-dir", err)
        self.assertIn("--target zshard-server zshard_python zshard-cli", err)

    def test_a_package_without_client_is_named_before_any_run(self):
        # What the newcomer hit: a zshard directory that imports but is not
        # the built package (here a namespace package: no __init__.py).
        with tempfile.TemporaryDirectory(prefix="zshard-netsim-build-") as tmp:
            executable(os.path.join(tmp, "server", "zshard-server"))
            executable(os.path.join(tmp, "client", "zshard"))
            os.makedirs(os.path.join(tmp, "python", "zshard"))
            rc, err = netsim("--check-build", "--no-build", "--build-dir", tmp)
        self.assertEqual(rc, 2, err)
        self.assertNotIn("no zshard-server", err)
        self.assertIn("cannot use the Python package in " + os.path.join(tmp, "python"), err)
        self.assertIn("has no attribute 'Client'", err)
        self.assertIn("Pass --build-dir", err)

    def test_the_build_tree_of_these_tests_passes(self):
        pythonpath = os.environ.get("ZSHARD_PYTHONPATH")
        if not pythonpath:
            self.fail("ZSHARD_PYTHONPATH (set by CTest) must name the build tree's python/")
        build = os.path.dirname(pythonpath)
        rc, err = netsim("--check-build", "--no-build", "--build-dir", build)
        self.assertEqual(rc, 0, err)
        self.assertIn("has what netsim needs", err)

    def test_bad_options_are_refused(self):
        for args in (["--schedule", "zigzag"], ["--repeat", "0"], ["--socket-cc", "a;b"],
                     ["--window", "x"]):
            rc, err = netsim("--check-build", *args)
            self.assertEqual(rc, 2, (args, err))


if __name__ == "__main__":
    unittest.main(verbosity=2)
