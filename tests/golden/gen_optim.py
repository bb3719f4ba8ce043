#!/usr/bin/python3
"""Golden trajectories of torch's optimizers for tests/unit/test_optim.c.

Run with Debian's interpreter (it has torch 1.13):

    /usr/bin/python3 tests/golden/gen_optim.py [output]   # default: optim.bin beside this script

For a fixed small "model" (tensors whose lengths are mostly not multiples of 8)
and a fixed gradient stream, runs torch.optim.AdamW / Adam / SGD for N_STEPS
steps in several configurations and records what the C kernels must reproduce
bit for bit: the master weights' hash after every step, the final master
weights, and hashes of the final optimizer state.

The gradients are not stored: they come from a counter-based generator
(splitmix64 of seed, step and element index, turned into a float exactly)
that the C test reimplements; the file carries the hash of the first step's
gradients so that a disagreement between the two generators is reported as
such. Hashes are position-dependent sums of splitmix64 over the 32-bit words,
computed identically in C.

torch has no switch for Adam's bias correction, so bias_correction=0 is run
through replicas of torch 1.13's _single_tensor_adamw / _single_tensor_adam
that issue the same tensor operations in the same order with both bias
corrections set to 1 (as DeepSpeedCPUAdam does). The replicas are checked
against torch.optim with bias correction on, bit for bit, before they are
trusted.

File layout (little-endian):
    char     magic[8] = "ZSOPTIM1"
    u32      n_tensors, n_steps
    u64      grad_seed
    u64      grad_hash_step1          hash of the concatenated step-1 gradients
    u32      lengths[n_tensors]
    f32      init_master[total]
    u32      n_configs
    per config:
        char name[32]                 NUL-padded
        u32  optimizer                0 adamw, 1 adam, 2 sgd (zs_optimizer)
        u32  bias_correction, nesterov, reserved
        f64  beta1, beta2, eps, weight_decay, momentum, dampening
        f64  lr[n_steps]              the learning rate of each step
        u64  master_hash[n_steps]     after each step
        u64  m_hash, v_hash           final exp_avg (or momentum buffer), exp_avg_sq; 0 if unused
        f32  final_master[total]
"""
import math
import os
import struct
import sys

import numpy as np
import torch

N_STEPS = 60
GRAD_SEED = 0x5A5A2024C0FFEE11
LENGTHS = [1, 7, 8, 33, 1000, 4099]
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x):
    """splitmix64's finaliser of x + golden gamma, elementwise on uint64."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & M64
        return z ^ (z >> np.uint64(31))


def gradients(step, total):
    """The gradient of every element at 1-based `step`, exactly as float32.

    z = splitmix64(seed ^ (step << 32) ^ i); one element in 64 is an exact zero,
    the others are (-1)^s * mant * 2^-(24 + e) with a 24-bit mant and e in
    0..15, so magnitudes span 2^-39 .. 1 and every value is exact in float.
    """
    i = np.arange(total, dtype=np.uint64)
    z = splitmix64(np.uint64(GRAD_SEED) ^ (np.uint64(step) << np.uint64(32)) ^ i)
    mant = (z & np.uint64(0xFFFFFF)).astype(np.float64)
    sign = np.where((z >> np.uint64(24)) & np.uint64(1), -1.0, 1.0)
    e = ((z >> np.uint64(25)) & np.uint64(15)).astype(np.int64)
    g = sign * np.ldexp(mant, -(24 + e))
    g[((z >> np.uint64(29)) & np.uint64(63)) == 0] = 0.0
    out = g.astype(np.float32)
    assert np.array_equal(out.astype(np.float64), g), "gradient not exact in float32"
    return out


def hash_f32(a):
    """Position-dependent hash of a float32 array's bit patterns."""
    w = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    i = np.arange(w.size, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.sum(splitmix64(w ^ (i << np.uint64(32))), dtype=np.uint64))


def initial_master():
    rng = np.random.default_rng(20240613)
    parts = []
    for n in LENGTHS:
        scale = 0.02 if n > 8 else 1.0  # weights vs. norm scales / biases
        parts.append((rng.standard_normal(n) * scale).astype(np.float32))
    init = np.concatenate(parts)
    init[3] = 0.0  # an exact zero and a negative zero ride along
    init[20] = -0.0
    return init


def split(flat):
    out, off = [], 0
    for n in LENGTHS:
        out.append(flat[off:off + n])
        off += n
    return out


# -- replicas of torch 1.13's single-tensor loops, for bias_correction=0 -------


def replica_adamw(params, grads, state, lr, beta1, beta2, eps, wd, bias_correction):
    for p, g, st in zip(params, grads, state):
        st["step"] += 1
        step = st["step"]
        p.mul_(1 - lr * wd)
        st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = 1 - beta1 ** step if bias_correction else 1
        bc2 = 1 - beta2 ** step if bias_correction else 1
        step_size = lr / bc1
        bc2_sqrt = math.sqrt(bc2)
        denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(st["exp_avg"], denom, value=-step_size)


def replica_adam(params, grads, state, lr, beta1, beta2, eps, wd, bias_correction):
    for p, g, st in zip(params, grads, state):
        st["step"] += 1
        step = st["step"]
        if wd != 0:
            g = g.add(p, alpha=wd)
        st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(g, g.conj(), value=1 - beta2)
        bc1 = 1 - beta1 ** step if bias_correction else 1
        bc2 = 1 - beta2 ** step if bias_correction else 1
        step_size = lr / bc1
        bc2_sqrt = math.sqrt(bc2)
        denom = (st["exp_avg_sq"].sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(st["exp_avg"], denom, value=-step_size)


# -- configurations ------------------------------------------------------------


def const_lr(lr):
    return [lr] * N_STEPS


def warmup_cosine(peak, warmup):
    out = []
    for s in range(1, N_STEPS + 1):
        if s <= warmup:
            out.append(peak * s / warmup)
        else:
            t = (s - warmup) / (N_STEPS - warmup)
            out.append(peak * 0.5 * (1 + math.cos(math.pi * t)))
    return out


def step_decay(lr, every, gamma):
    return [lr * gamma ** ((s - 1) // every) for s in range(1, N_STEPS + 1)]


ADAMW, ADAM, SGD = 0, 1, 2


def cfg(name, opt, lrs, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, momentum=0.0, dampening=0.0,
        nesterov=False, bias_correction=True, replica=False):
    return dict(name=name, opt=opt, lrs=lrs, beta1=beta1, beta2=beta2, eps=eps, wd=wd,
                momentum=momentum, dampening=dampening, nesterov=nesterov,
                bias_correction=bias_correction, replica=replica)


CONFIGS = [
    cfg("adamw_default", ADAMW, const_lr(1e-3), wd=1e-2),
    cfg("adamw_lr1e-2_wd0.1", ADAMW, const_lr(1e-2), wd=0.1),
    cfg("adamw_lr3e-4_wd0", ADAMW, const_lr(3e-4), wd=0.0),
    cfg("adamw_sched_b0.95_eps1e-6", ADAMW, warmup_cosine(5e-3, 10), beta2=0.95, eps=1e-6,
        wd=0.05),
    # Unusual on purpose: here (float)(1 - lr*wd) differs from 1 - (float)(lr*wd),
    # which pins down where torch rounds the decay factor.
    cfg("adamw_lr0.1_wd0.9", ADAMW, const_lr(0.1), wd=0.9),
    cfg("adamw_nobc", ADAMW, const_lr(1e-3), wd=1e-2, bias_correction=False, replica=True),
    cfg("adam_wd1e-2", ADAM, const_lr(1e-3), wd=1e-2),
    cfg("adam_lr2e-3", ADAM, const_lr(2e-3)),
    cfg("adam_nobc_wd1e-3", ADAM, const_lr(5e-4), wd=1e-3, bias_correction=False, replica=True),
    cfg("sgd_lr0.1", SGD, const_lr(0.1)),
    cfg("sgd_lr0.03_wd1e-3", SGD, const_lr(0.03), wd=1e-3),
    cfg("sgd_mom0.9_damp0.1", SGD, const_lr(0.05), momentum=0.9, dampening=0.1),
    cfg("sgd_nesterov_wd5e-4", SGD, const_lr(0.01), momentum=0.9, nesterov=True, wd=5e-4),
    cfg("sgd_mom0.8_wd_sched", SGD, step_decay(0.2, 15, 0.5), momentum=0.8, wd=1e-3),
]


def make_torch_optimizer(c, params):
    if c["opt"] == ADAMW:
        return torch.optim.AdamW(params, lr=c["lrs"][0], betas=(c["beta1"], c["beta2"]),
                                 eps=c["eps"], weight_decay=c["wd"])
    if c["opt"] == ADAM:
        return torch.optim.Adam(params, lr=c["lrs"][0], betas=(c["beta1"], c["beta2"]),
                                eps=c["eps"], weight_decay=c["wd"])
    return torch.optim.SGD(params, lr=c["lrs"][0], momentum=c["momentum"],
                           dampening=c["dampening"], nesterov=c["nesterov"],
                           weight_decay=c["wd"])


def run(c, init, use_replica):
    """Runs configuration c; returns (per-step master hashes, final master, m, v)."""
    total = init.size
    params = [torch.nn.Parameter(torch.from_numpy(x.copy())) for x in split(init)]
    if use_replica:
        state = [dict(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                 for p in params]
        fn = replica_adamw if c["opt"] == ADAMW else replica_adam
    else:
        opt = make_torch_optimizer(c, params)
    hashes = []
    for s in range(1, N_STEPS + 1):
        grads = [torch.from_numpy(g.copy()) for g in split(gradients(s, total))]
        lr = c["lrs"][s - 1]
        if use_replica:
            with torch.no_grad():
                fn(params, grads, state, lr, c["beta1"], c["beta2"], c["eps"], c["wd"],
                   c["bias_correction"])
        else:
            for p, g in zip(params, grads):
                p.grad = g
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        hashes.append(hash_f32(np.concatenate([p.detach().numpy() for p in params])))
    master = np.concatenate([p.detach().numpy() for p in params])
    if use_replica:
        m = np.concatenate([st["exp_avg"].numpy() for st in state])
        v = np.concatenate([st["exp_avg_sq"].numpy() for st in state])
    elif c["opt"] == SGD:
        m = (np.concatenate([opt.state[p]["momentum_buffer"].numpy() for p in params])
             if c["momentum"] != 0 else None)
        v = None
    else:
        m = np.concatenate([opt.state[p]["exp_avg"].numpy() for p in params])
        v = np.concatenate([opt.state[p]["exp_avg_sq"].numpy() for p in params])
    return hashes, master, m, v


def check_replicas(init):
    """The replicas must reproduce torch.optim exactly when bias correction is on."""
    for opt in (ADAMW, ADAM):
        for wd in (0.0, 1e-2):
            c = cfg("check", opt, warmup_cosine(2e-3, 5), wd=wd)
            got = run(c, init, use_replica=True)
            want = run(c, init, use_replica=False)
            assert got[0] == want[0], f"replica of optimizer {opt} (wd={wd}) diverges from torch"


def main():
    torch.set_num_threads(1)
    cap = torch.__config__.show()
    if "CPU capability usage: AVX2" not in cap:
        sys.exit("gen_optim.py: expected torch's AVX2 CPU kernels (see torch.__config__.show())")
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "optim.bin")

    init = initial_master()
    total = init.size
    check_replicas(init)

    blob = bytearray()
    blob += b"ZSOPTIM1"
    blob += struct.pack("<IIQQ", len(LENGTHS), N_STEPS, GRAD_SEED, hash_f32(gradients(1, total)))
    blob += struct.pack(f"<{len(LENGTHS)}I", *LENGTHS)
    blob += init.astype("<f4").tobytes()
    blob += struct.pack("<I", len(CONFIGS))
    for c in CONFIGS:
        hashes, master, m, v = run(c, init, use_replica=c["replica"])
        name = c["name"].encode()
        assert len(name) < 32
        blob += name.ljust(32, b"\0")
        blob += struct.pack("<IIII", c["opt"], int(c["bias_correction"]), int(c["nesterov"]), 0)
        blob += struct.pack("<6d", c["beta1"], c["beta2"], c["eps"], c["wd"], c["momentum"],
                            c["dampening"])
        blob += struct.pack(f"<{N_STEPS}d", *c["lrs"])
        blob += struct.pack(f"<{N_STEPS}Q", *hashes)
        blob += struct.pack("<QQ", hash_f32(m) if m is not None else 0,
                            hash_f32(v) if v is not None else 0)
        blob += master.astype("<f4").tobytes()
        print(f"{c['name']:28s} final |master|_2 = {np.linalg.norm(master.astype(np.float64)):.6f}")
    with open(out_path, "wb") as f:
        f.write(blob)
    print(f"wrote {out_path}: {len(blob)} bytes, {len(CONFIGS)} configurations, {N_STEPS} steps")


if __name__ == "__main__":
    main()
