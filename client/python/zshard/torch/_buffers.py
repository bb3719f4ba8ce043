"""broadcast_buffers: rank 0's module buffers (BatchNorm's running_mean,
running_var, num_batches_tracked...) reach every other rank before its
forward, as DDP's broadcast_buffers=True does, through the shards and with
no torch process group.

The shards only move data through a step, so the buffers travel as one
extra tensor of the job (named BUFFERS_TENSOR, in a param group of its own,
after the model's tensors and groups) that rank 0 pushes at every step():

* Every buffer's bytes, whatever its dtype (fp32 running stats, int64
  num_batches_tracked, bool masks), are cut into 16-bit words; each word w
  travels as the fp32 value w * 2**-64 (an exact integer times a power of
  two). Element 0 is a reference, 2**16 * 2**-64.
* Rank 0 pushes that payload as the tensor's gradient (micro-batch 0, fp32 on
  the wire); every other rank pushes "no gradient", which the shards count
  as zeros: the sum the shards hold is rank 0's payload exactly.
* The group is SGD with lr 0 and momentum 2**-149 (the smallest float): its
  momentum buffer (EXP_AVG) becomes momentum * buf + grad * scale, where
  momentum * buf rounds to 0 (|buf| < 2**-40) and scale is the step's
  gradient scale (clipping coefficient / loss scale / W, unknown to the
  trainers beforehand). Every element is scaled by the same float, so
  word = round(buf[i] / buf[0] * 2**16) recovers each word exactly (the one
  rounding of the scale product is 2**-24 relative; a word is below 2**16).
  The master weights never move (lr 0) and hold rank 0's buffers at
  shard() (the initial weights), which the first forward uses.
* Before its first forward after a step, every other rank reads that
  momentum buffer (zs_state_read: one gRPC call per shard holding a piece)
  at the version the step left, decodes it and copies it into its buffers.
  The step is complete on every shard when step() returns, and the next one
  cannot be applied before this rank pushes: the read sees exactly the
  previous step's payload.

The payload's 2**-64 scale keeps it out of the gradient norm in practice:
its squares (at most 2**-96 each, n of them) vanish in the double sum of
squares (53 bits) unless the model's own sum of squares (loss-scaled) is
below about n * 1e-13 (docs/PYTORCH.md). A step
skipped for overflow (dynamic loss scaling) leaves the previous payload,
so the ranks take rank 0's buffers of the step before.
"""

from typing import Any, Dict

import torch

import zshard

from ._common import _buffer

BUFFERS_TENSOR = "zshard.torch.buffers"
_SCALE = 2.0 ** -64
_REF = 2.0 ** 16
# The buffer group's SGD hyper-parameters, also sent with every step.
_MOMENTUM = 2.0 ** -149
GROUP: Dict[str, Any] = dict(optimizer="sgd", momentum=_MOMENTUM, dampening=0.0, weight_decay=0.0,
                             nesterov=0, push_dtype=zshard.FP32, pull_dtype=zshard.FP32)
STEP_VALUES = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, momentum=_MOMENTUM,
                   dampening=0.0)


def model_buffers(model):
    """The model's buffers, each once, in named_buffers() order (DDP
    broadcasts the same set)."""
    seen, out = set(), []
    for name, b in model.named_buffers():
        if b is not None and id(b) not in seen:
            seen.add(id(b))
            out.append((name, b))
    return out


def _nbytes(b):
    return b.numel() * b.element_size()


class Broadcast:
    """The buffer tensor of one sharded optimizer (W > 1, a model with
    buffers): encodes rank 0's buffers, pushes them at step(), decodes them
    into the other ranks' buffers before forward."""

    def __init__(self, model, rank):
        self.model = model
        self.rank = rank
        self.names = [n for n, _ in model_buffers(model)]
        words = sum((_nbytes(b) + 1) // 2 for _, b in model_buffers(model))
        self.numel = 1 + words      # the reference, then every buffer's words
        self.bytes = 4 * self.numel
        self.tensor = None          # its zshard tensor id, once added
        self.group = None
        self.pushed = -1            # the version whose step push() prepares
        self.todo = set()           # its micro-batches not pushed yet
        self.taken = None           # the version whose buffers this rank holds

    def _current(self):
        bufs = model_buffers(self.model)
        if [n for n, _ in bufs] != self.names:
            raise RuntimeError("zshard.torch: the model's buffers changed after shard() (%s, "
                               "now %s); broadcast_buffers needs a fixed set"
                               % (", ".join(self.names), ", ".join(n for n, _ in bufs)))
        return [b for _, b in bufs]

    def encode(self):
        """Rank 0's buffers as the payload: fp32, numel elements."""
        out = torch.empty(self.numel, dtype=torch.float32)
        out[0] = _REF * _SCALE
        at = 1
        for b in self._current():
            raw = b.detach().cpu().contiguous().view(-1).view(torch.uint8)
            if raw.numel() % 2:
                raw = torch.cat([raw, raw.new_zeros(1)])
            w = raw.view(torch.int16).to(torch.int32) & 0xFFFF
            out[at:at + w.numel()] = w.to(torch.float32) * _SCALE
            at += w.numel()
        return out

    def decode(self, payload):
        """Writes the buffers the payload carries into the model's; False if
        it carries none (the reference is 0: no step has pushed one)."""
        payload = payload.to(torch.float64)
        if payload[0].item() == 0.0:
            return False
        words = torch.round(payload[1:] / payload[0] * _REF).to(torch.int32)
        at = 1
        with torch.no_grad():
            for b in self._current():
                n = (_nbytes(b) + 1) // 2
                w = words[at - 1:at - 1 + n]
                at += n
                # Words above 2**15 - 1 as the int16 of the same bits.
                raw = torch.where(w >= 0x8000, w - 0x10000, w).to(torch.int16)
                raw = raw.view(torch.uint8)[:_nbytes(b)]
                if b.is_contiguous():
                    b.view(-1).view(torch.uint8).copy_(raw)
                else:
                    b.copy_(raw.view(b.dtype).view(b.shape))
        return True

    # ---- the trainer's side ------------------------------------------------------------

    def push(self, client, grad_accum, version):
        """This rank's pushes of the buffer tensor for the coming step, each
        micro-batch once (grad_norm() and step() both prepare the step, and
        a step() that failed is called again): rank 0's payload at
        micro-batch 0, "no gradient" otherwise. Waits for them; raises the
        first failure, after which the next call pushes what failed."""
        if self.pushed != version:
            self.pushed, self.todo = version, set(range(grad_accum))
        reqs = []
        for micro in sorted(self.todo):
            if self.rank == 0 and micro == 0:
                payload = self.encode()
                reqs.append((micro, payload, client.push(self.tensor, _buffer(payload), micro)))
            else:
                reqs.append((micro, None, client.push(self.tensor, None, micro)))
        err = None
        for micro, _, req in reqs:
            try:
                req.wait()
                self.todo.discard(micro)
            except zshard.Error as e:
                err = err or e
        if err is not None:
            raise err

    def take(self, client, version):
        """Before a forward on a rank other than 0: rank 0's buffers as of
        the last step (or as they were at shard(), before the first step),
        once per version."""
        if self.rank == 0 or self.taken == version:
            return
        payload = torch.empty(self.numel, dtype=torch.float32)
        got = False
        if version > 0:
            client.state_read(self.tensor, zshard.EXP_AVG, _buffer(payload))
            got = self.decode(payload)
        if not got:
            # Version 0, or no step has pushed a payload yet: the master
            # weights hold rank 0's buffers from shard() (a pull waits for
            # rank 0's initial weights).
            client.pull(self.tensor, _buffer(payload), zshard.FP32).wait()
            self.decode_master(payload)
        self.taken = version

    def initial(self):
        """Rank 0's initial weights of the buffer tensor: its buffers' words
        as plain fp32 integers (the reference 2**16), read back by
        decode_master()."""
        return self.encode() / _SCALE

    def decode_master(self, master):
        self.decode(master * _SCALE)
