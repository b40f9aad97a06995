"""LossCarrier: the batch loss rows a backward message carries, merged by count."""

from __future__ import annotations

import torch

from pipeline.runtime.loss_carrier import LossCarrier

CPU = torch.device("cpu")


def test_a_row_in_a_message_never_changes_after_it_left() -> None:
    """attach() hands out the known row itself (no clone): later losses must make new rows."""
    carrier = LossCarrier(CPU)
    carrier.add(torch.tensor(0.25))
    *_, sent = carrier.attach((torch.ones(2),))
    before = sent.clone()
    carrier.add(torch.tensor(0.5, dtype=torch.float64))
    assert torch.equal(sent, before)
    assert carrier.known is not None and carrier.known.tolist() == [2.0, 0.75]
    *_, empty = LossCarrier(CPU).attach(())
    assert empty.tolist() == [0.0, 0.0]


def test_the_row_that_knows_more_losses_wins_bit_for_bit_and_is_a_copy() -> None:
    losses = [torch.tensor(0.1, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64),
              torch.tensor(0.3, dtype=torch.float64)]
    last = LossCarrier(CPU)
    for loss in losses:
        last.add(loss)
    expected = torch.zeros((), dtype=torch.float64)
    for loss in losses:
        expected += loss
    other = LossCarrier(CPU)
    other.add(torch.tensor(9.0))  # knows one loss: the row of three replaces it
    buffer = torch.cat([last.attach(())[0]])  # as a transport delivers it: a view of its buffer
    grads = other.detach((torch.ones(1), buffer))
    assert len(grads) == 1 and torch.equal(grads[0], torch.ones(1))
    assert other.known is not None and other.known[0] == 3 and torch.equal(other.known[1], expected)
    buffer.zero_()  # the pooled buffer is reused: what is known stays
    assert other.known[0] == 3
    fewer = LossCarrier(CPU)
    fewer.add(torch.tensor(1.0))
    other.detach((fewer.attach(())[0],))  # knows fewer: ignored
    assert other.known[0] == 3 and torch.equal(other.known[1], expected)
