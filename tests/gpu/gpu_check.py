"""zshard.torch on a GPU (issue 27): started by tests/gpu/run from a bundle.

(a) Bits. A small transformer on the device trains through zshard (2 shards,
    fp32 wire); each step its gradients are copied to the CPU and fed to
    torch.optim.AdamW on a CPU copy of the model, and after every step every
    weight must equal the reference's bit for bit. Three variants:
    plain, release_after_forward=True, and autocast bf16 (the weights and
    gradients stay fp32, so the contract is the same). Then fp16 autocast
    with zshard's dynamic loss scaling and bf16 wire: trains (finite loss,
    steps applied or skipped for overflow), no bit check.
(b) Throughput. A ~110M-parameter GPT (GPT-2 small shapes, vocab 32000,
    tied head), autocast bf16, bf16 wire, for 20 steps each: plain torch with
    torch.optim.AdamW on the GPU, zshard, zshard with release_after_forward.
    The batch is doubled from 8 (seq 512) until plain torch's step takes at
    least 0.2 s. Printed per run: median step time (steps 3..20), the
    compute stream's wait on copy events and the host's wait for pulls per
    step, PCIe bytes per step, pinned staging bytes (peak), GPU peak memory
    and the memory held between steps.

--cpu-dry-run: everything above on the CPU, tiny sizes, the staged path
over _device.FakeBackend (so every staged line runs), with the bundle's
server and extension; it also checks the extension and gRPC were loaded
from the bundle. Results go to stdout and, with --out DIR, DIR/gpu_check.json.
Exit status 0 only if every check passed.
"""

import argparse
import copy
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BUNDLE = os.environ.get("ZSHARD_BUNDLE") or os.path.dirname(os.path.abspath(__file__))
T0 = time.monotonic()
BUDGET_S = 450.0
RESULTS = {"checks": {}, "throughput": {}}


def say(*a):
    print("[%6.1f s]" % (time.monotonic() - T0), *a, flush=True)


def check(name, ok, detail=""):
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": detail}
    say("%s %s %s" % ("PASS" if ok else "FAIL", name, detail))
    return ok


def version_tuple(v):
    return tuple(int(x) for x in v.split(".") if x.isdigit())


def preflight():
    """The machine's C runtime is new enough for the extension, which the
    Python process loads with the machine's own libc."""
    need = {}
    with open(os.path.join(BUNDLE, "MANIFEST")) as f:
        for line in f:
            k, _, v = line.strip().partition(" ")
            if k in ("glibc_needed", "glibcxx_needed"):
                need[k] = v
    have = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
    want = need.get("glibc_needed", "GLIBC_0").split("_")[-1]
    if version_tuple(have) < version_tuple(want):
        sys.exit("gpu_check: this machine's glibc is %s, the bundle's extension needs %s: build "
                 "the bundle on an older distribution (or build the extension here)" % (have, want))


class Shards:
    """n zshard-server processes from the bundle, under the bundle's own
    loader and C runtime, on loopback port 0."""

    def __init__(self, n, threads):
        self.n, self.threads = n, threads

    def __enter__(self):
        rt = os.path.join(BUNDLE, "lib", "runtime")
        loader = [os.path.join(rt, f) for f in os.listdir(rt) if f.startswith("ld-linux")]
        server = os.path.join(BUNDLE, "bin", "zshard-server")
        prefix = [loader[0], "--library-path", rt + ":" + os.path.join(BUNDLE, "lib")]
        self.tmp = tempfile.mkdtemp(prefix="zshard-gpu-")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ZSHARD_", "LD_"))}
        self.procs, ports = [], []
        for i in range(self.n):
            pf = os.path.join(self.tmp, "port%d" % i)
            log = open(os.path.join(self.tmp, "log%d" % i), "w")
            self.procs.append(subprocess.Popen(
                prefix + [server, "--listen", "127.0.0.1:0", "--port-file", pf, "--shard-id",
                          str(i), "--shards", str(self.n), "--threads", str(self.threads)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env))
        for i, p in enumerate(self.procs):
            pf = os.path.join(self.tmp, "port%d" % i)
            deadline = time.monotonic() + 30
            while not (os.path.exists(pf) and open(pf).read().strip()):
                if p.poll() is not None or time.monotonic() > deadline:
                    self.__exit__()
                    raise RuntimeError("zshard-server %d did not start: %s" % (
                        i, open(os.path.join(self.tmp, "log%d" % i)).read()[-2000:]))
                time.sleep(0.02)
            ports.append(int(open(pf).read().strip()))
        self.addresses = ",".join("127.0.0.1:%d" % p for p in ports)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def loaded_from_bundle(zshard):
    """The extension is the bundle's abi3 build, and the libraries it needs
    (gRPC, protobuf-c, libuv) were mapped from the bundle's lib/."""
    ext = os.path.realpath(zshard._zshard.__file__)
    ok = ext.startswith(os.path.realpath(BUNDLE)) and ext.endswith(".abi3.so")
    maps = open("/proc/self/maps").read().split("\n")
    libs = {line.split()[-1] for line in maps if ".so" in line and "/" in line}
    ours = [p for p in libs if any(n in os.path.basename(p) for n in ("libgrpc", "libuv",
                                                                       "libprotobuf-c"))]
    inside = [p for p in ours if os.path.realpath(p).startswith(os.path.realpath(BUNDLE))]
    return check("bundle_loads", ok and ours and len(inside) == len(ours),
                 "extension %s; %d of %d gRPC/uv/protobuf-c libraries from the bundle"
                 % (ext, len(inside), len(ours)))


# ---- models ------------------------------------------------------------------------------


def models(torch, nn, F):
    class Tiny(nn.Module):
        def __init__(self, vocab=40, d=64, heads=4, ff=128):
            super().__init__()
            self.vocab = vocab
            self.emb = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
                for _ in range(2))
            self.head = nn.Linear(d, vocab)

        def forward(self, x):
            h = self.emb(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                       for z in (q, k, v))
            if hasattr(F, "scaled_dot_product_attention"):
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:   # torch 1.13 (the CPU dry run)
                s = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
                mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
                a = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab, d, layers, heads, seq):
            super().__init__()
            self.vocab = vocab
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.tok.weight

        def forward(self, x):
            h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln(h))

    return Tiny, GPT


# ---- (a) bits -----------------------------------------------------------------------------


class AdamW113:
    """torch 1.13's single-tensor AdamW step, operation for operation: the
    algorithm the shards run. torch 2.x's own AdamW computes the first
    moment with lerp_, which rounds differently, so on torch 2.x the check
    compares against this and reports separately whether torch's own
    AdamW agreed (on the dry run's torch 1.13 both must)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        import torch
        self.params = params
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    def step(self, grads):
        import math
        self.t += 1
        b1, b2 = self.betas
        for p, g, m, v in zip(self.params, grads, self.m, self.v):
            p.mul_(1 - self.lr * self.wd)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
            denom = (v.sqrt() / math.sqrt(bc2)).add_(self.eps)
            p.addcdiv_(m, denom, value=-(self.lr / bc1))


def bits(torch, nn, zshard, Tiny, dev, steps, name, release=False, autocast=None):
    """Trains Tiny on `dev` through zshard; feeds the gradients of every step
    to CPU AdamW on a CPU copy; compares every weight after every step."""
    torch.manual_seed(1)
    model = Tiny()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    ref113 = AdamW113([p.detach().clone() for p in model.parameters()])
    torch_same = True
    model = model.to(dev)
    names = [n for n, _ in model.named_parameters()]
    grads = {}
    for n, p in model.named_parameters():
        # Each parameter is used once per forward: its hook sees the whole
        # gradient (release_after_forward keeps no p.grad).
        p.register_hook(lambda g, n=n: grads.__setitem__(n, g.detach().to("cpu", copy=True)))
    g = torch.Generator().manual_seed(2)
    loss_fn = nn.CrossEntropyLoss()
    bad = None
    with Shards(2, 2) as shards:
        opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 addresses=shards.addresses, wire_dtype=torch.float32, rank=0,
                                 world_size=1, split_threshold=4096, job="bits-" + name,
                                 release_after_forward=release, open_mode="create")
        try:
            for step in range(1, steps + 1):
                x = torch.randint(0, model.vocab, (8, 12), generator=g)
                y = torch.roll(x, 1, dims=1)
                x, y = x.to(dev), y.to(dev)
                opt.zero_grad()
                grads.clear()
                if autocast is not None:
                    with torch.autocast(dev.type, dtype=autocast):
                        out = model(x)
                else:
                    out = model(x)
                loss_fn(out.float().reshape(-1, model.vocab), y.reshape(-1)).backward()
                opt.step()
                for n, p in ref.named_parameters():
                    p.grad = grads[n]
                ref_opt.step()
                ref113.step([grads[n] for n in names])
                opt.gather()
                for n, p, q, r in zip(names, model.parameters(), ref.parameters(),
                                      ref113.params):
                    a = p.detach().to("cpu").view(torch.int32)
                    torch_same = torch_same and torch.equal(a, q.detach().view(torch.int32))
                    if not torch.equal(a, r.view(torch.int32)):
                        bad = "step %d: %s differs" % (step, n)
                        break
                if bad:
                    break
        finally:
            opt.close(close_job=True)
    RESULTS["checks"].setdefault("torch_adamw_same_bits", {"ok": True, "detail": ""})
    if not torch_same:
        # Informational on torch 2.x (lerp_); a failure on torch 1.13.
        RESULTS["checks"]["torch_adamw_same_bits"] = {
            "ok": not torch.__version__.startswith("1.13"),
            "detail": "torch %s's own AdamW differs from 1.13's single-tensor step (%s)"
                      % (torch.__version__, name)}
        say("NOTE torch %s's AdamW rounds differently from the shards' (1.13's) step in %s"
            % (torch.__version__, name))
    return check("bits_" + name, bad is None, bad or "%d steps, every weight bit for bit with "
                 "1.13's AdamW over the GPU's gradients%s" % (
                     steps, " (and torch's own)" if torch_same else ""))


def fp16_scaled(torch, nn, zshard, Tiny, dev, steps):
    """fp16 autocast (on a GPU) with dynamic loss scaling and a bf16 wire."""
    torch.manual_seed(1)
    model = Tiny().to(dev)
    g = torch.Generator().manual_seed(2)
    loss_fn = nn.CrossEntropyLoss()
    losses, applied = [], 0
    with Shards(2, 2) as shards:
        opt = zshard.torch.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 addresses=shards.addresses, wire_dtype=torch.bfloat16, rank=0,
                                 world_size=1, job="fp16", loss_scaling="dynamic",
                                 open_mode="create")
        try:
            for _ in range(steps):
                x = torch.randint(0, model.vocab, (8, 12), generator=g).to(dev)
                opt.zero_grad()
                if dev.type == "cuda":
                    with torch.autocast("cuda", dtype=torch.float16):
                        out = model(x)
                else:
                    out = model(x)   # no fp16 autocast on the CPU: the scaling path only
                loss = loss_fn(out.float().reshape(-1, model.vocab), x.reshape(-1))
                (loss * opt.loss_scale).backward()
                opt.step()
                losses.append(float(loss))
                applied += bool(opt.last_result.applied)
        finally:
            opt.close(close_job=True)
    ok = all(v == v and abs(v) < 1e9 for v in losses) and applied > 0
    return check("fp16_dynamic_loss_scale", ok, "%d of %d steps applied, loss %.3f -> %.3f"
                 % (applied, steps, losses[0], losses[-1]))


# ---- (b) throughput ---------------------------------------------------------------------


def sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def gpt_run(torch, nn, zshard, GPT, dev, cfg, batch, mode, steps, addresses):
    """One run of `steps` steps: mode "torch" (plain AdamW on the device),
    "zshard" or "zshard-release". Returns its figures."""
    torch.manual_seed(0)
    model = GPT(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["seq"]).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = inner
    if mode != "torch":
        opt = zshard.torch.shard(model, inner, addresses=addresses, wire_dtype=torch.bfloat16,
                                 rank=0, world_size=1, split_threshold=1 << 20, job=mode,
                                 release_after_forward=mode.endswith("release"), prefetch=2,
                                 open_mode="create")
    g = torch.Generator().manual_seed(3)
    loss_fn = nn.CrossEntropyLoss()
    amp = torch.bfloat16 if dev.type == "cuda" else None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times, waits, pull_waits, pcie, held = [], [], [], [], []
    last = opt.staging_stats() if mode != "torch" else None
    try:
        for step in range(steps):
            x = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]), generator=g).to(dev)
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if amp is not None:
                with torch.autocast(dev.type, dtype=amp):
                    out = model(x)
            else:
                out = model(x)
            loss_fn(out.float().reshape(-1, cfg["vocab"]), x.reshape(-1)).backward()
            opt.step()
            sync(torch, dev)
            times.append(time.perf_counter() - t)
            if dev.type == "cuda":
                held.append(torch.cuda.memory_allocated(dev))
            if mode != "torch":
                s = opt.staging_stats()
                waits.append(s["compute_wait_ms"] - last["compute_wait_ms"])
                pcie.append(s["d2h_bytes"] + s["h2d_bytes"] - last["d2h_bytes"] - last["h2d_bytes"])
                pull_waits.append(opt.timing().pull_wait_ms)
                last = s
    finally:
        stats = opt.staging_stats() if mode != "torch" else {}
        if mode != "torch":
            opt.close(close_job=True, gather=False)
    rest = slice(2, None) if steps > 3 else slice(0, None)
    step_s = statistics.median(times[rest])
    out = {"mode": mode, "params": nparams, "batch": batch, "seq": cfg["seq"],
           "step_s": round(step_s, 4)}
    if mode != "torch":
        out.update(compute_wait_ms_per_step=round(statistics.mean(waits[rest]), 3),
                   compute_wait_share=round(statistics.mean(waits[rest]) / 1000 / step_s, 4),
                   pull_wait_ms_per_step=round(statistics.mean(pull_waits[rest]), 3),
                   pcie_bytes_per_step=int(statistics.mean(pcie[rest])),
                   pinned_peak_bytes=int(stats["pinned_peak_bytes"]),
                   staging_limit_bytes=int(stats["staging_limit_bytes"]),
                   staging_over_limit=int(stats["staging_over_limit"]))
    if dev.type == "cuda":
        out.update(gpu_peak_bytes=int(torch.cuda.max_memory_allocated(dev)),
                   gpu_between_steps_bytes=int(statistics.median(held[rest])))
    say(json.dumps(out))
    del model, opt, inner
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def throughput(torch, nn, zshard, GPT, dev, dry):
    if dry:
        cfg, batch, steps = dict(vocab=256, d=64, layers=2, heads=4, seq=32), 2, 4
    else:
        cfg, batch, steps = dict(vocab=32000, d=768, layers=12, heads=12, seq=512), 8, 20
        # Plain torch's step must take at least 0.2 s: double the batch until it does.
        while batch < 512:
            r = gpt_run(torch, nn, zshard, GPT, dev, cfg, batch, "torch", 4, None)
            if r["step_s"] >= 0.2:
                break
            batch *= 2
    res = {"torch": gpt_run(torch, nn, zshard, GPT, dev, cfg, batch, "torch", steps, None)}
    with Shards(2, 8 if not dry else 1) as shards:
        for mode in ("zshard", "zshard-release"):
            if time.monotonic() - T0 > BUDGET_S:
                say("out of time before", mode)
                break
            res[mode] = gpt_run(torch, nn, zshard, GPT, dev, cfg, batch, mode, steps,
                                shards.addresses)
    RESULTS["throughput"] = res
    base = res["torch"]["step_s"]
    for mode in ("zshard", "zshard-release"):
        if mode in res:
            r = res[mode]
            say("%-15s step %.3f s (%.2fx torch's %.3f s), compute stream waited %.1f ms/step "
                "(%.1f %%), host waited %.1f ms/step for pulls, PCIe %.1f MB/step, pinned peak "
                "%.1f MB%s" % (mode, r["step_s"], r["step_s"] / base, base,
                               r["compute_wait_ms_per_step"], 100 * r["compute_wait_share"],
                               r["pull_wait_ms_per_step"], r["pcie_bytes_per_step"] / 1e6,
                               r["pinned_peak_bytes"] / 1e6,
                               ", GPU peak %.2f GB, between steps %.2f GB (torch: %.2f / %.2f)" % (
                                   r["gpu_peak_bytes"] / 1e9, r["gpu_between_steps_bytes"] / 1e9,
                                   res["torch"]["gpu_peak_bytes"] / 1e9,
                                   res["torch"]["gpu_between_steps_bytes"] / 1e9)
                               if "gpu_peak_bytes" in r else ""))
    return check("throughput_ran", "zshard-release" in res,
                 "batch %d x seq %d" % (batch, cfg["seq"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--out", help="folder for gpu_check.json")
    ap.add_argument("--skip-throughput", action="store_true")
    a = ap.parse_args()
    preflight()
    import torch
    import torch.nn.functional as F
    from torch import nn
    import zshard
    import zshard.torch
    from zshard.torch import _device
    loaded_from_bundle(zshard)
    RESULTS["torch"] = torch.__version__
    RESULTS["python"] = sys.version.split()[0]
    if a.cpu_dry_run:
        dev = torch.device("cpu")
        _device.FORCE_BACKEND = lambda: _device.FakeBackend(progress=True, timing=True)
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_check: torch %s sees no CUDA device (--cpu-dry-run for the CPU)"
                     % torch.__version__)
        dev = torch.device("cuda", torch.cuda.current_device())
        RESULTS["gpu"] = torch.cuda.get_device_name(dev)
        _device.FORCE_BACKEND = lambda: _device.CudaBackend(dev, timing=True)
    say("torch %s, python %s, device %s%s" % (torch.__version__, RESULTS["python"], dev,
                                            " (%s)" % RESULTS["gpu"] if "gpu" in RESULTS else ""))
    Tiny, GPT = models(torch, nn, F)
    steps = 5 if a.cpu_dry_run else 30
    bits(torch, nn, zshard, Tiny, dev, steps, "fp32")
    bits(torch, nn, zshard, Tiny, dev, steps, "release", release=True)
    bits(torch, nn, zshard, Tiny, dev, steps, "autocast_bf16", autocast=torch.bfloat16)
    fp16_scaled(torch, nn, zshard, Tiny, dev, steps)
    if not a.skip_throughput:
        throughput(torch, nn, zshard, GPT, dev, a.cpu_dry_run)
    ok = all(c["ok"] for c in RESULTS["checks"].values())
    RESULTS["ok"] = ok
    RESULTS["seconds"] = round(time.monotonic() - T0, 1)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    say("%s in %.0f s" % ("ALL PASSED" if ok else "FAILED", RESULTS["seconds"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
