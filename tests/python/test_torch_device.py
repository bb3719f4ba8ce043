"""zshard.torch's device seam (zshard/torch/_device.py), on the CPU.

The staged path that CUDA parameters take (a gradient cast to the wire dtype
and copied to a pinned block on a side stream, its push submitted once the
copy's event has completed; a pull landed in a block and copied to the
device on the side stream, the compute stream waiting for that copy) runs
here over FakeBackend: ordinary CPU blocks and a lazy copy stream whose
work runs only when an event after it is waited for (or polled, with
progress on). Data read before its event would be stale, so the bit-for-bit
checks below fail if the ordering is wrong.

* StagingPool: reuse, size classes, the byte bound (idle blocks freed,
  blocks waiting for an event waited for, the owner's reclaim), over-limit
  counted only when nothing can be given back.
* StagedPath's ordering: the copy stream waits for the compute stream
  before reading a gradient or writing a parameter; a staged gradient is
  not ready before its copy ran; the compute stream waits for a landing
  copy; a landed block is not reused before its copy ran.
* Training through the staged path with 2 real shards: a small transformer,
  fp32 wire, weights bit for bit plain torch.optim.AdamW's after every step
  (with and without release_after_forward, lazy and progressing copy
  streams); bf16 wire: the device-side cast gives the same weights as the
  CPU path (the library's cast), and the PCIe bytes are half of fp32's.
* The CPU path does not stage (staging_stats() all 0), and device errors
  are clear.

Run with Debian's interpreter (CTest does): /usr/bin/python3 tests/python/test_torch_device.py
"""

import copy
import os
import sys
import types
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402
from zshard.torch import _device  # noqa: E402
from zshard.torch._common import _buffer  # noqa: E402

STEPS = int(os.environ.get("ZSHARD_TEST_STEPS", "12"))
VOCAB, D, HEADS, FF, SEQ, BATCH = 40, 32, 4, 64, 10, 6


class Event:
    """An event the test completes by hand."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


class Pool(unittest.TestCase):

    def pool(self, limit):
        allocs = []

        def alloc(n):
            allocs.append(n)
            return torch.empty(n, dtype=torch.uint8)
        return _device.StagingPool(alloc, limit), allocs

    def test_blocks_are_reused_by_size_class(self):
        pool, allocs = self.pool(1 << 20)
        a = pool.acquire(5000)
        self.assertEqual(a.numel(), 8192)       # the next power of two
        pool.release(a)
        b = pool.acquire(8000)                  # same class: the same block
        self.assertIs(b, a)
        c = pool.acquire(100)                   # at least 4 KiB
        self.assertEqual(c.numel(), 4096)
        self.assertEqual(allocs, [8192, 4096])
        self.assertEqual((pool.allocs, pool.reuses), (2, 1))
        self.assertEqual(pool.held_bytes, 12288)
        self.assertEqual(pool.lent_bytes, 12288)

    def test_idle_blocks_of_other_sizes_are_freed_to_stay_under_the_limit(self):
        pool, allocs = self.pool(16384)
        a, b = pool.acquire(8192), pool.acquire(4096)
        pool.release(a)
        pool.release(b)
        c = pool.acquire(16384)                 # needs both idle blocks gone
        self.assertEqual(c.numel(), 16384)
        self.assertEqual(pool.held_bytes, 16384)
        self.assertLessEqual(pool.peak_bytes, pool.limit)
        self.assertEqual(pool.over_limit, 0)

    def test_a_block_waiting_for_its_event_is_not_reused_before_it(self):
        pool, _ = self.pool(1 << 20)
        a = pool.acquire(4096)
        ev = Event()
        pool.release(a, ev)
        b = pool.acquire(4096)                  # room under the limit: a new block
        self.assertIsNot(b, a)
        self.assertEqual(ev.waited, 0)          # and no wait for the event
        ev.done = True
        pool.release(b)
        c, d = pool.acquire(4096), pool.acquire(4096)
        self.assertEqual({id(c), id(d)}, {id(a), id(b)})
        self.assertEqual(pool.allocs, 2)

    def test_at_the_limit_the_oldest_event_is_waited_then_the_owner_reclaims(self):
        pool, _ = self.pool(8192)
        a, b = pool.acquire(4096), pool.acquire(4096)
        ev = Event()
        pool.release(a, ev)
        c = pool.acquire(4096)                  # full: waits for a's copy, reuses a
        self.assertIs(c, a)
        self.assertEqual(ev.waited, 1)
        lent = [b, c]
        calls = []

        def reclaim():
            calls.append(len(lent))
            if not lent:
                return False
            pool.release(lent.pop(0))
            return True
        d = pool.acquire(4096, reclaim)         # full and nothing idle: the owner gives one back
        self.assertIs(d, b)
        self.assertEqual(calls, [2])
        self.assertEqual(pool.over_limit, 0)
        lent.clear()
        e = pool.acquire(4096, reclaim)         # nothing left to give back: over, counted
        self.assertEqual(pool.over_limit, 1)
        self.assertEqual(pool.held_bytes, 3 * 4096)
        for blk in (c, d, e):
            pool.release(blk)
        pool.trim()
        self.assertLessEqual(pool.held_bytes, pool.limit)

    def test_default_bound_follows_the_prefetch_window(self):
        units = [1000, 1 << 20, 4000]
        two = _device.staging_limit(units, 2, 0, torch.bfloat16)
        four = _device.staging_limit(units, 4, 0, torch.bfloat16)
        self.assertEqual(two, 4 * (1 << 20) * 2)
        self.assertEqual(four - two, 2 * (1 << 20) * 2)
        self.assertEqual(_device.staging_limit(units, 2, 0, torch.float32), 2 * two)


class Ordering(unittest.TestCase):

    def path(self, wire, progress=False):
        backend = _device.FakeBackend(progress=progress)
        return backend, _device.StagedPath(backend, wire, 1 << 20)

    def test_a_gradient_is_read_after_the_compute_stream_and_pushed_after_its_copy(self):
        backend, path = self.path(torch.bfloat16)
        g = torch.randn(1000)
        want = g.to(torch.bfloat16)
        st = path.stage_grad(g)
        self.assertEqual(st.dtype, zshard.BF16)
        self.assertEqual(st.host.dtype, torch.bfloat16)
        self.assertFalse(st.ready())            # lazy copy stream: not run yet
        g.mul_(0)                               # still held: the copy reads g at its turn
        g.add_(want.float())
        st.wait()
        self.assertTrue(st.ready())
        self.assertTrue(torch.equal(st.host.view(torch.int16), want.view(torch.int16)))
        self.assertEqual(backend.log[0][0], "copy waits")
        self.assertTrue(backend.log[0][1].startswith("compute#"))
        self.assertEqual(backend.log[-1], ("host waits", st.event.name))
        self.assertEqual(path.d2h_bytes, 2000)
        path.done(st)
        self.assertIsNone(st.keep)
        self.assertEqual(path.pool.lent_bytes, 0)

    def test_progress_makes_a_polled_copy_ready_without_a_wait(self):
        backend, path = self.path(torch.float32, progress=True)
        st = path.stage_grad(torch.ones(10))
        self.assertTrue(st.ready())
        self.assertFalse(any(what == "host waits" for what, _ in backend.log))
        self.assertEqual(st.dtype, zshard.FP32)

    def test_a_pull_lands_before_the_compute_stream_goes_on(self):
        backend, path = self.path(torch.bfloat16)
        p = torch.zeros(300)
        st = path.pull_target(300)
        src = torch.randn(300).to(torch.bfloat16)
        st.host.copy_(src)                      # what the library wrote
        version = p._version
        path.land(p, st)
        self.assertTrue(torch.equal(p, src.float()))     # widened on the "device"
        # Written as the library writes a CPU parameter: the version counter
        # moves only when _ensure says the pull brought a new version.
        self.assertEqual(p._version, version)
        order = [w for w, _ in backend.log]
        self.assertEqual(order, ["copy waits", "compute waits"])
        self.assertEqual(path.h2d_bytes, 600)
        # The block came back with the copy's event, which has run: reused.
        again = path.pull_target(300)
        self.assertIs(again.block, st.block)

    def test_a_landed_block_is_not_reused_before_its_copy_ran(self):
        backend, path = self.path(torch.float32)
        st = path.pull_target(100)
        ev = Event()
        path.pool.release(st.block, ev)         # a landing copy still queued
        other = path.pull_target(100)
        self.assertIsNot(other.block, st.block)


class Errors(unittest.TestCase):

    def test_mixed_devices_and_unsupported_devices_are_refused(self):
        def fake(dev):
            return types.SimpleNamespace(is_meta=False, device=torch.device(dev))
        with self.assertRaisesRegex(ValueError, "several devices.*a on cpu.*b on cuda:0"):
            _device.params_device([("a", fake("cpu")), ("b", fake("cuda:0"))])
        with self.assertRaisesRegex(ValueError, "several devices"):
            _device.params_device([("a", fake("cuda:0")), ("b", fake("cuda:1"))])
        for dev in ("mps", "xla"):
            with self.assertRaisesRegex(ValueError, "w is on %s.*CPU and CUDA parameters only"
                                        % dev):
                _device.params_device([("w", fake(dev))])
        meta = torch.empty(3, device="meta")
        self.assertEqual(_device.params_device([("m", meta), ("c", torch.ones(2))]).type, "cpu")
        self.assertEqual(_device.params_device([("c", fake("cuda:0")), ("m", meta)]),
                         torch.device("cuda:0"))

    def test_a_device_tensor_is_never_handed_over_as_host_memory(self):
        with self.assertRaisesRegex(RuntimeError, "meta tensor handed to the extension"):
            _buffer(torch.empty(4, device="meta"))


class TinyTransformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def batches(n):
    g = torch.Generator().manual_seed(5)
    for _ in range(n):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        yield x, torch.roll(x, 1, dims=1)


def train(addresses, wire, release=False, backend=None, steps=STEPS, job="dev", **options):
    """Trains TinyTransformer through zshard (staged over `backend`, or the
    CPU path); returns the weights after every step and the staging stats."""
    torch.manual_seed(3)
    model = TinyTransformer()
    _device.FORCE_BACKEND = backend
    try:
        opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 addresses=addresses, wire_dtype=wire, rank=0, world_size=1,
                                 split_threshold=2048, release_after_forward=release, job=job,
                                 open_mode="create", **options)
    finally:
        _device.FORCE_BACKEND = None
    loss_fn = nn.CrossEntropyLoss()
    weights = []
    try:
        for x, y in batches(steps):
            opt.zero_grad()
            loss_fn(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
            opt.step()
            opt.gather()
            weights.append([p.detach().clone() for p in model.parameters()])
        stats = opt.staging_stats()
    finally:
        opt.close(close_job=True)
    # close() gives the pinned blocks back.
    stats["after_close_bytes"] = opt.staging_stats()["pinned_bytes"]
    return weights, stats


def reference(steps=STEPS):
    """Plain torch.optim.AdamW on the CPU over the same model and data."""
    torch.manual_seed(3)
    model = TinyTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for x, y in batches(steps):
        opt.zero_grad()
        loss_fn(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


class StagedTraining(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.ref = reference()
        cls.numel = sum(p.numel() for p in cls.ref[0])

    def assertBits(self, got, want):
        self.assertEqual(len(got), len(want))
        for step, (g, w) in enumerate(zip(got, want), 1):
            for i, (a, b) in enumerate(zip(g, w)):
                self.assertTrue(torch.equal(a.view(torch.int32), b.view(torch.int32)),
                                "step %d, parameter %d differs" % (step, i))

    def check_fp32(self, release, progress):
        events = []

        def backend():
            b = _device.FakeBackend(progress=progress)
            events.append(b)
            return b
        with zshard_servers.Shards(2) as shards:
            got, stats = train(shards.addresses, torch.float32, release=release, backend=backend)
        self.assertBits(got, self.ref)
        log = events[0].log
        # Copies were waited for by event, and the compute stream waited for
        # every landing copy.
        self.assertTrue(any(w == "compute waits" for w, _ in log))
        if not progress:
            self.assertTrue(any(w == "host waits" for w, _ in log))
        self.assertEqual(stats["d2h_bytes"], 4 * self.numel * STEPS)
        self.assertGreaterEqual(stats["h2d_bytes"], 4 * self.numel * STEPS)
        self.assertGreater(stats["staging_reuses"], stats["staging_allocs"])
        self.assertLessEqual(stats["pinned_peak_bytes"], stats["staging_limit_bytes"])
        self.assertEqual(stats["staging_over_limit"], 0)
        self.assertGreater(stats["pinned_bytes"], 0)
        self.assertEqual(stats["after_close_bytes"], 0)
        return stats

    def test_fp32_wire_staged_trains_bit_for_bit_like_torch(self):
        self.check_fp32(release=False, progress=False)

    def test_fp32_wire_staged_with_release_after_forward_and_a_progressing_stream(self):
        stats = self.check_fp32(release=True, progress=True)
        # release pulls again for backward: more than one copy per step.
        self.assertGreater(stats["h2d_bytes"], 4 * self.numel * STEPS * 1.5)

    def test_bf16_wire_cast_on_the_device_matches_the_library_cast(self):
        with zshard_servers.Shards(2) as shards:
            host, host_stats = train(shards.addresses, torch.bfloat16, job="host")
            staged, stats = train(shards.addresses, torch.bfloat16, job="staged",
                                  backend=lambda: _device.FakeBackend(progress=True))
        self.assertBits(staged, host)
        self.assertEqual(stats["d2h_bytes"], 2 * self.numel * STEPS)
        self.assertEqual(host_stats["pinned_bytes"], 0)
        self.assertEqual(host_stats["d2h_bytes"], 0)

    def test_a_pool_smaller_than_a_step_reclaims_transfers_and_keeps_the_bits(self):
        # 8 KiB: every acquire finds the pool full and finishes older
        # transfers first; the attention's 12 KiB (16 KiB block) weights
        # are bigger than the whole pool and go over it, counted. What the
        # pool cannot give back is the batch being submitted: a prefetch
        # window's pulls (2 modules) at most.
        units = sorted(sum(_device._block_size(4 * p.numel()) for p in m.parameters(recurse=False))
                       for m in TinyTransformer().modules())
        with zshard_servers.Shards(2) as shards:
            got, stats = train(shards.addresses, torch.float32, release=True, staging_bytes=8192,
                               backend=lambda: _device.FakeBackend(progress=False))
        self.assertBits(got, self.ref)
        self.assertEqual(stats["staging_limit_bytes"], 8192)
        self.assertGreater(stats["staging_over_limit"], 0)
        self.assertLessEqual(stats["pinned_peak_bytes"], 8192 + units[-1] + units[-2])
        self.assertGreater(stats["staging_reuses"], 0)

    def test_the_cpu_path_stages_nothing(self):
        with zshard_servers.Shards(1) as shards:
            model = nn.Linear(4, 4)
            opt = zshard.torch.shard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     addresses=shards.addresses, rank=0, world_size=1, job="cpu")
            try:
                self.assertFalse(opt._dev.staged)
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
                self.assertEqual(set(opt.staging_stats().values()), {0})
            finally:
                opt.close()


if __name__ == "__main__":
    unittest.main()
