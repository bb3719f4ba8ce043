"""zshard.torch with release_after_forward=True holds far less memory.

Two trainer processes train the same 8-layer MLP (8.4M parameters, 34 MB of
fp32) for 3 steps, one holding its weights (release_after_forward=False),
one releasing them after forward and every gradient once pushed (True). Their
resident memory growth over the process before the model existed, sampled
after forward, after backward and after step(), is compared: the holding
trainer keeps weights and gradients (about 2 x 34 MB), the releasing one
after forward only the client's fixed cost. glibc is told to serve every allocation above 64 KiB
with mmap so that freed tensors leave the resident set at once.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_memory.py
"""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

WIDTH, LAYERS = 1024, 8


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(addresses, release):
    import zshard.torch
    torch.set_num_threads(1)
    x = torch.randn(4, WIDTH)
    base = rss_bytes()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                             addresses=addresses, wire_dtype=torch.bfloat16,
                             release_after_forward=release, prefetch=1, job="mem")
    peak = after_forward = 0
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        after_forward = max(after_forward, rss_bytes() - base)
        peak = max(peak, after_forward)
        loss.backward()
        peak = max(peak, rss_bytes() - base)
        opt.step()
        peak = max(peak, rss_bytes() - base)
    params = 4 * sum(p.numel() for p in model.parameters())
    opt.close()
    print(json.dumps({"peak_growth": peak, "after_forward": after_forward,
                      "param_bytes": params}))


class Memory(unittest.TestCase):

    def test_release_after_forward_lowers_resident_memory(self):
        growth = {}
        for release in (False, True):
            with zshard_servers.Shards(1) as shards:
                env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "worker", shards.addresses,
                     str(int(release))], env=env, check=True, stdout=subprocess.PIPE, text=True)
            growth[release] = json.loads(out.stdout.strip().splitlines()[-1])
        held, released = growth[False], growth[True]
        params = held["param_bytes"]
        sys.stderr.write("\n  RSS growth after forward / peak: holding %.1f / %.1f MB, releasing "
                         "%.1f / %.1f MB (parameters %.1f MB)\n" % (
                             held["after_forward"] / 1e6, held["peak_growth"] / 1e6,
                             released["after_forward"] / 1e6, released["peak_growth"] / 1e6,
                             params / 1e6))
        # The holding trainer has its weights, and at its peak the gradients too.
        self.assertGreater(held["after_forward"], params)
        self.assertGreater(held["peak_growth"], 1.8 * params)
        # After forward the releasing one holds no weights: what remains is
        # the client's fixed cost (threads, gRPC, conversion buffers, about
        # 15 MB here). Its peak (in backward: `prefetch` re-pulled layers and
        # the gradients whose pushes are still in flight, which depends on
        # how fast the shard answers) is only required to be lower.
        self.assertLess(released["after_forward"], held["after_forward"] - 0.75 * params)
        self.assertLess(released["peak_growth"], held["peak_growth"])

class WorkingSet(unittest.TestCase):

    def test_every_forward_holds_a_few_layers_not_the_model(self):
        """With release_after_forward, the parameters holding storage while
        each layer runs are a few layers' worth, in the first forward (which
        has no unit order yet) as in the later ones: counted, not timed."""
        import zshard.torch
        layers = 8
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(layers)])
        layer_bytes = 4 * (256 * 256 + 256)
        seen = []

        def held(module, inputs):
            # The package's own record of which parameters hold storage:
            # reading p.storage() here would go through its function mode,
            # which makes the parameter current first.
            seen.append(sum(4 * P.numel for P in opt._params if P.alloc))

        for m in model:
            m.register_forward_pre_hook(held)
        with zshard_servers.Shards(1) as shards:
            opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                     addresses=shards.addresses, wire_dtype=torch.float32,
                                     release_after_forward=True, prefetch=1, job="ws")
            try:
                for step in range(3):
                    del seen[:]
                    opt.zero_grad(set_to_none=True)
                    model(torch.randn(4, 256)).square().mean().backward()
                    opt.step()
                    self.assertEqual(len(seen), layers)
                    self.assertLessEqual(max(seen), 4 * layer_bytes, (step, seen))
            finally:
                opt.close()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3] == "1")
    else:
        unittest.main(verbosity=2)
