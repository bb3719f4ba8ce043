"""state_dict() / load_state_dict() of zshard.torch's ShardedOptimizer in
torch.optim's own format, and model.load_state_dict() after shard(): reads
and writes of the shards' weights, moments and step count between steps.
A mixin: the state it uses is set up by ShardedOptimizer.__init__."""

from typing import TYPE_CHECKING, Any, Dict, List

import torch

import zshard

from ._common import _buffer


class _StateDict:
    if TYPE_CHECKING:
        # A mixin of ShardedOptimizer (zshard/torch/__init__.py): what its
        # methods use of the optimizer, declared for the type checker only.
        client: zshard.Client
        world_size: int
        param_groups: List[Dict[str, Any]]
        state: Dict[Any, Any]
        _closed: bool
        _optim: str
        _inner: torch.optim.Optimizer
        _params: List[Any]
        _by_id: Dict[int, Any]
        _groups: List[Dict[str, Any]]

        def _check_open(self) -> None: ...
        def _wait_pulls(self) -> None: ...
        def _group_options(self, g: Dict[str, Any]) -> Dict[str, Any]: ...

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
        t = t.detach().to("cpu").contiguous()   # no copy for a CPU tensor
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

    def state_dict(self) -> Dict[str, Any]:
        """torch.optim's state_dict() of the same optimizer, read from the
        shards: {'state': {index: per-parameter state}, 'param_groups': the
        groups with torch's keys and parameter indices}. Per parameter:
        AdamW/Adam {'step': tensor(float(steps)), 'exp_avg', 'exp_avg_sq'}, Lion
        {'step', 'exp_avg'},
        SGD {'momentum_buffer': tensor, or None without momentum}, from the
        parameter's own step count (the steps that gave it a gradient): a
        parameter that never had one has no state, as in torch. So
        torch.optim.AdamW(model.parameters()).load_state_dict(opt.state_dict())
        continues the run (bit for bit with an fp32 wire). Call it between
        steps: a read while another trainer steps may fail with ESTEP. The
        weights are model.state_dict()."""
        self._check_open()
        self._wait_pulls()
        state = {}
        for P in self._params:
            steps = self.client.tensor_steps(P.idx)
            if steps == 0:
                continue
            g = self.param_groups[P.group]
            if self._optim == "sgd":
                state[P.p] = {"momentum_buffer": self._read_state(P, zshard.EXP_AVG)
                              if g["momentum"] else None}
            else:
                state[P.p] = {"step": torch.tensor(float(steps))}
                for key, which in self._moments():
                    state[P.p][key] = self._read_state(P, which)
        # torch's own packing (indices, group keys), over this state.
        saved, self.state = self.state, state
        try:
            # self is a ShardedOptimizer, so an Optimizer; the mixin alone is not.
            return torch.optim.Optimizer.state_dict(self)  # type: ignore[arg-type]
        finally:
            self.state = saved

    def _moments(self):
        """The moments of Adam(W) and Lion: [(state key, shards' array)]."""
        out = [("exp_avg", zshard.EXP_AVG)]
        if self._optim != "lion":
            out.append(("exp_avg_sq", zshard.EXP_AVG_SQ))
        return out

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
            if self._optim == "lion":
                return dict(betas=(s["beta1"], s["beta2"]), weight_decay=s["weight_decay"])
            return dict(betas=(s["beta1"], s["beta2"]), eps=s["eps"],
                        weight_decay=s["weight_decay"])
        keys = {"sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
                "lion": ("betas", "weight_decay")}.get(self._optim,
                                                       ("betas", "eps", "weight_decay"))
        missing = [k for k in keys if k not in g]
        if missing:
            raise ValueError("zshard.torch.load_state_dict: param group %d has no %s (a state_dict "
                             "of another optimizer than %s?)" % (gi, ", ".join(missing),
                                                                type(self._inner).__name__))
        if self._optim == "sgd":
            return dict(momentum=float(g["momentum"]), dampening=float(g["dampening"]),
                        weight_decay=float(g["weight_decay"]), nesterov=bool(g["nesterov"]))
        if self._optim == "lion":
            return dict(betas=tuple(float(b) for b in g["betas"]),
                        weight_decay=float(g["weight_decay"]))
        return dict(betas=tuple(float(b) for b in g["betas"]), eps=float(g["eps"]),
                    weight_decay=float(g["weight_decay"]))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads torch.optim's state_dict() of the same optimizer (from torch,
        or from state_dict() here) onto the shards: the moments or momentum
        buffers and the step count; lr and the groups' other keys into
        param_groups. lr, betas, eps, weight_decay, momentum and dampening
        may differ from the shards' (they are sent every step); nesterov and
        whether SGD's momentum is 0, fixed when the job opened, must agree
        (ValueError naming the difference).

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
            # Every step sends the groups' current values, so the state_dict's
            # become the next step's; only what decides the shards' state
            # (nesterov, whether SGD keeps a momentum buffer) must agree.
            for k in ("nesterov", "momentum"):
                if k in mine and (mine[k] != 0) != (theirs[k] != 0):
                    raise ValueError("zshard.torch.load_state_dict: param group %d's %s is %r in "
                                     "the state_dict, %r on the shards: it is fixed when the job "
                                     "opens" % (gi, k, theirs[k], mine[k]))
            self._group_options(dict(g, **{k: v for k, v in sg.items() if k != "params"}))
            for i, p in zip(sg["params"], g["params"]):
                index[i] = self._by_id[id(p)]
        writes, counts = self._check_state(state_dict["state"], index)
        self._check_between_steps("load_state_dict")
        # The job's count is the highest; the parameters at another one
        # (torch keeps a count per parameter) get theirs after it.
        steps = max(counts.values(), default=0)
        if self._optim == "sgd" and steps:
            # torch keeps no count for SGD: keep the shards' unless it is 0,
            # at which the next step would start the momentum buffers anew.
            steps = self.client.optimizer_steps() or 1
            counts = {P: steps if c else 0 for P, c in counts.items()}
        for P, which, t in writes:
            self._write_state(P, which, t)
        try:
            self.client.set_optimizer_steps(steps)
        except zshard.Error as e:
            if e.status != zshard.ENOTREADY or self.world_size == 1 or \
                    self.client.optimizer_steps() != steps:
                raise
        for P, c in counts.items():
            if c != steps:
                try:
                    self.client.set_tensor_steps(P.idx, c)
                except zshard.Error as e:
                    if e.status != zshard.ENOTREADY or self.world_size == 1 or \
                            self.client.tensor_steps(P.idx) != c:
                        raise
        # Keep the wrapped optimizer's group dicts (schedulers hold them).
        for g, sg in zip(groups, saved_groups):
            g.update({k: v for k, v in sg.items() if k != "params"})

    def _check_state(self, state, index):
        """The writes a torch state makes, [(P, array, fp32 tensor)], and
        each parameter's step count {P: count} (0 for a parameter without
        state: it never had a gradient); raises naming the first thing the
        shards cannot hold."""
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
            # A parameter with a buffer continues it (count 1 or more); one
            # without starts it from its next gradient (count 0), as torch.
            with_buf = [P for P in self._params if self.param_groups[P.group]["momentum"]]
            bufs = [P for P in with_buf if have.get(P, {}).get("momentum_buffer") is not None]
            writes = [(P, zshard.EXP_AVG, fp32(P, "momentum_buffer", have[P]["momentum_buffer"]))
                      for P in bufs]
            stepped = set(bufs) | {P for P in self._params if P in have and P not in with_buf}
            return writes, {P: int(P in stepped) for P in self._params}
        writes, counts = [], {}
        for P in self._params:
            if P not in have:
                # No state: torch's before the parameter's first gradient,
                # zero moments and count 0.
                z = torch.zeros(P.p.shape)
                writes += [(P, which, z) for _, which in self._moments()]
                counts[P] = 0
                continue
            s = have[P]
            keys = ["step"] + [key for key, _ in self._moments()]
            extra = sorted(set(s) - set(keys))
            if extra or "step" not in s:
                raise ValueError("zshard.torch.load_state_dict: %s's state has keys %s; %s keeps "
                                 "%s" % (P.name, sorted(s), type(self._inner).__name__,
                                         ", ".join(keys)))
            step = float(s["step"])
            if step != int(step) or step < 0:
                raise ValueError("zshard.torch.load_state_dict: %s's step %r is not a count" %
                                 (P.name, step))
            counts[P] = int(step)
            writes += [(P, which, fp32(P, key, s[key])) for key, which in self._moments()]
        return writes, counts
