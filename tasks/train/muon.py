"""Muon for the draft's hidden matrices, and the pair of optimizers that steps it beside AdamW as one.

Muon (Keller Jordan, 2024; `torch.optim.Muon`, speculators' default) replaces each 2-D weight's momentum update by
its nearest semi-orthogonal matrix (a quintic Newton-Schulz iteration), so every direction of the matrix moves at
the same rate. Ours differs from torch's in one respect, and it is why this module exists: the iteration runs in
float32. torch runs it in bfloat16, which a CPU without native bf16 (AVX2) takes about 25 s a step for, against 1 s.

`OptimizerPair` drives Muon and AdamW as the one optimizer the training step and the checkpoints expect: the
learning rate is set on every group, and its state dict numbers the parameters in one sequence, so a checkpoint
resumes either half exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's coefficients, chosen for the steepest slope at zero


def orthogonalize(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximately semi-orthogonal matrix with `update`'s singular vectors (its singular values pushed into
    about 0.7-1.2), in float32 whatever `update`'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    wide = x.size(0) <= x.size(1)
    if not wide:  # iterate on the side with fewer rows: the Gram matrix is the smaller one
        x = x.T
    x = x / x.norm().clamp_min(eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.T


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, orthogonalized, on 2-D parameters only; the step scaled to match AdamW's update size
    (0.2 * sqrt(max(rows, cols)), torch's `match_rms_adamw`), so one learning rate serves both halves; decoupled
    weight decay."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                 momentum: float = 0.95, ns_steps: int = 5) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "ns_steps": ns_steps})
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D weights only, got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = orthogonalize(p.grad.lerp(buf, mu), group["ns_steps"])
                p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
        return None


class OptimizerPair:
    """Several optimizers over disjoint parameters, seen as one: `param_groups` lists every group (the training
    step sets the learning rate on each), `state_dict` numbers parameters consecutively across them."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def state_dict(self) -> dict:
        state: dict[int, dict] = {}
        groups: list[dict] = []
        offset = 0
        for opt in self.optimizers:
            sd = opt.state_dict()
            state.update({offset + i: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [offset + i for i in g["params"]]} for g in sd["param_groups"]]
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict) -> None:
        groups = list(sd["param_groups"])
        if len(groups) != len(self.param_groups):
            raise ValueError(f"the saved optimizer has {len(groups)} parameter groups, this one "
                             f"{len(self.param_groups)}: it was saved for another optimizer")
        offset = 0
        for opt in self.optimizers:
            mine, groups = groups[:len(opt.param_groups)], groups[len(opt.param_groups):]
            n = sum(len(g["params"]) for g in mine)
            state = {i - offset: s for i, s in sd["state"].items() if offset <= i < offset + n}
            opt.load_state_dict({"state": state, "param_groups": [
                {**g, "params": [i - offset for i in g["params"]]} for g in mine]})
            offset += n
