"""Several runs of one architecture trained as one: parameters stacked, one ``vmap`` pass per step.

A tiny ViT's training step on a GPU is bound by the host launching kernels, not by the GPU. Stacking the
parameters of N runs along a new first dimension (``torch.func.stack_module_state``) and running the model
once under ``torch.func.vmap`` makes every kernel do N runs' work for one launch. Each run keeps its own
parameters, optimizer state, gradient-norm clipping and EMA: all of them act element by element or per run,
so a stacked step equals N separate steps up to float rounding. Random draws are each run's own: every run has
the global random states its separate run has (:class:`Streams`: torch's on the CPU and on the device, numpy's,
Python's), in place while its batch is built (:func:`own_streams`: timm's Mixup draws from numpy) and while the
stacked pass draws its dropout and drop-path masks (:class:`_PerRun`: under ``vmap``, each run's mask is drawn
from its own stream by the code its separate run calls). Any other random operation inside the pass is refused
(``randomness="error"``), as is a separate run's attention dropout inside a fused attention kernel, so a stacked
run equals its separate run or does not train. The stacked pass runs timm's explicit attention path: on CUDA the
backward of PyTorch's memory-efficient attention kernel fails under ``vmap`` ("LSE is not correctly aligned").

:class:`Stack` is built from the runs' own models, optimizers and EMAs, steps them, and writes the result
back (:meth:`Stack.unstack`), so everything else (evaluation, checkpoints, resume) stays per run. A stack lives
as long as its runs train together (its tensors keep their state between unstacks), so a compiled pass
(``compile=True``, ``torch.compile`` of the vmapped forward) compiles once.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import timm.layers
import torch
import torch.nn.functional as F
from timm.layers import DropPath
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from .capture import set_fused_attention
from .device import autocast
from .dropout import FastDropout, _keep_mask, _keep_threshold
from .errors import UserError

__all__ = ["Stack", "Streams", "check_stackable", "own_streams", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every GPU), numpy and Python's ``random``, as a run does at the start of each epoch."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device``, the one a separate run's random operations there draw from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


@dataclass
class Streams:
    """One run's global random states: torch's (on the CPU and the training device), numpy's and Python's."""

    torch: dict[str, torch.Tensor]
    numpy: dict
    python: tuple

    @classmethod
    def seeded(cls, seed: int, devices: Iterable[str]) -> Streams:
        """The states :func:`seed_everything` leaves; the global states stay as they were."""
        before = cls.current(devices)
        try:
            seed_everything(seed)
            return cls.current(devices)
        finally:
            before.install()

    @classmethod
    def current(cls, devices: Iterable[str]) -> Streams:
        """The global states now, e.g. a separate run's right after it seeded its epoch."""
        return cls({d: _generator(torch.device(d)).get_state() for d in devices}, np.random.get_state(legacy=False),
                   random.getstate())

    def install(self) -> None:
        """Make these the global states."""
        for device, state in self.torch.items():
            _generator(torch.device(device)).set_state(state)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@contextlib.contextmanager
def own_streams(streams: Streams) -> Iterator[None]:
    """Draw from one run's global random states for the duration: they advance, and the states before come back."""
    before = Streams.current(streams.torch)
    streams.install()
    try:
        yield
    finally:
        now = Streams.current(streams.torch)
        streams.torch, streams.numpy, streams.python = now.torch, now.numpy, now.python
        before.install()


_ACTIVE: contextvars.ContextVar[list[Streams] | None] = contextvars.ContextVar("stacked_streams", default=None)


class _PerRun(torch.autograd.Function):
    """A random draw inside the vmapped pass, each run's from its own stream: under ``vmap``, ``draw`` runs on every
    run's slice of ``x`` in turn, with that run's torch state in the default generator's place, so it draws what
    the same call draws in the run's separate pass. The result (a mask or noise) carries no gradient."""

    @staticmethod
    def forward(x: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return draw(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.mark_non_differentiable(output)

    @staticmethod
    def vmap(info, in_dims, x: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor]):
        streams = _ACTIVE.get()
        x = x.movedim(in_dims[0], 0) if in_dims[0] is not None else x.expand(info.batch_size, *x.shape)
        generator, device = _generator(x.device), str(x.device)
        before, draws = generator.get_state(), []
        for run, streams_of_run in zip(x, streams, strict=True):
            generator.set_state(streams_of_run.torch[device])
            draws.append(draw(run))
            streams_of_run.torch[device] = generator.get_state()
        generator.set_state(before)
        return torch.stack(draws), 0


class _RunDropout(FastDropout):
    """``FastDropout`` (on CUDA ``F.dropout``) with each run's mask drawn from its own stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p <= 0.0 or self.p >= 1.0 or self.inplace:
            return F.dropout(x, self.p, self.training, self.inplace)
        if x.device.type != "cpu":  # F.dropout's own kernel and mask, scaled as it scales
            mask = _PerRun.apply(x, partial(_native_mask, p=self.p))
            return torch.where(mask, x, 0.0).mul_(1.0 / (1.0 - self.p))
        keep = _keep_threshold(self.p)
        if keep == 65536:
            return x
        return torch.where(_PerRun.apply(x, partial(_keep_mask, keep=keep)), x, 0.0).mul_(65536 / keep)


def _native_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.native_dropout(x, p, True)[1]


class _RunDropPath(DropPath):
    """timm's ``DropPath`` with each run's draw from its own stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        return x * _PerRun.apply(x, partial(_drop_path_noise, keep=1 - self.drop_prob, scale=self.scale_by_keep))


def _drop_path_noise(x: torch.Tensor, keep: float, scale: bool) -> torch.Tensor:
    """timm's ``drop_path`` noise for ``x``: one Bernoulli draw per sample, scaled by the keep rate."""
    noise = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return noise.div_(keep) if keep > 0.0 and scale else noise


class Stack:
    """The models, optimizers and (optional) EMA models of N runs as stacked tensors.

    ``make_optimizer(param_groups)`` builds the optimizer for the stacked parameters (the same factory the runs
    used: every group's hyperparameters, weight decay included, are copied from the first run's optimizer, since
    stacking changes the parameter dimensions timm's weight-decay grouping looks at). ``compile``: the vmapped pass
    through ``torch.compile`` in ``compile_mode``.
    """

    def __init__(self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                 emas: Sequence[nn.Module] | None, criterion: nn.Module,
                 make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], compile: bool = False,
                 compile_mode: str = "default"):
        self.models, self.optimizers, self.emas, self.criterion = list(models), list(optimizers), emas, criterion
        self._pass = torch.compile(self._vmapped, mode=compile_mode) if compile else self._vmapped
        self.params, self.buffers = stack_module_state(self.models)
        self.base = copy.deepcopy(self.models[0]).to("meta")
        _draw_per_run(self.base)
        set_fused_attention(self.base, False)  # fused SDPA's backward fails under vmap on CUDA
        self.devices = sorted({"cpu", str(next(iter(self.params.values())).device)})
        self.seed(range(len(self.models)))
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

    def seed(self, seeds: Iterable[int]) -> None:
        """Give each run the random states :func:`seed_everything` gives its separate run (default: 0, 1, ...)."""
        self.streams = [Streams.seeded(seed, self.devices) for seed in seeds]

    def _vmapped(self, params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        return vmap(self._forward, randomness="error")(params, buffers, x)  # any other draw is refused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Every run's model on its own inputs: ``x`` (N, B, ...) -> (N, B, ...), in the models' train/eval mode,
        each run's dropout and drop-path masks drawn from its own :attr:`streams` (compiled once when the stack
        was built with ``compile``; dynamo leaves the draws out of the graph)."""
        self.base.train(self.models[0].training)
        token = _ACTIVE.set(self.streams)
        try:
            return self._pass(self.params, self.buffers, x)
        except RuntimeError as e:
            if "randomness error mode" not in str(e):
                raise
            raise UserError("the model draws random numbers that --stack cannot draw per run as its separate run "
                            "does (only dropout and drop path can be); turn that randomness off or drop --stack") \
                from None
        finally:
            _ACTIVE.reset(token)

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


# timm's patch dropout (ViT's, and Eva's and NaFlexViT's with indices; the latter only in newer timm)
_PATCH_DROPOUTS = tuple(c for c in (getattr(timm.layers, n, None) for n in ("PatchDropout", "PatchDropoutWithIndices"))
                        if c is not None)


def check_stackable(model: nn.Module) -> None:
    """Refuse, before anything is written, a model with random draws that a stacked pass cannot make per run as
    each separate run does: attention dropout inside the fused attention kernel, timm's patch dropout. Any other
    draw inside the pass is refused at the first stacked step."""
    for module in model.modules():
        if getattr(module, "fused_attn", False) and getattr(getattr(module, "attn_drop", None), "p", 0.0) > 0:
            raise UserError("--stack cannot draw the attention dropout inside the fused attention kernel per run as "
                            "its separate run does; drop --stack (new runs may pass --model-kwargs attn_drop_rate=0)")
        if isinstance(module, _PATCH_DROPOUTS) and module.prob > 0:
            raise UserError("--stack cannot draw timm's patch dropout per run as its separate run does; drop --stack "
                            "(new runs may pass --model-kwargs patch_drop_rate=0)")


def _draw_per_run(base: nn.Module) -> None:
    """Make ``base``'s dropout and drop path draw each run's masks from its own stream (:func:`check_stackable`
    refuses what cannot be)."""
    check_stackable(base)
    for module in base.modules():
        if type(module) is FastDropout:
            module.__class__ = _RunDropout
        elif type(module) is DropPath:
            module.__class__ = _RunDropPath


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
