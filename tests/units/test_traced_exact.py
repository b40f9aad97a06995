"""A model as it is written, pipelined in one process: loss and every gradient equal the
plain model's (float64, by the model's own parameter names), every schedule family."""

from __future__ import annotations

import copy

import pytest
import torch

from pipeline import Pipe, SummedLoss
from traced_models import build, llama, loss_options, reference, tokens

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v")
MODES = ("never", "always")
TOLERANCE = 1e-10


@pytest.fixture(scope="module", params=["llama", "gpt2", "looped"])
def case(request: pytest.FixtureRequest):
    model, batch, target = build(request.param)
    plain = copy.deepcopy(model)
    return request.param, model, batch, target, reference(plain, batch, target, request.param)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_equal_the_plain_model(case, schedule: str, mode: str) -> None:
    kind, model, batch, target, (loss_expected, grads_expected) = case
    model.zero_grad()
    with Pipe(model, chunks=4, schedule=schedule, checkpoint=mode, sample=batch,
              devices=["cpu", "cpu"], **loss_options(kind)) as pipe:
        loss = pipe.step(batch, target)
    assert abs(loss.item() - loss_expected) < TOLERANCE
    grads = {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}
    assert set(grads) == set(grads_expected)
    for name, grad in grads.items():
        assert grad is not None, name
        assert (grad - grads_expected[name]).abs().max().item() < TOLERANCE, name


def test_the_default_cut_is_prologue_blocks_epilogue() -> None:
    model = llama()  # the make the other tests trace: the trace is shared (units.trace)
    batch, target = tokens()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        names = [unit.name for unit in pipe.units]
        assert names == ["(prologue)", "model.layers.0", "model.layers.1", "model.layers.2",
                         "model.layers.3", "(epilogue)"]
        assert sum(pipe.balance) == 6
        stages = [unit.stage for unit in pipe.units]
        assert stages == sorted(stages) and stages[0] == 0 and stages[-1] == 1
        assert [unit.chunk for unit in pipe.units] == stages  # 1F1B: one chunk a stage
        assert "model.layers.1.self_attn.q_proj.weight" in pipe.units[2].parameters
        assert "model.norm" in pipe.units[5].modules
        # the parameters that run are the model's own objects
        own = {id(p) for p in model.parameters()}
        assert all(id(p) in own for p in pipe.model.parameters())


def test_sequence_length_changes_between_steps() -> None:
    model = llama()
    plain = copy.deepcopy(model)
    batch, _ = tokens(length=12)
    with Pipe(model, chunks=2, schedule="zb-v", checkpoint="always", sample=batch,
              devices=["cpu", "cpu"], **loss_options("llama")) as pipe:
        for length in (12, 7, 20):
            batch, target = tokens(length=length, seed=length)
            loss_expected, grads_expected = reference(plain, batch, target, "llama")
            model.zero_grad()
            loss = pipe.step(batch, target)
            assert abs(loss.item() - loss_expected) < TOLERANCE, length
            worst = max((p.grad - grads_expected[n]).abs().max().item()
                        for n, p in model.named_parameters(remove_duplicate=False))
            assert worst < TOLERANCE, length


def test_the_output_is_what_the_model_returns_in_both_modes() -> None:
    model = llama()
    batch, _ = tokens()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        for training in (True, False):
            pipe.train(training)
            output = pipe(batch)
            expected = model(**batch)
            assert type(output) is type(expected)
            assert (output.logits - expected.logits).abs().max().item() < TOLERANCE


def test_an_optimizer_on_the_model_trains_what_runs() -> None:
    model = llama()
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    batch, target = tokens()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        for _ in range(2):
            pipe.step(batch, target)
            optimizer.step()
            optimizer.zero_grad()
            reference(plain, batch, target, "llama")
            plain_optimizer.step()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert (p - q).abs().max().item() < TOLERANCE, name


def test_dropout_gives_one_result_across_schedules_cuts_and_modes() -> None:
    """A GPT-2 with dropout on: one seed, one loss and one gradient, whatever the schedule,
    the cut or the recomputation (two steps: the second draws anew)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=4, n_head=2,
                                      n_positions=64, bos_token_id=1, eos_token_id=2)).double()
    batch, target = tokens()
    found = []
    for schedule, mode in [("1f1b", "never"), ("zb-v", "always"),
                           ("interleaved-1f1b", "except_last")]:
        model = copy.deepcopy(base)
        with Pipe(model, chunks=4, schedule=schedule, checkpoint=mode, sample=batch,
                  devices=["cpu", "cpu"], **loss_options("gpt2")) as pipe:
            torch.manual_seed(5)
            losses = [pipe.step(batch, target).item() for _ in range(2)]
        found.append((losses, torch.cat([p.grad.flatten() for p in model.parameters()])))
    (first_losses, first_grads), *others = found
    assert first_losses[0] != first_losses[1]  # dropout drew anew
    for losses, grads in others:
        assert losses == pytest.approx(first_losses, abs=TOLERANCE)
        assert (grads - first_grads).abs().max().item() < TOLERANCE


def test_clipping_counts_the_tied_weight_once() -> None:
    model = llama()
    plain = copy.deepcopy(model)
    batch, target = tokens()
    with Pipe(model, chunks=2, sample=batch, devices=["cpu", "cpu"],
              **loss_options("llama")) as pipe:
        pipe.step(batch, target)
        norm = pipe.clip_grad_norm_(0.1)
    reference(plain, batch, target, "llama")
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    assert abs(norm.item() - expected.item()) < TOLERANCE
    for p, q in zip(model.parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < TOLERANCE


def _family(name: str) -> tuple[torch.nn.Module, dict, torch.Tensor, object]:
    import transformers

    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "vit":
        config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=3,
                                        num_attention_heads=2, intermediate_size=32,
                                        image_size=16, patch_size=8, num_labels=3,
                                        hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
        pixels = torch.randn(4, 3, 16, 16, dtype=torch.float64)
        labels = torch.tensor([0, 1, 2, 1])
        return (transformers.ViTForImageClassification(config).double(),
                {"pixel_values": pixels}, labels,
                lambda output, target: torch.nn.functional.cross_entropy(output.logits, target))
    make = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                        {"sliding_window": 8})}[name]
    batch, labels = tokens()
    return make[1](make[0](**text, **make[2])).double(), batch, labels, None


@pytest.mark.parametrize("family", ["qwen2", "mistral", "vit"])
def test_more_families_as_written(family: str) -> None:
    """Qwen2, Mistral (a sliding window) and a ViT classifier, untouched, under ZB-V with
    recomputation: exact against the plain model."""
    model, batch, target, loss_fn = _family(family)
    plain = copy.deepcopy(model)
    options = loss_options("llama") if loss_fn is None else {"loss_fn": loss_fn}
    plain.zero_grad()
    output = plain(**batch)
    loss = options["loss_fn"]
    expected_loss = (loss(output, target) / (
        loss.count(target) if isinstance(loss, SummedLoss) else 1))
    expected_loss.backward()
    with Pipe(model, chunks=2, schedule="zb-v", checkpoint="always", sample=batch,
              devices=["cpu", "cpu"], **options) as pipe:
        loss = pipe.step(batch, target)
        assert len(pipe.units) == 5
    assert abs(loss.item() - expected_loss.item()) < TOLERANCE
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < TOLERANCE, name


@pytest.mark.parametrize("split", ["layers", "graph"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_traced_linear_layers_defer_their_weight_gradients_to_w_exactly(
        kind: str, split: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced model's Linear layers are ``aten.linear`` nodes (GPT-2's Conv1D ``aten.addmm``),
    not module calls: under ``split_backward="layers"`` they defer like an ``nn.Linear``
    (W runs their recorded products), under ``"graph"`` the graph split takes them; both
    exact."""
    from split_backward.chunk_split import ChunkSplit
    from split_backward.traced_linears import addmm, linear

    recorded: list[object] = []
    record = ChunkSplit.record
    monkeypatch.setattr(ChunkSplit, "record", lambda self, r: (recorded.append(r), record(self, r)))
    model, batch, target = build(kind)
    loss_expected, grads_expected = reference(copy.deepcopy(model), batch, target, kind)
    for schedule, mode in (("zb-h1", "never"), ("zb-v", "always"), ("dualpipe-v", "never")):
        model.zero_grad()
        with Pipe(model, chunks=4, schedule=schedule, checkpoint=mode, sample=batch,
                  devices=["cpu", "cpu"], split_backward=split, **loss_options(kind)) as pipe:
            loss = pipe.step(batch, target)
            products = [node for unit in pipe.model for graph in unit.graphs
                        for node in graph.graph.nodes if node.target in (linear, addmm)]
            blocks = len(pipe.units) - 2
        # every projection of every block points at a deferring function (Llama 7, GPT-2 4)
        assert len(products) >= 2 * 4 * blocks, len(products)  # two graphs: train and eval
        assert abs(loss.item() - loss_expected) < TOLERANCE, (schedule, mode)
        for name, p in model.named_parameters():
            assert (p.grad - grads_expected[name]).abs().max().item() < TOLERANCE, (schedule, name)
    if split == "layers":
        assert len(recorded) > 0, "no traced Linear deferred its weight gradient"
    else:
        assert recorded == []
