"""Several runs of one architecture trained as one: parameters stacked, one ``vmap`` pass per step.

A tiny ViT's training step on a GPU is bound by the host launching kernels, not by the GPU. Stacking the
parameters of N runs along a new first dimension (``torch.func.stack_module_state``) and running the model
once under ``torch.func.vmap`` makes every kernel do N runs' work for one launch. Each run keeps its own
parameters, optimizer state, gradient-norm clipping and EMA: all of them act element by element or per run,
so a stacked step equals N separate steps up to float rounding. Dropout draws an independent mask per run
(``randomness="different"``), with PyTorch's dropout, which ``vmap`` batches.

:class:`Stack` is built from the runs' own models, optimizers and EMAs, steps them, and writes the result
back (:meth:`Stack.unstack`), so everything else (evaluation, checkpoints, resume) stays per run. A stack lives
as long as its runs train together (its tensors keep their state between unstacks), so a compiled pass
(``compile=True``, ``torch.compile`` of the vmapped forward) compiles once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from .device import autocast
from .dropout import FastDropout

__all__ = ["Stack"]


class Stack:
    """The models, optimizers and (optional) EMA models of N runs as stacked tensors.

    ``make_optimizer(param_groups)`` builds the optimizer for the stacked parameters (the same factory the runs
    used: every group's hyperparameters, weight decay included, are copied from the first run's optimizer, since
    stacking changes the parameter dimensions timm's weight-decay grouping looks at).
    """

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 emas: Sequence[nn.Module] | None, criterion: nn.Module,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], compile: bool = False):
        self.models, self.optimizers, self.emas, self.criterion = list(models), list(optimizers), emas, criterion
        self._pass = torch.compile(self._vmapped) if compile else self._vmapped
        self.params, self.buffers = stack_module_state(self.models)
        self.base = copy.deepcopy(self.models[0]).to("meta")
        for module in self.base.modules():  # vmap batches PyTorch's dropout; FastDropout draws raw bits
            if type(module) is FastDropout:
                module.__class__ = nn.Dropout
        names = {id(p): n for n, p in self.models[0].named_parameters()}
        own_groups = self.optimizers[0].param_groups
        self.groups = [[names[id(p)] for p in g["params"]] for g in own_groups]
        self.optimizer = make_optimizer([{**_hyper(g), "params": [self.params[n] for n in group]}
                                         for g, group in zip(own_groups, self.groups, strict=True)])
        runs = list(zip(self.optimizers, self.models, strict=True))
        for n in (n for group in self.groups for n in group):
            states = [opt.state.get(m.get_parameter(n)) for opt, m in runs]
            if states[0]:
                self.optimizer.state[self.params[n]] = _stack_state(states, self.params[n].shape[1:])
        self.ema = None
        if emas is not None:
            self.ema = {k: torch.stack([e.state_dict()[k] for e in emas]) for k in emas[0].state_dict()}

    def _forward(self, params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.base, (params, buffers), (x,))

    def _vmapped(self, params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        return vmap(self._forward, randomness="different")(params, buffers, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every run's model on its own inputs: ``x`` (N, B, ...) -> (N, B, ...), in the models' train/eval mode,
        dropout masks drawn independently per run (compiled once when the stack was built with ``compile``)."""
        self.base.train(self.models[0].training)
        return self._pass(self.params, self.buffers, x)

    def step(self, x: torch.Tensor, y: torch.Tensor, *, device: torch.device, amp_dtype: torch.dtype | None,
             clip_grad: float | None = None) -> torch.Tensor:
        """One update of every run: ``x`` (N, B, ...) and ``y`` (N, B, ...) hold each run's batch; returns the
        (N,) losses. Clipping bounds each run's own gradient norm, as ``clip_grad_norm_`` does for one run."""
        with autocast(device, amp_dtype):
            logits = self.forward(x)
            losses = vmap(self.criterion)(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        if clip_grad:
            grads = [p.grad for p in self.params.values() if p.grad is not None]
            norms = torch.stack([torch.linalg.vector_norm(g.flatten(1).float(), dim=1) for g in grads])
            coef = (clip_grad / (torch.linalg.vector_norm(norms, dim=0) + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef.view(-1, *[1] * (g.dim() - 1)).to(g.dtype))
        self.optimizer.step()
        return losses.detach()

    def follow_schedule(self) -> None:
        """Take the learning rate (and any other scheduled value) the first run's scheduler set."""
        for stacked, own in zip(self.optimizer.param_groups, self.optimizers[0].param_groups, strict=True):
            stacked.update(_hyper(own))

    @torch.no_grad()
    def update_ema(self, decay: float) -> None:
        """``ModelEmaV3``'s update for every run: floats move towards the model by ``1 - decay`` (one foreach
        kernel per dtype group), other entries copy."""
        model = {**self.params, **self.buffers}
        floats = [(v, model[k]) for k, v in self.ema.items() if v.is_floating_point()]
        if floats:
            torch._foreach_lerp_([v for v, _ in floats], [m.to(v.dtype) for v, m in floats], 1.0 - decay)
        for k, v in self.ema.items():
            if not v.is_floating_point():
                v.copy_(model[k])

    @torch.no_grad()
    def unstack(self) -> None:
        """Write every run's parameters, buffers, optimizer state, learning rates and EMA back into its own
        objects, as if it had trained alone."""
        for i, (model, opt) in enumerate(zip(self.models, self.optimizers, strict=True)):
            for n, v in self.params.items():
                model.get_parameter(n).copy_(v[i])
            for n, v in self.buffers.items():
                model.get_buffer(n).copy_(v[i])
            for own, stacked, names in zip(opt.param_groups, self.optimizer.param_groups, self.groups, strict=True):
                own.update(_hyper(stacked))
                for n in names:
                    state = self.optimizer.state.get(self.params[n])
                    if state:
                        opt.state[model.get_parameter(n)] = {
                            k: (v[i].clone() if _stacked(v, self.params[n].shape[1:]) else
                                v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
            if self.ema is not None:
                for k, v in self.emas[i].state_dict().items():
                    v.copy_(self.ema[k][i])


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _stacked(value: object, shape: torch.Size) -> bool:
    """Whether an optimizer state entry is per element of a parameter (stacked per run), not a scalar."""
    return torch.is_tensor(value) and value.dim() == len(shape) + 1 and value.shape[1:] == shape


def _stack_state(states: list[dict], shape: torch.Size) -> dict:
    """One stacked parameter's optimizer state from the runs' states: per-element entries stacked, scalars (the
    step count, equal in every run) taken from the first run."""
    first = states[0]
    return {k: (torch.stack([s[k] for s in states]) if torch.is_tensor(v) and v.shape == shape else
                v.clone() if torch.is_tensor(v) else v) for k, v in first.items()}
