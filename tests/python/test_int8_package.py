"""int8 blocks from the zshard package (no torch).

A client with push_dtype="int8", pull_dtype="int8" and error_feedback=1,
and a param group of its own in bf16, trains a tensor split over two shards
and a small one: pulls give every piece the INT8_BLOCK round trip of the
weights (blocks restarting at each slice) and the bf16 group its bf16
rounding, and after two SGD steps the shards' fp32 masters are, bit for bit,
what the format's specification (the numpy codec of test_grpc_interop.py)
and error feedback predict: the second push carries the first one's
residual (in the bf16 group too).

Run with Debian's interpreter (CTest does, through pytest):
/usr/bin/python3 -m pytest -q tests/python/test_int8_package.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import numpy as np  # noqa: E402
import torch  # noqa: E402

import zshard  # noqa: E402
from test_grpc_interop import int8_block_decode, int8_block_encode  # noqa: E402


def round_trip(c, tensor, x):
    """x through INT8_BLOCK piece by piece, as the client and shards cut it."""
    out = np.empty_like(x)
    for _, offset, numel in c.tensor_slices(tensor):
        piece = x[offset:offset + numel]
        out[offset:offset + numel] = int8_block_decode(int8_block_encode(piece), numel)
    return out


def bf16(x):
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


class Int8Package(unittest.TestCase):

    def test_int8_pulls_pushes_and_error_feedback_follow_the_specification(self):
        rng = np.random.default_rng(12)
        a0 = rng.standard_normal(5000, dtype=np.float32)
        b0 = rng.standard_normal(100, dtype=np.float32)
        grads = [(rng.standard_normal(5000, dtype=np.float32) * 1e-2,
                  rng.standard_normal(100, dtype=np.float32) * 1e-2) for _ in range(2)]
        with zshard_servers.Shards(2) as shards:
            with zshard.Client(shards.addresses, split_threshold=1000, push_dtype="int8",
                               pull_dtype="int8", error_feedback=1, job="int8-package",
                               open_mode="create") as c:
                c.add_group("sgd")
                c.add_group("sgd", push_dtype="bf16", pull_dtype="bf16")
                a = c.add_tensor("a", 5000, group=0)
                b = c.add_tensor("b", 100, group=1)
                c.open_job([a0, b0])
                self.assertEqual(len(c.tensor_slices(a)), 2)

                # An int8 buffer is refused: int8 is a wire dtype.
                with self.assertRaises(zshard.Error) as cm:
                    c.pull(a, np.empty(5200, np.int8), dtype=zshard.INT8_BLOCK).wait()
                self.assertEqual(cm.exception.status, zshard.EDTYPE)

                master_a, master_b = a0.copy(), b0.copy()
                resid, resid_b = np.zeros_like(a0), np.zeros_like(b0)
                for step, (ga, gb) in enumerate(grads, 1):
                    x, y = np.empty_like(a0), np.empty_like(b0)
                    c.pull(a, x).wait()
                    c.pull(b, y).wait()
                    self.assertTrue(np.array_equal(x, round_trip(c, a, master_a)),
                                    "step %d: the int8 pull of a" % step)
                    self.assertTrue(np.array_equal(y, bf16(master_b)),
                                    "step %d: the bf16 pull of b" % step)
                    c.push(a, ga).wait()
                    c.push(b, gb).wait()
                    r = c.step(lr=1.0)
                    self.assertTrue(r.applied)
                    # What the shards received: the quantized gradient plus
                    # the residual carried from the previous push.
                    v = ga + resid
                    sent = round_trip(c, a, v)
                    resid = v - sent
                    master_a = master_a - sent
                    # Error feedback covers every lossy push of an fp32
                    # buffer: the bf16 group's too.
                    vb = gb + resid_b
                    resid_b = vb - bf16(vb)
                    master_b = master_b - bf16(vb)
                    got_a, got_b = np.empty_like(a0), np.empty_like(b0)
                    c.state_read(a, zshard.MASTER, got_a)
                    c.state_read(b, zshard.MASTER, got_b)
                    self.assertTrue(np.array_equal(got_a, master_a),
                                    "step %d: a's master is not the prediction" % step)
                    self.assertTrue(np.array_equal(got_b, master_b),
                                    "step %d: b's master is not the prediction" % step)


if __name__ == "__main__":
    unittest.main(verbosity=2)
