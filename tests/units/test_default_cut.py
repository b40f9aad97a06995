"""The default cut of a traced model: every block of its most frequent block class, across
containers (a ResNet's BasicBlocks in layer1..layer4), not one container's blocks; blocks
inside a block (a mixture's experts) are not units; Llama and GPT-2 keep their cuts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline import Pipe
from traced_models import gpt2, llama
from units.boundaries import block_run, forward_order

TOLERANCE = 1e-10
BLOCKS = [f"layer{stage}.{block}" for stage in range(1, 5) for block in range(2)]


class BasicBlock(nn.Module):
    """torchvision's BasicBlock, as it is written there: in-place ReLU and sum, a downsample
    where the shape changes."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's resnet18 layout, narrow: a stem, layer1..layer4 of two BasicBlocks each
    (layer4 holds the most parameters), a pooled head."""

    def __init__(self, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [width, width, 2 * width, 4 * width, 8 * width]
        for stage in range(1, 5):
            stride = 1 if stage == 1 else 2
            setattr(self, f"layer{stage}", nn.Sequential(
                BasicBlock(widths[stage - 1], widths[stage], stride),
                BasicBlock(widths[stage], widths[stage])))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8 * width, classes)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def test_a_resnets_blocks_are_every_basic_block_across_its_layers() -> None:
    assert block_run(ResNet()) == BLOCKS


def test_a_resnet_is_cut_at_every_basic_block_and_is_exact() -> None:
    """Eight BasicBlocks, a prologue (the stem) and an epilogue (the head), under 1F1B on two
    stages: gradients and BatchNorm statistics as the plain model's, micro-batch by micro-batch."""
    model = ResNet()
    plain = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 32, 32, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 5, (4,), generator=generator)
    with Pipe(model, chunks=2, sample=x, devices=["cpu", "cpu"], loss_fn=F.cross_entropy) as pipe:
        assert [unit.name for unit in pipe.units] == ["(prologue)", *BLOCKS, "(epilogue)"]
        pipe.step(x, y)
    for part, target in zip(x.chunk(2), y.chunk(2)):
        (F.cross_entropy(plain(part), target) / 2).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None, name
        assert (p.grad - q.grad).abs().max().item() < TOLERANCE, name
    for key, value in plain.state_dict().items():
        assert (model.state_dict()[key].double() - value.double()).abs().max() < TOLERANCE, key


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(h)))


class MixtureLayer(nn.Module):
    """A block holding a run of four experts: more experts than layers, yet not the blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList(Expert() for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        normed = self.norm(h)
        return h + sum(expert(normed) for expert in self.experts)


class Mixture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MixtureLayer() for _ in range(2))


def test_blocks_inside_a_block_are_not_units() -> None:
    assert block_run(Mixture()) == ["layers.0", "layers.1"]


class Stages(nn.Module):
    """Blocks grouped in a Sequential of Sequentials (stages of two blocks): the blocks are
    the units, not the stages that hold them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.stages = nn.Sequential(nn.Sequential(Expert(), Expert()),
                                    nn.Sequential(Expert(), Expert(), Expert()))


def test_blocks_grouped_in_sequentials_are_counted_across_them() -> None:
    assert block_run(Stages()) == ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1",
                                   "stages.1.2"]


def test_sequentials_that_are_the_blocks_stay_the_blocks() -> None:
    """A plain CNN written as a Sequential of (conv, norm, ReLU) Sequentials: those are its
    blocks, as before."""
    features = nn.Sequential(*(nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.ReLU())
                               for _ in range(3)))
    model = nn.Module()
    model.features, model.head = features, nn.Linear(3, 2)
    assert block_run(model) == ["features.0", "features.1", "features.2"]


def test_heads_without_parameters_are_not_blocks() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList(Expert() for _ in range(2))
    model.drops = nn.ModuleList(nn.Dropout(0.1) for _ in range(3))
    assert block_run(model) == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize(("factory", "prefix"), [(llama, "model.layers"),
                                                 (gpt2, "transformer.h")])
def test_llama_and_gpt2_keep_their_decoder_layers(factory, prefix: str) -> None:
    assert block_run(factory()) == [f"{prefix}.{index}" for index in range(4)]


class Reversed(nn.Module):
    """Two containers of one block class, the one defined second run first."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.ModuleList(Expert() for _ in range(2))
        self.encoder = nn.ModuleList(Expert() for _ in range(2))
        self.unused = nn.ModuleList(Expert() for _ in range(2))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder, *self.decoder]:
            h = block(h)
        return h


def test_forward_order_puts_blocks_as_the_forward_runs_them() -> None:
    model = Reversed()
    starts = block_run(model)
    assert starts[:2] == ["decoder.0", "decoder.1"]  # as the model names them
    graph = torch.export.export(model, (torch.randn(2, 4),)).graph
    assert forward_order(graph, starts) == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]


def test_a_block_alone_in_its_container_is_a_block_of_its_class() -> None:
    """A T5 with one encoder block and two decoder blocks: all three, in the order the
    model names them (encoder first)."""
    from transformers import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(
        vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=2,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    assert block_run(model) == ["encoder.block.0", "decoder.block.0", "decoder.block.1"]
    lonely = nn.Module()
    lonely.blocks = nn.ModuleList([Expert()])
    assert block_run(lonely) == []


class DecoderFirst(nn.Module):
    """Its decoder is defined before its encoder and run after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.decoder = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder, *self.decoder]:
            x = block(x)
        return x


def test_the_default_units_run_in_the_forwards_order() -> None:
    model = DecoderFirst()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    y = torch.randn(4, 6, dtype=torch.float64)
    F.mse_loss(plain(x), y).backward()
    with Pipe(model, chunks=2, sample=x, devices=["cpu", "cpu"], loss_fn=F.mse_loss) as pipe:
        assert [info.name for info in pipe.units] == [
            "encoder.0", "encoder.1", "decoder.0", "decoder.1"]
        pipe.step(x, y)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert (p.grad - q.grad).abs().max().item() < TOLERANCE
