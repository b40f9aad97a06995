"""Tokens sent to the rank that holds their expert and back: the experts modules of a traced graph made expert-parallel.

The model is traced with each experts module (``units.ep_plan``) one opaque call,
``pipesched::experts(hidden, top_k_index, top_k_weights, parameters, name)``, so that the
graph holds where it is called and on what, whatever the module computes inside.
``place_dispatch`` then makes each such call ``Exchange.dispatch``:

1. each (token, pick) pair goes to the rank holding its expert, in order of rank: the pair
   counts first (one all-to-all), then the token rows and their local expert ids;
2. the rank runs its own experts on what it received through the module's own forward, on
   a view of the module that holds this rank's experts (each row one pick of weight one);
3. the outputs go back the same way (one all-to-all), and each token's are summed, each
   times its routing weight, where the token lives.

The all-to-alls are differentiable (backward: the same exchange reversed), so a rank's
experts get the gradients of every rank's tokens they computed. Every rank of the ``ep``
group runs each exchange, in the same order, also with nothing to send. Between issuing a
token all-to-all and waiting for it, ``Exchange.in_flight`` lets the other action of an
overlapped pair compute (``pipeline.runtime.paired``).
"""

from __future__ import annotations

import copy
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn


@torch.library.custom_op("pipesched::experts", mutates_args=())
def _experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             parameters: list[torch.Tensor], name: str) -> torch.Tensor:
    raise RuntimeError(f"the traced call of experts module {name!r} runs only once "
                       f"place_dispatch has made it an exchange")


@_experts.register_fake
def _(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
      parameters: list[torch.Tensor], name: str) -> torch.Tensor:
    return torch.empty_like(hidden)


EXPERTS_CALL = torch.ops.pipesched.experts.default


def opaque_experts(model: nn.Module, names: list[str]) -> nn.Module:
    """``model`` (a copy made for tracing) with each experts module in ``names`` calling
    ``pipesched::experts`` instead of computing (an instance forward on the copy, bound to
    it: a copy of the copy calls its own)."""
    for name in names:
        module = model.get_submodule(name)
        module.__dict__["_experts_name"] = name
        module.forward = types.MethodType(_opaque_forward, module)
    return model


def _opaque_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    parameters = [tensor for _, tensor in module.named_parameters(recurse=False)]
    called: torch.Tensor = torch.ops.pipesched.experts(hidden, top_k_index, top_k_weights,
                                                       parameters,
                                                       module.__dict__["_experts_name"])
    return called


@dataclass
class ExchangeCounts:
    """All-to-alls of token rows a rank ran (forward and backward) and the bytes it sent."""

    forward: int = 0
    backward: int = 0
    forward_bytes: int = 0
    backward_bytes: int = 0
    received_rows: int = 0  # (token, pick) rows this rank's experts computed
    waited: float = 0.0  # seconds the token rows' all-to-alls were waited for, both ways
    overlapped: int = 0  # of them, those the other action of an overlapped pair covered


@dataclass(eq=False)
class Exchange:
    """The ``ep`` group's token exchange, as the function a graph calls (``dispatch``)."""

    group: dist.ProcessGroup
    model: nn.Module  # the model whose experts modules the graph's calls name
    timeout: float | None = None  # seconds an all-to-all may wait for the others (the Pipe's)
    counts: ExchangeCounts = field(default_factory=ExchangeCounts)
    # A declared cost of each all-to-all of rows (``schedules.Link``: latency + bytes sent /
    # bandwidth per message, ``size - 1`` messages): it completes no sooner. gloo's
    # all-to-all between processes of one host costs next to nothing; benchmarks declare
    # a network's. None: as fast as it is.
    declared_link: Any = None
    # Called right after a token rows' all-to-all is issued, before it is waited for: the
    # runtime's turn-taking within an overlapped pair (``pipeline.runtime.paired``).
    # Returns whether the other action of the pair computed meanwhile.
    in_flight: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        self.size = dist.get_world_size(self.group)
        exchange = self

        def ep_dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, parameters: list[torch.Tensor],
                        name: str) -> torch.Tensor:
            return exchange.run(hidden, top_k_index, top_k_weights, parameters, name)

        self.dispatch = ep_dispatch

    def run(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor, parameters: list[torch.Tensor],
            name: str) -> torch.Tensor:
        """What experts module ``name`` returns for ``hidden``, its experts spread over the
        group (``parameters``: this rank's slices of its own parameters)."""
        module = self.model.get_submodule(name)
        local_experts = parameters[0].shape[0]
        tokens, picks = top_k_index.shape
        flat = top_k_index.reshape(-1)
        owner = torch.div(flat, local_experts, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.size)
        received = self._exchanged(send, send.new_empty(self.size), None, None, "pair counts")
        send_splits, received_splits = send.tolist(), received.tolist()
        rows = torch.div(order, picks, rounding_mode="floor")
        local_ids = self._exchanged((flat - owner * local_experts)[order],
                                    flat.new_empty(sum(received_splits)), received_splits,
                                    send_splits, "expert ids")
        arrived: torch.Tensor = _AllToAll.apply(  # type: ignore[no-untyped-call]
            hidden[rows], self, received_splits, send_splits)
        self.counts.received_rows += len(local_ids)
        computed = _run_local(module, parameters, arrived, local_ids, top_k_weights.dtype)
        returned: torch.Tensor = _AllToAll.apply(  # type: ignore[no-untyped-call]
            computed, self, send_splits, received_splits)
        by_pair = returned[torch.argsort(order)].view(tokens, picks, -1)
        combined: torch.Tensor = (by_pair * top_k_weights.unsqueeze(-1)).sum(dim=1)
        return combined.to(hidden.dtype)

    def _exchanged(self, sent: torch.Tensor, output: torch.Tensor,
                   output_splits: list[int] | None, input_splits: list[int] | None,
                   what: str, backward: bool = False, rows: bool = False) -> torch.Tensor:
        """``sent`` (rows in order of destination rank) exchanged over the group into
        ``output``, waiting at most the timeout (and, for token ``rows``, at least the
        declared link's time)."""
        issued = time.perf_counter()
        work = dist.all_to_all_single(output, sent.contiguous(), output_splits, input_splits,
                                      group=self.group, async_op=True)
        if rows and self.in_flight is not None and self.in_flight():
            self.counts.overlapped += 1
        waiting = time.perf_counter()
        try:
            assert work is not None
            work.wait(None if self.timeout is None else timedelta(seconds=self.timeout))
            if self.declared_link is not None and rows:
                link, nbytes = self.declared_link, sent.numel() * sent.element_size()
                cost = (self.size - 1) * (link.latency + nbytes / self.size / link.bandwidth)
                time.sleep(max(0.0, issued + cost - time.perf_counter()))
            if rows:
                self.counts.waited += time.perf_counter() - waiting
        except RuntimeError as error:
            raise RuntimeError(
                f"an expert-parallel all-to-all ({what}, {'backward' if backward else 'forward'})"
                f" across the {self.size} ep ranks did not complete within {self.timeout}s "
                f"(a rank died, hung or is too slow: raise Pipe(timeout=...)): {error}"
            ) from error
        return output


def _run_local(module: nn.Module, parameters: list[torch.Tensor], arrived: torch.Tensor,
               local_ids: torch.Tensor, weight_dtype: torch.dtype) -> torch.Tensor:
    """``module``'s forward on this rank's experts: each arrived row its own token, with
    one pick (its local expert, weight one)."""
    if not len(local_ids):
        return arrived * 0  # nothing to compute; kept on the graph so its backward exchanges
    view = _holding(module, parameters)
    ones = torch.ones(len(local_ids), 1, dtype=weight_dtype, device=arrived.device)
    computed: torch.Tensor = view(arrived, local_ids.unsqueeze(1), ones)
    return computed


def _holding(module: nn.Module, parameters: list[torch.Tensor]) -> nn.Module:
    """A shallow view of experts ``module`` whose own parameters are ``parameters`` (its
    ``num_experts`` their count): the module's forward on the tensors a graph passes."""
    view = copy.copy(module)
    view.__dict__["_parameters"] = dict(zip(
        [key for key, _ in module.named_parameters(recurse=False)], parameters))
    if isinstance(getattr(module, "num_experts", None), int):
        view.__dict__["num_experts"] = parameters[0].shape[0]
    return view


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over the group (``output_splits`` from each rank, ``input_splits`` to
    each); backward the gradients exchanged back."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, exchange: Exchange, output_splits: list[int],
                input_splits: list[int]) -> torch.Tensor:
        ctx.exchange, ctx.splits = exchange, (output_splits, input_splits)
        output = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        exchange.counts.forward += 1
        exchange.counts.forward_bytes += rows.numel() * rows.element_size()
        return exchange._exchanged(rows, output, output_splits, input_splits, "token rows",
                                   rows=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        output_splits, input_splits = ctx.splits
        exchange: Exchange = ctx.exchange
        output = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        exchange.counts.backward += 1
        exchange.counts.backward_bytes += grad.numel() * grad.element_size()
        returned = exchange._exchanged(grad, output, input_splits, output_splits,
                                       "token rows' gradients", backward=True, rows=True)
        return returned, None, None, None


def local_experts(model: nn.Module) -> Any:
    """A pass making every ``pipesched::experts`` call of a program run the experts module
    of ``model`` it names, as written, on the tensors the graph gives it."""
    def experts_as_written(hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, parameters: list[torch.Tensor],
                           name: str) -> torch.Tensor:
        module = _holding(model.get_submodule(name), parameters)
        return module(hidden, top_k_index, top_k_weights)  # type: ignore[no-any-return]

    def run_as_written(graph_module: fx.GraphModule) -> None:
        calls = [node for node in graph_module.graph.nodes
                 if node.op == "call_function" and node.target is EXPERTS_CALL]
        for node in calls:
            node.target = experts_as_written
        if calls:
            graph_module.recompile()
    return run_as_written


def place_dispatch(graph_module: fx.GraphModule, exchange: Exchange) -> int:
    """Make every ``pipesched::experts`` call of ``graph_module`` the exchange, in place;
    how many there were."""
    calls = [node for node in graph_module.graph.nodes
             if node.op == "call_function" and node.target is EXPERTS_CALL]
    for node in calls:
        node.target = exchange.dispatch
    if calls:
        graph_module.recompile()
    return len(calls)
