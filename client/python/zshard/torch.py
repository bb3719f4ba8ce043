"""zshard.torch: train a PyTorch model with its weights and optimizer on zshard shards.

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = zshard.torch.shard(model, opt, addresses="h0:7070,h1:7070")
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # gradients are pushed during backward
        opt.step()                        # the shards run the optimizer
    opt.close()                           # the model keeps the trained weights

How it works (ZeRO-3 on a parameter server):

* Every parameter of the optimizer's param groups becomes a zshard tensor (in
  param-group order, named after the model's parameter names); every param
  group becomes a zshard group with its hyper-parameters. Every step() sends
  each group's current lr (so any lr scheduler works, one lambda per group
  included).
* The model's forward runs under a torch function mode that sees every
  operation's tensor arguments. A parameter (or a view of one: tied weights,
  `w.t()`, MultiheadAttention reading `out_proj.weight` without calling
  `out_proj`) is made current before the first operation that reads it. The
  first forward records the order in which parameters are first used; later
  forwards pull `prefetch` units (the parameters of one module) ahead of use.
* Gradients are pushed as autograd accumulates them (a hook on each
  parameter's AccumulateGrad node), so the network overlaps backward: a
  unit's gradients go out together once they are all there.
* Transfers that start together are submitted as one batch
  (client.push_many / pull_many: one wake-up of the client's workers): a
  unit's prefetch, a unit's pushes, step()'s pushes, the initial pulls.
* With `release_after_forward=True` a parameter's storage is freed (resized to
  0, the tensor keeps its shape) after its last use in forward, and pulled
  again when backward unpacks a saved tensor that refers to it (saved tensor
  hooks), `prefetch` units ahead in reverse order; it is freed again once its
  gradient has been pushed.
  The gradient is not kept in `p.grad` either: it is freed once pushed. The
  parameters' storage is freed at shard() already (the shards hold the
  weights); mmap_threshold= makes glibc return freed parameters to the
  system at once (at a cost in page faults).
* A pull of a new version bumps the parameter's version counter, so a graph
  built before step() can never silently run backward on new data.

Semantics to know: the gradient pushed is `p.grad` as accumulated by one
backward pass: one backward per step, or `grad_accum=M` backward passes (the
shards add the M micro-batch gradients in order, as torch's accumulation in
p.grad does; p.grad is then not kept). Use the shards' `max_grad_norm` rather
than clipping `p.grad` yourself, which would happen after the push. A
parameter that gets no gradient in a step is pushed zeros (torch would skip
it; see NOTES below). Parameters read outside forward are current after
`gather()`, `close()`, `model.state_dict()` or a forward.

state_dict() returns torch.optim's state_dict() of the same optimizer, read
from the shards; load_state_dict() and model.load_state_dict() write torch's
to them. Every rank loads the same dicts between the same two steps (no
barrier needed: every rank writes the same values).
"""

import collections
import ctypes
import os

import torch
from torch.overrides import TorchFunctionMode

import zshard

__all__ = ["shard", "ShardedOptimizer", "NOTES"]

# What the current C API cannot do yet (each raises a clear error here).
NOTES = {
    "group_options": "group hyper-parameters (betas, eps, weight_decay, momentum...) cannot "
                     "change after zs_open_job: the shards fix them when the job opens, and "
                     "zs_state_write reaches only the arrays and the step count",
    "skip_tensor": "a tensor must be pushed every step; there is no way to say 'no gradient' "
                   "(torch skips such parameters, zshard applies a zero gradient)",
}

_UNUSED, _QUEUED, _DONE = 0, 1, 2

_WIRE = {torch.float32: zshard.FP32, torch.float16: zshard.FP16, torch.bfloat16: zshard.BF16}


def _buffer(t):
    """A writable buffer over a contiguous fp32 CPU tensor's memory, no copy.
    Not t.numpy(): that marks the storage non-resizable for good, and
    release_after_forward resizes parameters' storage. The buffer does not
    keep `t` alive: the caller holds `t` until the transfer is waited."""
    if t.numel() == 0:
        return bytearray()
    return (ctypes.c_float * t.numel()).from_address(t.data_ptr())


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
                 "current", "pull", "bump", "micro", "failed", "node", "key", "last_op")

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


class ShardedOptimizer(torch.optim.Optimizer):
    """The optimizer-like object shard() returns. It is a torch.optim.Optimizer
    (so lr schedulers accept it) whose param_groups are the wrapped
    optimizer's; the wrapped optimizer itself is not stepped."""

    def __init__(self, model, optimizer, addresses, wire_dtype=torch.bfloat16, rank=None,
                 world_size=None, prefetch=2, release_after_forward=False, max_grad_norm=None,
                 grad_accum=1, job="zshard", split_threshold=0, grad_reduce="mean",
                 mmap_threshold=None, **client_options):
        # Deliberately not Optimizer.__init__: the parameters are the wrapped
        # optimizer's, in its groups and with its hyper-parameters.
        self.defaults = dict(optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = collections.defaultdict(dict)
        self._inner = optimizer
        self._model = model
        self.prefetch = int(prefetch)
        self.release_after_forward = bool(release_after_forward)
        self.max_grad_norm = max_grad_norm
        self.grad_accum = int(grad_accum)
        if self.grad_accum < 1:
            raise ValueError("zshard.torch: grad_accum must be at least 1")
        self.last_result = None
        self._closed = False
        self._optim = self._optimizer_kind(optimizer)
        if wire_dtype not in _WIRE:
            raise ValueError("wire_dtype must be torch.float32, torch.float16 or torch.bfloat16")
        rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
        self.rank, self.world_size = rank, world_size

        names = {}
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
        self._params = []
        self._by_id = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in self._by_id:
                    raise ValueError("a parameter appears twice in the param groups")
                if p.dtype != torch.float32 or p.device.type != "cpu":
                    raise ValueError("zshard.torch: parameter %s is %s on %s; fp32 CPU parameters "
                                     "only" % (names.get(id(p), "?"), p.dtype, p.device))
                if not p.is_contiguous() or p.storage_offset() != 0 or \
                        p.storage().size() != p.numel():
                    raise ValueError("zshard.torch: parameter %s does not own a contiguous storage"
                                     % names.get(id(p), "?"))
                P = _Param(len(self._params), p, names.get(id(p), "group%d.param%d" % (gi, len(
                    self._params))), gi)
                self._params.append(P)
                self._by_id[id(p)] = P
        self._by_key = {P.key: P for P in self._params}
        self._groups = [self._group_options(g) for g in self.param_groups]
        self._check_group_lrs()

        self.client = zshard.Client(addresses, rank=rank, world_size=world_size, job=job,
                                    push_dtype=_WIRE[wire_dtype], pull_dtype=_WIRE[wire_dtype],
                                    split_threshold=split_threshold, grad_reduce=grad_reduce,
                                    grad_accum=self.grad_accum,
                                    **client_options)
        try:
            for g in self._groups:
                self.client.add_group(**g)
            for P in self._params:
                self.client.add_tensor(P.name, P.numel, P.group, tuple(P.p.shape))
            init = [_buffer(P.p) for P in self._params] if rank == 0 else None
            self.client.open_job(init)
        except BaseException:
            self.client.close()
            raise
        self._version = self.client.current_step - 1
        self._zeros = None         # pushed for parameters without a gradient
        self._op = 0
        self._trace = None         # params in order of first use during the first forward
        self._units = []           # lists of _Param, in forward order
        self._release_at = None    # op number -> params last used by it
        self._in_forward = False
        # (param, micro, gradient, request) of the pushes in flight, oldest first.
        self._inflight = collections.deque()
        self._push_error = None
        # Gradients accumulated but not pushed yet, by unit: a unit's pushes
        # go out together (zs_push_many) once all its gradients are there,
        # the rest at the end of backward.
        self._ready = collections.defaultdict(list)
        self._unit_grads = {}      # unit -> how many of its parameters get a gradient
        self._flush_queued = False
        self._hooks = []
        self._loading = []         # params model.load_state_dict() is copying into
        self._install()
        # The parameters of each module, pulled together when the first
        # forward (which has no unit order yet) reaches one of them.
        self._siblings = {}
        for m in model.modules():
            mine = [self._by_id[id(p)] for p in m.parameters(recurse=False) if id(p) in self._by_id]
            for P in mine:
                self._siblings.setdefault(P.idx, mine)
        if self.release_after_forward:
            if mmap_threshold:
                _limit_mmap_threshold(mmap_threshold)
            # ZeRO-3 from the start: the fp32 weights the model was built
            # with are on the shards now (rank 0 wrote them; the others' are
            # not used), so the trainer lets go of them here rather than
            # after the first forward. The first forward pulls them.
            for P in self._params:
                self._release(P)
        else:
            # The shards' weights (bf16 on the wire: not bit for bit the
            # model's fp32 ones; a resumed job: another version), in one batch
            # that overlaps whatever the program does before its forward.
            self._issue_many(self._params)

    # ---- setup -----------------------------------------------------------------

    @staticmethod
    def _optimizer_kind(optimizer):
        if type(optimizer) is torch.optim.AdamW:
            return "adamw"
        if type(optimizer) is torch.optim.Adam:
            return "adam"
        if type(optimizer) is torch.optim.SGD:
            return "sgd"
        raise TypeError("zshard.torch: optimizer %s is not supported (torch.optim.AdamW, Adam or "
                        "SGD)" % type(optimizer).__name__)

    def _group_options(self, g):
        bad = [k for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach")
               if g.get(k)]
        if bad:
            raise ValueError("zshard.torch: unsupported optimizer option(s) %s (the shards run "
                             "torch's default single-tensor algorithm)" %
                             ", ".join("%s=%r" % (k, g[k]) for k in bad))
        if isinstance(g["lr"], torch.Tensor):
            raise ValueError("zshard.torch: a tensor lr is not supported")
        if self._optim == "sgd":
            return dict(optimizer="sgd", momentum=float(g["momentum"]),
                        dampening=float(g["dampening"]), weight_decay=float(g["weight_decay"]),
                        nesterov=int(bool(g["nesterov"])))
        b1, b2 = g["betas"]
        return dict(optimizer=self._optim, beta1=float(b1), beta2=float(b2), eps=float(g["eps"]),
                    weight_decay=float(g["weight_decay"]))

    def _check_group_lrs(self):
        """Every step sends each group's lr as it stands in param_groups
        (zs_step_ex's group_lr), so any scheduler works; only the values
        must be plain non-negative numbers."""
        lrs = []
        for gi, g in enumerate(self.param_groups):
            lr = g["lr"]
            if isinstance(lr, torch.Tensor):
                raise ValueError("zshard.torch: param group %d: a tensor lr is not supported" % gi)
            lr = float(lr)
            if not lr >= 0.0 or lr == float("inf"):
                raise ValueError("zshard.torch: param group %d's lr %r is not a finite number >= 0"
                                 % (gi, g["lr"]))
            lrs.append(lr)
        return lrs

    def _install(self):
        for P in self._params:
            p = P.p
            if not p.requires_grad:
                continue
            # The AccumulateGrad node: its post-hook runs once p.grad holds
            # this backward's summed gradient (torch 1.13 has no
            # post-accumulate-grad hook on tensors).
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            P.node = node
            self._hooks.append(node.register_hook(self._grad_hook(P)))
        # model.state_dict() holds tensors sharing the parameters' storage:
        # making them current at the end (the root's hook runs last) makes
        # the returned tensors current and never released memory.
        self._hooks.append(self._model._register_state_dict_hook(
            lambda module, state_dict, prefix, meta: self.gather()))
        # model.load_state_dict(): each module's pre-hook makes the parameters
        # it is about to load allocated and current (torch copies into them;
        # the keys the dict lacks keep the current weights), its post-hook
        # writes them to the shards as the master weights.
        for m in self._model.modules():
            mine = [(n, self._by_id[id(p)]) for n, p in m._parameters.items()
                    if p is not None and id(p) in self._by_id]
            if mine:
                self._hooks.append(m._register_load_state_dict_pre_hook(self._load_pre_hook(mine)))
                self._hooks.append(m.register_load_state_dict_post_hook(
                    self._load_post_hook(mine)))
        # A submodule called on its own (model.head(h)) runs outside the
        # wrapped forward: its parameters are made current first.
        for m in self._model.modules():
            mine = [self._by_id[id(p)] for p in m.parameters() if id(p) in self._by_id]
            if m is not self._model and mine:
                self._hooks.append(m.register_forward_pre_hook(self._outside_hook(mine)))
        model, inner = self._model, self._model.forward
        self._orig_forward = inner

        def forward(*args, **kwargs):
            return self._forward(inner, args, kwargs)
        model.forward = forward

    def _outside_hook(self, params):
        def hook(module, inputs):
            if not self._in_forward and not self._closed:
                for P in params:
                    self._issue(P)
                for P in params:
                    self._ensure(P)
        return hook

    def _load_pre_hook(self, mine):
        def hook(state_dict, prefix, *args):
            if self._closed:
                return
            todo = [P for n, P in mine if prefix + n in state_dict]
            if not todo:
                return
            self._check_between_steps("model.load_state_dict")
            self._issue_many(todo)
            for P in todo:
                self._ensure(P)
            self._loading.extend(todo)
        return hook

    def _load_post_hook(self, mine):
        def hook(module, incompatible):
            if self._closed or not self._loading:
                return
            ids = {id(P) for _, P in mine}
            todo = [P for P in self._loading if id(P) in ids]
            self._loading = [P for P in self._loading if id(P) not in ids]
            done = set()
            for P in todo:
                # Not twice (tied), and only what the pre-hook made current:
                # an entry left by a load that failed part-way may have been
                # released or gone stale since.
                if id(P) in done or not (P.alloc and P.current):
                    continue
                done.add(id(P))
                self._write_state(P, zshard.MASTER, P.p.detach())
                self._loaded(P)
        return hook

    def _loaded(self, P):
        """P's weights on the shards were overwritten: the next use pulls
        them (the shards' copy, in the wire dtype, as every trainer sees it)
        and bumps P's version counter, as torch's own in-place load does."""
        P.current = False
        P.pulled_version = -1
        if self.release_after_forward:
            self._release(P)

    def _check_between_steps(self, what):
        """Optimizer state and weights are written only between steps: after
        step() (or shard()), before the next backward, on every rank."""
        self._check_open()
        pushed = [P.name for P in self._params if P.micro or P.failed]
        if pushed or self._inflight:
            raise RuntimeError(
                "zshard.torch: %s between steps only: this trainer already pushed gradients of "
                "step %d (%s); call it after step() and before the next backward, on every rank"
                % (what, self._version + 1, ", ".join(pushed[:3]) or "in flight"))
        self._wait_pulls()

    def _write_state(self, P, which, t):
        """Writes array `which` of P from the fp32 tensor t (P's shape).

        Every rank writes the same values (they all load the same dict): zshard
        has no barrier between trainers, and a write is refused (ENOTREADY) on
        a shard that already holds a contribution of the next step. Such a
        contribution comes from a trainer that finished its own load first,
        so the shards hold these values already: that is checked by reading
        them back, and only a difference is an error."""
        t = t.contiguous()
        try:
            self.client.state_write(P.idx, which, _buffer(t))
        except zshard.Error as e:
            if e.status != zshard.ENOTREADY or self.world_size == 1:
                raise
            back = torch.empty_like(t)
            self.client.state_read(P.idx, which, _buffer(back))
            if not torch.equal(back.view(torch.int32), t.view(torch.int32)):
                raise RuntimeError(
                    "zshard.torch: another trainer started the next step before this one loaded "
                    "%s, and the shards hold other values: every rank must load the same "
                    "state_dict between the same two steps" % P.name) from e

    # ---- parameters' data ---------------------------------------------------------------

    def _issue(self, P):
        """Starts a pull of the current version into P's storage (if needed)."""
        self._issue_many((P,))

    def _issue_many(self, params):
        """Starts pulls of the current version into the storage of those of
        `params` that need one, submitted as one batch (zs_pull_many: one
        wake-up of the client's workers for all of them)."""
        todo = []
        for P in params:
            if P.pull is not None or (P.alloc and P.current) or P in todo:
                continue
            if not P.alloc:
                P.p.storage().resize_(P.numel)
                P.alloc = True
            P.bump = P.pulled_version != self._version
            todo.append(P)
        if len(todo) == 1:
            P = todo[0]
            P.pull = self.client.pull(P.idx, _buffer(P.p))
        elif todo:
            reqs = self.client.pull_many([P.idx for P in todo], [_buffer(P.p) for P in todo])
            for P, r in zip(todo, reqs):
                P.pull = r

    def _ensure(self, P):
        if P.alloc and P.current and P.pull is None:
            return
        self._issue(P)
        req, P.pull = P.pull, None
        try:
            req.wait()
        except zshard.Error:
            P.current = False
            raise
        P.current = True
        if P.bump:
            # An in-place no-op on a tensor sharing P's version counter: any
            # graph that saved P before this pull now fails to run backward
            # instead of silently using the new data.
            with torch.no_grad():
                d = P.p.detach()
                d.as_strided_(d.size(), d.stride(), d.storage_offset())
            P.pulled_version = self._version

    def _release(self, P):
        if P.pull is not None:
            self._ensure(P)
        if P.alloc:
            P.p.storage().resize_(0)
            P.alloc = False

    def _prefetch_units(self, first, direction):
        if not self._units or self.prefetch <= 0:
            return
        u, batch = first, []
        for _ in range(self.prefetch):
            u += direction
            if u < 0 or u >= len(self._units):
                break
            batch.extend(self._units[u])
        self._issue_many(batch)

    def _touch(self, a):
        if isinstance(a, torch.Tensor):
            P = self._by_key.get(_storage_key(a)) if self._by_key else None
            if P is None:
                return
            if self._trace is not None and P.last_op < 0:
                self._trace.append(P)
            if self._trace is not None:
                P.last_op = self._op
            fresh = not (P.alloc and P.current and P.pull is None)
            if fresh and P.unit is None:
                self._issue_many(self._siblings.get(P.idx, (P,)))
            self._ensure(P)
            if fresh and P.unit is not None:
                self._prefetch_units(P.unit, +1)
        elif isinstance(a, (list, tuple)):
            for x in a:
                self._touch(x)

    def _forward(self, inner, args, kwargs):
        if self._closed:
            return inner(*args, **kwargs)
        if self._in_forward:
            raise RuntimeError("zshard.torch: the model's forward is re-entered")
        self._in_forward = True
        first = not self._units
        if first:
            self._trace = []
            self._release_at = None
        elif self._units:
            self._prefetch_units(-1, +1)
        self._op = 0
        try:
            with _Mode(self):
                if self.release_after_forward:
                    with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                        out = inner(*args, **kwargs)
                else:
                    out = inner(*args, **kwargs)
        finally:
            self._in_forward = False
            if first:
                self._finish_trace()
        if self.release_after_forward:
            for P in self._params:
                self._release(P)
        return out

    def _finish_trace(self):
        trace, self._trace = self._trace, None
        owner = {}
        for mname, m in self._model.named_modules():
            for p in m.parameters(recurse=False):
                owner.setdefault(id(p), mname)
        # A unit is the parameters of one module, in the order of first use.
        units, where = [], {}
        for P in trace:
            m = owner.get(id(P.p), P.name)
            if m not in where:
                where[m] = len(units)
                units.append([])
            units[where[m]].append(P)
        for P in self._params:      # never used in forward: a unit at the end
            if P.last_op < 0:
                if "" not in where:
                    where[""] = len(units)
                    units.append([])
                units[where[""]].append(P)
        for u, ps in enumerate(units):
            for P in ps:
                P.unit = u
            self._unit_grads[u] = sum(P.node is not None for P in ps)
        self._units = units
        if self.release_after_forward:
            rel = collections.defaultdict(list)
            for P in trace:
                rel[P.last_op].append(P)
            self._release_at = dict(rel)

    # ---- backward -----------------------------------------------------------------------

    def _pack(self, t):
        P = self._by_key.get(_storage_key(t))
        if P is None:
            return t
        return (P, self._version, t)

    def _unpack(self, x):
        if not isinstance(x, tuple):
            return x
        P, version, t = x
        if version != self._version:
            raise RuntimeError("zshard.torch: backward of a forward from before step(): parameter "
                               "%s has changed since" % P.name)
        fresh = not (P.alloc and P.current and P.pull is None)
        self._ensure(P)
        if fresh and P.unit is not None:
            self._prefetch_units(P.unit, -1)
        return t

    def _grad_hook(self, P):
        def hook(grad_inputs, grad_outputs):
            self._queue_push(P, P.p.grad)
            if self.release_after_forward or self.grad_accum > 1:
                # The push holds the gradient until it completes. With
                # micro-batches the next backward must start from nothing
                # (the shards add the micro-batches, in order); with release
                # the trainer keeps no gradient (ZeRO-3).
                P.p.grad = None
            if self.release_after_forward:
                self._release(P)
            self._reap()
        return hook

    def _queue_push(self, P, g):
        """Queues P's gradient from backward: pushed together with the rest
        of its unit once they are all there (usually at once: a module's
        AccumulateGrad nodes run one after the other), whatever is left at
        the end of backward."""
        e = self._prepare_push(P, g)
        if P.unit is None:
            self._submit_pushes([e])
            return
        ready = self._ready[P.unit]
        ready.append(e)
        if len(ready) >= self._unit_grads.get(P.unit, 1):
            del self._ready[P.unit]
            self._submit_pushes(ready)
        elif not self._flush_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._flush_pushes)
            self._flush_queued = True

    def _flush_pushes(self):
        """Pushes every queued gradient (end of backward, step, zero_grad)."""
        self._flush_queued = False
        ready, self._ready = self._ready, collections.defaultdict(list)
        for entries in ready.values():
            self._submit_pushes(entries)

    def _push(self, P, g, micro=None):
        """Pushes `g` (None: zeros) as P's gradient of micro-batch `micro`
        (None: the next one of this step)."""
        self._submit_pushes([self._prepare_push(P, g, micro)])

    def _prepare_push(self, P, g, micro=None):
        """(P, micro, gradient) for a push, counting the micro-batch."""
        if micro is None:
            if P.micro >= self.grad_accum:
                raise RuntimeError(
                    "zshard.torch: the gradient of %s was already pushed %d time(s) this step: "
                    "call step() after every %d backward pass(es) (shard(..., grad_accum=M) for "
                    "micro-batches)" % (P.name, P.micro, self.grad_accum))
            micro = P.micro
            P.micro += 1
        if g is None:
            if self._zeros is None:
                self._zeros = torch.zeros(max(Q.numel for Q in self._params))
            g = self._zeros[:P.numel]
        else:
            if g.dtype != torch.float32 or g.is_sparse:
                raise RuntimeError("zshard.torch: gradient of %s is %s; dense fp32 only" %
                                   (P.name, g.dtype))
            g = g.detach()
            if not g.is_contiguous():
                g = g.contiguous()
        return (P, micro, g)

    def _submit_pushes(self, entries):
        """Submits pushes, those of one micro-batch as one zs_push_many. Each
        gradient stays referenced with its request until the push is waited."""
        by_micro = collections.defaultdict(list)
        for e in entries:
            by_micro[e[1]].append(e)
        for micro, es in by_micro.items():
            if len(es) == 1:
                P, _, g = es[0]
                self._inflight.append((P, micro, g, self.client.push(P.idx, _buffer(g), micro)))
                continue
            reqs = self.client.push_many([P.idx for P, _, _ in es],
                                         [_buffer(g) for _, _, g in es], micro)
            for (P, _, g), r in zip(es, reqs):
                self._inflight.append((P, micro, g, r))

    def _finish_push(self, entry):
        """Waits for one push; a failed one is kept (with its gradient) to be
        pushed again by the next step() and its error raised by this one."""
        P, micro, g, req = entry
        try:
            req.wait()
        except zshard.Error as e:
            P.failed.append((micro, g))
            self._push_error = self._push_error or e

    def _reap(self):
        """Finishes the pushes that have completed, oldest first, so that
        their gradients are freed during backward."""
        q = self._inflight
        while q and q[0][3].test():
            self._finish_push(q.popleft())

    def _wait_pushes(self):
        self._flush_pushes()
        q = self._inflight
        while q:
            self._finish_push(q.popleft())
        err, self._push_error = self._push_error, None
        if err is not None:
            raise err

    def _wait_pulls(self):
        for P in self._params:
            if P.pull is not None:
                self._ensure(P)

    # ---- the optimizer interface ----------------------------------------------------------

    def _step_lrs(self):
        lrs = self._check_group_lrs()
        for gi, g in enumerate(self.param_groups):
            now = self._group_options(g)
            for k, v in now.items():
                if self._groups[gi][k] != v:
                    raise NotImplementedError("zshard.torch: param group %d's %s changed from %r "
                                              "to %r (%s)" % (gi, k, self._groups[gi][k], v,
                                                              NOTES["group_options"]))
        return lrs

    def step(self, closure=None, clip_coef=None):
        """Pushes what backward has not (gradients set by hand, zeros for
        parameters without one), waits for the pushes, and runs the step on
        the shards with every param group's current lr (zs_step_ex's
        group_lr). clip_coef: a clipping coefficient computed elsewhere
        (e.g. from grad_norm() and other parameters' norms), used instead of
        max_grad_norm's. Returns the loss of `closure` if given."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lrs = self._step_lrs()
        self._prepare_step()
        self.last_result = self.client.step(lrs[0], float(self.max_grad_norm or 0.0), 0.0,
                                            group_lr=lrs, clip_coef=float(clip_coef or 0.0))
        self._version = self.client.current_step - 1
        for P in self._params:
            P.micro = 0
            P.current = False
        self._prefetch_units(-1, +1)
        return loss

    def _prepare_step(self):
        """Every gradient of the step pushed and waited for."""
        self._flush_pushes()
        self._wait_pulls()
        retry = []
        for P in self._params:
            failed, P.failed = P.failed, []
            retry.extend(self._prepare_push(P, g, micro) for micro, g in failed)
        self._submit_pushes(retry)
        passes = max(P.micro for P in self._params)
        if 0 < passes < self.grad_accum:
            raise RuntimeError("zshard.torch: step() after %d backward pass(es), grad_accum is %d"
                               % (passes, self.grad_accum))
        # Gradients set by hand; zeros for parameters without one: one batch
        # per micro-batch.
        rest = []
        for P in self._params:
            while P.micro < self.grad_accum:
                rest.append(self._prepare_push(P, P.p.grad))
        self._submit_pushes(rest)
        self._wait_pushes()

    def grad_norm(self):
        """The global norm of this step's gradient (over every trainer's
        contributions, divided by the loss scale, before clipping) and
        whether it overflowed, without stepping: (norm, overflow). Waits for
        this step's pushes and for the other trainers'. For a clipping
        coefficient computed together with parameters outside this job:
        pass it to step(clip_coef=...)."""
        self._check_open()
        self._prepare_step()
        return self.client.grad_norm()

    def zero_grad(self, set_to_none=False):
        """torch's zero_grad, after waiting for the pushes in flight (which
        read p.grad)."""
        self._wait_pushes()
        for P in self._params:
            p = P.p
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def gather(self):
        """Makes every parameter hold the current version (pulling what is
        stale or released), e.g. before reading parameters outside the
        model's forward (model.state_dict() does it by itself)."""
        self._check_open()
        for P in self._params:
            self._issue(P)
        for P in self._params:
            self._ensure(P)

    @property
    def loss_scale(self):
        """The loss scale to multiply the loss by before backward for the
        current step (1 unless the client option loss_scaling is "static" or
        "dynamic"; the dynamic scaler follows DeepSpeed's rules)."""
        return self.client.loss_scale

    def timing(self):
        """Where the last step's time went (zshard.Timing)."""
        return self.client.last_timing()

    def checkpoint(self, step=0):
        """Checkpoints the job on every shard (from one trainer, rank 0)."""
        self._check_open()
        self._wait_pulls()
        self.client.checkpoint(step)

    def restore(self, step=0):
        """Restores every shard to checkpoint `step` (0: the newest common
        one); the parameters are pulled again before their next use. Returns
        the step training continues at."""
        self._check_open()
        self._wait_pulls()
        try:
            self._wait_pushes()
        except zshard.Error:
            pass
        cur = self.client.restore(step)
        self._version = cur - 1
        for P in self._params:
            P.micro = 0
            P.failed = []
            P.current = False
        return cur

    def state_dict(self):
        """torch.optim's state_dict() of the same optimizer, read from the
        shards: {'state': {index: per-parameter state}, 'param_groups': the
        groups with torch's keys and parameter indices}. Per parameter:
        AdamW/Adam {'step': tensor(float(steps)), 'exp_avg', 'exp_avg_sq'},
        SGD {'momentum_buffer': tensor, or None without momentum}; 'state' is
        empty before the first applied step, as torch's. So
        torch.optim.AdamW(model.parameters()).load_state_dict(opt.state_dict())
        continues the run (bit for bit with an fp32 wire). Call it between
        steps: a read while another trainer steps may fail with ESTEP. The
        weights are model.state_dict()."""
        self._check_open()
        self._wait_pulls()
        steps = self.client.optimizer_steps()
        state = {}
        if steps > 0:
            step = torch.tensor(float(steps))
            for P in self._params:
                g = self.param_groups[P.group]
                if self._optim == "sgd":
                    state[P.p] = {"momentum_buffer": self._read_state(P, zshard.EXP_AVG)
                                  if g["momentum"] else None}
                else:
                    state[P.p] = {"step": step.clone(),
                                  "exp_avg": self._read_state(P, zshard.EXP_AVG),
                                  "exp_avg_sq": self._read_state(P, zshard.EXP_AVG_SQ)}
        # torch's own packing (indices, group keys), over this state.
        saved, self.state = self.state, state
        try:
            return torch.optim.Optimizer.state_dict(self)
        finally:
            self.state = saved

    def _read_state(self, P, which):
        t = torch.empty(P.p.shape, dtype=torch.float32)
        self.client.state_read(P.idx, which, _buffer(t))
        return t

    def _hparams(self, gi, g=None):
        """The hyper-parameters the shards fixed for group gi (g None), or
        those of a torch group dict g, under torch's keys."""
        if g is None:
            s = self._groups[gi]
            if self._optim == "sgd":
                return dict(momentum=s["momentum"], dampening=s["dampening"],
                            weight_decay=s["weight_decay"], nesterov=bool(s["nesterov"]))
            return dict(betas=(s["beta1"], s["beta2"]), eps=s["eps"],
                        weight_decay=s["weight_decay"])
        keys = (("momentum", "dampening", "weight_decay", "nesterov") if self._optim == "sgd"
                else ("betas", "eps", "weight_decay"))
        missing = [k for k in keys if k not in g]
        if missing:
            raise ValueError("zshard.torch.load_state_dict: param group %d has no %s (a state_dict "
                             "of another optimizer than %s?)" % (gi, ", ".join(missing),
                                                                type(self._inner).__name__))
        if self._optim == "sgd":
            return dict(momentum=float(g["momentum"]), dampening=float(g["dampening"]),
                        weight_decay=float(g["weight_decay"]), nesterov=bool(g["nesterov"]))
        return dict(betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                    weight_decay=float(g["weight_decay"]))

    def load_state_dict(self, state_dict):
        """Loads torch.optim's state_dict() of the same optimizer (from torch,
        or from state_dict() here) onto the shards: the moments or momentum
        buffers and the step count; lr and the groups' other keys into
        param_groups. The groups' hyper-parameters (betas, eps,
        weight_decay, momentum, dampening, nesterov) must equal the shards',
        fixed when the job opened (ValueError naming the difference); lr may
        differ (it is sent every step).

        Every rank calls it with the same dict between the same two steps
        (after step() or shard(), before the next backward; RuntimeError
        otherwise): each rank writes the same values, so no barrier is
        needed. The whole dict is checked before anything is written."""
        self._check_open()
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("zshard.torch.load_state_dict: the state_dict has %d param groups, "
                             "the optimizer %d" % (len(saved_groups), len(groups)))
        index = {}
        for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError("zshard.torch.load_state_dict: param group %d has %d parameters "
                                 "in the state_dict, %d here" % (gi, len(sg["params"]),
                                                                 len(g["params"])))
            mine, theirs = self._hparams(gi), self._hparams(gi, sg)
            for k in mine:
                if mine[k] != theirs[k]:
                    raise ValueError("zshard.torch.load_state_dict: param group %d's %s is %r in "
                                     "the state_dict, %r on the shards (%s)" %
                                     (gi, k, theirs[k], mine[k], NOTES["group_options"]))
            self._group_options(dict(g, **{k: v for k, v in sg.items() if k != "params"}))
            for i, p in zip(sg["params"], g["params"]):
                index[i] = self._by_id[id(p)]
        writes, steps = self._check_state(state_dict["state"], index)
        self._check_between_steps("load_state_dict")
        if self._optim == "sgd" and steps:
            # torch keeps no count for SGD: keep the shards' unless it is 0,
            # at which the next step would start the momentum buffers anew.
            steps = self.client.optimizer_steps() or 1
        for P, which, t in writes:
            self._write_state(P, which, t)
        try:
            self.client.set_optimizer_steps(steps)
        except zshard.Error as e:
            if e.status != zshard.ENOTREADY or self.world_size == 1 or \
                    self.client.optimizer_steps() != steps:
                raise
        # Keep the wrapped optimizer's group dicts (schedulers hold them).
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})

    def _check_state(self, state, index):
        """The writes a torch state makes, [(P, array, fp32 tensor)], and the
        step count; raises naming the first thing the shards cannot hold."""
        def fp32(P, key, v):
            if not isinstance(v, torch.Tensor) or v.shape != P.p.shape:
                raise ValueError("zshard.torch.load_state_dict: %s's %s is %s, not a tensor of "
                                 "shape %s" % (P.name, key, getattr(v, "shape", type(v).__name__),
                                               tuple(P.p.shape)))
            return v.detach().to(device="cpu", dtype=torch.float32).contiguous()

        for i in state:
            if i not in index:
                raise ValueError("zshard.torch.load_state_dict: state for parameter %r, which no "
                                 "param group has" % (i,))
        have = {index[i]: s for i, s in state.items()}
        if self._optim == "sgd":
            with_buf = [P for P in self._params if self.param_groups[P.group]["momentum"]]
            bufs = [P for P in with_buf if have.get(P, {}).get("momentum_buffer") is not None]
            if bufs and len(bufs) != len(with_buf):
                lack = [P.name for P in with_buf if P not in bufs]
                raise ValueError("zshard.torch.load_state_dict: no momentum_buffer for %s while "
                                 "other parameters have one: the shards start every buffer at "
                                 "the same step" % ", ".join(lack[:5]))
            writes = [(P, zshard.EXP_AVG, fp32(P, "momentum_buffer", have[P]["momentum_buffer"]))
                      for P in bufs]
            return writes, 1 if have else 0
        if not state:
            # torch's state before its first step: zero moments, count 0.
            zeros = [torch.zeros(P.p.shape) for P in self._params]
            return [(P, w, z) for P, z in zip(self._params, zeros)
                    for w in (zshard.EXP_AVG, zshard.EXP_AVG_SQ)], 0
        lack = [P.name for P in self._params if P not in have]
        if lack:
            raise ValueError("zshard.torch.load_state_dict: no state for %s (torch keeps none for "
                             "a parameter that never had a gradient): the shards keep one step "
                             "count for every parameter" % ", ".join(lack[:5]))
        writes, counts = [], {}
        for P in self._params:
            s = have[P]
            extra = sorted(set(s) - {"step", "exp_avg", "exp_avg_sq"})
            if extra or "step" not in s:
                raise ValueError("zshard.torch.load_state_dict: %s's state has keys %s; %s keeps "
                                 "step, exp_avg, exp_avg_sq" % (P.name, sorted(s),
                                                              type(self._inner).__name__))
            step = float(s["step"])
            if step != int(step) or step < 0:
                raise ValueError("zshard.torch.load_state_dict: %s's step %r is not a count" %
                                 (P.name, step))
            counts.setdefault(int(step), P.name)
            writes.append((P, zshard.EXP_AVG, fp32(P, "exp_avg", s["exp_avg"])))
            writes.append((P, zshard.EXP_AVG_SQ, fp32(P, "exp_avg_sq", s["exp_avg_sq"])))
        if len(counts) > 1:
            raise ValueError("zshard.torch.load_state_dict: the parameters' steps differ (%s): the "
                             "shards keep one step count for every parameter" %
                             ", ".join("%s %d" % (n, c) for c, n in sorted(counts.items())))
        return writes, next(iter(counts))

    def add_param_group(self, param_group):
        raise NotImplementedError("zshard.torch: the model's tensors are fixed when the job opens")

    def close(self, close_job=False):
        """Leaves the model with the current weights in its parameters,
        removes the hooks and closes the client.

        close_job=True also closes the job on the shards (zs_close_job): they
        free its weights and optimizer state and take the next job (another
        model, open_mode="create") without a restart. One trainer does it,
        rank 0, once every other trainer has closed (zshard has no barrier:
        use the launcher's, e.g. torch.distributed.barrier(), or close the
        others first); a trainer still using the job then fails with
        ENOTOPEN. Without it (the default) the job stays on the shards, to be
        resumed (open_mode "either" or "resume") or restored from a
        checkpoint."""
        if self._closed:
            return
        try:
            self._wait_pushes()
        except zshard.Error:
            pass
        try:
            self.gather()
            if close_job:
                self.client.close_job()
        finally:
            self._closed = True
            for h in self._hooks:
                h.remove()
            self._hooks = []
            if self._model.__dict__.get("forward") is not None:
                del self._model.forward
            self.client.close()

    def _check_open(self):
        if self._closed:
            raise RuntimeError("zshard.torch: the sharded optimizer is closed")

    def __getstate__(self):
        raise TypeError("a zshard.torch.ShardedOptimizer cannot be pickled")

    def __repr__(self):
        return "zshard.torch.ShardedOptimizer(%s, %d tensors, step %d)" % (
            self._optim, len(self._params), self._version + 1)


def shard(model, optimizer, addresses, wire_dtype=torch.bfloat16, rank=None, world_size=None,
          prefetch=2, release_after_forward=False, max_grad_norm=None, **options):
    """Moves `optimizer`'s parameters and their optimizer to the zshard shards
    at `addresses` ("h0:7070,h1:7070" or "zshard-{i}.zshard:7070" with
    num_shards=N) and returns the optimizer to train `model` with.

    wire_dtype: dtype of gradients and parameters on the wire (fp32 is exact).
    rank, world_size: default to $RANK and $WORLD_SIZE (torchrun), else 0 and 1.
    prefetch: modules pulled ahead of the one computing.
    release_after_forward: free each parameter after its last use in forward
      and pull it again for backward (ZeRO-3 memory).
    max_grad_norm: global gradient clipping on the shards (None: none).
    grad_accum: backward passes (micro-batches) per step.
    open_mode: "either" (default), "create" (a new run: refuses shards holding
      another job or this one already trained) or "resume" (refuses shards
      without the job); close(close_job=True) ends the job on the shards.
    mmap_threshold: with release_after_forward, set glibc's mmap threshold to
      this many bytes (e.g. 1 << 20) so that released parameters leave the
      resident set at once, at the price of page faults on every pull (the
      22M-parameter benchmark: peak 12 % lower, steps 60 % slower). None
      (default): the allocator is left alone.
    Other keywords: job (name), split_threshold, grad_reduce ("mean" or "sum"),
    and any zshard.Client option."""
    return ShardedOptimizer(model, optimizer, addresses, wire_dtype=wire_dtype, rank=rank,
                            world_size=world_size, prefetch=prefetch,
                            release_after_forward=release_after_forward,
                            max_grad_norm=max_grad_norm, **options)
