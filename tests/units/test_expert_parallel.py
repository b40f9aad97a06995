"""Expert parallelism on a model as it is written: Hugging Face MoE models and one written by
hand at (pp=2, ep=2) against the plain model on the whole batch, state by the model's names
across ep degrees, plans refused before anything is sharded, and the experts traced as one
call each (an eager loop over the experts a token picked runs, exactly)."""

from __future__ import annotations

import copy

import pytest
import torch

from ep_workers import (HAND_PLAN, HandMoE, ep_exact, ep_silent_peer, ep_state, hand_loss,
                        moe_model)
from partitioners.measure.cost import LayerCost
from partitioners.measure.model_cut import cut_of
from partitioners.plan.expert_parallel import ExpertParallelism, spread_costs
from schedules import Link
from schedules.registry import schedule_names
from tests.pipeline.helpers.dist_harness import in_turn, run_ranks
from traced_models import tokens
from units import TraceError
from units.ep_dispatch import EXPERTS_CALL
from units.ep_plan import check_expert_split, expert_count, resolve_expert_plan

# (model, schedule, checkpoint): the bars' models and schedules, 4 ranks, (pp=2, ep=2)
# (Qwen2-MoE under ZB-V, float64 through the example: tests/test_train_moe.py)
CASES = [("mixtral", "1f1b", "never"), ("mixtral", "dualpipe-v", "never"),
         ("qwen3-moe", "1f1b", "always"),
         ("hand", "zb-v", "always"), ("hand", "interleaved-1f1b", "always"),
         ("hand", "zb-h1", "never"), ("hand-one-side", "1f1b", "never"),
         # the rest of the registered schedules and the default recomputation
         ("hand", "gpipe", "never"), ("hand", "zb-h2", "never"), ("hand", "zb", "never"),
         ("hand", "v-half", "always"), ("hand", "v-min", "never"),
         ("hand", "dualpipe-v", "never"), ("hand", "1f1b", "except_last"),
         # DualPipeV's F&B pairs, each one's exchanges in the other's turns
         ("mixtral", "dualpipe-v+overlap", "never"), ("hand", "dualpipe-v+overlap", "always"),
         ("hand-one-side", "dualpipe-v+overlap", "never")]
FLOAT32 = (1e-5, 1e-4)  # the loss's relative error; a gradient's, relative to the largest
FLOAT64 = 1e-10


def test_moe_models_with_experts_spread_over_ep_are_exact(tmp_path) -> None:
    by_rank = run_ranks(in_turn, 4, [(ep_exact, ((2, 2), ("pp", "ep"), CASES)),
                                     (ep_state, (str(tmp_path / "checkpoint"),))],
                        timeout=900)
    assert {schedule for _, schedule, _ in CASES} >= set(schedule_names())  # every one
    for rank, (rows, state) in enumerate(by_rank):
        assert [row[:3] for row in rows] == CASES
        for kind, schedule, mode, loss_error, grad_error, compared, received, overlapped \
                in rows:
            case = f"rank {rank}: {kind}, {schedule}, checkpoint={mode}"
            loss_bar, grad_bar = (FLOAT64, FLOAT64) if kind.startswith("hand") else FLOAT32
            assert loss_error < loss_bar, case
            assert grad_error < grad_bar, case
            assert compared > 0, case
            if kind == "hand-one-side":  # every token to the first ep rank's experts
                # (under DualPipeV's V stage 0 holds no MoE layer)
                holds = rank >= 2 or not schedule.startswith("dualpipe-v")
                assert (received > 0) == (rank % 2 == 0 and holds), case
            if not schedule.endswith("+overlap"):
                assert overlapped == 0, case
            elif rank >= 2:  # stage 1 holds every model's MoE layers under the V
                assert overlapped > 0, case
        _check_state(rank, state)


def test_replicas_beside_ep_average_all_but_the_experts_exactly() -> None:
    """(pp=2, dp=2, ep=2): the router, norms and embedding averaged over the 4 ranks
    sharing the batch, each expert over its 2 dp replicas only; one side's experts never
    picked on the other (zero gradients, still reduced alike)."""
    cases = [("hand", "1f1b", "never"), ("hand-one-side", "zb-h1", "never")]
    for rank, rows in enumerate(run_ranks(ep_exact, 8, (2, 2, 2), ("pp", "dp", "ep"), cases,
                                          timeout=600)):
        for kind, schedule, mode, loss_error, grad_error, compared, received, overlapped \
                in rows:
            assert loss_error < FLOAT64 and grad_error < FLOAT64, (rank, kind)
            assert compared > 0
            if kind == "hand-one-side":
                assert (received > 0) == (rank % 2 == 0), rank


def test_a_silent_ep_peer_fails_the_exchange_within_the_timeout() -> None:
    waited, _, message = run_ranks(ep_silent_peer, 2)[0].partition("s: ")
    assert 1.5 < float(waited) < 5.0, waited
    assert "expert-parallel all-to-all (pair counts, forward) across the 2 ep ranks did not " \
           "complete within 2.0s" in message and "Pipe(timeout=...)" in message


def _check_state(rank: int, state: dict) -> None:
    assert "'layers.0.experts' holds 3 experts, which ep=2" in state["refused"]
    assert state["kept"], "a refused plan left the model as it was"
    no_plan, fsdp, no_dimension, sequential = state["mesh_refusals"]
    assert "'ep' dimension is 2: pass expert_parallel=" in no_plan
    assert "data_parallel='fsdp' is not supported yet" in fsdp
    assert "needs a mesh with an 'ep' dimension" in no_dimension
    assert "not an nn.Sequential" in sequential
    assert state["predicted"] is not None and state["predicted"] > 0
    assert state["norm_error"] < FLOAT64
    _, _, planned = state["auto"]
    assert planned and state["auto_error"] < FLOAT64, state["auto"]
    for key in ("gathered_error", "plain_error", "ep1_error", "ep2_error", "eval_error"):
        if key in state:
            assert state[key] < FLOAT64, (rank, key)
    if "gathered_keys" in state:
        assert state["gathered_keys"]
    if rank == 0:
        assert "plain_error" in state and "gathered_error" in state
    if rank >= 2:
        assert "eval_error" in state


def test_the_planner_prices_a_ranks_share_of_the_experts_and_its_exchanges() -> None:
    hop = Link(latency=1e-4, bandwidth=1e8)
    spread = ExpertParallelism(2, experts=(0.0, 0.75), exchanges=(0, 1), picks=(0, 2), link=hop)
    costs = [LayerCost(forward=1.0, backward=2.0, param_bytes=400, activation_bytes=1000),
             LayerCost(forward=1.0, backward=2.0, param_bytes=400, activation_bytes=1000,
                       backward_input=1.2, backward_weight=0.8)]
    plain, moe = spread_costs(costs, spread)
    assert plain == costs[0]
    # 2 all-to-alls each way of 2 x 1000 bytes, half sent: 1 message of 1000 bytes
    exchange = 2 * (1e-4 + 1000 / 1e8)
    assert moe.forward == pytest.approx(1.0 + exchange)
    assert moe.backward == pytest.approx(2.0 + exchange)
    assert moe.backward_input == pytest.approx(1.2 + exchange)
    assert moe.backward_weight == 0.8
    assert moe.param_bytes == round(400 * (0.25 + 0.75 / 2))
    with pytest.raises(ValueError, match="expected one of each per unit"):
        ExpertParallelism(2, (0.5,), (1, 1), (2,), hop)


def test_an_eager_loop_over_experts_traces_as_one_call_and_runs_exactly() -> None:
    model = HandMoE()
    with pytest.raises(TraceError, match="control flow depends on tensor values"):
        cut_of(copy.deepcopy(model), {"input_ids": tokens()[0]["input_ids"]})
    batch, target = tokens()
    batch = {"input_ids": batch["input_ids"]}
    plain = copy.deepcopy(model)
    cut = cut_of(model, batch, None, HAND_PLAN)
    calls = [node for unit in cut.units for graph in unit.graphs for node in graph.graph.nodes
             if node.op == "call_function" and node.target is not EXPERTS_CALL
             and getattr(node.target, "__name__", "") == "experts_as_written"]
    assert len(calls) == 2 * 2  # one per block, in each mode's graph
    loss = hand_loss(cut.units(batch), target)
    expected = hand_loss(plain(**batch), target)
    loss.backward()
    expected.backward()
    assert abs(loss.item() - expected.item()) < FLOAT64
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < FLOAT64, name


def test_auto_reads_the_plan_the_config_ships() -> None:
    for kind in ("mixtral", "qwen2-moe", "qwen3-moe"):
        assert resolve_expert_plan(moe_model(kind), "auto") == [
            "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], kind
    with pytest.raises(ValueError, match=r"config.base_model_ep_plan\); HandMoE has no config"):
        resolve_expert_plan(HandMoE(), "auto")


@pytest.mark.parametrize("plan, message", [
    ({"layers.*.moe": "ep_dispatch_experts"}, r"'layers.\*.moe' matches no module of HandMoE"),
    ({"layers.*.experts": "sharded"}, r"has style 'sharded', which is not one of"),
    ({}, "an empty dict marks no experts"),
    ({"layers.*.experts.down_proj": "grouped_gemm"},
     r"its module 'layers.\*.experts' is not marked 'ep_dispatch_experts'"),
    ("everything", r"expected 'auto' or a dict"),
])
def test_a_plan_that_marks_nothing_or_no_style_is_refused(plan, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_expert_plan(HandMoE(), plan)


def test_what_ep_ranks_cannot_share_is_refused_naming_the_module() -> None:
    model = HandMoE(experts=6)
    names = resolve_expert_plan(model, HAND_PLAN)
    check_expert_split(model, names, 3)
    with pytest.raises(ValueError, match=r"'layers.0.experts' holds 6 experts, which ep=4"):
        check_expert_split(model, names, 4)
    with pytest.raises(ValueError, match=r"'layers.0.norm'.* are not stacked one slice per "
                                         r"expert"):
        expert_count("layers.0.norm", model.layers[0].norm)
    with pytest.raises(ValueError, match=r"'layers.0' \(Sequential\) is not an experts module"
                                         r".*got none"):
        expert_count("layers.0", torch.nn.Sequential())
    with pytest.raises(ValueError, match=r"'layers.0' .* parameters in submodules"):
        expert_count("layers.0", model.layers[0])


def test_the_planner_picks_dualpipe_v_pairs_where_exchanges_are_worth_hiding() -> None:
    from partitioners.plan.search import plan

    hop = Link(latency=2e-3, bandwidth=1e8)  # an exchange as long as most of a forward
    units = [LayerCost(forward=3e-3, backward=6e-3, param_bytes=400, activation_bytes=4000)
             for _ in range(8)]
    spread = ExpertParallelism(2, experts=(0.75,) * 8, exchanges=(1,) * 8, picks=(2,) * 8,
                               link=hop)
    moe = spread_costs(units, spread)
    assert all(cost.exchange > 0 for cost in moe)
    chosen = plan({1: moe, 2: moe}, stages=2, batch=16, microbatch_counts=[8, 16],
                  schedules=["1f1b", "zb-v", "dualpipe-v"], checkpoints=["never"], prune=False)
    assert (chosen.schedule, dict(chosen.schedule_options)) == ("dualpipe-v", {"overlap": True})
    pairs = [c for c in chosen.candidates if dict(c.schedule_options).get("overlap")]
    plain = [c for c in chosen.candidates if c.schedule == "dualpipe-v"
             and not dict(c.schedule_options)]
    assert pairs and plain and min(c.step_time for c in pairs) < min(c.step_time for c in plain)
    # without exchanges the pairs are not searched at all
    bare = plan({1: units, 2: units}, stages=2, batch=16, microbatch_counts=[8, 16],
                schedules=["dualpipe-v"], checkpoints=["never"])
    assert not any(dict(c.schedule_options) for c in bare.candidates)
