"""Layers whose randomness or in-place writes show only after micro-batch 0 (issue 31, rows
4-6), the models built from them, and references computed by the plain model.

Shared by the one-process tests (``test_detection.py``) and the spawned gloo ranks
(``dist_workers.detection_rows``), so both runtimes check the same cases.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ROWS, WIDTH, CHUNKS = 13, 6, 4  # micro-batches of 4, 3, 3, 3 rows
TOLERANCE = 1e-10


def _key(row: torch.Tensor) -> bytes:
    return bytes(row.detach().contiguous().view(torch.uint8).tolist())


class NoisyRows(nn.Module):
    """Scales by ``1 + noise`` the rows whose first feature exceeds ``threshold``: it draws
    from the default generator only for those rows (none in micro-batch 0 here).

    The noise a row gets the first time the layer sees it is kept by the row's bytes, so
    a plain model run micro-batch by micro-batch (the same shapes, so the same bits) can
    replay what the pipeline's forward drew: the gradients then must match that forward,
    which a recomputation that drew other numbers would not.
    """

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold
        self.first_noise: dict[bytes, torch.Tensor] = {}
        self.replay: dict[bytes, torch.Tensor] | None = None
        self.rows_drawn: list[int] = []  # per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.zeros_like(x)
        if self.replay is not None:
            for index in range(x.shape[0]):
                noise[index] = self.replay.get(_key(x[index]), noise[index])
            return x * (1 + noise)
        rows = (x[:, 0] > self.threshold).nonzero().flatten().tolist()
        self.rows_drawn.append(len(rows))
        if rows:
            drawn = torch.randn(len(rows), x.shape[1], dtype=x.dtype)
            for index, row in zip(rows, drawn):
                self.first_noise.setdefault(_key(x[index]), row)
            noise[rows] = drawn
        return x * (1 + noise)


class OwnNoise(nn.Module):
    """Inverted dropout drawn from a ``torch.Generator`` the layer owns (an attribute)."""

    def __init__(self, seed: int, p: float = 0.7) -> None:
        super().__init__()
        self.p = p
        self.generator = torch.Generator().manual_seed(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.bernoulli(torch.full_like(x, self.p), generator=self.generator)
        return x * keep / self.p


class ClosureNoise(nn.Module):
    """The same, with the generator captured in a closure: nothing on the module shows it."""

    def __init__(self, seed: int, p: float = 0.7) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.p = p
        self.draw: Callable[[torch.Tensor], torch.Tensor] = lambda like: torch.bernoulli(
            torch.full_like(like, p), generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.draw(x) / self.p


class FixNaN(nn.Module):
    """``if h.isnan().any(): h.nan_to_num_()``: writes its input only when it holds a NaN."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.isnan().any():
            h.nan_to_num_(nan=0.25)
        return h


class HalveRows(nn.Module):
    """Halves in place the rows of its input whose first feature exceeds ``threshold``."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = h[:, 0] > self.threshold
        if rows.any():
            h[rows] = h[rows] * 0.5
        return h * 1.5


def _linear() -> nn.Linear:
    return nn.Linear(WIDTH, WIDTH)


def draws_model() -> nn.Sequential:
    """Row 4: a drawing layer first in chunk 0 and one inside chunk 1."""
    torch.manual_seed(0)
    return nn.Sequential(NoisyRows(0.5), _linear(), nn.Tanh(),
                         _linear(), NoisyRows(0.0), _linear()).double()


def generator_model(closure: bool = False) -> nn.Sequential:
    """Row 5: a layer with a generator of its own in each chunk."""
    torch.manual_seed(0)
    noise: type[nn.Module] = ClosureNoise if closure else OwnNoise
    return nn.Sequential(_linear(), noise(11), nn.Tanh(), _linear(), noise(12), _linear()).double()


def writes_model() -> nn.Sequential:
    """Row 6: chunk 0 fixes NaNs in the caller's x (micro-batches 1 and 3), chunk 1 halves
    rows of its input (a Linear's output, which the plain model may write) in micro-batches
    2 and 3."""
    torch.manual_seed(0)
    return nn.Sequential(FixNaN(), _linear(), nn.Tanh(), _linear(), HalveRows(0.0),
                         _linear()).double()


def writes_x_model() -> nn.Sequential:
    """Row 6, the caller's x alone: chunk 0 fixes NaNs in it, nothing else writes."""
    torch.manual_seed(0)
    return nn.Sequential(FixNaN(), _linear(), nn.Tanh(), _linear(), _linear(), _linear()).double()


MODELS: dict[str, Callable[[], nn.Sequential]] = {
    "draws": draws_model, "generator": generator_model, "writes": writes_model,
    "writes_x": writes_x_model,
}
BALANCES = {"draws": [3, 3], "generator": [3, 3], "writes": [4, 2],  # HalveRows first in chunk 1
            "writes_x": [3, 3]}


def batch(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    y = torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    if case == "draws":
        x[:4, 0] = -1.0  # micro-batch 0: no row over NoisyRows(0.5)'s threshold
    if case.startswith("writes"):
        x[5, 2] = x[10, 4] = float("nan")  # micro-batches 1 and 3
    return x, y


def microbatches(value: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.tensor_split(value, CHUNKS))


def reference(case: str, before: nn.Sequential, pipelined: nn.Sequential,
              x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The plain model's gradients for ``case``.

    ``before`` is a copy of the model taken before the step (its generators as they were);
    ``pipelined`` the model the Pipe ran, whose NoisyRows hold the noise they drew. Rows 4
    and 5 run the plain model micro-batch by micro-batch (the draws depend on the shapes),
    weighting each loss by its share of the batch; row 6 runs the whole batch at once on
    a copy of ``x`` (the plain model writes its input).
    """
    model = copy.deepcopy(before)
    if case.startswith("writes"):
        nn.MSELoss()(model(x.clone()), y).backward()
    else:
        for mine, theirs in zip(model, pipelined):
            if isinstance(mine, NoisyRows) and isinstance(theirs, NoisyRows):
                mine.replay = theirs.first_noise
        for part, target in zip(microbatches(x), microbatches(y)):
            (nn.MSELoss()(model(part), target) * (part.shape[0] / ROWS)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def differences(model: nn.Module, expected: dict[str, torch.Tensor]) -> tuple[float, int]:
    """Largest gradient difference over the parameters this process holds, and their count."""
    worst, compared = 0.0, 0
    for name, parameter in model.named_parameters():
        if parameter.is_meta or parameter.grad is None:
            continue
        worst = max(worst, (parameter.grad - expected[name]).abs().max().item())
        compared += 1
    return worst, compared


def _share_noise(model: nn.Module) -> None:
    """Across ranks, every NoisyRows learns the noise drawn by its copy on the rank that ran
    it (test code: the ranks trust each other's pickles)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    layers = [layer for layer in model if isinstance(layer, NoisyRows)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [layer.first_noise for layer in layers])
    for index, layer in enumerate(layers):
        for noise in gathered:
            layer.first_noise.update(noise[index])


def run_case(case: str, schedule: str, checkpoint: str, seed: int = 3,
             **pipe_options: Any) -> dict[str, Any]:
    """One step of ``case`` under a Pipe: figures a bug would change.

    Returns the loss, the largest difference from the plain model's gradients (and how many
    gradients were compared), every local gradient (for comparing modes), whether the
    caller's x kept its values, and the rows each NoisyRows drew per call.
    """
    from pipeline import Pipe

    model = MODELS[case]()
    before = MODELS[case]()  # a fresh build: generators as they start, closures too
    x, y = batch(case)
    kept = x.clone()
    pipe = Pipe(model, chunks=CHUNKS, balance=BALANCES[case], schedule=schedule,
                checkpoint=checkpoint, loss_fn=nn.MSELoss(), **pipe_options)
    torch.manual_seed(seed)
    loss = pipe.step(x, y)
    pipe.close()
    _share_noise(model)
    error, compared = differences(model, reference(case, before, model, kept, y))
    return {
        "loss": loss.item(), "error": error, "compared": compared,
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()
                  if not p.is_meta and p.grad is not None},
        "x_kept": bool(torch.equal(x.nan_to_num(7.0), kept.nan_to_num(7.0))),
        "rows_drawn": [layer.rows_drawn for layer in model if isinstance(layer, NoisyRows)],
    }
