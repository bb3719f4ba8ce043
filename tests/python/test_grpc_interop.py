"""Interoperability of zshard-server with a foreign gRPC stack (grpcio).

Python stubs are generated from proto/ at test time; a real zshard-server
(ZSHARD_SERVER_BIN) is driven through one AdamW step, and its result is
compared bit for bit with torch.optim.AdamW on the same data.

Run with Debian's interpreter: /usr/bin/python3 tests/python/test_grpc_interop.py
"""

import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np
import torch

SOURCE_DIR = os.environ.get(
    "ZS_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
READY_SECONDS = 20
STOP_SECONDS = 30
CALL_TIMEOUT = 30


def generate_stubs(out_dir):
    """protoc + grpc_python_plugin into out_dir. The health proto is copied
    under another directory first: generated as grpc/health/v1/..., its
    package would shadow grpcio's own `grpc` module."""
    proto_dir = os.path.join(out_dir, "protos")
    os.makedirs(os.path.join(proto_dir, "zshard", "v1"))
    os.makedirs(os.path.join(proto_dir, "zs_health", "v1"))
    shutil.copy(os.path.join(SOURCE_DIR, "proto", "zshard", "v1", "zshard.proto"),
                os.path.join(proto_dir, "zshard", "v1"))
    shutil.copy(os.path.join(SOURCE_DIR, "proto", "grpc", "health", "v1", "health.proto"),
                os.path.join(proto_dir, "zs_health", "v1"))
    gen = os.path.join(out_dir, "gen")
    os.makedirs(gen)
    subprocess.run(
        ["protoc", "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
         "-I" + proto_dir, "--python_out=" + gen, "--grpc_out=" + gen,
         "zshard/v1/zshard.proto", "zs_health/v1/health.proto"],
        check=True)
    return gen


def int8_block_encode(x, block=128):
    """The INT8_BLOCK format from docs/PROTOCOL.md, written from the text:
    per block of `block` elements (the last one may be short), a little-endian
    fp32 scale then int8 values; amax >= 2^127 or non-finite: NaN scale and
    zeros; amax < 2^-100: zero scale and zeros; else scale = amax / 127 and
    q = rint(x * (127 / amax)), every operation in fp32."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    out = bytearray()
    for b in range(0, x.size, block):
        v = x[b:b + block]
        amax = np.max(np.abs(v)) if np.all(np.isfinite(v)) else np.float32(np.inf)
        if not amax < np.float32(2.0 ** 127):
            scale, q = np.float32(np.nan), np.zeros(v.size, np.int8)
        elif amax < np.float32(2.0 ** -100):
            scale, q = np.float32(0), np.zeros(v.size, np.int8)
        else:
            scale = np.float32(amax / np.float32(127))
            inv = np.float32(np.float32(127) / amax)
            q = np.clip(np.rint(v * inv), -127, 127).astype(np.int8)
        out += np.array([scale], dtype="<f4").tobytes() + q.tobytes()
    return bytes(out)


def int8_block_decode(data, n, block=128):
    """Elements = q * scale in fp32, block by block."""
    out = np.empty(n, dtype=np.float32)
    pos = 0
    for b in range(0, n, block):
        k = min(block, n - b)
        scale = np.frombuffer(data, dtype="<f4", count=1, offset=pos)[0]
        q = np.frombuffer(data, dtype=np.int8, count=k, offset=pos + 4)
        out[b:b + k] = q.astype(np.float32) * scale
        pos += 4 + k
    return out


class ServerFixture(unittest.TestCase):
    """One zshard-server (one shard) per test class."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="zshard-py-")
        gen = generate_stubs(cls.tmp)
        sys.path.insert(0, gen)
        cls.pb = importlib.import_module("zshard.v1.zshard_pb2")
        cls.pbg = importlib.import_module("zshard.v1.zshard_pb2_grpc")
        cls.hpb = importlib.import_module("zs_health.v1.health_pb2")
        cls.hpbg = importlib.import_module("zs_health.v1.health_pb2_grpc")
        import grpc
        cls.grpc = grpc

        binary = os.environ.get("ZSHARD_SERVER_BIN")
        if not binary or not os.access(binary, os.X_OK):
            raise RuntimeError("ZSHARD_SERVER_BIN must name the zshard-server binary")
        cls.port_file = os.path.join(cls.tmp, "port")
        cls.log_path = os.path.join(cls.tmp, "server.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZSHARD_")}
        cls.log = open(cls.log_path, "w")
        cls.proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0", "--port-file", cls.port_file,
             "--shard-id", "0", "--shards", "1", "--threads", "1"],
            stdin=subprocess.DEVNULL, stdout=cls.log, stderr=cls.log, env=env)
        deadline = time.monotonic() + READY_SECONDS
        port = None
        while port is None:
            if cls.proc.poll() is not None:
                cls.dump_log()
                raise RuntimeError("zshard-server exited with %d" % cls.proc.returncode)
            if time.monotonic() > deadline:
                cls.proc.kill()
                cls.dump_log()
                raise RuntimeError("zshard-server not ready")
            try:
                with open(cls.port_file) as f:
                    port = int(f.read())
            except (FileNotFoundError, ValueError):
                time.sleep(0.01)
        max_len = 1 << 30
        cls.channel = grpc.insecure_channel(
            "127.0.0.1:%d" % port,
            options=[("grpc.max_receive_message_length", max_len),
                     ("grpc.max_send_message_length", max_len)])
        cls.stub = cls.pbg.ZShardStub(cls.channel)
        cls.health = cls.hpbg.HealthStub(cls.channel)

    @classmethod
    def dump_log(cls):
        cls.log.flush()
        with open(cls.log_path) as f:
            sys.stderr.write("----- zshard-server log -----\n" + f.read() +
                             "----- end of log -----\n")

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.proc.send_signal(signal.SIGTERM)
        try:
            code = cls.proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            cls.proc.kill()
            code = cls.proc.wait()
        cls.log.close()
        if code != 0:
            cls.dump_log()
        shutil.rmtree(cls.tmp, ignore_errors=True)
        if code != 0:
            raise AssertionError("zshard-server exited with %d after SIGTERM" % code)


class ZShardInterop(ServerFixture):

    def test_one_adamw_step_matches_torch_bit_for_bit(self):
        pb = self.pb
        torch.manual_seed(1234)
        shapes = {"fc.weight": (30, 100), "fc.bias": (30,)}
        names = list(shapes)
        weights = {n: torch.randn(shapes[n], dtype=torch.float32) for n in names}
        grads = {n: torch.randn(shapes[n], dtype=torch.float32) for n in names}
        lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01

        spec = pb.ModelSpec(
            job="python-interop", world_size=1, grad_accum=1, num_shards=1,
            grad_reduce=pb.GRAD_REDUCE_MEAN, param_dtype=pb.DTYPE_BF16,
            groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_ADAMW, lr_scale=1.0, beta1=betas[0],
                                  beta2=betas[1], eps=eps, weight_decay=wd)],
            tensors=[pb.TensorSpec(name=n, numel=weights[n].numel(), group=0,
                                   shape=list(shapes[n])) for n in names])
        opened = self.stub.Open(pb.OpenRequest(spec=spec, rank=0), timeout=CALL_TIMEOUT)
        self.assertTrue(opened.created)
        self.assertEqual(opened.version, 0)
        h = opened.spec_hash
        # Below the default split threshold, each tensor is one piece (slice 0).
        for t, n in enumerate(names):
            r = self.stub.InitParams(
                pb.InitParamsRequest(spec_hash=h, tensor=t, slice=0,
                                     data=weights[n].numpy().tobytes()), timeout=CALL_TIMEOUT)
            self.assertTrue(r.written)
        # The server decodes PushRequest by hand (to avoid copying the payload):
        # the last tensor goes in as protobuf allows but no encoder of ours
        # writes it: fields in reverse order, unknown fields between them, and a
        # decoy data field that the real one, coming later, replaces.
        push_raw = self.channel.unary_unary("/zshard.v1.ZShard/Push",
                                            response_deserializer=pb.PushResponse.FromString)
        for t, n in enumerate(names):
            req = pb.PushRequest(spec_hash=h, step=1, rank=0, micro=0, tensor=t, slice=0,
                                 dtype=pb.DTYPE_FP32, data=grads[n].numpy().tobytes())
            if t == len(names) - 1:
                fields = [pb.PushRequest(data=b"decoy").SerializeToString()]
                for f in reversed(req.ListFields()):
                    fields.append(pb.PushRequest(**{f[0].name: f[1]}).SerializeToString())
                    fields.append(b"\x78\x05\x82\x01\x03abc")  # fields 15 and 16
                self.assertFalse(push_raw(b"".join(fields), timeout=CALL_TIMEOUT).duplicate)
            else:
                self.assertFalse(self.stub.Push(req, timeout=CALL_TIMEOUT).duplicate)
            self.assertTrue(self.stub.Push(req, timeout=CALL_TIMEOUT).duplicate)

        stats = self.stub.GradStats(pb.GradStatsRequest(spec_hash=h, step=1, timeout_ms=10000),
                                    timeout=CALL_TIMEOUT)
        self.assertTrue(stats.complete)
        self.assertFalse(stats.nonfinite)
        want = sum(float(np.sum(grads[n].numpy().astype(np.float64) ** 2)) for n in names)
        self.assertLess(abs(stats.sum_squares - want), 1e-12 * want)

        applied = self.stub.Apply(pb.ApplyRequest(spec_hash=h, step=1, lr=lr, coef=1.0),
                                  timeout=CALL_TIMEOUT)
        self.assertEqual((applied.version, applied.skipped, applied.optimizer_steps), (1, False, 1))

        params = [torch.nn.Parameter(weights[n].clone()) for n in names]
        for p, n in zip(params, names):
            p.grad = grads[n].clone()
        torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                          foreach=False).step()

        for t, (n, p) in enumerate(zip(names, params)):
            got = self.stub.Pull(pb.PullRequest(spec_hash=h, tensor=t, slice=0, min_version=1,
                                                dtype=pb.DTYPE_FP32), timeout=CALL_TIMEOUT)
            self.assertEqual(got.version, 1)
            self.assertEqual(got.dtype, pb.DTYPE_FP32)
            mine = np.frombuffer(got.data, dtype=np.uint32)
            theirs = p.detach().numpy().reshape(-1).view(np.uint32)
            differ = int(np.count_nonzero(mine != theirs))
            if differ:
                ulps = np.abs(mine.astype(np.int64) - theirs.astype(np.int64)).max()
                self.fail("%s: %d of %d elements differ from torch.optim.AdamW "
                          "(at most %d ulp)" % (n, differ, mine.size, ulps))
            low = self.stub.Pull(pb.PullRequest(spec_hash=h, tensor=t, slice=0, min_version=1,
                                                dtype=pb.DTYPE_BF16), timeout=CALL_TIMEOUT)
            want_low = p.detach().to(torch.bfloat16).reshape(-1).view(torch.int16).numpy()
            self.assertTrue(np.array_equal(np.frombuffer(low.data, dtype=np.int16), want_low),
                            "%s: the bf16 copy is not torch's bf16 rounding" % n)

        info = self.stub.GetInfo(pb.GetInfoRequest(), timeout=CALL_TIMEOUT)
        self.assertEqual((info.shard_id, info.num_shards), (0, 1))
        self.assertEqual(info.job, "python-interop")
        self.assertEqual(info.spec_hash, h)
        self.assertEqual(info.version, 1)
        self.assertTrue(info.initialized)
        self.assertTrue(info.serving)

    def test_health_check_is_serving(self):
        hpb = self.hpb
        for service in ("", "zshard.v1.ZShard"):
            r = self.health.Check(hpb.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
            self.assertEqual(r.status, hpb.HealthCheckResponse.SERVING)

    def test_errors_carry_the_grpc_code_and_the_zs_status_trailer(self):
        pb, grpc = self.pb, self.grpc
        with self.assertRaises(grpc.RpcError) as cm:
            self.stub.Pull(pb.PullRequest(spec_hash=1, tensor=0, dtype=pb.DTYPE_FP32),
                           timeout=CALL_TIMEOUT)
        code = cm.exception.code()
        trailer = dict(cm.exception.trailing_metadata() or ())
        # Either no job is open yet or the hash is wrong: FAILED_PRECONDITION.
        self.assertEqual(code, grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn(trailer.get("zs-status"), ("-14", "-4"))
        with self.assertRaises(grpc.RpcError) as cm:
            self.channel.unary_unary("/zshard.v1.ZShard/Nope")(b"", timeout=CALL_TIMEOUT)
        self.assertEqual(cm.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
        # A truncated field key is no message at all, for either decoder.
        for method in ("Push", "Open", "Pull"):
            with self.assertRaises(grpc.RpcError) as cm:
                self.channel.unary_unary("/zshard.v1.ZShard/" + method)(b"\xff\xff\xff",
                                                                        timeout=CALL_TIMEOUT)
            self.assertEqual(cm.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, method)
            self.assertEqual(dict(cm.exception.trailing_metadata())["zs-status"], "-10", method)


class Int8BlockInterop(ServerFixture):
    """A foreign client pushes and pulls int8 blocks made from the format's
    specification alone: the shard adds exactly the decoded gradients (two
    AdamW steps bit for bit with torch on them), and its int8 pulls, the
    first quantized on request, the second from the copy made once per
    version, are the bytes the specification gives for its weights."""

    def test_int8_pushes_and_pulls_follow_the_specification(self):
        pb = self.pb
        torch.manual_seed(99)
        # 300 elements: two whole blocks and a short one of 44.
        shapes = {"w": (3, 100), "b": (7,)}
        names = list(shapes)
        weights = {n: torch.randn(shapes[n], dtype=torch.float32) for n in names}
        lr, betas, eps, wd = 1e-2, (0.9, 0.999), 1e-8, 0.01
        spec = pb.ModelSpec(
            job="python-int8", world_size=1, grad_accum=1, num_shards=1,
            grad_reduce=pb.GRAD_REDUCE_MEAN, param_dtype=pb.DTYPE_BF16,
            groups=[pb.ParamGroup(optimizer=pb.OPTIMIZER_ADAMW, lr_scale=1.0, beta1=betas[0],
                                  beta2=betas[1], eps=eps, weight_decay=wd)],
            tensors=[pb.TensorSpec(name=n, numel=weights[n].numel(), group=0,
                                   shape=list(shapes[n])) for n in names])
        h = self.stub.Open(pb.OpenRequest(spec=spec, rank=0), timeout=CALL_TIMEOUT).spec_hash
        for t, n in enumerate(names):
            self.stub.InitParams(pb.InitParamsRequest(spec_hash=h, tensor=t, slice=0,
                                                      data=weights[n].numpy().tobytes()),
                                 timeout=CALL_TIMEOUT)
        params = [torch.nn.Parameter(weights[n].clone()) for n in names]
        opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                foreach=False)
        for step in (1, 2):
            for t, n in enumerate(names):
                g = torch.randn(shapes[n], dtype=torch.float32).numpy().reshape(-1)
                wire = int8_block_encode(g)
                self.assertEqual(len(wire), 4 * ((g.size + 127) // 128) + g.size)
                if step == 1 and t == 0:
                    # One byte short: refused, and nothing is added.
                    with self.assertRaises(self.grpc.RpcError) as cm:
                        self.stub.Push(pb.PushRequest(spec_hash=h, step=step, rank=0, micro=0,
                                                      tensor=t, slice=0,
                                                      dtype=pb.DTYPE_INT8_BLOCK,
                                                      data=wire[:-1]), timeout=CALL_TIMEOUT)
                    self.assertEqual(cm.exception.code(), self.grpc.StatusCode.INVALID_ARGUMENT)
                self.stub.Push(pb.PushRequest(spec_hash=h, step=step, rank=0, micro=0, tensor=t,
                                              slice=0, dtype=pb.DTYPE_INT8_BLOCK, data=wire),
                               timeout=CALL_TIMEOUT)
                params[t].grad = torch.from_numpy(
                    int8_block_decode(wire, g.size).reshape(shapes[n]).copy())
            stats = self.stub.GradStats(pb.GradStatsRequest(spec_hash=h, step=step,
                                                            timeout_ms=10000),
                                        timeout=CALL_TIMEOUT)
            self.assertTrue(stats.complete)
            applied = self.stub.Apply(pb.ApplyRequest(spec_hash=h, step=step, lr=lr, coef=1.0),
                                      timeout=CALL_TIMEOUT)
            self.assertEqual(applied.version, step)
            opt.step()
            for t, (n, p) in enumerate(zip(names, params)):
                got = self.stub.Pull(pb.PullRequest(spec_hash=h, tensor=t, slice=0,
                                                    min_version=step, dtype=pb.DTYPE_FP32),
                                     timeout=CALL_TIMEOUT)
                mine = np.frombuffer(got.data, dtype=np.uint32)
                theirs = p.detach().numpy().reshape(-1).view(np.uint32)
                self.assertTrue(np.array_equal(mine, theirs),
                                "%s step %d: the shard did not add the decoded gradient" %
                                (n, step))
                q = self.stub.Pull(pb.PullRequest(spec_hash=h, tensor=t, slice=0,
                                                  min_version=step, dtype=pb.DTYPE_INT8_BLOCK),
                                   timeout=CALL_TIMEOUT)
                self.assertEqual(q.dtype, pb.DTYPE_INT8_BLOCK)
                self.assertEqual(q.data, int8_block_encode(p.detach().numpy()),
                                 "%s step %d: the int8 pull is not the specification's" %
                                 (n, step))


if __name__ == "__main__":
    unittest.main(verbosity=2)
