"""The whole training step recorded once as a CUDA graph and replayed (``train --capture``).

A tiny ViT's step on a GPU is bound by the host launching its few hundred small kernels, not by the GPU. A CUDA
graph launches them all at once, but replays exactly what it recorded: every value that changes from step to step
must then live in device memory, at a fixed address. :class:`Plan` holds them: the training images and labels
(uint8, resident), each run's image order and crop/flip draws of the epoch (drawn on the host once an epoch, by the
very calls the eager loop makes once a step, so the numbers are the same), a step counter the graph advances
itself, and the per-step losses, summed on the device and read once an epoch. The learning rates are device
tensors the host fills from timm's scheduler before each replay (Adam/AdamW with ``capturable=True`` read them
there). :class:`Graphed` runs the step eagerly for its first calls (on a side stream, as PyTorch asks before a
capture, and as real training steps), then records it once and replays it. What the step bakes in from the host
(the EMA's decay) is its key: a step with another key runs eagerly, so a replay never computes another step.

The eager step is the reference: the same body runs in both, and on a CPU (where nothing is captured) the body
equals the eager loop bit for bit (``tests/test_graphed.py``); the captured step equals the eager body on CUDA
(``tests/test_cuda.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch

from .augment import crop_flip, crop_flip_draws
from .data import normalize

__all__ = ["CAPTURE_DEVICES", "CAPTURE_OPTIMIZERS", "Graphed", "Plan", "epoch_draws", "fill_lrs", "learning_rates",
           "set_capturable", "tensor_lrs"]

CAPTURE_DEVICES = ("cuda",)  # where --capture records graphs
CAPTURE_OPTIMIZERS = ("adam", "adamw")  # torch's, which read a tensor learning rate on the device when capturable
WARMUP = 3  # eager steps before the capture (PyTorch: let lazy initialisation and autotuning happen first)


def epoch_draws(steps: int, batch: int, padding: int, hflip: float, generator: torch.Generator) -> torch.Tensor:
    """The crop offsets and flips of an epoch's ``steps`` batches, (steps, 3, batch): one
    :func:`~timm_rollout.augment.crop_flip_draws` call per step, in order, as the eager loop draws them."""
    return torch.stack([crop_flip_draws(batch, padding, hflip, generator) for _ in range(steps)])


class Plan:
    """The inputs of a captured step that change per step, in device memory: each run's image order and crop/flip
    draws of one epoch, the step counter and the per-step losses (steps, runs). The runs' training images and labels
    (one tensor each per run, on the device) stay resident, once for runs that share them."""

    def __init__(self, images: Sequence[torch.Tensor], labels: Sequence[torch.Tensor], mean: Sequence[float],
                 std: Sequence[float], padding: int, steps: int, batch: int):
        firsts: dict[int, int] = {}  # a shared tensor (by identity) -> its first row in self.images
        kept, offsets, rows = [], [], 0
        for run_images, run_labels in zip(images, labels, strict=True):
            if id(run_images) not in firsts:
                firsts[id(run_images)] = rows
                kept.append((run_images, run_labels))
                rows += len(run_images)
            offsets.append(firsts[id(run_images)])
        self.images = kept[0][0] if len(kept) == 1 else torch.cat([i for i, _ in kept])
        self.labels = kept[0][1] if len(kept) == 1 else torch.cat([lab for _, lab in kept])
        self.mean, self.std, self.padding = mean, std, padding
        normalize(self.images[:1], mean, std)  # its device copies of mean and std are made (and cached) here, not
        # in a recorded step, which cannot copy from the host
        device, runs = self.images.device, len(offsets)
        self.offsets = torch.tensor(offsets, device=device).view(runs, 1)  # each run's first row in self.images
        self.order = torch.zeros(runs, steps, batch, dtype=torch.long, device=device)
        self.draws = torch.zeros(runs, steps, 3, batch, dtype=torch.long, device=device)
        self.losses = torch.zeros(steps, runs, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)

    def start(self, orders: Sequence[torch.Tensor], draws: Sequence[torch.Tensor]) -> None:
        """Load an epoch: each run's image order (steps * batch,) and draws (steps, 3, batch); the counter to 0."""
        for i, (order, drawn) in enumerate(zip(orders, draws, strict=True)):
            self.order[i].copy_(order.view(self.order.shape[1:]) + self.offsets[i])
            self.draws[i].copy_(drawn)
        self.losses.zero_()
        self.step.zero_()

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's normalised, augmented inputs (runs, B, C, H, W) and labels (runs, B), read on the device."""
        idx = self.order.index_select(1, self.step).squeeze(1)  # (runs, B)
        drawn = self.draws.index_select(1, self.step).squeeze(1).transpose(0, 1).flatten(1)  # (3, runs * B)
        x = normalize(crop_flip(self.images[idx.flatten()], drawn, self.padding), self.mean, self.std)
        return x.view(*idx.shape, *x.shape[1:]), self.labels[idx]

    def record(self, losses: torch.Tensor) -> None:
        """Keep this step's losses (one per run) and advance the counter."""
        self.losses.index_copy_(0, self.step, losses.detach().float().view(1, -1))
        self.step.add_(1)


class Graphed:
    """``body(key)`` run eagerly for its first :data:`WARMUP` calls, then recorded once as a CUDA graph and
    replayed while ``key`` (what the body bakes in from the host) stays the recorded one; eager otherwise, and
    always off CUDA."""

    def __init__(self, body: Callable[[Hashable], None], device: torch.device):
        self.body, self.device = body, device
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: Hashable = None
        self.calls = 0
        self.side: torch.cuda.Stream | None = None  # the warm-up's stream

    @property
    def captures(self) -> bool:
        return self.device.type == "cuda"

    def __call__(self, key: Hashable) -> None:
        if self.graph is not None and key == self.key:
            self.graph.replay()
        elif not self.captures or self.graph is not None or self.calls < WARMUP:
            self.calls += 1
            self._eager(key)
        else:
            self.graph, self.key = torch.cuda.CUDAGraph(), key
            with torch.cuda.graph(self.graph):  # records; runs nothing
                self.body(key)
            self.graph.replay()

    def _eager(self, key: Hashable) -> None:
        if not self.captures or self.graph is not None:
            self.body(key)
            return
        self.side = self.side or torch.cuda.Stream(self.device)  # warm-up on a side stream, as torch.cuda.graph's
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # docs ask
        with torch.cuda.stream(self.side):
            self.body(key)
        torch.cuda.current_stream(self.device).wait_stream(self.side)


def set_capturable(optimizer: torch.optim.Optimizer, capturable: bool) -> None:
    """Make a torch Adam/AdamW (e.g. restored from a resume state written by the other mode) keep its step
    counts where ``capturable`` needs them: on the parameters' device when True, on the CPU when False."""
    for group in optimizer.param_groups:
        if "capturable" not in group:
            continue
        group["capturable"] = capturable
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(p.device if capturable else "cpu", torch.float32)


def learning_rates(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """One float32 device tensor per parameter group, for a capturable optimizer (None otherwise)."""
    groups = optimizer.param_groups
    if not all(g.get("capturable") for g in groups):
        return None
    return [torch.tensor(float(g["lr"]), dtype=torch.float32, device=g["params"][0].device) for g in groups]


def fill_lrs(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor] | None) -> None:
    """Copy the groups' current learning rates (the scheduler's) into ``lrs``: one small kernel each, no sync."""
    for lr, group in zip(lrs or (), optimizer.param_groups, strict=False):
        lr.fill_(float(group["lr"]))


@contextlib.contextmanager
def tensor_lrs(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor] | None) -> Iterator[None]:
    """The groups read their learning rates from ``lrs`` for the duration (what a recorded step reads on every
    replay); their float values, which the scheduler and the checkpoints use, come back after."""
    if lrs is None:
        yield
        return
    floats = [g["lr"] for g in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    try:
        yield
    finally:
        for group, value in zip(optimizer.param_groups, floats, strict=True):
            group["lr"] = value
