"""Deferred initialisation: a model whose parameters are on the `meta`
device gets its weights on the shards without any trainer holding them all.

shard() replaces each meta parameter by a CPU parameter of the same shape
whose storage is empty (the optimizer's param_groups and every module that
holds it are updated; tied parameters stay tied), then replays the
initialisation one unit at a time: the unit's parameters get storage, the
modules' own reset_parameters() (or the user's param_init_fn) fill them,
rank 0 writes them to the shards (zs_init_tensor) and the storage is freed
before the next unit. Only rank 0 initialises parameters; every rank
materialises meta buffers (BatchNorm's running statistics: small), which is
the one reason another rank replays a unit.

Bits. torch's constructors draw from the default generator in the order the
modules are built, and each module's reset runs at the end of its own
constructor, after its children's. The replay walks the modules in
registration order, children before their parent, so for torch's own
modules (and models that register modules in the order they build them) the
same seed gives the same bits as building the model on the CPU. A module
whose reset also writes its children's parameters (MultiheadAttention zeroes
out_proj.bias) is one unit with its whole subtree. A tied parameter met
again (a language model's head tied to its embedding) is initialised once;
the later module's reset runs on a scratch tensor, so the generator moves as
it did when that module built its own weight.
"""

import contextlib
from typing import Iterator
import warnings

import torch
from torch.overrides import TorchFunctionMode

# Factory functions init_empty() sends to the meta device when no device is
# given (torch >= 2.0's `with torch.device("meta")` does the same).
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
              torch.randint, torch.empty_strided, torch.normal, torch.arange, torch.eye}


class _MetaFactories(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


@contextlib.contextmanager
def init_empty() -> Iterator[None]:
    """Builds a model on the `meta` device (no memory, no draw from the
    generator), for shard() to initialise one module at a time:

        with zshard.torch.init_empty():
            model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt = zshard.torch.shard(model, opt, addresses)

    Every tensor a torch factory function (torch.empty, zeros, ones, full,
    rand, randn, arange, ...) creates without an explicit device is a meta
    tensor, buffers included: a buffer with values that no reset method
    restores (a constant mask) must be created with device="cpu" or by a
    param_init_fn. torch's own modules also take device="meta" directly."""
    with _MetaFactories():
        yield


def has_meta(param_groups):
    return any(p.is_meta for g in param_groups for p in g["params"])


def _empty_like(p):
    """A CPU tensor of p's shape and dtype whose storage holds nothing."""
    t = torch.empty(p.shape, dtype=p.dtype)
    t.storage().resize_(0)
    return t


def materialize_empty(model, param_groups):
    """Replaces every meta parameter of `model` by a CPU parameter with empty
    storage, in the modules and in `param_groups`. Returns the set of ids of
    the new parameters."""
    new = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                new[id(p)] = torch.nn.Parameter(_empty_like(p), requires_grad=p.requires_grad)
            # setattr, not _parameters[name]: RNNs keep a list of their
            # weights that their __setattr__ updates.
            setattr(m, name, new[id(p)])
    for g in param_groups:
        for i, p in enumerate(g["params"]):
            if p.is_meta:
                if id(p) not in new:
                    raise ValueError("zshard.torch: a meta parameter of the optimizer (shape %s) "
                                     "is not a parameter of the model" % (tuple(p.shape),))
                g["params"][i] = new[id(p)]
    return {id(q) for q in new.values()}


def _has_reset(m):
    return callable(getattr(m, "reset_parameters", None)) or \
        callable(getattr(m, "_reset_parameters", None))


def _own(m, deferred):
    """Whether module m itself holds a deferred parameter or a meta buffer."""
    return any(p is not None and id(p) in deferred for p in m._parameters.values()) or \
        any(b is not None and b.is_meta for b in m._buffers.values())


def plan_units(model, deferred):
    """The replay order: a list of units, each a list of modules in the order
    their resets run (children before parents)."""
    units, seen = [], set()

    def subtree(m):
        out = []
        for c in m.children():
            if id(c) not in seen:
                seen.add(id(c))
                out.extend(subtree(c))
        out.append(m)
        return out

    def visit(m):
        kids = [c for c in m.children() if id(c) not in seen]
        if _own(m, deferred) and _has_reset(m) and \
                any(_own(x, deferred) for c in kids for x in c.modules()):
            units.append([x for x in subtree(m) if _own(x, deferred)])
            return
        for c in kids:
            if id(c) not in seen:
                seen.add(id(c))
                visit(c)
        if _own(m, deferred):
            units.append([m])

    seen.add(id(model))
    visit(model)
    return units


def _reset(m, param_init_fn, names):
    if param_init_fn is not None:
        param_init_fn(m)
    elif callable(getattr(m, "reset_parameters", None)):
        m.reset_parameters()
    elif callable(getattr(m, "_reset_parameters", None)):
        m._reset_parameters()
    else:
        raise ValueError("zshard.torch: module %s (%s) has parameters or buffers on the meta "
                         "device and no reset_parameters(): pass param_init_fn=, a function "
                         "that initialises a module's own parameters in place"
                         % (names.get(id(m), "?"), type(m).__name__))


def replay(units, by_id, names, param_init_fn, write, unit_has_buffers_only=False):
    """Initialises the units in order. by_id: id(param) -> _Param of the
    parameters the job manages; write(P) sends P's weights to the shards.
    Returns how many parameters were written."""
    done, written = set(), 0
    for unit in units:
        meta_buffers = any(b is not None and b.is_meta for m in unit for b in m._buffers.values())
        if write is None and not meta_buffers:
            continue  # not rank 0: only buffers are materialised here
        fresh, swapped = [], []
        for m in unit:
            for name, b in list(m._buffers.items()):
                if b is not None and b.is_meta:
                    m._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
            for name, p in list(m._parameters.items()):
                P = by_id.get(id(p)) if p is not None else None
                if P is None:
                    continue
                if id(p) in done:
                    # Tied and initialised already: the reset draws into a
                    # scratch tensor of the same shape.
                    setattr(m, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype)))
                    swapped.append((m, name, p))
                elif not P.alloc:
                    p.storage().resize_(P.numel)
                    P.alloc = True
                    fresh.append(P)
                    done.add(id(p))
        with torch.no_grad():
            for m in unit:
                _reset(m, param_init_fn, names)
        for m, name, p in swapped:
            setattr(m, name, p)
        for P in fresh:
            if write is not None:
                write(P)
                written += 1
            P.p.storage().resize_(0)
            P.alloc = False
    return written


def warn_unreplayable(model, deferred, names):
    """Warns about modules whose initialisation the replay cannot reproduce
    bit for bit: a custom module with its own parameters and no reset method
    is an error later; one whose constructor re-initialises its children
    (self.apply(init_fn) at the end of __init__) is replayed without that."""
    for m in model.modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) in deferred]
        if own and not _has_reset(m):
            warnings.warn("zshard.torch: %s (%s) has meta parameters and no reset_parameters(); "
                          "pass param_init_fn" % (names.get(id(m), "?"), type(m).__name__),
                          stacklevel=3)
