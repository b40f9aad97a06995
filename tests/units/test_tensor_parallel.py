"""Tensor parallelism on a model as it is written, by its own names: Hugging Face models in
a (pp, tp) and a (pp, dp, tp) mesh against the plain model on the whole batch (float64),
the all-reduces Megatron's pair costs, state by the model's names across tp degrees, and
plans refused before anything is split."""

from __future__ import annotations

import pytest
import torch

from tests.pipeline.helpers.dist_harness import in_turn, run_ranks
from tp_workers import LLAMA_PLAN, hf_model, tp_exact, tp_random, tp_silent_peer, tp_state
from traced_models import tokens
from units.tp_graph import Boundaries, place_boundaries
from units.tp_local import check_splittable, localized
from units.tp_plan import Style, resolve_plan
from units.trace import export_model
from units.signature import modes
from units.variants import own_copy

TOLERANCE = 1e-10
# (model, plan, schedule, checkpoint): the bars' models and schedules, 4 ranks, (pp=2, tp=2)
CASES = [("llama", "auto", "1f1b", "never"), ("llama", "auto", "zb-v", "always"),
         ("llama", "auto", "interleaved-1f1b", "never"), ("llama", "llama", "zb-h1", "never"),
         ("qwen2", "auto", "1f1b", "always"),  # Mistral's attention is Llama's: by hand
         ("qwen3", "auto", "zb-h1", "never"),  # replicated_with_grad_allreduce norms
         ("gpt2", "gpt2", "1f1b", "never")]
BLOCKS_PER_STAGE = 2  # the Llama's 4 blocks on 2 stages (the other models have 2 blocks)
MICROBATCHES = 2


def _check_exact(rows: list[tuple], where: str) -> None:
    for kind, plan, schedule, mode, loss_error, grad_error, compared, *_ in rows:
        case = f"{where}: {kind}, plan {plan}, {schedule}, checkpoint={mode}"
        assert loss_error < TOLERANCE, case
        assert grad_error < TOLERANCE, case
        assert compared > 0, case


def test_hugging_face_models_split_by_their_names_are_exact(tmp_path) -> None:
    by_rank = run_ranks(in_turn, 4, [(tp_exact, ((2, 2), ("pp", "tp"), CASES)),
                                     (tp_state, (str(tmp_path / "checkpoint"),)),
                                     (tp_random, ())],
                        timeout=900)
    for rank, (rows, state, apart) in enumerate(by_rank):
        # dropout everywhere, generators seeded apart: what every tp rank computes whole
        # drew the same numbers on each (the step's seed is agreed)
        assert apart == 0.0, rank
        assert len(rows) == len(CASES)
        _check_exact(rows, f"rank {rank}")
        for kind, plan, schedule, mode, *_, forward, backward, times in rows:
            if kind != "llama" or schedule in ("zb-v", "interleaved-1f1b"):
                continue  # 2 blocks (traces cost per block); V and interleaved stages
                # hold other shares of the blocks
            # Megatron's pair: 2 all-reduces forward and 2 backward per block and
            # micro-batch (a recomputed forward runs its 2 again in the backward).
            blocks = BLOCKS_PER_STAGE * MICROBATCHES
            assert forward == 2 * blocks * (2 if mode == "always" else 1), (rank, kind, mode)
            assert backward == 2 * blocks, (rank, kind, mode)
            if schedule == "zb-h1" and times is not None:
                # the split Linears' weight gradients were deferred to W
                assert times["W"] > 0.1 * (times["I"] + times["W"]), times
        # a plan the model cannot take is refused at Pipe(), the model as it was
        assert "lm_head.weight is tied to" in state["refused"] and state["kept"], rank
        assert state["norm_error"] < TOLERANCE  # clip_grad_norm_ across pp and tp
        # predict() measured the chunks with their all-reduces (and changed nothing: the
        # step after it is exact), every rank of a pipeline the same simulated step
        assert state["probed_reduces"] > 0 and state["predicted"] > 0
        if rank in (0, 1):  # the ranks that gather, per pipeline
            assert state["gathered_keys"]
            for key in ("gathered_error", "tp1_error", "tp2_checkpoint_error",
                        "tp2_state_dict_error"):
                assert state[key] < TOLERANCE, (rank, key)
        if rank == 0:
            assert state["plain_error"] < TOLERANCE and state["plain_tied"]
        if "eval_error" in state:  # the last stage's ranks: pipe(x) in evaluation mode
            assert state["eval_error"] < TOLERANCE
    assert sum("eval_error" in state for _, state, _ in by_rank) == 2


def test_a_silent_tp_peer_fails_the_all_reduce_within_the_timeout() -> None:
    waited, _, message = run_ranks(tp_silent_peer, 2)[0].partition("s: ")
    assert 1.5 < float(waited) < 5.0, waited
    assert "tensor-parallel all-reduce (forward) across the 2 tp ranks did not complete " \
           "within 2.0s" in message and "Pipe(timeout=...)" in message


# (pp=2, dp=2, tp=2) with FSDP under ZB-H1: tests/test_train_hf.py, through the example.


def test_auto_reads_the_plan_the_config_ships() -> None:
    model = hf_model("llama", layers=2)
    styles = resolve_plan(model, "auto")
    assert styles == resolve_plan(model, LLAMA_PLAN)
    assert len(styles) == 2 * 7
    assert styles["model.layers.1.self_attn.o_proj"] == Style("rowwise")
    assert styles["model.layers.0.mlp.up_proj"] == Style("colwise")


@pytest.mark.parametrize("plan, message", [
    ({"model.layers.*.attn.q_proj": "colwise"}, "'model.layers.*.attn.q_proj' matches no module"),
    ({"model.layers.*.self_attn.q_proj": "diagonal"}, "style 'diagonal'"),
    ({}, "an empty dict"),
    ("everything", "expected 'auto'"),
    ({"model.layers.0.mlp.up_proj": "colwise", "model.layers.*.mlp.up_proj": "rowwise"},
     "given two styles"),
])
def test_a_plan_that_names_nothing_or_no_style_is_refused(plan, message) -> None:
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        resolve_plan(hf_model("llama", layers=2), plan)


def test_a_packed_projection_counts_its_packs_from_its_holder() -> None:
    from tp_workers import plan_of

    gpt2 = resolve_plan(hf_model("gpt2", layers=2), plan_of("gpt2"))
    assert gpt2["transformer.h.1.attn.c_attn"] == Style("packed_colwise", packs=3)  # q, k, v
    fused = torch.nn.Sequential(torch.nn.Linear(4, 16))  # a gate and up projection, say
    assert resolve_plan(fused, {"0": "packed_colwise"})["0"] == Style("packed_colwise", packs=2)
    told = resolve_plan(fused, {"0": Style("packed_colwise", packs=4)})["0"]
    assert told.packs == 4 and told.parts == 4


def test_auto_needs_a_config_that_ships_a_plan() -> None:
    with pytest.raises(ValueError, match="base_model_tp_plan"):
        resolve_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), "auto")


def test_what_cannot_split_is_refused_naming_the_module_the_dimension_and_tp() -> None:
    model = hf_model("llama", layers=2)  # 4 heads, 2 key/value heads
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible by tp=4"):
        check_splittable(model, resolve_plan(model, "auto"), 4)
    check_splittable(model, resolve_plan(model, "auto"), 2)
    odd = {"model.layers.0.mlp.up_proj": Style("colwise")}  # 32 output features
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj' \(colwise\) splits its "
                                         r"weight's dimension 0 \(32\) over tp=3"):
        check_splittable(model, odd, 3)
    tied = {"lm_head": Style("colwise")}
    with pytest.raises(ValueError, match="lm_head.weight is tied to"):
        check_splittable(model, tied, 2)
    with pytest.raises(ValueError, match="splits nn.Linear and Conv1D layers; 'model.norm'"):
        check_splittable(model, {"model.norm": Style("colwise")}, 2)


def test_a_block_traced_at_one_ranks_sizes_has_one_boundary_pair_per_split_pair() -> None:
    """Per block: one entry before the attention's q, k, v (shared) and one before the MLP's
    gate and up, one exit after o_proj and one after down_proj: 2 all-reduces each way."""
    model = hf_model("llama", layers=2)
    batch, _ = tokens(rows=2, length=6)
    styles = resolve_plan(model, "auto")
    local = localized(model, styles, 2)
    assert local.model.layers[0].self_attn.k_proj.weight.shape == (4, 16)  # 1 of 2 kv heads
    on_meta = {key: value.to("meta") for key, value in batch.items()}
    graph_module = own_copy(export_model(local, on_meta, modes(local))[0])
    boundaries = Boundaries(group=None)  # type: ignore[arg-type]  # never called here
    place_boundaries(graph_module, styles, boundaries)
    called = [node.target.__name__ for node in graph_module.graph.nodes
              if node.op == "call_function" and getattr(node.target, "__name__", "")
              in ("tp_enter", "tp_leave")]
    assert called.count("tp_enter") == 2 * 2 and called.count("tp_leave") == 2 * 2


def test_random_ops_in_a_split_region_draw_apart_and_the_others_alike() -> None:
    """GPT-2 with every dropout on: the attention's (on a rank's heads) draws apart per rank,
    the residual and embedding dropouts (whole on every rank) draw alike."""
    from tp_workers import plan_of

    model = hf_model("gpt2", layers=2)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.2
    model.config.attn_pdrop = 0.2
    batch, _ = tokens(rows=2, length=6)
    styles = resolve_plan(model, plan_of("gpt2"))
    local = localized(model, styles, 2)
    on_meta = {key: value.to("meta") for key, value in batch.items()}
    graph_module = own_copy(export_model(local, on_meta, modes(local))[0])
    random = [node for node in graph_module.graph.nodes if node.op == "call_function"
              and "dropout" in str(node.target) or "scaled_dot_product" in str(node.target)]
    place_boundaries(graph_module, styles, Boundaries(group=None))  # type: ignore[arg-type]
    apart = [node for node in graph_module.graph.nodes
             if getattr(node.target, "__name__", "") == "tp_draw_apart"]
    assert len(apart) == 2  # one attention per block
    assert len(random) - len(apart) == 1 + 2 * 2  # embedding, two residual dropouts a block
