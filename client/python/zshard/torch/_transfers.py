"""The transfers of zshard.torch's ShardedOptimizer: pulls ahead of use
(prefetch in first-forward order, release after forward and re-pull for
backward) and the pushes of gradients as backward produces them, batched.
A mixin: the state it uses is set up by ShardedOptimizer.__init__.

Parameters on a device (self._dev.staged, _device.py) differ in three places
only: a pull lands in a staging block and is copied to the device when it
has arrived (_ensure), a gradient is staged to a pinned block as it is
queued (_prepare_push) and its push is submitted once that copy has run
(_drain_staged, polled from every gradient hook, waited at the end of
backward). On the CPU path none of those branches runs."""

import collections
import time

import torch

import zshard

from ._common import _Mode, _buffer, _grad_buffer, _storage_key
from ._device import Staged


def _held(P, g):
    """Gradient bytes a push in flight holds (none for "no gradient")."""
    return 0 if g is None else 4 * P.numel


class _Transfers:
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
        if self._dev.staged:
            self._issue_staged(todo)
        elif len(todo) == 1:
            P = todo[0]
            P.pull = self.client.pull(P.idx, _buffer(P.p))
        elif todo:
            reqs = self.client.pull_many([P.idx for P in todo], [_buffer(P.p) for P in todo])
            for P, r in zip(todo, reqs):
                P.pull = r

    def _issue_staged(self, todo):
        """_issue_many's pulls on the staged path: into staging blocks, in
        the wire dtype (landed on the device by _ensure)."""
        if not todo:
            return
        for P in todo:
            P.stage = self._dev.pull_target(P.numel)
        try:
            reqs = self.client.pull_many([P.idx for P in todo], [P.stage.buffer for P in todo],
                                         self._dev.zs_wire)
        except BaseException:
            for P in todo:
                st, P.stage = P.stage, None
                self._dev.drop(st)
            raise
        for P, r in zip(todo, reqs):
            P.pull = r

    def _land_arrived(self):
        """Staged path: the pulls that have arrived go to the device now
        (their copy queued on the copy stream), ahead of their use."""
        for P in self._params:
            if P.stage is not None and P.pull is not None and P.pull.test():
                self._ensure(P)

    def _ensure(self, P):
        if P.alloc and P.current and P.pull is None:
            return
        self._issue(P)
        req, P.pull = P.pull, None
        st, P.stage = P.stage, None
        try:
            req.wait()
        except zshard.Error:
            P.current = False
            if st is not None:
                self._dev.drop(st)
            raise
        if st is not None:
            self._dev.land(P.p, st)
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
        if self._dev.staged:
            self._land_arrived()
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
            if self._trace is not None and self.release_after_forward:
                self._first_forward_window(P)
        elif isinstance(a, (list, tuple)):
            for x in a:
                self._touch(x)

    def _first_forward_window(self, P):
        """The first forward has no unit order to release by: it keeps the
        parameters of the last few modules it touched and releases older
        ones (never one the current operation reads), so that even the
        first forward holds a working set, not the model. A parameter read
        again later (a tied weight, a module called twice) is pulled again."""
        group = self._siblings.get(P.idx, (P,))
        win = self._first_window
        win[id(group)] = group
        win.move_to_end(id(group))
        keep = max(2, self.prefetch + 1)
        for key in list(win):
            if len(win) <= keep:
                break
            old = win[key]
            if any(Q.last_op == self._op for Q in old):
                continue  # read by the operation running now
            del win[key]
            for Q in old:
                self._release(Q)

    def _forward(self, inner, args, kwargs):
        if self._closed:
            return inner(*args, **kwargs)
        if self._in_forward:
            raise RuntimeError("zshard.torch: the model's forward is re-entered")
        if self._bufs is not None:
            # broadcast_buffers: rank 0's buffers of the last step, before
            # the first forward after it (DDP syncs them before forward).
            self._bufs.take(self.client, self._version)
        self._in_forward = True
        first = not self._units
        if first:
            self._trace = []
            self._release_at = None
            self._first_window = collections.OrderedDict()
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
            self._bound_pushes()
        return hook

    def _bound_pushes(self):
        """Backpressure: while the gradients held by pushes in flight exceed
        the window, backward waits for the oldest. Without it a trainer
        whose network (or shards) is slower than its backward holds every
        gradient of the step at once: memory that grows with the model."""
        q = self._inflight
        while self._push_window and q and self._inflight_bytes > self._push_window:
            self._finish_push(q.popleft())

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
        if self._dev.staged:
            self._drain_staged(True)

    def _push(self, P, g, micro=None):
        """Pushes `g` (None: no gradient) as P's gradient of micro-batch `micro`
        (None: the next one of this step)."""
        self._submit_pushes([self._prepare_push(P, g, micro)])

    def _prepare_push(self, P, g, micro=None):
        """(P, micro, gradient) for a push, counting the micro-batch. On the
        staged path the gradient becomes a Staged (its copy to the host
        started)."""
        if micro is None:
            if P.micro >= self.grad_accum:
                raise RuntimeError(
                    "zshard.torch: the gradient of %s was already pushed %d time(s) this step: "
                    "call step() after every %d backward pass(es) (shard(..., grad_accum=M) for "
                    "micro-batches)" % (P.name, P.micro, self.grad_accum))
            micro = P.micro
            P.micro += 1
        if g is None:
            # No gradient: the shards skip the parameter when no trainer has
            # one (torch skips a .grad of None), and count this push as zeros
            # when another does.
            pass
        elif isinstance(g, Staged):
            pass        # a failed push retried: staged already
        else:
            if g.dtype != torch.float32 or g.is_sparse:
                raise RuntimeError("zshard.torch: gradient of %s is %s%s; dense fp32 only (an "
                                   "nn.Embedding or EmbeddingBag needs sparse=False)" %
                                   (P.name, "sparse " if g.is_sparse else "", g.dtype))
            g = g.detach()
            if not g.is_contiguous():
                g = g.contiguous()
            if self._dev.staged:
                g = self._dev.stage_grad(g)
        return (P, micro, g)

    def _submit_pushes(self, entries):
        """Submits pushes, those of one micro-batch as one zs_push_many. Each
        gradient stays referenced with its request until the push is waited.
        Staged path: queued until their copies to the host have run."""
        if self._dev.staged:
            if entries:
                self._staged_q.append(entries)
                self._drain_staged(False)
            return
        self._push_now(entries)

    def _drain_staged(self, block):
        """Submits the queued staged pushes whose copies have run, oldest
        first (block: all of them, waiting for each copy's event, never for
        the whole device)."""
        q = self._staged_q
        while q:
            if not block and not all(g is None or g.ready() for _, _, g in q[0]):
                return
            entries = q.popleft()
            for _, _, g in entries:
                if g is not None:
                    g.wait()
            self._push_now(entries)

    def _reclaim_staging(self):
        """The staging pool is full: finishes this trainer's oldest transfer
        holding a block (a push, a queued push, a pull). False: none."""
        if self._inflight:
            self._finish_push(self._inflight.popleft())
            return True
        if self._staged_q:
            entries = self._staged_q.popleft()
            for _, _, g in entries:
                if g is not None:
                    g.wait()
            self._push_now(entries)
            return True
        for P in self._params:
            if P.stage is not None and P.pull is not None:
                self._ensure(P)
                return True
        return False

    @staticmethod
    def _gbuf(g):
        """The buffer a push sends: a staging block's, or the gradient's own
        memory (None: no gradient)."""
        return g.buffer if isinstance(g, Staged) else _grad_buffer(g)

    def _push_now(self, entries):
        by_micro = collections.defaultdict(list)
        for e in entries:
            by_micro[e[1]].append(e)
        for micro, es in by_micro.items():
            if len(es) == 1:
                P, _, g = es[0]
                self._inflight.append((P, micro, g, self.client.push(P.idx, self._gbuf(g),
                                                                     micro, self._push_dtype)))
                self._inflight_bytes += _held(P, g)
                continue
            reqs = self.client.push_many([P.idx for P, _, _ in es],
                                         [self._gbuf(g) for _, _, g in es], micro,
                                         self._push_dtype)
            for (P, _, g), r in zip(es, reqs):
                self._inflight.append((P, micro, g, r))
                self._inflight_bytes += _held(P, g)

    def _finish_push(self, entry):
        """Waits for one push; a failed one is kept (with its gradient) to be
        pushed again by the next step() and its error raised by this one."""
        P, micro, g, req = entry
        self._inflight_bytes -= _held(P, g)
        try:
            req.wait()
        except zshard.Error as e:
            P.failed.append((micro, g))
            self._push_error = self._push_error or e
            return
        if isinstance(g, Staged):
            self._dev.done(g)

    def _reap(self):
        """Finishes the pushes that have completed, oldest first, so that
        their gradients are freed during backward."""
        q = self._inflight
        while q and q[0][3].test():
            self._finish_push(q.popleft())
        if self._dev.staged:
            self._drain_staged(False)

    def _wait_pushes(self):
        self._flush_pushes()
        q = self._inflight
        while q:
            self._finish_push(q.popleft())
        err, self._push_error = self._push_error, None
        if err is not None:
            raise err

    def _open_requests(self):
        return [e[3] for e in self._inflight] + [P.pull for P in self._params
                                                 if P.pull is not None]

    def _settle(self, limit_s):
        """Waits until every push and pull in flight has completed, or until
        none has completed for `limit_s` seconds (a shard that is gone: the
        library retries a lost connection for about 30 s whatever the
        deadline of one call). Returns the requests still open then."""
        pending = [r for r in self._open_requests() if not r.test()]
        last, pause = time.monotonic(), 0.001
        while pending:
            if time.monotonic() - last > limit_s:
                return pending
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
            still = [r for r in pending if not r.test()]
            if len(still) < len(pending):
                last = time.monotonic()
            pending = still
        return []

    def _forget_requests(self):
        """Waits for every push and pull in flight, dropping their results
        (after the client is closed they end at once, cancelled). Returns
        what the failed ones were, in the library's words (the transfer,
        the shard's index and its configured address)."""
        reqs = [e[3] for e in self._inflight]
        stages = [e[2] for e in self._inflight if isinstance(e[2], Staged)]
        stages += [g for es in self._staged_q for _, _, g in es if isinstance(g, Staged)]
        stages += [g for P in self._params for _, g in P.failed if isinstance(g, Staged)]
        self._staged_q.clear()
        self._inflight.clear()
        self._inflight_bytes = 0
        for P in self._params:
            if P.pull is not None:
                reqs.append(P.pull)
                P.pull = None
            if P.stage is not None:
                stages.append(P.stage)
                P.stage = None
            P.current = False
        what = []
        for r in reqs:
            try:
                r.wait()
            except zshard.Error as e:
                w = str(e).split(" failed: ")[0]
                if w not in what:
                    what.append(w)
        for st in stages:   # every transfer has ended: the blocks are idle
            self._dev.drop(st)
        return what

    def _drop_pulls(self):
        """Waits for every pull in flight and forgets them, failed or not:
        their parameters are pulled again before their next use."""
        for P in self._params:
            req, P.pull = P.pull, None
            if req is not None:
                try:
                    req.wait()
                except zshard.Error:
                    pass
            st, P.stage = P.stage, None
            if st is not None:
                self._dev.drop(st)
            P.current = False

    def _wait_pulls(self):
        for P in self._params:
            if P.pull is not None:
                self._ensure(P)

    # ---- the optimizer interface ----------------------------------------------------------
