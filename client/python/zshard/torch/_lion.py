"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
Algorithm 2) as a torch optimizer, for torch versions without one.

Each step, for a parameter p with gradient g and momentum m:

    p <- p * (1 - lr * weight_decay)
    c  = beta1 * m + (1 - beta1) * g
    p <- p - lr * sign(c)
    m <- beta2 * m + (1 - beta2) * g

in these torch ops, whose roundings the shards' Lion kernel reproduces bit
for bit (server/optim/optim.c): zshard.torch.shard() runs it on the shards
for a model trained with this class, and the same class runs it in plain
torch, so a sharded run and an unsharded one give the same bits. A parameter
whose .grad is None is skipped (no decay, no momentum change), as torch's own
optimizers skip it.
"""

from typing import Any, Callable, Iterable, Optional, Tuple

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0).

    State per parameter: 'exp_avg' (the momentum, fp32, the parameter's
    shape) and 'step' (a count, as torch's Adam keeps it). The paper's
    defaults; its advice is an lr 3-10x smaller and a weight decay 3-10x
    larger than AdamW's."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4,
                 betas: Tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        if not 0.0 <= lr:
            raise ValueError("Invalid learning rate: {}".format(lr))
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError("Invalid beta parameter at index 0: {}".format(betas[0]))
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError("Invalid beta parameter at index 1: {}".format(betas[1]))
        if not 0.0 <= weight_decay:
            raise ValueError("Invalid weight_decay value: {}".format(weight_decay))
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                state["step"] += 1
                g = p.grad
                p.mul_(1 - lr * wd)
                c = m.mul(beta1).add_(g, alpha=1 - beta1)
                p.add_(c.sign(), alpha=-lr)
                m.mul_(beta2).add_(g, alpha=1 - beta2)
        return loss
