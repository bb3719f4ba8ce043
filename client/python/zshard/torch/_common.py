"""Helpers zshard.torch's modules share: the buffers handed to the C
extension, each parameter's record, and the function mode that makes
parameters current before torch reads them (see zshard/torch.py)."""

import ctypes
import os

import torch
from torch.overrides import TorchFunctionMode

import zshard

# What the current C API cannot do yet (each raises a clear error here).
NOTES: dict[str, str] = {}

_UNUSED, _QUEUED, _DONE = 0, 1, 2

# torch.int8 stands for zshard's int8 blocks (128 elements with an fp32 scale,
# docs/PROTOCOL.md): the buffers stay fp32, only the wire is quantized.
_WIRE = {torch.float32: zshard.FP32, torch.float16: zshard.FP16, torch.bfloat16: zshard.BF16,
         torch.int8: zshard.INT8_BLOCK}


def _buffer(t):
    """A writable buffer over a contiguous fp32 CPU tensor's memory, no copy.
    Not t.numpy(): that marks the storage non-resizable for good, and
    release_after_forward resizes parameters' storage. The buffer does not
    keep `t` alive: the caller holds `t` until the transfer is waited."""
    if t.device.type != "cpu":
        # A device pointer read as host memory would be garbage or a crash:
        # device tensors go through _device.py's staging blocks.
        raise RuntimeError("zshard.torch: a %s tensor handed to the extension as host memory"
                           % t.device)
    if t.numel() == 0:
        return bytearray()
    return (ctypes.c_float * t.numel()).from_address(t.data_ptr())


def _grad_buffer(g):
    """_buffer(g) for a push, None for a parameter without a gradient (the
    push then says so: zs_push with no buffer)."""
    return None if g is None else _buffer(g)


def _limit_mmap_threshold(nbytes):
    """glibc only: serve allocations of `nbytes` and more with mmap, so that
    the memory of a released parameter leaves the process when it is freed.
    By default glibc raises its threshold to the largest mmapped block freed
    so far (up to 32 MiB): after the first parameters are freed, the next
    ones come from the heap, and freeing them keeps them resident. The
    server fixes the same threshold (1 MiB) for the same reason. A
    MALLOC_MMAP_THRESHOLD_ in the environment wins."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        M_MMAP_THRESHOLD = -3
        return libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(int(nbytes))) == 1
    except (OSError, AttributeError):
        return False


def _storage_key(t):
    """Identifies the storage of `t` across resizes (the StorageImpl)."""
    try:
        return t.storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


class _Param:
    """One managed parameter: its zshard tensor id and where its data is."""
    __slots__ = ("idx", "p", "name", "numel", "group", "unit", "alloc", "pulled_version",
                 "current", "pull", "bump", "micro", "failed", "node", "key", "last_op",
                 "stage")

    def __init__(self, idx, p, name, group):
        self.idx, self.p, self.name, self.group = idx, p, name, group
        self.numel = p.numel()
        self.unit = None           # index into the unit order (after the first forward)
        self.alloc = True          # the storage holds numel elements
        self.current = False       # the storage holds the current version
        self.pulled_version = -1   # the version last pulled into the storage
        self.pull = None           # zshard.Request of a pull in flight
        self.bump = False          # that pull brings a new version
        self.micro = 0             # gradients pushed this step (the next micro-batch)
        self.failed = []           # (micro, gradient) of pushes that failed
        self.node = None           # the AccumulateGrad node (kept alive for its hook)
        self.key = _storage_key(p)
        self.last_op = -1
        self.stage = None          # _device.Staged of the pull in flight (staged path)


class _Mode(TorchFunctionMode):
    """Active during the model's forward: makes every parameter an op reads
    current first, and releases parameters after their last use."""

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        o._op += 1
        for a in args:
            o._touch(a)
        for a in kwargs.values():
            o._touch(a)
        out = func(*args, **kwargs)
        if o._release_at:
            for P in o._release_at.get(o._op, ()):
                o._release(P)
        return out
