"""`zshard export` read by an independent reader.

Two zshard-server processes (ZSHARD_SERVER_BIN) with a state directory train
the example MLP (zshard-mlp) for a few steps; `zshard checkpoint` (the CLI,
ZSHARD_CLI_BIN) commits a checkpoint and `zshard export` writes it as
safetensors, in fp32 with the Adam moments and in bf16. This test then reads
everything with json and numpy only, following the published layouts:

  * the safetensors files (8-byte little-endian header length, JSON header,
    raw data), checked against the parameters the shards serve over gRPC
    (grpcio, stubs generated from proto/) in fp32 and bf16;
  * the checkpoint's own shard files, decoded from the description in
    docs/CHECKPOINTS.md (header, section table, CRC32C of every section, the
    canonical spec, the piece table, the arenas), whose masters and moments
    must be exactly the exported tensors.

Run with Debian's interpreter: /usr/bin/python3 tests/python/test_export.py
"""

import importlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np

SOURCE_DIR = os.environ.get(
    "ZS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_SECONDS = 20
STOP_SECONDS = 30
CALL_TIMEOUT = 30
STEPS = 6


def generate_stubs(out_dir):
    """protoc + grpc_python_plugin into out_dir (see test_grpc_interop.py)."""
    proto_dir = os.path.join(out_dir, "protos")
    os.makedirs(os.path.join(proto_dir, "zshard", "v1"))
    shutil.copy(os.path.join(SOURCE_DIR, "proto", "zshard", "v1", "zshard.proto"),
                os.path.join(proto_dir, "zshard", "v1"))
    gen = os.path.join(out_dir, "gen")
    os.makedirs(gen)
    subprocess.run(
        ["protoc", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
         "-I" + proto_dir, "--python_out=" + gen, "--grpc_out=" + gen,
         "zshard/v1/zshard.proto"],
        check=True)
    return gen


# ---------------------------------------------------------------- CRC32C

def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data, crc=0):
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---------------------------------------------------------------- readers

def read_safetensors(path):
    """Returns (metadata, {name: numpy array}) following the safetensors
    layout: u64 LE header size, JSON header, data."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    data = blob[8 + n:]
    meta = header.pop("__metadata__", {})
    dtypes = {"F32": np.dtype("<f4"), "BF16": np.dtype("<u2"), "F16": np.dtype("<f2")}
    tensors = {}
    covered = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dt = dtypes[info["dtype"]]
        count = int(np.prod(info["shape"]))
        assert end - begin == count * dt.itemsize, name
        tensors[name] = (info["dtype"],
                         np.frombuffer(data[begin:end], dtype=dt).reshape(info["shape"]))
        covered.append((begin, end))
    # The data is covered exactly, without holes or overlaps.
    covered.sort()
    pos = 0
    for begin, end in covered:
        assert begin == pos, (begin, pos)
        pos = end
    assert pos == len(data)
    return meta, tensors


class Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt):
        vals = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return vals if len(vals) > 1 else vals[0]

    def string(self):
        n = self.take("<I")
        s = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return s


def read_zsc(path):
    """Decodes one shard file as docs/CHECKPOINTS.md describes it."""
    with open(path, "rb") as f:
        blob = f.read()
    assert blob[:8] == b"ZSHDCKPT"
    (fmt, hbytes, shard, nshards, spec_hash, version, opt_steps, nelems, nsec, flags,
     table_off, table_crc) = struct.unpack_from("<IIIIQQQQIIQI", blob, 8)
    assert (fmt, hbytes, table_off, flags) == (1, 128, 128, 0)
    assert struct.unpack_from("<I", blob, 124)[0] == crc32c(blob[:124])
    table = blob[128:128 + 32 * nsec]
    assert crc32c(table) == table_crc
    sections = {}
    for i in range(nsec):
        kind, sflags, off, length, crc, _ = struct.unpack_from("<IIQQII", table, 32 * i)
        body = blob[off:off + length]
        assert len(body) == length and crc32c(body) == crc, (path, kind)
        sections[kind] = body
    # The spec's canonical encoding (common/model/spec.c).
    c = Cursor(sections[1])
    assert c.buf[:14] == b"zshard.spec.v1"
    c.pos = 14
    spec = {"job": c.string()}
    spec["world_size"], spec["grad_accum"], spec["num_shards"] = c.take("<III")
    spec["split_threshold"] = c.take("<Q")
    spec["reduce"], spec["param_dtype"] = c.take("<II")
    groups = []
    for _ in range(c.take("<I")):
        g = {"optimizer": c.take("<I")}
        (g["lr_scale"], g["beta1"], g["beta2"], g["eps"], g["weight_decay"], g["momentum"],
         g["dampening"]) = c.take("<7d")
        g["nesterov"], g["bias_correction"] = c.take("<II")
        groups.append(g)
    tensors = []
    for _ in range(c.take("<I")):
        t = {"name": c.string(), "numel": c.take("<Q")}
        t["group"], ndim = c.take("<II")
        t["shape"] = [c.take("<Q") for _ in range(ndim)] or [t["numel"]]
        tensors.append(t)
    assert c.pos == len(c.buf)
    spec["groups"], spec["tensors"] = groups, tensors
    assert spec["num_shards"] == nshards
    c = Cursor(sections[3])
    count, _ = c.take("<II")
    pieces = []
    for _ in range(count):
        tensor, slc, group, _, offset, numel, arena_off = c.take("<IIIIQQQ")
        pieces.append((tensor, slc, offset, numel, arena_off))
    arrays = {}
    for kind, name in ((4, "master"), (5, "exp_avg"), (6, "exp_avg_sq")):
        if kind in sections:
            arrays[name] = np.frombuffer(sections[kind], dtype="<f4")
            assert arrays[name].size == nelems
    return {"shard": shard, "spec": spec, "version": version, "optimizer_steps": opt_steps,
            "pieces": pieces, "arrays": arrays}


def bf16_rne(x):
    """fp32 -> bf16 bits, round to nearest even (what the shards do)."""
    bits = x.astype("<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2")


# ---------------------------------------------------------------- the test

class Export(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.procs, cls.logs, cls.channels = [], [], []
        try:
            cls.start()
        except BaseException:
            # unittest skips tearDownClass when setUpClass fails: the servers
            # started so far are stopped here.
            cls.tearDownClass()
            raise

    @classmethod
    def start(cls):
        cls.tmp = tempfile.mkdtemp(prefix="zshard-export-")
        sys.path.insert(0, generate_stubs(cls.tmp))
        cls.pb = importlib.import_module("zshard.v1.zshard_pb2")
        cls.pbg = importlib.import_module("zshard.v1.zshard_pb2_grpc")
        import grpc
        cls.grpc = grpc
        server = os.environ.get("ZSHARD_SERVER_BIN")
        cls.cli = os.environ.get("ZSHARD_CLI_BIN")
        if not server or not cls.cli:
            raise RuntimeError("ZSHARD_SERVER_BIN and ZSHARD_CLI_BIN must name the binaries")
        cls.mlp = os.path.join(os.path.dirname(cls.cli), "zshard-mlp")
        cls.state = os.path.join(cls.tmp, "state")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        cls.ports = []
        for i in range(2):
            port_file = os.path.join(cls.tmp, "port-%d" % i)
            log = open(os.path.join(cls.tmp, "server-%d.log" % i), "w")
            cls.logs.append(log)
            cls.procs.append(subprocess.Popen(
                [server, "--listen", "127.0.0.1:0", "--port-file", port_file, "--shard-id",
                 str(i), "--shards", "2", "--threads", "1", "--state-dir", cls.state],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env))
            deadline = time.monotonic() + READY_SECONDS
            while True:
                if cls.procs[i].poll() is not None:
                    raise RuntimeError("zshard-server exited with %d" % cls.procs[i].returncode)
                if time.monotonic() > deadline:
                    raise RuntimeError("zshard-server not ready")
                try:
                    with open(port_file) as f:
                        cls.ports.append(int(f.read()))
                    break
                except (FileNotFoundError, ValueError):
                    time.sleep(0.01)
        cls.addrs = ",".join("127.0.0.1:%d" % p for p in cls.ports)
        max_len = 1 << 30
        cls.channels = [grpc.insecure_channel(
            "127.0.0.1:%d" % p, options=[("grpc.max_receive_message_length", max_len)])
            for p in cls.ports]
        cls.stubs = [cls.pbg.ZShardStub(ch) for ch in cls.channels]

        cls.sh([cls.mlp, "--shards", cls.addrs, "--steps", str(STEPS), "--synthetic",
                 "--log-every", "100"])
        out = cls.sh([cls.cli, "checkpoint", "--shards", cls.addrs])
        assert "checkpoint step %d committed on 2 shards" % STEPS in out, out
        cls.fp32 = os.path.join(cls.tmp, "model.safetensors")
        cls.bf16 = os.path.join(cls.tmp, "model-bf16.safetensors")
        cls.sh([cls.cli, "export", cls.state, cls.fp32, "--moments"])
        cls.sh([cls.cli, "export", os.path.join(cls.state, "step-%d" % STEPS), cls.bf16,
                 "--dtype", "bf16"])

    @classmethod
    def sh(cls, argv):
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
        out = p.stdout.decode()
        if p.returncode != 0:
            raise RuntimeError("%s exited %d:\n%s" % (argv[:2], p.returncode, out))
        return out

    @classmethod
    def tearDownClass(cls):
        for ch in cls.channels:
            ch.close()
        bad = False
        for p in cls.procs:
            p.send_signal(signal.SIGTERM)
            try:
                bad |= p.wait(STOP_SECONDS) != 0
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                bad = True
        for log in cls.logs:
            log.close()
        if bad:
            for i in range(len(cls.logs)):
                with open(os.path.join(cls.tmp, "server-%d.log" % i)) as f:
                    sys.stderr.write(f.read())
        if getattr(cls, "tmp", None):
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def shard_files(self):
        d = os.path.join(self.state, "step-%d" % STEPS)
        return [read_zsc(os.path.join(d, "shard-%d-of-2.zsc" % i)) for i in range(2)]

    def pull(self, spec_hash, tensor, numel, split, dtype):
        """The whole tensor as the shards serve it, assembled by the layout
        rule of DESIGN.md (split tensors: slice j of ceil(numel/N) rounded up
        to 16 on shard j; whole tensors: on one shard, found by asking)."""
        np_dtype = "<f4" if dtype == self.pb.DTYPE_FP32 else "<u2"
        out = np.zeros(numel, dtype=np_dtype)
        if split:
            c = -(-numel // 2)
            c = -(-c // 16) * 16
            slices = [(j, j, j * c, min((j + 1) * c, numel)) for j in range(2) if j * c < numel]
        else:
            slices = [(None, 0, 0, numel)]
        for shard, slc, begin, end in slices:
            for j in ([shard] if shard is not None else range(2)):
                req = self.pb.PullRequest(spec_hash=spec_hash, tensor=tensor, slice=slc,
                                          min_version=STEPS, dtype=dtype)
                try:
                    r = self.stubs[j].Pull(req, timeout=CALL_TIMEOUT)
                except self.grpc.RpcError:
                    continue
                out[begin:end] = np.frombuffer(r.data, dtype=np_dtype)
                break
            else:
                self.fail("no shard serves slice %d of tensor %d" % (slc, tensor))
        return out

    def test_export_holds_exactly_what_the_shards_serve(self):
        meta, tensors = read_safetensors(self.fp32)
        self.assertEqual(meta["zshard.step"], str(STEPS))
        self.assertEqual(meta["zshard.job"], "zshard-mlp")
        self.assertEqual(meta["format"], "pt")
        files = self.shard_files()
        spec = files[0]["spec"]
        spec_hash = int(meta["zshard.spec_hash"], 16)
        names = [t["name"] for t in spec["tensors"]]
        self.assertEqual(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                 "fc3.weight", "fc3.bias"])
        for i, t in enumerate(spec["tensors"]):
            dtype, arr = tensors[t["name"]]
            self.assertEqual(dtype, "F32")
            self.assertEqual(list(arr.shape), t["shape"])
            served = self.pull(spec_hash, i, t["numel"], t["numel"] >= spec["split_threshold"],
                               self.pb.DTYPE_FP32)
            self.assertTrue(np.array_equal(arr.reshape(-1).view("<u4"), served.view("<u4")),
                            t["name"])

    def test_export_holds_exactly_the_checkpoints_masters_and_moments(self):
        _, tensors = read_safetensors(self.fp32)
        files = self.shard_files()
        spec = files[0]["spec"]
        self.assertEqual([f["version"] for f in files], [STEPS, STEPS])
        full = {}
        for f in files:
            for tensor, slc, offset, numel, arena_off in f["pieces"]:
                for name, arr in f["arrays"].items():
                    dst = full.setdefault((tensor, name),
                                          np.full(spec["tensors"][tensor]["numel"], np.nan,
                                                  dtype="<f4"))
                    dst[offset:offset + numel] = arr[arena_off:arena_off + numel]
        suffix = {"master": "", "exp_avg": ".exp_avg", "exp_avg_sq": ".exp_avg_sq"}
        seen = 0
        for (tensor, name), arr in full.items():
            key = spec["tensors"][tensor]["name"] + suffix[name]
            self.assertIn(key, tensors)
            self.assertTrue(np.array_equal(tensors[key][1].reshape(-1).view("<u4"),
                                           arr.view("<u4")), key)
            seen += 1
        # Every parameter with both Adam moments, and nothing else.
        self.assertEqual(seen, 18)
        self.assertEqual(len(tensors), 18)
        # AdamW's second moment is never negative; after STEPS steps it is set.
        self.assertTrue(all((tensors[k][1] >= 0).all() for k in tensors if k.endswith("_sq")))

    def test_bf16_export_is_the_rounded_masters_and_what_the_shards_serve(self):
        meta, half = read_safetensors(self.bf16)
        _, full = read_safetensors(self.fp32)
        spec = self.shard_files()[0]["spec"]
        spec_hash = int(meta["zshard.spec_hash"], 16)
        self.assertEqual(len(half), 6)
        for i, t in enumerate(spec["tensors"]):
            dtype, arr = half[t["name"]]
            self.assertEqual(dtype, "BF16")
            want = bf16_rne(full[t["name"]][1].reshape(-1))
            self.assertTrue(np.array_equal(arr.reshape(-1), want), t["name"])
            served = self.pull(spec_hash, i, t["numel"], t["numel"] >= spec["split_threshold"],
                               self.pb.DTYPE_BF16)
            self.assertTrue(np.array_equal(arr.reshape(-1), served), t["name"])


if __name__ == "__main__":
    unittest.main()
