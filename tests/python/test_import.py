"""Pretrained weights are imported onto the shards one tensor at a time.

zshard.torch.load_pretrained() reads a safetensors file or torch.save's zip
format (.pt/.bin) and writes each tensor to its shards' fp32 masters: the
masters then hold exactly what model.load_state_dict() gives torch (fp32,
bf16 and fp16 files), and the next forward pulls them. Missing, unexpected and
mis-shaped names, a corrupt file and a pickle that names a global other than
torch's tensor rebuilders are refused before anything is written (the masters
are compared before and after). With two trainers each loads the same file
and both pull it. The importer's peak memory is measured in a
subprocess: it stays under the largest tensor plus a constant, well under the
file. shard(..., state_dict_path=) loads the file once the model is sharded
(CPU and meta models), and leaves a resumed job's trained weights.
`zshard import` (the CLI) writes a file `zshard export` wrote back to the
same bits, writes a torch.save'd state dict (fp32, bf16, fp16, nn.Parameter
values, views saved with their strides) to the bits model.load_state_dict()
gives, refuses bad .pt files (names, a mis-shaped view, a hostile global, a compressed member, a cut file, the
pre-1.6 format) with nothing written, and holds one tensor at a time.

Two real zshard-server processes on port 0; fp32 on the wire.
Run with Debian's interpreter (CTest does): /usr/bin/python3 -m pytest tests/python/test_import.py
"""

import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import unittest
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zshard_servers  # noqa: E402

zshard_servers.use_build_tree_package()
import torch  # noqa: E402
from torch import nn  # noqa: E402

import zshard  # noqa: E402
import zshard.torch  # noqa: E402

ST_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64"}


class Net(nn.Module):
    """Parameters large enough to be split over both shards, a tied weight
    and a BatchNorm's buffers (one of them int64)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(96, 64)
        self.fc = nn.Linear(64, 80)
        self.norm = nn.BatchNorm1d(80)
        self.out = nn.Linear(80, 64, bias=False)
        with torch.no_grad():
            self.norm.running_mean.normal_()
            self.norm.running_var.uniform_(0.5, 2)
            self.norm.num_batches_tracked.fill_(seed)

    def forward(self, x):
        return self.out(self.norm(self.fc(self.emb(x))))


def write_safetensors(path, tensors, metadata=None):
    """The format, written here by hand: 8-byte length, JSON header, data."""
    header, blobs, off = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        t = t.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for b in blobs:
            f.write(b)


def masters(opt):
    """{name: the fp32 master weights on the shards}."""
    out = {}
    for P in opt._params:
        t = torch.empty(P.p.shape)
        opt.client.state_read(P.idx, zshard.MASTER, zshard.torch._common._buffer(t))
        out[P.name] = t
    return out


def shard(model, shards, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return zshard.torch.shard(model, opt, addresses=shards.addresses, wire_dtype=torch.float32,
                              rank=0, world_size=1, split_threshold=1024, job="import", **kw)


class LoadPretrained(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="zshard-import-")
        cls.shards = zshard_servers.Shards(2).__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.shards.__exit__(None, None, None)
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def setUp(self):
        self.model = Net(seed=2)
        self.opt = shard(self.model, self.shards)

    def tearDown(self):
        self.opt.close(close_job=True)

    def assertMastersAre(self, ref, what):
        got = masters(self.opt)
        for n, p in ref.named_parameters():
            self.assertTrue(torch.equal(got[n].view(torch.int32), p.detach().view(torch.int32)),
                            "%s: %s differs" % (what, n))

    def assertLoadsLikeTorch(self, sd, path):
        """load_pretrained(path) leaves the masters, the model's weights
        after a gather and its buffers as model.load_state_dict(sd)."""
        want = Net(seed=2)
        want.load_state_dict(sd)
        n = zshard.torch.load_pretrained(self.opt, path)
        self.assertEqual(n, sum(t.numel() * t.element_size() for t in sd.values()))
        self.assertMastersAre(want, path)
        self.opt.gather()
        for (k, a), b in zip(self.model.state_dict().items(), want.state_dict().values()):
            self.assertTrue(torch.equal(a, b), "%s: model's %s after gather" % (path, k))

    def test_torch_save_state_dict_imports_like_load_state_dict(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                sd = {k: v.to(dtype) if v.is_floating_point() else v
                      for k, v in Net(seed=7).state_dict().items()}
                torch.save(sd, self.path("sd.pt"))
                self.assertLoadsLikeTorch(sd, self.path("sd.pt"))

    def test_safetensors_imports_like_load_state_dict(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                sd = {k: v.to(dtype) if v.is_floating_point() else v
                      for k, v in Net(seed=8).state_dict().items()}
                write_safetensors(self.path("sd.safetensors"), sd, {"format": "pt"})
                self.assertLoadsLikeTorch(sd, self.path("sd.safetensors"))

    def test_a_saved_module_view_and_parameter_objects_import(self):
        """torch.save of a dict with nn.Parameter values and a transposed
        view (not contiguous in its storage)."""
        ref = Net(seed=9)
        sd = ref.state_dict(keep_vars=True)
        w = ref.fc.weight.detach().t().contiguous().t()  # a transpose of a contiguous tensor
        sd["fc.weight"] = w
        torch.save(sd, self.path("params.bin"))
        self.assertLoadsLikeTorch({k: v.detach() for k, v in sd.items()}, self.path("params.bin"))

    def test_wrong_names_and_shapes_are_reported_like_torch_and_nothing_is_written(self):
        before = masters(self.opt)
        sd = Net(seed=3).state_dict()
        del sd["fc.bias"]
        sd["head.weight"] = torch.zeros(3)
        sd["out.weight"] = torch.zeros(64, 81)
        torch.save(sd, self.path("bad.pt"))
        write_safetensors(self.path("bad.safetensors"), sd)
        for p in (self.path("bad.pt"), self.path("bad.safetensors")):
            with self.assertRaises(RuntimeError) as cm:
                zshard.torch.load_pretrained(self.opt, p)
            msg = str(cm.exception)
            self.assertIn('Missing key(s) in state_dict: "fc.bias"', msg)
            self.assertIn('Unexpected key(s) in state_dict: "head.weight"', msg)
            self.assertIn("size mismatch for out.weight: copying a param with shape "
                          "torch.Size([64, 81]) from checkpoint, the shape in current model is "
                          "torch.Size([64, 80])", msg)
            # torch's own words, for the same dict.
            with self.assertRaises(RuntimeError) as ref:
                Net(seed=2).load_state_dict(sd)
            for line in str(ref.exception).split("\n\t")[1:]:
                self.assertIn(line.strip(), msg)
            after = masters(self.opt)
            for n in before:
                self.assertTrue(torch.equal(before[n], after[n]), n)
        # strict=False: the names are skipped, a shape mismatch still refused.
        with self.assertRaisesRegex(RuntimeError, "size mismatch for out.weight"):
            zshard.torch.load_pretrained(self.opt, self.path("bad.pt"), strict=False)
        del sd["out.weight"]
        torch.save(sd, self.path("partial.pt"))
        zshard.torch.load_pretrained(self.opt, self.path("partial.pt"), strict=False)
        got = masters(self.opt)
        self.assertTrue(torch.equal(got["fc.weight"], sd["fc.weight"]))
        self.assertTrue(torch.equal(got["fc.bias"], before["fc.bias"]))
        self.assertTrue(torch.equal(got["out.weight"], before["out.weight"]))

    def test_corrupt_safetensors_are_refused_and_nothing_is_written(self):
        before = masters(self.opt)
        sd = Net(seed=4).state_dict()
        good = self.path("good.safetensors")
        write_safetensors(good, sd)
        raw = open(good, "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])

        def with_header(h, tail=None):
            head = json.dumps(h).encode()
            return struct.pack("<Q", len(head)) + head + (raw[8 + n:] if tail is None else tail)

        def edit(name, key, value):
            h = json.loads(json.dumps(header))
            h[name][key] = value
            return with_header(h)

        first, second = "emb.weight", "fc.weight"
        cases = {
            "short": (raw[:5], "too short"),
            "length past the end": (struct.pack("<Q", len(raw)) + raw[8:], "beyond the file"),
            "not json": (struct.pack("<Q", 4) + b"{{{{" + raw[8 + n:], "not JSON"),
            "a list": (with_header([1, 2]), "not a JSON object"),
            "truncated data": (raw[:-100], "data_offsets"),
            "offsets past the data": (edit(first, "data_offsets", [0, 1 << 40]), "data_offsets"),
            "offsets backwards": (edit(first, "data_offsets", [8, 4]), "data_offsets"),
            "size disagrees with shape": (edit(first, "shape", [96, 63]), "needs"),
            "overlap": (edit(second, "data_offsets",
                             [header[first]["data_offsets"][0] + 4,
                              header[first]["data_offsets"][0] + 4 +
                              header[second]["data_offsets"][1] -
                              header[second]["data_offsets"][0]]), "overlap"),
            "unknown dtype": (edit(first, "dtype", "F8_E4M3"), "dtype"),
            "negative size": (edit(first, "shape", [-96, -64]), "shape"),
            "extra field": (edit(first, "crc", 1), "exactly"),
        }
        for what, (data, want) in cases.items():
            with self.subTest(what):
                p = self.path("corrupt.safetensors")
                with open(p, "wb") as f:
                    f.write(data)
                with self.assertRaisesRegex(zshard.torch.PretrainedError, want):
                    zshard.torch.load_pretrained(self.opt, p)
                after = masters(self.opt)
                for k in before:
                    self.assertTrue(torch.equal(before[k], after[k]), (what, k))

    def test_a_pickle_naming_another_global_is_refused_without_running_it(self):
        marker = self.path("ran")

        class Evil:
            def __reduce__(self):
                return (os.system, ("touch " + marker,))

        p = self.path("evil.pt")
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("archive/data.pkl", pickle.dumps({"fc.weight": Evil()}, protocol=2))
            z.writestr("archive/version", "3\n")
        with self.assertRaisesRegex(zshard.torch.PretrainedError,
                                    r"global (posix|os)\.system is not allowed"):
            zshard.torch.load_pretrained(self.opt, p)
        self.assertFalse(os.path.exists(marker))


class EveryRankLoads(unittest.TestCase):

    def test_two_trainers_load_the_same_file_and_both_pull_it(self):
        """W = 2: each rank calls load_pretrained with the same file (each
        writes the same values, no barrier), then each pulls them."""
        with tempfile.TemporaryDirectory(prefix="zshard-import-w2-") as tmp, \
                zshard_servers.Shards(2) as shards:
            path = os.path.join(tmp, "sd.safetensors")
            ref = Net(seed=11)
            write_safetensors(path, ref.state_dict())
            opts = []
            try:
                for rank in (0, 1):
                    model = Net(seed=2)
                    opts.append(zshard.torch.shard(
                        model, torch.optim.AdamW(model.parameters()), addresses=shards.addresses,
                        wire_dtype=torch.float32, rank=rank, world_size=2, split_threshold=1024,
                        job="import-w2"))
                for opt in opts:
                    zshard.torch.load_pretrained(opt, path)
                for opt in opts:
                    opt.gather()
                    for (n, p), q in zip(opt._model.named_parameters(), ref.parameters()):
                        self.assertTrue(torch.equal(p.detach(), q.detach()), (opt.rank, n))
            finally:
                for opt in reversed(opts):
                    opt.close(close_job=opt.rank == 0)


class ModelBuiltEmpty(unittest.TestCase):

    def test_a_model_built_on_meta_takes_the_files_weights(self):
        """init_empty() + release_after_forward: the trainer never holds the
        model; load_pretrained overwrites the weights shard() initialised
        and the first forward computes with the file's."""
        with tempfile.TemporaryDirectory(prefix="zshard-import-meta-") as tmp, \
                zshard_servers.Shards(2) as shards:
            ref = Net(seed=12)
            path = os.path.join(tmp, "sd.pt")
            torch.save(ref.state_dict(), path)
            with zshard.torch.init_empty():
                model = Net(seed=2)
            opt = shard(model, shards, release_after_forward=True)
            try:
                zshard.torch.load_pretrained(opt, path)
                got = masters(opt)
                for n, p in ref.named_parameters():
                    self.assertTrue(torch.equal(got[n], p.detach()), n)
                model.eval()
                ref.eval()
                x = torch.arange(16)
                with torch.no_grad():
                    self.assertTrue(torch.equal(model(x), ref(x)))
            finally:
                opt.close(close_job=True)


class ShardFromAFile(unittest.TestCase):

    def test_shard_with_state_dict_path_starts_from_the_files_bits_unless_resumed(self):
        """shard(..., state_dict_path=) loads the file once the model is
        sharded, for a model built on the CPU and one built on meta: the
        masters and the buffers are the file's. A job already stepped keeps
        its trained weights; a file that does not fit raises like
        load_state_dict."""
        with tempfile.TemporaryDirectory(prefix="zshard-shard-path-") as tmp, \
                zshard_servers.Shards(2) as shards:
            ref = Net(seed=14)
            path = os.path.join(tmp, "sd.pt")
            torch.save(ref.state_dict(), path)

            def open_(model, job):
                return zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          addresses=shards.addresses, wire_dtype=torch.float32,
                                          rank=0, world_size=1, split_threshold=1024, job=job,
                                          state_dict_path=path)

            for how in ("cpu", "meta"):
                with self.subTest(how):
                    if how == "meta":
                        with zshard.torch.init_empty():
                            model = Net(seed=2)
                    else:
                        model = Net(seed=2)
                    opt = open_(model, "from-file-" + how)
                    try:
                        got = masters(opt)
                        for n, p in ref.named_parameters():
                            self.assertTrue(torch.equal(got[n].view(torch.int32),
                                                        p.detach().view(torch.int32)), n)
                        for (n, b), c in zip(model.named_buffers(), ref.buffers()):
                            self.assertTrue(torch.equal(b, c), n)
                        opt.zero_grad()
                        model(torch.arange(8)).square().mean().backward()
                        opt.step()
                        trained = masters(opt)
                        self.assertFalse(torch.equal(trained["fc.weight"], got["fc.weight"]))
                        opt.close()
                        opt = open_(Net(seed=2), "from-file-" + how)
                        again = masters(opt)
                        for n in trained:
                            self.assertTrue(torch.equal(again[n], trained[n]), n)
                    finally:
                        opt.close(close_job=True)
            sd = ref.state_dict()
            del sd["fc.bias"]
            torch.save(sd, path)
            with self.assertRaisesRegex(RuntimeError, r'Missing key\(s\) in state_dict: "fc\.bias"'):
                open_(Net(seed=2), "from-file-bad")


class CliImport(unittest.TestCase):
    """`zshard import` (ZSHARD_CLI_BIN) into a job a trainer opened: it asks
    the shards for the spec, joins the job and writes the masters."""

    def setUp(self):
        self.cli = os.environ.get("ZSHARD_CLI_BIN")
        if not self.cli:
            self.skipTest("ZSHARD_CLI_BIN is not set")
        self.tmp = tempfile.TemporaryDirectory(prefix="zshard-cli-import-")
        self.state = os.path.join(self.tmp.name, "state")
        os.mkdir(self.state)

    def tearDown(self):
        self.tmp.cleanup()

    def run_cli(self, *argv, ok=True):
        p = subprocess.run([self.cli] + list(argv), capture_output=True, text=True, timeout=120)
        if ok:
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def read_safetensors(self, path):
        raw = open(path, "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        out = {}
        for k, v in json.loads(raw[8:8 + n]).items():
            if k == "__metadata__":
                continue
            b, e = v["data_offsets"]
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[
                v["dtype"]]
            out[k] = torch.frombuffer(bytearray(raw[8 + n + b:8 + n + e]), dtype=dtype).view(
                v["shape"])
        return out

    def test_export_then_import_gives_the_same_bits_and_bad_files_change_nothing(self):
        with zshard_servers.Shards(2, extra_args=["--state-dir", self.state]) as shards:
            opt = shard(Net(seed=2), shards)
            try:
                # One step, so that a trainer joining later resumes (at version
                # 0 a rank 0 would bring initial weights of its own).
                opt.zero_grad()
                opt._model(torch.arange(8)).square().mean().backward()
                opt.step()
                self.run_cli("checkpoint", "--shards", shards.addresses)
                exported = {}
                for dtype in ("fp32", "bf16", "fp16"):
                    exported[dtype] = os.path.join(self.tmp.name, "%s.safetensors" % dtype)
                    self.run_cli("export", self.state, exported[dtype], "--dtype", dtype)
                want = masters(opt)
                for dtype, path in exported.items():
                    with self.subTest(dtype=dtype):
                        # Other weights first, so that the import has work to do.
                        torch.save(Net(seed=5).state_dict(), self.path("other.pt"))
                        zshard.torch.load_pretrained(opt, self.path("other.pt"))
                        out = self.run_cli("import", "--shards", shards.addresses, path).stdout
                        self.assertRegex(out, r"imported 6 tensors .* GB/s")
                        got = masters(opt)
                        ref = self.read_safetensors(path)
                        for n in want:
                            self.assertTrue(torch.equal(got[n], ref[n].float()), (dtype, n))
                            if dtype == "fp32":
                                self.assertTrue(torch.equal(got[n].view(torch.int32),
                                                            want[n].view(torch.int32)), n)
                before = masters(opt)
                sd = {k: v.detach() for k, v in Net(seed=6).named_parameters()}
                del sd["fc.bias"]
                sd["head.weight"] = torch.zeros(3)
                sd["out.weight"] = torch.zeros(64, 81)
                write_safetensors(self.path("bad.safetensors"), sd)
                p = self.run_cli("import", "--shards", shards.addresses,
                                 self.path("bad.safetensors"), ok=False)
                self.assertEqual(p.returncode, 1)
                self.assertIn('Missing key(s) in state_dict: "fc.bias"', p.stderr)
                self.assertIn('Unexpected key(s) in state_dict: "head.weight"', p.stderr)
                self.assertIn("size mismatch for out.weight: copying a param with shape [64, 81] "
                              "from checkpoint, the shape in current model is [64, 80]", p.stderr)
                self.assertIn("nothing was written", p.stderr)
                raw = open(exported["fp32"], "rb").read()
                with open(self.path("cut.safetensors"), "wb") as f:
                    f.write(raw[:-1])
                p = self.run_cli("import", "--shards", shards.addresses,
                                 self.path("cut.safetensors"), ok=False)
                self.assertEqual(p.returncode, 1)
                self.assertIn("not a range inside the", p.stderr)
                after = masters(opt)
                for n in before:
                    self.assertTrue(torch.equal(before[n], after[n]), n)
                # --partial: missing names keep their weights.
                del sd["head.weight"]
                sd["out.weight"] = torch.ones(64, 80)
                write_safetensors(self.path("part.safetensors"), sd)
                self.run_cli("import", "--shards", shards.addresses, "--partial", "--quiet",
                             self.path("part.safetensors"))
                got = masters(opt)
                self.assertTrue(torch.equal(got["out.weight"], torch.ones(64, 80)))
                self.assertTrue(torch.equal(got["fc.bias"], before["fc.bias"]))

                # A trainer that joins the job after an import pulls its weights.
                self.run_cli("import", "--shards", shards.addresses, exported["fp32"])
                opt.close()
                opt = shard(Net(seed=9), shards)
                opt.gather()
                for n, p in opt._model.named_parameters():
                    self.assertTrue(torch.equal(p.detach(), want[n]), n)
            finally:
                opt.close(close_job=True)

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def test_a_torch_save_state_dict_imports_to_the_bits_load_state_dict_gives(self):
        """torch.save(model.state_dict()) (its parameters: the shards hold
        no buffers) -> `zshard import` -> the masters are what
        model.load_state_dict() gives the model, for fp32, bf16 and fp16
        files; a dict of nn.Parameter objects (keep_vars) and one of views
        (transposed, expanded, sliced) too."""
        with zshard_servers.Shards(2) as shards:
            opt = shard(Net(seed=2), shards)
            try:
                for dtype in (torch.float32, torch.bfloat16, torch.float16, "params", "views",
                              "bf16 views"):
                    with self.subTest(dtype=dtype):
                        ref = Net(seed=13)
                        # model.state_dict() itself (an OrderedDict with its
                        # _metadata), less the buffers; others as plain dicts.
                        sd = ref.state_dict(keep_vars=dtype == "params")
                        for k, _ in ref.named_buffers():
                            del sd[k]
                        if dtype in (torch.bfloat16, torch.float16):
                            sd = {k: v.to(dtype) for k, v in sd.items()}
                        if dtype in ("views", "bf16 views"):
                            # Views saved with their strides, gathered by the
                            # importer: a transpose, an expand (stride 0), a
                            # slice (an offset and a row stride).
                            d = torch.bfloat16 if dtype == "bf16 views" else torch.float32
                            sd = {k: v.to(d) for k, v in sd.items()}
                            sd["fc.weight"] = sd["fc.weight"].t().contiguous().t()
                            sd["fc.bias"] = torch.randn(1).to(d).expand(80)
                            sd["out.weight"] = torch.randn(64, 100).to(d)[:, 10:90]
                        path = self.path("sd.pt")
                        torch.save(sd, path)
                        want = Net(seed=2)
                        want.load_state_dict(sd, strict=False)
                        out = self.run_cli("import", "--shards", shards.addresses, path).stdout
                        self.assertRegex(out, r"imported 6 tensors from .*sd\.pt")
                        self.assertMastersAre(opt, want, dtype)
            finally:
                opt.close(close_job=True)

    def assertMastersAre(self, opt, ref, what):
        got = masters(opt)
        for n, p in ref.named_parameters():
            self.assertTrue(torch.equal(got[n].view(torch.int32), p.detach().view(torch.int32)),
                            "%s: %s differs" % (what, n))

    def test_bad_torch_files_are_refused_naming_the_problem_and_nothing_is_written(self):
        marker = self.path("ran")

        class Evil:
            def __reduce__(self):
                return (os.system, ("touch " + marker,))

        def params(seed):
            return {k: v.detach() for k, v in Net(seed=seed).named_parameters()}

        with zshard_servers.Shards(2) as shards:
            opt = shard(Net(seed=2), shards)
            try:
                before = masters(opt)
                files = {}
                sd = params(3)
                del sd["fc.bias"]
                sd["head.weight"] = torch.zeros(3)
                sd["out.weight"] = torch.zeros(64, 81)
                torch.save(sd, self.path("names.pt"))
                files["names.pt"] = ('Missing key(s) in state_dict: "fc.bias"',
                                     'Unexpected key(s) in state_dict: "head.weight"',
                                     "size mismatch for out.weight: copying a param with shape "
                                     "[64, 81] from checkpoint, the shape in current model is "
                                     "[64, 80]", "nothing was written")
                sd = params(3)
                sd["fc.weight"] = torch.randn(80, 100)[:, :65]
                torch.save(sd, self.path("view.pt"))
                files["view.pt"] = ("size mismatch for fc.weight: copying a param with shape "
                                    "[80, 65]",)
                with zipfile.ZipFile(self.path("evil.pt"), "w") as z:
                    z.writestr("archive/data.pkl", pickle.dumps({"fc.weight": Evil()},
                                                                protocol=2))
                files["evil.pt"] = ("global posix.system is not allowed",)
                torch.save(params(3), self.path("good.pt"))
                with zipfile.ZipFile(self.path("good.pt")) as src, \
                        zipfile.ZipFile(self.path("deflated.pt"), "w",
                                        zipfile.ZIP_DEFLATED) as dst:
                    for info in src.infolist():
                        dst.writestr(info.filename, src.read(info.filename))
                files["deflated.pt"] = ("is compressed (method 8)",)
                raw = open(self.path("good.pt"), "rb").read()
                with open(self.path("cut.pt"), "wb") as f:
                    f.write(raw[:len(raw) // 2])
                files["cut.pt"] = ("no end of central directory record",)
                torch.save(params(3), self.path("legacy.pt"), _use_new_zipfile_serialization=False)
                files["legacy.pt"] = ("format before torch 1.6",)
                for name, phrases in files.items():
                    with self.subTest(name):
                        p = self.run_cli("import", "--shards", shards.addresses, self.path(name),
                                         ok=False)
                        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
                        for phrase in phrases:
                            self.assertIn(phrase, p.stderr)
                        after = masters(opt)
                        for n in before:
                            self.assertTrue(torch.equal(before[n], after[n]), (name, n))
                self.assertFalse(os.path.exists(marker))
            finally:
                opt.close(close_job=True)


PEAK_SCRIPT = r"""
import os, sys
sys.path.insert(0, os.environ["ZSHARD_PYTHONPATH"])
import torch, zshard.torch
from torch import nn

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield int(line.split()[1]) * 1024

model = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(8)])
opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters()),
                         addresses=sys.argv[1], wire_dtype=torch.float32, rank=0, world_size=1,
                         job="peak", release_after_forward=True)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
peak0, rss0 = hwm()
n = zshard.torch.load_pretrained(opt, sys.argv[2])
peak, _ = hwm()
print(n, rss0, peak, flush=True)
opt.close(close_job=True)
"""


class PeakMemory(unittest.TestCase):
    LARGEST = 2048 * 2048 * 4           # one layer's fp32 weights: 16 MiB
    CONSTANT = 32 << 20             # the reads, the write messages in flight, malloc

    def measure(self, shards, path):
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1",
                   ZSHARD_PYTHONPATH=sys.path[0] if "ZSHARD_PYTHONPATH" not in os.environ
                   else os.environ["ZSHARD_PYTHONPATH"])
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, shards.addresses, path],
                             env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr)
        n, rss0, peak = (int(x) for x in out.stdout.split())
        return n, peak - rss0

    def test_the_importer_holds_one_tensor_at_a_time(self):
        if not os.path.exists("/proc/self/clear_refs"):
            self.skipTest("no /proc/self/clear_refs to reset the peak")
        torch.manual_seed(0)
        sd = {"%d.weight" % i: torch.randn(2048, 2048) for i in range(8)}
        with tempfile.TemporaryDirectory(prefix="zshard-peak-") as tmp, \
                zshard_servers.Shards(2) as shards:
            for fmt in ("pt", "safetensors", "bf16.safetensors"):
                path = os.path.join(tmp, "model." + fmt)
                if fmt == "pt":
                    torch.save(sd, path)
                elif fmt == "safetensors":
                    write_safetensors(path, sd)
                else:
                    write_safetensors(path, {k: v.bfloat16() for k, v in sd.items()})
                n, grew = self.measure(shards, path)
                print("%s: %.1f MiB of tensors, the peak grew by %.1f MiB" %
                      (fmt, n / 2**20, grew / 2**20))
                self.assertEqual(n, 8 * 2048 * 2048 * (2 if fmt.startswith("bf16") else 4))
                # The whole file (128 MiB in fp32, 64 MiB in bf16) would not fit.
                self.assertLess(grew, self.LARGEST + self.CONSTANT,
                                "%s: the peak grew by %.1f MiB" % (fmt, grew / 2**20))
                os.unlink(path)

    def test_the_cli_holds_one_tensor_at_a_time(self):
        """`zshard import`'s own peak resident set (the VmHWM its last line
        reports) over that of an import of no tensor after the same
        connections (its baseline)."""
        cli = os.environ.get("ZSHARD_CLI_BIN")
        if not cli:
            self.skipTest("ZSHARD_CLI_BIN is not set")
        torch.manual_seed(0)
        names = ["%d.weight" % i for i in range(8)]
        sd = {n: torch.randn(2048, 2048) for n in names}

        def peak(shards, *argv):
            p = subprocess.run([cli, "import", "--shards", shards.addresses, "--quiet"] +
                               list(argv), capture_output=True, text=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            return int(re.search(r"peak resident set .* \(([0-9]+) bytes\)", p.stdout).group(1))

        with tempfile.TemporaryDirectory(prefix="zshard-cli-peak-") as tmp, \
                zshard_servers.Shards(2) as shards:
            c = zshard.Client(shards.addresses, job="cli-peak", rank=0, world_size=1)
            c.add_group(optimizer=zshard.SGD)
            for n in names:
                c.add_tensor(n, 2048 * 2048, 0, (2048, 2048))
            zeros = torch.zeros(2048 * 2048).numpy()
            c.open_job([zeros] * len(names))
            try:
                empty = os.path.join(tmp, "empty.safetensors")
                write_safetensors(empty, {})
                base = peak(shards, "--partial", empty)
                self.assertGreater(base, 0)
                for fmt in ("F32", "BF16", "torch.save"):
                    path = os.path.join(tmp, "model.safetensors")
                    if fmt == "torch.save":
                        path = os.path.join(tmp, "model.pt")
                        torch.save(sd, path)
                    else:
                        write_safetensors(path, {n: t if fmt == "F32" else t.bfloat16()
                                                 for n, t in sd.items()})
                    grew = peak(shards, path) - base
                    print("zshard import of %s: %.1f MiB file, the peak grew by %.1f MiB over "
                          "the baseline's %.1f MiB" % (fmt, os.path.getsize(path) / 2**20,
                                                      grew / 2**20, base / 2**20))
                    self.assertLess(grew, self.LARGEST + self.CONSTANT, fmt)
                    got = torch.empty(2048, 2048)
                    c.state_read(3, zshard.MASTER, zshard.torch._common._buffer(got))
                    want = sd["3.weight"] if fmt != "BF16" else sd["3.weight"].bfloat16().float()
                    self.assertTrue(torch.equal(got, want), fmt)
            finally:
                c.close()

if __name__ == "__main__":
    unittest.main()
