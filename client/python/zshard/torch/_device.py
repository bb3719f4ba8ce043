"""The one seam between zshard.torch and an accelerator.

Every line of zshard.torch that knows a parameter may live on a GPU is here;
the rest of the package hands host buffers to the C extension and does not
care where the tensors came from.

Two paths:

* HostPath (CPU parameters, the default): the identity. A gradient is pushed
  from p.grad's own memory and a pull writes straight into the parameter's
  storage, as before this module existed; the transfers code does not even
  call into it on that path (`staged` is False), so the CPU path keeps its
  speed and its copies (none).

* StagedPath (CUDA parameters): a gradient leaves the device as soon as
  AccumulateGrad fires: on a side ("copy") stream that first waits for an
  event recorded on the compute stream, it is cast to the wire dtype on the
  device (bf16 or fp16 halve the PCIe bytes; fp32 and int8 blocks travel as
  fp32, the library encodes int8) and copied into a pinned staging block;
  the push is submitted from that block once the copy's event has completed
  (polled, never waited on while backward runs; waited at the end of
  backward), so the library pushes it without another copy. A pull lands in
  a pinned block in the wire dtype; once it has arrived the block is copied
  host-to-device and widened to fp32 on the copy stream, and the compute
  stream waits for that copy's event (stream.wait_event: no device-wide
  synchronize, no host wait). The block goes back to the pool once the
  copy's event has completed.

Copies per transfer, staged: a push is one device cast (wire dtype narrower
than fp32 only), one device-to-host copy, then the library's send from the
pinned block; a pull is the library's receive into the pinned block, one
host-to-device copy and one device widening.

Staging blocks come from StagingPool: blocks of a power-of-two size, reused,
bounded by a byte limit sized by the prefetch window (shard(...,
staging_bytes=N) overrides it). When a new block would pass the limit the
pool first frees idle blocks, then waits for blocks whose copies are still
running, then asks its owner to finish the oldest transfer in flight; only
when nothing is left to give back (the batch being submitted, a prefetch
window's pulls or a module's gradients, does not fit in the whole pool)
does it go over, and counts that.

The pool and every ordering decision are device-agnostic: they talk to a
backend (streams, events, host blocks, running work on a stream).
CudaBackend is the only code that needs CUDA. FakeBackend runs the same
logic on the CPU with ordinary (non-pinned) blocks and lazy streams: work
queued on its copy stream runs only when an event after it is waited for or
polled with progress on, and it records the order of every wait, so the CPU
tests prove that no data is read before its event and tests/gpu/run
--cpu-dry-run drives the staged path end to end without a GPU.
"""

from __future__ import annotations

import collections
import ctypes
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

import zshard

_MIN_BLOCK = 4096


def _block_size(nbytes: int) -> int:
    """The pool's size class for `nbytes`: the next power of two, at least
    4 KiB, so that tensors of nearby sizes share blocks."""
    size = _MIN_BLOCK
    while size < nbytes:
        size <<= 1
    return size


# ---- the pool ---------------------------------------------------------------------------


class StagingPool:
    """Bounded, reused host staging blocks (pinned on a GPU).

    alloc(nbytes) returns a new uint8 host tensor; `limit` is the byte bound
    on every block the pool holds (idle, lent, or waiting for an event). A
    block is lent by acquire() and comes back by release(block) or, once
    `event` has completed, by release(block, event)."""

    def __init__(self, alloc: Callable[[int], torch.Tensor], limit: int) -> None:
        self._alloc = alloc
        self.limit = int(limit)
        self._idle: Dict[int, List[torch.Tensor]] = collections.defaultdict(list)
        self._waiting: Deque[Tuple[torch.Tensor, Any]] = collections.deque()
        self.held_bytes = 0      # every block allocated and not freed
        self.peak_bytes = 0
        self.lent_bytes = 0      # blocks handed out and not released
        self.allocs = 0
        self.reuses = 0
        self.over_limit = 0      # blocks allocated past the limit (nothing left to give back)

    def _collect(self, block_on_oldest: bool = False) -> bool:
        """Moves blocks whose event has completed to the idle lists (the
        oldest first, waiting for it if asked). True if one moved."""
        moved = False
        w = self._waiting
        while w:
            block, event = w[0]
            if not event.query():
                if not block_on_oldest or moved:
                    break
                event.synchronize()
            w.popleft()
            self._idle[block.numel()].append(block)
            moved = True
        return moved

    def _free_idle(self, keep: int) -> bool:
        """Frees the largest idle block not of size `keep`. True if one was."""
        sizes = sorted((s for s, blocks in self._idle.items() if blocks and s != keep),
                       reverse=True)
        if not sizes:
            return False
        self._idle[sizes[0]].pop()
        self.held_bytes -= sizes[0]
        return True

    def acquire(self, nbytes: int, reclaim: Optional[Callable[[], bool]] = None) -> torch.Tensor:
        """A block of at least `nbytes`, reused when one of its size is idle.
        reclaim(): finishes the owner's oldest transfer that holds a block
        (True), or says there is none (False)."""
        size = _block_size(nbytes)
        self._collect()
        while True:
            if self._idle[size]:
                self.reuses += 1
                self.lent_bytes += size
                return self._idle[size].pop()
            if self.held_bytes + size <= self.limit:
                break
            if self._free_idle(size) or self._collect(block_on_oldest=True):
                continue
            if reclaim is not None and reclaim():
                self._collect()
                continue
            self.over_limit += 1
            break
        block = self._alloc(size)
        self.allocs += 1
        self.held_bytes += size
        self.lent_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return block

    def release(self, block: torch.Tensor, event: Any = None) -> None:
        """Gives `block` back, at once or once `event` has completed."""
        self.lent_bytes -= block.numel()
        if event is None:
            self._idle[block.numel()].append(block)
        else:
            self._waiting.append((block, event))

    def trim(self) -> None:
        """Frees idle blocks while the pool holds more than its limit (after
        the limit was lowered, or a transfer went over it)."""
        self._collect()
        while self.held_bytes > self.limit and self._free_idle(-1):
            pass


# ---- backends ---------------------------------------------------------------------------


class CudaBackend:
    """Streams, events and pinned blocks of one CUDA device: the only code
    here that needs CUDA. timing=True records a pair of timing events around
    every wait of the compute stream, to measure how long it waited."""

    def __init__(self, device: torch.device, timing: bool = False) -> None:
        self.device = device
        self.timing = timing
        self.copy_stream = torch.cuda.Stream(device)

    def compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: Any, timing: bool = False) -> Any:
        e = torch.cuda.Event(enable_timing=timing)
        e.record(stream)
        return e

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def elapsed_ms(start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end))


class FakeEvent:
    """A point on a FakeStream: done once the stream's work up to it ran."""

    def __init__(self, stream: "FakeStream", upto: int, backend: "FakeBackend") -> None:
        self.stream, self.upto, self.backend = stream, upto, backend
        self.name = "%s#%d" % (stream.name, upto)

    def _done(self) -> bool:
        return self.stream.ran >= self.upto

    def query(self) -> bool:
        if not self._done() and self.backend.progress:
            self.stream.run_to(self.upto)
        return self._done()

    def synchronize(self) -> None:
        self.backend.log.append(("host waits", self.name))
        self.stream.run_to(self.upto)


class FakeStream:
    """A stream whose work runs later, in order: when an event after it is
    synchronized, or polled while the backend's `progress` is on. The
    compute stream is the host's own order (eager), as the CPU model runs."""

    def __init__(self, name: str, backend: "FakeBackend", eager: bool = False) -> None:
        self.name, self.backend, self.eager = name, backend, eager
        self.work: List[Callable[[], None]] = []
        self.ran = 0

    def run_to(self, upto: int) -> None:
        while self.ran < upto:
            fn = self.work[self.ran]
            self.ran += 1
            fn()


class FakeBackend:
    """The CPU stand-in for CudaBackend (tests and tests/gpu/run's dry run):
    ordinary CPU blocks, a lazy copy stream, and a log of the order of
    waits, copies and allocations. progress=True: polling an event runs the
    work before it (a GPU that keeps up); False: only waits run it."""

    def __init__(self, progress: bool = True, timing: bool = False) -> None:
        self.progress = progress
        self.timing = timing
        self.log: List[Tuple[str, str]] = []
        self.copy_stream = FakeStream("copy", self)
        self._compute = FakeStream("compute", self, eager=True)
        self.alloc_bytes: List[int] = []

    def compute_stream(self) -> FakeStream:
        return self._compute

    def record(self, stream: FakeStream, timing: bool = False) -> FakeEvent:
        return FakeEvent(stream, len(stream.work), self)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self.log.append(("%s waits" % stream.name, event.name))
        if stream.eager:
            event.stream.run_to(event.upto)
        else:
            stream.work.append(lambda: event.stream.run_to(event.upto))

    def run(self, stream: FakeStream, fn: Callable[[], None]) -> None:
        if stream.eager:
            fn()
        else:
            stream.work.append(fn)

    def alloc(self, nbytes: int) -> torch.Tensor:
        self.alloc_bytes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    @staticmethod
    def elapsed_ms(start: Any, end: Any) -> float:
        return 0.0


# ---- the paths --------------------------------------------------------------------------


class HostPath:
    """CPU parameters: no staging (the transfers code does not call in)."""
    staged = False

    def stats(self) -> Dict[str, float]:
        return dict(pinned_bytes=0, pinned_peak_bytes=0, staging_limit_bytes=0,
                    staging_allocs=0, staging_reuses=0, staging_over_limit=0, d2h_bytes=0,
                    h2d_bytes=0, compute_wait_ms=0.0)

    def trim(self) -> None:
        pass

    def close(self) -> None:
        pass


class Staged:
    """One transfer's staging block: `buffer` (what the extension reads or
    writes, in zshard dtype `dtype`), the device tensors it keeps alive
    until its copy has run, and the copy's event."""
    __slots__ = ("block", "buffer", "host", "dtype", "event", "keep", "nbytes")

    def __init__(self, block: torch.Tensor, host: torch.Tensor, dtype: int) -> None:
        self.block, self.host, self.dtype = block, host, dtype
        self.buffer: Any = None
        self.event: Any = None
        self.keep: Any = None
        self.nbytes = host.numel() * host.element_size()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """Waits for the copy's event (that copy only, not the device); the
        device tensor it read is not needed after it."""
        if self.event is not None:
            self.event.synchronize()
        self.keep = None


# The wire dtypes a gradient is cast to on the device: narrower than fp32
# only; int8 blocks are encoded by the library from fp32.
_NARROW = {torch.float16: (torch.float16, zshard.FP16), torch.bfloat16: (torch.bfloat16,
                                                                           zshard.BF16)}


def _host_bytes(t: torch.Tensor) -> Any:
    """The extension's view of a staging block's bytes (no copy): a ctypes
    byte array over the host memory; the transfer names the dtype. The
    block itself stays referenced by its Staged until the transfer ends."""
    if t.device.type != "cpu":
        raise RuntimeError("zshard.torch: a staging block on %s" % t.device)
    return (ctypes.c_uint8 * (t.numel() * t.element_size())).from_address(t.data_ptr())


def _alias(p: torch.Tensor) -> torch.Tensor:
    """A flat tensor over p's storage with a version counter of its own:
    writing a pull through it leaves p's counter alone, as the library's
    write into a CPU parameter does (_transfers._ensure bumps it when the
    pull brought a new version, on both paths)."""
    storage = p.untyped_storage() if hasattr(p, "untyped_storage") else p.storage()
    return torch.empty(0, dtype=p.dtype, device=p.device).set_(storage, 0, (p.numel(),), (1,))


class StagedPath:
    """Parameters on a device: pinned staging, side-stream copies, events."""
    staged = True

    def __init__(self, backend: Any, wire: torch.dtype, limit: int) -> None:
        self.backend = backend
        self.wire, self.zs_wire = _NARROW.get(wire, (torch.float32, zshard.FP32))
        self.pool = StagingPool(backend.alloc, limit)
        self.reclaim: Optional[Callable[[], bool]] = None
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self._waits: List[Tuple[Any, Any]] = []
        self.compute_wait_ms = 0.0

    def _stage(self, numel: int) -> Staged:
        nbytes = numel * (2 if self.wire != torch.float32 else 4)
        block = self.pool.acquire(nbytes, self.reclaim)
        host = block[:nbytes].view(self.wire)
        st = Staged(block, host, self.zs_wire)
        st.buffer = _host_bytes(host)
        return st

    def stage_grad(self, g: torch.Tensor) -> Staged:
        """Starts `g`'s trip to a pinned block: the copy stream waits for
        the compute stream's work so far (which produced g), casts g to the
        wire dtype on the device and copies it to the host. The push may be
        submitted once the Staged is ready()."""
        b = self.backend
        st = self._stage(g.numel())
        produced = b.record(b.compute_stream())
        b.wait(b.copy_stream, produced)
        host = st.host

        def copy() -> None:
            src = g.reshape(-1)
            if src.dtype != host.dtype:
                src = src.to(host.dtype)    # the cast on the device
            host.copy_(src, non_blocking=True)
        b.run(b.copy_stream, copy)
        st.event = b.record(b.copy_stream)
        st.keep = g                         # freed once the copy has run
        self.d2h_bytes += st.nbytes
        return st

    def pull_target(self, numel: int) -> Staged:
        """A pinned block for a pull of `numel` elements in the wire dtype."""
        return self._stage(numel)

    def land(self, p: torch.Tensor, st: Staged) -> None:
        """The pull in `st` has arrived: copies it into p on the copy stream
        (after the compute stream's work so far, which may still read or
        have just allocated p's storage), widening to fp32 on the device,
        and makes the compute stream wait for that copy. The block returns
        to the pool once the copy has run."""
        b = self.backend
        compute = b.compute_stream()
        b.wait(b.copy_stream, b.record(compute))
        host = st.host

        def copy() -> None:
            with torch.no_grad():
                dst = _alias(p)
                if host.dtype == dst.dtype:
                    dst.copy_(host, non_blocking=True)
                else:
                    dst.copy_(host.to(dst.device, non_blocking=True))
        b.run(b.copy_stream, copy)
        done = b.record(b.copy_stream)
        self.h2d_bytes += st.nbytes
        if b.timing:
            start = b.record(compute, timing=True)
            b.wait(compute, done)
            self._waits.append((start, b.record(compute, timing=True)))
        else:
            b.wait(compute, done)
        self.pool.release(st.block, done)

    def done(self, st: Staged) -> None:
        """A push from `st` has completed (its copy ran before it was
        submitted): the block is idle again, the device gradient freed."""
        st.keep = None
        self.pool.release(st.block)

    def drop(self, st: Staged) -> None:
        """A transfer abandoned (failed pull, closed client): the block goes
        back once whatever copy it was part of has run."""
        st.keep = None
        self.pool.release(st.block, st.event)

    def trim(self) -> None:
        self.pool.trim()

    def close(self) -> None:
        """Every transfer has ended: frees the idle blocks (pinned memory
        goes back now, not when the optimizer is collected)."""
        self.pool.limit = 0
        while self.pool._collect(block_on_oldest=True):
            pass
        self.pool.trim()

    def stats(self) -> Dict[str, float]:
        waits, self._waits = self._waits, []
        for start, end in waits:
            self.compute_wait_ms += self.backend.elapsed_ms(start, end)
        p = self.pool
        return dict(pinned_bytes=p.held_bytes, pinned_peak_bytes=p.peak_bytes,
                    staging_limit_bytes=p.limit, staging_allocs=p.allocs,
                    staging_reuses=p.reuses, staging_over_limit=p.over_limit,
                    d2h_bytes=self.d2h_bytes, h2d_bytes=self.h2d_bytes,
                    compute_wait_ms=self.compute_wait_ms)


# ---- choosing a path ------------------------------------------------------------------

# tests and tests/gpu/run --cpu-dry-run: a backend factory that puts CPU
# parameters on the staged path (FakeBackend), None for the real choice.
FORCE_BACKEND: Optional[Callable[[], Any]] = None


def params_device(named: List[Tuple[str, torch.Tensor]]) -> torch.device:
    """The one device of the parameters (meta ones aside: deferred
    initialisation builds them on the CPU); ValueError for mixed devices or
    a device zshard.torch cannot stage from."""
    devices: Dict[torch.device, str] = {}
    for name, p in named:
        if not p.is_meta:
            devices.setdefault(p.device, name)
    if len(devices) > 1:
        raise ValueError("zshard.torch: the parameters are on several devices (%s): one model "
                         "on one device per trainer (move it with model.to(device) before "
                         "shard())" % ", ".join("%s on %s" % (n, d) for d, n in devices.items()))
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError("zshard.torch: parameter %s is on %s: CPU and CUDA parameters only (MPS, "
                         "XLA and other devices are not supported)" % (devices[device], device))
    return device


def staging_limit(unit_numels: List[int], prefetch: int, push_window: int, wire: torch.dtype) \
        -> int:
    """The default pool bound, sized by the prefetch window: the pulls of
    `prefetch` units ahead plus the one computing, a unit's gradients being
    copied, and the push window's gradients (in wire bytes), at least two of
    the largest unit."""
    per = 2 if wire in _NARROW else 4
    largest = max(unit_numels, default=0) * per
    window = push_window * per // 4 if push_window else 0
    return max(2 * largest, (prefetch + 2) * largest + window, 1 << 20)


def choose(device: torch.device, wire: torch.dtype, limit: int) -> Any:
    """HostPath for CPU parameters, StagedPath over CUDA (or the forced
    backend)."""
    if FORCE_BACKEND is not None:
        return StagedPath(FORCE_BACKEND(), wire, limit)
    if device.type == "cpu":
        return HostPath()
    return StagedPath(CudaBackend(device), wire, limit)
