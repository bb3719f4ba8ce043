"""Tokens from Python: the zshard package passes token= to zs_client_options.

A shard started with --token-file refuses a client without the token
(zshard.Error EUNAUTHENTICATED, and no job is opened) and serves one that
gives it with token=; the environment's ZSHARD_TOKEN_FILE works too, through
the C library.

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_auth.py
"""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import numpy as np  # noqa: E402

import zshard  # noqa: E402

TOKEN = "python-trainer-token-0123"


def train_one_step(addresses, **options):
    """Opens a one-tensor SGD job and steps once; returns the new weights."""
    w0 = np.arange(8, dtype=np.float32)
    with zshard.Client(addresses, push_dtype="fp32", pull_dtype="fp32", job="pyauth",
                       max_retries=1, **options) as c:
        c.add_group("sgd")
        t = c.add_tensor("w", 8)
        c.open_job([w0])
        c.push(t, np.ones(8, dtype=np.float32))
        c.step(0.5)
        out = np.empty(8, dtype=np.float32)
        c.pull(t, out)
        return out


class Tokens(unittest.TestCase):

    def test_token_keyword_opens_a_job_and_no_token_is_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "token")
            with open(path, "w") as f:
                f.write(TOKEN + "\n")
            os.chmod(path, 0o600)  # others may not read a token file
            args = ["--token-file", path, "--data-listen", "off"]
            with zshard_servers.Shards(1, extra_args=args) as shards:
                saved = {k: os.environ.pop(k) for k in list(os.environ)
                         if k in ("ZSHARD_TOKEN", "ZSHARD_TOKEN_FILE")}
                try:
                    with self.assertRaises(zshard.Error) as cm:
                        train_one_step(shards.addresses)
                    self.assertEqual(cm.exception.status, zshard.EUNAUTHENTICATED)
                    with self.assertRaises(zshard.Error) as cm:
                        train_one_step(shards.addresses, token="wrong-token-0123456789")
                    self.assertEqual(cm.exception.status, zshard.EUNAUTHENTICATED)

                    out = train_one_step(shards.addresses, token=TOKEN)
                    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32) - 0.5)

                    # The environment, read by the C library: the job
                    # resumes and steps again.
                    os.environ["ZSHARD_TOKEN_FILE"] = path
                    out = train_one_step(shards.addresses)
                    np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32) - 1.0)
                finally:
                    os.environ.pop("ZSHARD_TOKEN_FILE", None)
                    os.environ.update(saved)

    def test_token_must_be_a_str(self):
        with self.assertRaises(TypeError):
            zshard.Client("127.0.0.1:1", token=1234)


if __name__ == "__main__":
    unittest.main()
