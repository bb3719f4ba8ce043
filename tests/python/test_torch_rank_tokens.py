"""A real two-trainer run (zshard.torch, W=2) where each trainer holds its own
rank token: the shards started with --rank-key-file and
--require-rank-tokens accept each rank's pushes, and the weights come out
bit for bit as in test_torch_two_trainers (torch fed the rank-ordered sum).

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_rank_tokens.py
"""

import hashlib
import hmac
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import test_torch_two_trainers as two  # noqa: E402
import torch  # noqa: E402


def _secret_file(d, name, text):
    path = os.path.join(d, name)
    with open(path, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)
    return path


def mint(key, job, rank):
    mac = hmac.new(key.encode(), ("zsr1|%s|%d|0" % (job, rank)).encode(),
                   hashlib.sha256).hexdigest()
    return "zsr1.%s.%d.0.%s" % (job, rank, mac)


class RankTokens(unittest.TestCase):

    def test_two_trainers_with_rank_tokens_train_as_without(self):
        tmp = tempfile.mkdtemp(prefix="zshard-ranktok-")
        self.addCleanup(shutil.rmtree, tmp, True)
        key = "rank-key-" + os.urandom(16).hex()
        args = ["--token-file", _secret_file(tmp, "trainer", "trainer-" + os.urandom(16).hex()),
                "--admin-token-file", _secret_file(tmp, "admin", "admin-" + os.urandom(16).hex()),
                "--rank-key-file", _secret_file(tmp, "key", key), "--require-rank-tokens"]
        with zshard_servers.Shards(2, extra_args=args) as shards:
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                           ZSHARD_TOKEN=mint(key, "two", rank))
                env.pop("ZSHARD_TOKEN_FILE", None)
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(two.__file__), "worker", shards.addresses,
                     os.path.join(tmp, "rank%d.pt" % rank)], env=env))
            try:
                codes = [p.wait(300) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait(30)
        self.assertEqual(codes, [0, 0])

        ref = two.make_model()
        opt = two.make_opt(ref)
        for step in range(1, two.STEPS + 1):
            grads = []
            for rank in range(2):
                m = two.copy.deepcopy(ref)
                two.loss_of(m, step, rank).backward()
                grads.append([p.grad for p in m.parameters()])
            for p, g0, g1 in zip(ref.parameters(), *grads):
                p.grad = g0 + g1
            opt.step()
        want = dict(ref.named_parameters())
        for rank in range(2):
            got = torch.load(os.path.join(tmp, "rank%d.pt" % rank))
            for n, w in got.items():
                self.assertTrue(torch.equal(w, want[n].detach()), "rank %d: %s" % (rank, n))


if __name__ == "__main__":
    torch.set_num_threads(1)
    unittest.main(verbosity=2)
