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
  each group's current lr and hyper-parameters (so any scheduler works, one
  lambda per group included, and OneCycleLR's or CyclicLR's cycled momentum
  or beta1 too).
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
p.grad does; p.grad is then not kept). torch.nn.utils.clip_grad_norm_ on the
sharded parameters goes to opt.clip_grad_norm_ (the gradients are on the
shards). A parameter whose .grad is None at step() is skipped as torch skips
it (the trainer pushes "no gradient"; with W trainers it is skipped when no
rank had one, and a rank without one counts as zeros otherwise, as DDP's
find_unused_parameters). Parameters read outside forward are current after
`gather()`, `close()`, `model.state_dict()` or a forward. With W trainers,
rank 0's module buffers reach the others before their first forward after
each step (broadcast_buffers, as DDP's).

state_dict() returns torch.optim's state_dict() of the same optimizer, read
from the shards; load_state_dict() and model.load_state_dict() write torch's
to them. Every rank loads the same dicts between the same two steps (no
barrier needed: every rank writes the same values).
"""

from __future__ import annotations

import collections
import copy
import os
import sys
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

import zshard

# The optimizer's transfers and its state_dict live in modules of their own
# (_transfers.py, _state.py), mixed into ShardedOptimizer.
from . import _buffers, _deferred, _device
from ._common import NOTES, _WIRE, _buffer, _limit_mmap_threshold, _Param
from ._deferred import init_empty
from ._lion import Lion
from ._pretrained import PretrainedError, load_pretrained
from ._state import _StateDict
from ._transfers import _Transfers

__all__ = ["shard", "ShardedOptimizer", "NOTES", "init_empty", "load_pretrained", "PretrainedError",
           "Lion"]


# The parameters of the open sharded optimizers (id(param) -> optimizer), for
# torch.nn.utils.clip_grad_norm_, which shard() routes to
# ShardedOptimizer.clip_grad_norm_ for them.
_OWNERS: weakref.WeakValueDictionary[int, ShardedOptimizer] = weakref.WeakValueDictionary()
_TORCH_CLIP = torch.nn.utils.clip_grad_norm_


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, *args, **kwargs):
    """torch.nn.utils.clip_grad_norm_, except that parameters of a sharded
    optimizer are clipped by it: their gradients are on the shards, so
    clipping p.grad here would silently do nothing."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(_OWNERS.get(id(p))): _OWNERS.get(id(p)) for p in params}
    if None not in owners.values():
        if len(owners) == 1:
            return next(iter(owners.values())).clip_grad_norm_(max_norm, norm_type)
        raise RuntimeError("zshard.torch: clip_grad_norm_ over parameters of several sharded "
                           "optimizers: call each optimizer's clip_grad_norm_")
    if len(owners) > 1:
        raise RuntimeError("zshard.torch: clip_grad_norm_ over sharded and unsharded parameters "
                           "together: the sharded ones' gradients are on the shards; combine "
                           "opt.grad_norm() with the others' norm and pass step(clip_coef=...)")
    return _TORCH_CLIP(params, max_norm, norm_type, *args, **kwargs)


def _route_clipping():
    if torch.nn.utils.clip_grad_norm_ is not _clip_grad_norm_:
        torch.nn.utils.clip_grad_norm_ = _clip_grad_norm_
        torch.nn.utils.clip_grad.clip_grad_norm_ = _clip_grad_norm_


class ShardedOptimizer(_Transfers, _StateDict, torch.optim.Optimizer):
    """The optimizer-like object shard() returns. It is a torch.optim.Optimizer
    (so lr schedulers accept it) whose param_groups are the wrapped
    optimizer's; the wrapped optimizer itself is not stepped."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, addresses: str,
                 wire_dtype: torch.dtype = torch.bfloat16, rank: Optional[int] = None,
                 world_size: Optional[int] = None, prefetch: int = 2,
                 release_after_forward: bool = False, max_grad_norm: Optional[float] = None,
                 grad_accum: int = 1, job: str = "zshard", split_threshold: int = 0,
                 grad_reduce: Union[str, int] = "mean", mmap_threshold: Optional[int] = None,
                 param_init_fn: Optional[Callable[[torch.nn.Module], None]] = None,
                 init_timeout_s: Optional[float] = None, push_window: Optional[int] = None,
                 broadcast_buffers: bool = True, **client_options: Any) -> None:
        # Deliberately not Optimizer.__init__: the parameters are the wrapped
        # optimizer's, in its groups and with its hyper-parameters.
        self.defaults = dict(optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = collections.defaultdict(dict)
        # torch 2.x's Optimizer methods (state_dict()'s hooks, schedulers)
        # read these, which its __init__ would set (torch 1.13 has none).
        for k in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                  "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                  "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, k, collections.OrderedDict())
        self._inner = optimizer
        self._model = model
        self.prefetch = int(prefetch)
        self.release_after_forward = bool(release_after_forward)
        self.max_grad_norm = max_grad_norm
        self.grad_accum = int(grad_accum)
        if self.grad_accum < 1:
            raise ValueError("zshard.torch: grad_accum must be at least 1")
        self.last_result: Optional[zshard.StepResult] = None
        self._clip_once: Optional[float] = None  # clip_grad_norm_'s coefficient for the coming step
        self._closed = False
        self._optim = self._optimizer_kind(optimizer)
        if wire_dtype not in _WIRE:
            raise ValueError("wire_dtype must be torch.float32, torch.float16, torch.bfloat16 or "
                             "torch.int8 (int8 blocks)")
        rank = int(os.environ.get("RANK", 0)) if rank is None else int(rank)
        world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else int(world_size)
        self.rank, self.world_size = rank, world_size

        # One device for every parameter (_device.py: the one seam that
        # knows about GPUs); meta parameters become CPU ones.
        names: Dict[int, str] = {}
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
        self.device = _device.params_device(
            [(names.get(id(p), "?"), p) for g in self.param_groups for p in g["params"]])
        deferred = set()
        if self.device.type != "cpu" and _deferred.has_meta(self.param_groups):
            raise ValueError("zshard.torch: meta parameters are initialised on the CPU, and the "
                             "others are on %s: build the whole model on the meta device (a CPU "
                             "model) or on %s" % (self.device, self.device))
        # Deferred initialisation (_deferred.py): meta parameters become CPU
        # parameters with empty storage, initialised after the job opens.
        if _deferred.has_meta(self.param_groups):
            deferred = _deferred.materialize_empty(model, self.param_groups)
        names = {}
        for n, p in model.named_parameters():
            names.setdefault(id(p), n)
        self._params: List[_Param] = []
        self._by_id: Dict[int, _Param] = {}
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                if id(p) in self._by_id:
                    raise ValueError("a parameter appears twice in the param groups")
                if p.dtype != torch.float32:
                    raise ValueError("zshard.torch: parameter %s is %s on %s; fp32 parameters "
                                     "only (on the CPU or a CUDA device)"
                                     % (names.get(id(p), "?"), p.dtype, p.device))
                if id(p) not in deferred and (not p.is_contiguous() or p.storage_offset() != 0
                                              or p.storage().size() != p.numel()):
                    raise ValueError("zshard.torch: parameter %s does not own a contiguous storage"
                                     % names.get(id(p), "?"))
                P = _Param(len(self._params), p, names.get(id(p), "group%d.param%d" % (gi, len(
                    self._params))), gi)
                P.alloc = id(p) not in deferred
                self._params.append(P)
                self._by_id[id(p)] = P
        self._by_key = {P.key: P for P in self._params}
        self._groups: List[Dict[str, Any]] = [self._group_options(g) for g in self.param_groups]
        self._check_group_lrs()
        # broadcast_buffers (_buffers.py): one more tensor and group, only
        # with W > 1 and buffers to send (a single trainer pays nothing).
        self._bufs = None
        if broadcast_buffers and world_size > 1 and _buffers.model_buffers(model):
            if client_options.get("pipelined"):
                raise ValueError("zshard.torch: broadcast_buffers with pipelined=1: the pipelined "
                                 "step returns before the shards apply it, so rank 0's buffers "
                                 "could be read a step late; pass broadcast_buffers=False")
            self._bufs = _buffers.Broadcast(model, rank)

        staging_bytes = client_options.pop("staging_bytes", None)  # _device.py's pool bound
        # close() gives up on transfers that make no progress for one call's
        # deadline (zs_client_options.rpc_timeout_ms, 0: its 30 s default).
        self._stall_s = (client_options.get("rpc_timeout_ms") or 30000) / 1000.0
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
            if self._bufs is not None:
                self._bufs.group = self.client.add_group(**_buffers.GROUP)
                self._bufs.tensor = self.client.add_tensor(_buffers.BUFFERS_TENSOR,
                                                           self._bufs.numel, self._bufs.group)
            if deferred:
                self.client.open_job(deferred=True)
                self._init_deferred(model, deferred, param_init_fn, init_timeout_s)
            else:
                # Host copies of device parameters (a CPU one is its own).
                host = [P.p.detach().cpu() for P in self._params] if rank == 0 else []
                init = [_buffer(h) for h in host] if rank == 0 else None
                if init is not None and self._bufs is not None:
                    first = self._bufs.initial()
                    init.append(_buffer(first))
                self.client.open_job(init)
        except BaseException:
            self.client.close()
            raise
        self._version = self.client.current_step - 1
        if self._version > 0 and rank == 0:
            # Re-running a script against trained shards resumes them
            # (open_mode "either"): say so, once, rather than silently.
            print("zshard.torch: resumed job '%s' at step %d from the shards (open_mode='create' "
                  "starts a new run; close(close_job=True) ends this one)"
                  % (job, self._version + 1), file=sys.stderr, flush=True)
        for P in self._params:
            _OWNERS[id(P.p)] = self
        _route_clipping()
        self._op = 0
        self._trace = None         # params in order of first use during the first forward
        self._units = []           # lists of _Param, in forward order
        self._release_at = None    # op number -> params last used by it
        self._in_forward = False
        # (param, micro, gradient, request) of the pushes in flight, oldest first.
        self._inflight: collections.deque[Any] = collections.deque()
        self._inflight_bytes = 0
        # The gradient bytes pushes in flight may hold before backward waits
        # (_bound_pushes): by default, with release_after_forward (bounded
        # memory is the point), 64 MiB or two of the largest tensors;
        # otherwise no bound (the trainer holds p.grad for every parameter
        # anyway). 0: no bound.
        if push_window is None:
            push_window = max(64 << 20, 8 * max(P.numel for P in self._params)) \
                if self.release_after_forward else 0
        self._push_window = int(push_window)
        # Staging for device parameters (_device.py; the CPU path: HostPath,
        # no staging), its pool bounded by the prefetch window.
        units = [sum(p.numel() for p in m.parameters(recurse=False) if id(p) in self._by_id)
                 for m in model.modules()]
        self._dev = _device.choose(self.device, wire_dtype, int(staging_bytes) if staging_bytes
                                   else _device.staging_limit(units, self.prefetch,
                                                              self._push_window, wire_dtype))
        if self._dev.staged:
            self._dev.reclaim = self._reclaim_staging
        self._push_dtype = self._dev.zs_wire if self._dev.staged else 0
        # Staged pushes waiting for their copies to the host, in order.
        self._staged_q: collections.deque[Any] = collections.deque()
        self._push_error = None
        # Gradients accumulated but not pushed yet, by unit: a unit's pushes
        # go out together (zs_push_many) once all its gradients are there,
        # the rest at the end of backward.
        self._ready = collections.defaultdict(list)
        self._unit_grads: Dict[int, int] = {}  # unit -> how many of its parameters get a gradient
        self._flush_queued = False
        self._hooks: List[Any] = []
        self._loading = []         # params model.load_state_dict() is copying into
        self._install()
        # The parameters of each module, pulled together when the first
        # forward (which has no unit order yet) reaches one of them.
        self._siblings: Dict[Any, Any] = {}
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

    def _init_deferred(self, model, deferred, param_init_fn, init_timeout_s):
        """After open_job(deferred=True): rank 0 of a new job writes every
        parameter's initial weights, the deferred ones one unit at a time;
        every rank materialises its meta buffers; then every rank waits for
        the shards to hold all initial weights."""
        mods = {id(m): n or "(the model)" for n, m in model.named_modules()}
        fresh = self.rank == 0 and self.client.current_step == 1
        write = None
        if fresh:
            def write(P):
                self.client.init_tensor(P.idx, _buffer(P.p))
            for P in self._params:
                if P.alloc:  # built on the CPU: written as it is
                    write(P)
            _deferred.warn_unreplayable(model, deferred, mods)
        units = _deferred.plan_units(model, deferred)
        _deferred.replay(units, self._by_id, mods, param_init_fn, write)
        if fresh and self._bufs is not None:
            # The buffers are materialised and initialised by now. (_buffer
            # does not keep its tensor alive: `first` does.)
            first = self._bufs.initial()
            self.client.init_tensor(self._bufs.tensor, _buffer(first))
        timeout = 0 if init_timeout_s is None else max(1, int(init_timeout_s * 1000))
        self.client.wait_initialized(timeout)

    @staticmethod
    def _optimizer_kind(optimizer):
        """AdamW, Adam, SGD, zshard.torch.Lion, or a subclass of one that
        keeps its step(): the shards run that step; a subclass with its own
        step() would not be what runs, so it is refused."""
        def unwrap(f):
            # torch.optim wraps a class's step() for the profiler the first
            # time one of its instances is built (functools.wraps).
            while hasattr(f, "__wrapped__"):
                f = f.__wrapped__
            return f

        for base, kind in ((torch.optim.AdamW, "adamw"), (torch.optim.Adam, "adam"),
                           (torch.optim.SGD, "sgd"), (Lion, "lion")):
            if isinstance(optimizer, base):
                if unwrap(type(optimizer).step) is not unwrap(base.step):
                    raise TypeError("zshard.torch: %s overrides step(), which the shards would "
                                    "not run; subclasses of %s.%s are supported when they keep "
                                    "its step()" % (type(optimizer).__name__,
                                                    "zshard.torch" if base is Lion else
                                                    "torch.optim", base.__name__))
                return kind
        raise TypeError("zshard.torch: optimizer %s is not supported (torch.optim.AdamW, Adam or "
                        "SGD, zshard.torch.Lion, or a subclass of one that keeps its step())"
                        % type(optimizer).__name__)

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
        if self._optim == "lion":
            return dict(optimizer="lion", beta1=float(b1), beta2=float(b2),
                        weight_decay=float(g["weight_decay"]))
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
            # A view needs the storage's size (deferred parameters have
            # none yet): it is lent for the moment, one parameter at a time.
            if not P.alloc:
                p.storage().resize_(P.numel)
            node = p.expand_as(p).grad_fn.next_functions[0][0]
            if not P.alloc:
                p.storage().resize_(0)
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
        # copy.deepcopy(model) (an EMA copy) looks __deepcopy__ up on the
        # instance: the copy is an ordinary model with the current weights.
        model.__deepcopy__ = self._deepcopy_model

    def _uninstall(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for k in ("forward", "__deepcopy__"):
            self._model.__dict__.pop(k, None)

    def _deepcopy_model(self, memo):
        """copy.deepcopy(model): every parameter made current, then a copy
        without zshard's hooks and forward: an ordinary, unsharded model
        holding the current weights, which the sharded one never touches."""
        self._check_open()
        self.gather()
        self._uninstall()
        try:
            return copy.deepcopy(self._model, memo)
        finally:
            self._install()

    def _outside_hook(self, params):
        def hook(module, inputs):
            if not self._in_forward and not self._closed:
                for P in params:
                    self._issue(P)
                for P in params:
                    self._ensure(P)
        return hook

    # torch's ranges for the hyper-parameters a step sends (zs_step_options'
    # group_* arrays): (low, high, high excluded).
    _HPARAM_RANGES = dict(beta1=(0.0, 1.0, True), beta2=(0.0, 1.0, True),
                          eps=(0.0, float("inf"), False), weight_decay=(0.0, float("inf"), False),
                          momentum=(0.0, float("inf"), False), dampening=(0.0, 1.0, False))

    def _step_options(self):
        """The keywords of client.step() that carry every group's current
        lr and hyper-parameters as they stand in param_groups (a scheduler's
        values, for this step only); raises ValueError, before anything is
        pushed, for a value torch's optimizers would refuse or one the
        shards cannot follow (nesterov, or an SGD momentum that starts or
        stops the momentum buffer)."""
        lrs = self._check_group_lrs()
        hps = {}
        for gi, g in enumerate(self.param_groups):
            now, first = self._group_options(g), self._groups[gi]
            for k, v in now.items():
                if k in self._HPARAM_RANGES:
                    lo, hi, open_hi = self._HPARAM_RANGES[k]
                    if not (lo <= v and (v < hi if open_hi else v <= hi)) or v == float("inf"):
                        raise ValueError("zshard.torch: param group %d's %s is %r: it must be "
                                         "finite and in [%g, %g%s" %
                                         (gi, k, v, lo, hi, ")" if open_hi else "]"))
                    hps.setdefault("group_" + k, []).append(v)
                elif first[k] != v:
                    raise ValueError("zshard.torch: param group %d's %s changed from %r to %r: "
                                     "it is fixed when the job opens" % (gi, k, first[k], v))
            if self._optim == "sgd" and (now["momentum"] != 0) != (first["momentum"] != 0):
                raise ValueError("zshard.torch: param group %d's momentum changed from %r to %r: "
                                 "the momentum buffer exists from the first step or never, so "
                                 "momentum may change only between values above 0" %
                                 (gi, first["momentum"], now["momentum"]))
            if now.get("nesterov") and not (now["momentum"] > 0 and now["dampening"] == 0):
                raise ValueError("zshard.torch: param group %d: nesterov momentum requires a "
                                 "momentum and zero dampening" % gi)
        if self._bufs is not None:
            # The buffer group's constant values (lr 0: its weights never move).
            lrs = lrs + [0.0]
            for k, v in hps.items():
                v.append(_buffers.STEP_VALUES[k[len("group_"):]])
        return dict(group_lr=lrs, **hps)

    def step(self, closure: Optional[Callable[[], Any]] = None,
             clip_coef: Optional[float] = None) -> Any:
        """Pushes what backward has not (gradients set by hand, "no
        gradient" for parameters without one), waits for the pushes, and
        runs the step on the shards with every param group's current lr and
        hyper-parameters (zs_step_ex's group_lr, group_beta1...). clip_coef:
        a clipping coefficient computed elsewhere (e.g. from grad_norm() and
        other parameters' norms), used instead of max_grad_norm's. Returns
        the loss of `closure` if given."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        opts = self._step_options()
        self._prepare_step()
        if clip_coef is None and self._clip_once is not None:
            clip_coef = self._clip_once  # from clip_grad_norm_
        self._clip_once = None
        self.last_result = self.client.step(opts["group_lr"][0], float(self.max_grad_norm or 0.0),
                                            0.0, clip_coef=float(clip_coef or 0.0), **opts)
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
        # Gradients set by hand; "no gradient" for parameters without one
        # (skipped by the shards unless another trainer has one): one batch
        # per micro-batch.
        rest = []
        for P in self._params:
            while P.micro < self.grad_accum:
                rest.append(self._prepare_push(P, P.p.grad))
        self._submit_pushes(rest)
        self._wait_pushes()
        if self._bufs is not None:
            self._bufs.push(self.client, self.grad_accum, self._version)

    @property
    def num_members(self) -> int:
        """How many ranks contributed to the last step (the world size until
        the shards' trainer timeout leaves a rank out; docs/PYTORCH.md,
        "Elastic trainers"): a data loader re-shards the next step's batch
        over this many."""
        r = self.last_result
        return self.world_size if r is None else int(r.num_members)

    @property
    def member_rank(self) -> int:
        """This rank's place among the last step's members, from 0: its
        share of a re-sharded batch."""
        r = self.last_result
        return self.rank if r is None else int(r.member_rank)

    def grad_norm(self) -> Tuple[float, bool]:
        """The global norm of this step's gradient (over every trainer's
        contributions, divided by the loss scale, before clipping) and
        whether it overflowed, without stepping: (norm, overflow). Waits for
        this step's pushes and for the other trainers'. For a clipping
        coefficient computed together with parameters outside this job:
        pass it to step(clip_coef=...)."""
        self._check_open()
        self._prepare_step()
        return self.client.grad_norm()

    def zero_grad(self, set_to_none: bool = False) -> None:
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

    def gather(self) -> None:
        """Makes every parameter hold the current version (pulling what is
        stale or released), e.g. before reading parameters outside the
        model's forward (model.state_dict() does it by itself)."""
        self._check_open()
        for P in self._params:
            self._issue(P)
        for P in self._params:
            self._ensure(P)

    @property
    def loss_scale(self) -> float:
        """The loss scale to multiply the loss by before backward for the
        current step (1 unless the client option loss_scaling is "static" or
        "dynamic"; the dynamic scaler follows DeepSpeed's rules)."""
        return self.client.loss_scale

    def timing(self) -> zshard.Timing:
        """Where the last step's time went (zshard.Timing)."""
        return self.client.last_timing()

    def staging_stats(self) -> Dict[str, float]:
        """The device path's staging and copies (_device.py), cumulative
        since shard(): pinned_bytes (staging blocks held now),
        pinned_peak_bytes, staging_limit_bytes (the pool's bound),
        staging_allocs, staging_reuses, staging_over_limit (blocks allocated
        past the bound), d2h_bytes and h2d_bytes (PCIe bytes copied),
        compute_wait_ms (time the compute stream waited on copy events,
        measured only when the backend times them). All 0 for CPU
        parameters: they are pushed and pulled in place."""
        return self._dev.stats()

    def checkpoint(self, step: int = 0) -> None:
        """Checkpoints the job on every shard (from one trainer, rank 0)."""
        self._check_open()
        self._wait_pulls()
        self.client.checkpoint(step)

    def restore(self, step: int = 0) -> int:
        """Restores every shard to checkpoint `step` (0: the newest common
        one); the parameters are pulled again before their next use. Returns
        the step training continues at."""
        self._check_open()
        # The transfers in flight belong to the timeline being abandoned:
        # they are waited for (they write the parameters' storage) and
        # their failures dropped. A shard killed and restarted since failed
        # the pulls step() started ahead (bound for its old data port);
        # raising those here made restore() fail once per such pull.
        self._drop_pulls()
        try:
            self._wait_pushes()
        except zshard.Error:
            pass
        cur = self.client.restore(step)
        self._version = cur - 1
        if self._bufs is not None:
            self._bufs.pushed = -1
            self._bufs.taken = None
        for P in self._params:
            P.micro = 0
            for _, g in P.failed:
                if isinstance(g, _device.Staged):
                    self._dev.drop(g)
            P.failed = []
            P.current = False
        return cur

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError(
            "zshard.torch: add_param_group() after shard(): the model's tensors and groups are "
            "fixed when the job opens. Build the optimizer with every param group before "
            "shard() (a group can start with lr=0 and be enabled later by a scheduler, which "
            "zshard follows step by step)")

    # ---- clipping ----------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ for the sharded parameters (FSDP's
        pattern): returns this step's global gradient norm (over every
        trainer's gradient, as an fp32 tensor) and makes the coming step()
        scale the gradient by torch's coefficient, max_norm / (norm + 1e-6)
        capped at 1. Call it after backward and before step(); torch's own
        clip_grad_norm_ on these parameters comes here. The norm is exact
        (rounded once); torch's sums fp32 per-tensor norms, so the two can
        differ in the last bits (docs/PYTORCH.md)."""
        self._check_open()
        if float(norm_type) != 2.0:
            raise NotImplementedError("zshard.torch: clip_grad_norm_ with norm_type=%r: the "
                                      "shards compute the 2-norm only" % (norm_type,))
        max_norm = float(max_norm)
        if not max_norm > 0.0:
            raise ValueError("zshard.torch: clip_grad_norm_: max_norm must be positive")
        norm, _ = self.grad_norm()
        total = torch.tensor(norm, dtype=torch.float32)
        # torch's coefficient, computed as torch computes it (fp32, clamped
        # at 1), from the shards' norm: that norm is the exact one rounded
        # once, where torch sums fp32 norms, so the two can differ in the
        # last bits, and then so do the clipped weights.
        self._clip_once = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total

    def close(self, close_job: bool = False, gather: bool = True) -> None:
        """Leaves the model with the current weights in its parameters,
        removes the hooks and closes the client.

        gather=False leaves the parameters as they are (with
        release_after_forward: shapes without storage) instead of pulling
        every weight: for a model larger than this trainer can hold, whose
        weights stay on the shards (zshard export, or state_dict() before
        close, reads them).

        close_job=True also closes the job on the shards (zs_close_job): they
        free its weights and optimizer state and take the next job (another
        model, open_mode="create") without a restart. One trainer does it,
        rank 0, once every other trainer has closed (zshard has no barrier:
        use the launcher's, e.g. torch.distributed.barrier(), or close the
        others first); a trainer still using the job then fails with
        ENOTOPEN. Without it (the default) the job stays on the shards, to be
        resumed (open_mode "either" or "resume") or restored from a
        checkpoint.

        Once no transfer has completed for the client's rpc_timeout_ms (a
        shard that died: the library would retry for about 30 s), close()
        closes the client anyway and raises zshard.Error ETIMEDOUT naming
        the transfers it gave up on (tensor, shard index, address)."""
        if self._closed:
            return
        stuck = []
        try:
            # A transfer to a shard that is gone fails only after the
            # library's retries (about 30 s); close() gives up once no
            # transfer has completed for rpc_timeout_ms.
            stuck = self._settle(self._stall_s)
            if not stuck:
                try:
                    self._wait_pushes()
                except zshard.Error:
                    pass
                if gather:
                    for P in self._params:
                        self._issue(P)
                # No transfer writes a parameter after close.
                stuck = self._settle(self._stall_s)
            if not stuck:
                if gather:
                    self.gather()
                else:
                    self._wait_pulls()
                if close_job:
                    self.client.close_job()
        finally:
            self._closed = True
            self._uninstall()
            for P in self._params:
                if _OWNERS.get(id(P.p)) is self:
                    del _OWNERS[id(P.p)]
            self.client.close()   # cancels what is still in flight
            waiting = self._forget_requests()
            self._dev.close()
        if stuck:
            more = len(waiting) - 3
            err = zshard.Error("zshard.torch: close() gave up after %g s without a transfer "
                               "completing (the client's rpc_timeout_ms); a parameter whose "
                               "pull was cut short holds unspecified values. Still waiting: "
                               "%s%s" %
                               (self._stall_s, "; ".join(waiting[:3]),
                                " and %d more" % more if more > 0 else ""))
            err.status, err.name = zshard.ETIMEDOUT, "ZS_ETIMEDOUT"
            raise err

    def _check_open(self):
        if self._closed:
            raise RuntimeError("zshard.torch: the sharded optimizer is closed")

    def __getstate__(self):
        raise TypeError("a zshard.torch.ShardedOptimizer cannot be pickled")

    def __repr__(self):
        return "zshard.torch.ShardedOptimizer(%s, %d tensors, step %d)" % (
            self._optim, len(self._params), self._version + 1)


def shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer, addresses: str,
          wire_dtype: torch.dtype = torch.bfloat16, rank: Optional[int] = None,
          world_size: Optional[int] = None, prefetch: int = 2, release_after_forward: bool = False,
          max_grad_norm: Optional[float] = None,
          state_dict_path: Union[str, os.PathLike[str], None] = None,
          **options: Any) -> ShardedOptimizer:
    """Moves `optimizer`'s parameters and their optimizer to the zshard shards
    at `addresses` ("h0:7070,h1:7070" or "zshard-{i}.zshard:7070" with
    num_shards=N; a replicated shard's members separated by "|",
    "h0a:7070|h0b:7070,...") and returns the optimizer to train `model` with.

    wire_dtype: dtype of gradients and parameters on the wire (fp32 is exact;
      torch.int8: int8 blocks with a scale per 128 elements, best with
      error_feedback=1, which costs 4 bytes per parameter on the trainer).
    rank, world_size: default to $RANK and $WORLD_SIZE (torchrun), else 0 and 1.
    prefetch: modules pulled ahead of the one computing.
    release_after_forward: free each parameter after its last use in forward
      and pull it again for backward (ZeRO-3 memory).
    max_grad_norm: global gradient clipping on the shards (None: none).
    grad_accum: backward passes (micro-batches) per step.
    open_mode: "either" (default), "create" (a new run: refuses shards holding
      another job or this one already trained), "resume" (refuses shards
      without the job) or "join" (a new or restarted trainer of an elastic
      job, admitted at the next step boundary: docs/PYTORCH.md "Elastic
      trainers"); close(close_job=True) ends the job on the shards.
    mmap_threshold: with release_after_forward, set glibc's mmap threshold to
      this many bytes (e.g. 1 << 20) so that released parameters leave the
      resident set at once, at the price of page faults on every pull (the
      22M-parameter benchmark: peak 12 % lower, steps 60 % slower). None
      (default): the allocator is left alone.
    token, tls_ca, tls_cert, tls_key, tls_server_name: the shards' token and
      TLS files (zshard.Client; default the ZSHARD_TOKEN, ZSHARD_TOKEN_FILE and
      ZSHARD_TLS_* environment variables). close(close_job=True) and
      state_dict loading need the admin token on shards that have one.
    pipelined: 1 for the pipelined step (docs/CLIENT.md): each piece is
      applied on its shard as soon as every trainer's gradient of it is in and
      its pulls overlap the other pushes; no max_grad_norm, no dynamic loss
      scaling. step() returns with the first `prefetch` modules of the next
      forward already being pulled (tests/python/test_torch_traffic.py, W=1).
    schedule, schedule_window, tcp_congestion, tcp_pacing_mbit: when pushes
      and pulls go on the wire ("fifo" or "rotated", 1 to 64 in flight), the
      data-plane sockets' TCP congestion control and their pacing in Mbit/s
      (zshard.Client; default the ZSHARD_SCHEDULE, ZSHARD_SCHEDULE_WINDOW,
      ZSHARD_TCP_CONGESTION and ZSHARD_TCP_PACING_MBIT environment
      variables).
    param_init_fn: for parameters on the meta device (deferred
      initialisation: rank 0 initialises one module at a time and writes it
      to the shards; docs/PYTORCH.md, "A model bigger than a trainer"):
      fn(module) initialises the module's own parameters in place instead of
      its reset_parameters().
    init_timeout_s: with meta parameters, how long the other ranks wait for
      rank 0's initial weights (None: no limit).
    staging_bytes: CUDA parameters: the bound on the pinned staging blocks
      (None: sized by the prefetch window, _device.staging_limit).
    push_window: the gradient bytes pushes in flight may hold before backward
      waits for the oldest (None: with release_after_forward 64 MiB or two of
      the largest tensors, whichever is more, else no bound; 0: no bound).
    state_dict_path: a safetensors file or torch.save'd state dict to start
      from: load_pretrained(opt, state_dict_path) once the model is sharded
      (strict names; every rank reads it, one tensor at a time). Parameters
      are initialised first (meta ones too) and then overwritten: the file's
      bits, whatever the initialisation was. A job the shards have already
      stepped (a resumed run) keeps its trained weights: the file is not read.
    broadcast_buffers: with W > 1, rank 0's module buffers (BatchNorm's
      running statistics...) become every rank's before its first forward
      after each step(), through the shards, as DDP's broadcast_buffers
      (_buffers.py; docs/PYTORCH.md, "Buffers across ranks"). False: each
      rank keeps its own. W = 1 adds nothing.
    Other keywords: job (name), split_threshold, grad_reduce ("mean" or "sum"),
    and any zshard.Client option."""
    opt = ShardedOptimizer(model, optimizer, addresses, wire_dtype=wire_dtype, rank=rank,
                           world_size=world_size, prefetch=prefetch,
                           release_after_forward=release_after_forward,
                           max_grad_norm=max_grad_norm, **options)
    if state_dict_path is not None and opt._version == 0:
        try:
            load_pretrained(opt, state_dict_path)
        except BaseException:
            opt.close()
            raise
    return opt
