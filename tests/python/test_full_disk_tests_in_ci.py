"""The full-disk tests fail, not skip, in a CI that cannot mount a tmpfs.

tests/common/privileged.h decides: a test that needs root (it mounts a small
tmpfs to fill a disk) skips where it cannot mount one, unless CI is set (as
CI services set it) or ZSHARD_TEST_PRIVILEGED=1 (scripts/test as root), where
it fails with a sentence that says why; ZSHARD_TEST_PRIVILEGED=0 is a CI's
explicit, visible choice to skip. These tests run the real full-disk test of
tests/unit/test_ckpt.c without the right to mount (CAP_SYS_ADMIN dropped from
the bounding set when this runs as root) under each setting.
"""
import os
import shutil
import subprocess

import pytest

SERVER = os.environ.get("ZSHARD_SERVER_BIN", "")
BUILD = os.path.dirname(os.path.dirname(SERVER)) if SERVER else ""
TEST_CKPT = os.path.join(BUILD, "tests", "test_ckpt")
FULL_DISK = "full_disk_fails_clearly_and_keeps_the_previous_checkpoint"


def run_unprivileged(extra_env):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "ZSHARD_TEST_PRIVILEGED")}
    env.update(extra_env)
    env["ZS_TEST_FILTER"] = FULL_DISK
    cmd = [TEST_CKPT]
    if os.geteuid() == 0:
        # As root the mount would succeed: take the capability away.
        cmd = [shutil.which("setpriv") or "/usr/bin/setpriv", "--bounding-set=-sys_admin",
               "--inh-caps=-sys_admin", "--"] + cmd
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout + r.stderr


@pytest.fixture(autouse=True)
def _binary():
    assert os.path.isfile(TEST_CKPT), f"{TEST_CKPT} not built (ZSHARD_SERVER_BIN={SERVER!r})"


def test_in_ci_a_full_disk_test_that_cannot_mount_fails_saying_why():
    rc, out = run_unprivileged({"CI": "true"})
    assert rc != 0, out
    assert "cannot mount a tmpfs" in out
    assert "CI is set: this test is required, not skipped" in out
    assert "ZSHARD_TEST_PRIVILEGED=0 to skip it on purpose" in out
    assert "[  FAILED  ] " + FULL_DISK in out


def test_with_zshard_test_privileged_1_it_fails_too():
    rc, out = run_unprivileged({"ZSHARD_TEST_PRIVILEGED": "1"})
    assert rc != 0, out
    assert "ZSHARD_TEST_PRIVILEGED=1: this test is required, not skipped" in out


def test_outside_ci_it_skips_and_says_so():
    rc, out = run_unprivileged({})
    assert rc == 0, out
    assert "skipped (neither CI nor ZSHARD_TEST_PRIVILEGED=1 requires it)" in out
    assert "[  SKIPPED ] " + FULL_DISK in out


def test_a_ci_may_skip_it_only_by_saying_so():
    for ci in ("true", "1"):
        rc, out = run_unprivileged({"CI": ci, "ZSHARD_TEST_PRIVILEGED": "0"})
        assert rc == 0, out
        assert "[  SKIPPED ] " + FULL_DISK in out
    # CI=false is no CI.
    rc, out = run_unprivileged({"CI": "false"})
    assert rc == 0, out
    assert "[  SKIPPED ] " + FULL_DISK in out
