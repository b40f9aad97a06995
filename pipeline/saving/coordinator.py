"""The first rank plans for all: each rank's part goes to it alone, and it answers each rank
with that rank's own share.

``torch.distributed.checkpoint`` plans a save the same way (a coordinator gathers the
local plans, merges them and scatters each rank its final plan), through pickled
object collectives. Here the parts cross as ``pipeline.payloads.values`` encodes them
(checked JSON and tensor bytes, never pickle), every wait is bounded by the Pipe's
timeout (``PeerError``), and a rank decodes only what is its own: the first rank the
parts of all (it merges them, as DCP's coordinator does), every other rank its answer.
So a rank's cost grows with its own entries, not with ranks x entries, as it did when
every rank gathered and decoded every rank's plan. What every rank sees is a few ints
a rank: each part's size and whether its sender could encode it.

A failure anywhere is raised on every rank, as ``checkpoints._agree`` does: a rank's own
error where it failed, elsewhere a ``CheckpointError`` naming the rank that failed. A
value a rank may not send (``encode`` refuses it) is raised on every rank at once, as
``group.collectives.gather_objects`` does, naming that rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pipeline.errors import PeerError
from pipeline.group.collectives import all_gather, wait
from pipeline.group.ranks import RankGroup, Ranks
from pipeline.payloads.checked_json import StructureError, short
from pipeline.payloads.values import MAX_MESSAGE_BYTES, decode, encode
from pipeline.saving.format import CheckpointError

T = TypeVar("T")
_REFUSALS = {1: TypeError, 2: ValueError}  # a sender's status, when not 0
_MAX_REFUSAL = 1 << 16


class _PeerFailure(CheckpointError):
    """Another rank's failure, as the first rank learned it (its message names that rank)."""


def attempt(work: Callable[[], T], what: str) -> tuple[T | None, BaseException | None]:
    """``work()``, or the error it raised; torch's own errors and the system's (OSError)
    become a CheckpointError whose message is their first line (DCP's CheckpointException
    is not even an Exception)."""
    try:
        return work(), None
    except (CheckpointError, PeerError) as error:
        return None, error
    except Exception as error:  # noqa: BLE001 - reported on every rank by agree or answer
        line = (str(error).strip().splitlines() or [""])[0][:500]
        wrapped = CheckpointError(f"{what}: {type(error).__name__}: {line}")
        wrapped.__cause__ = error
        return None, wrapped


def agree(ranks: Ranks, device: torch.device, failure: BaseException | None, what: str
          ) -> None:
    """Return once every rank reached this point; the first failure raised on every rank
    (this rank's own, or one naming the rank that failed). A few bytes a rank, on every
    rank. Waits at most the Pipe's timeout (PeerError)."""
    gathered = ranks.gather({"failed": _text(failure), "value": None}, what, device)
    if failure is not None:
        raise failure
    for rank, entry in enumerate(gathered):
        _check_envelope(entry, rank, what)
        if entry["failed"] is not None:
            raise CheckpointError(f"rank {rank} failed {what}: {entry['failed']}")


def collect(ranks: Ranks, mine: Any, failure: BaseException | None, what: str,
            device: torch.device) -> tuple[list[Any] | None, BaseException | None]:
    """Every rank's ``mine`` on the first rank, in rank order; None on the others.

    Returns the values (the first rank) and the failure to pass to ``answer``: this rank's
    own, or on the first rank the first of any rank's (a ``CheckpointError`` naming it).

    Raises:
        TypeError, ValueError: on every rank, when a rank's value may not cross.
        StructureError: a rank sent bytes that ``encode`` never writes.
        PeerError: a rank did not take part within the timeout.
    """
    envelope = {"failed": _text(failure), "value": None if failure else mine}
    if not isinstance(ranks, RankGroup):
        return ([mine] if failure is None else None), failure
    group, timeout = ranks.group, ranks.timeout
    status, refusal = 0, None
    try:
        data = encode(envelope)
    except (TypeError, ValueError) as error:  # sent in place of the value: every rank raises
        status, refusal = (1 if isinstance(error, TypeError) else 2), error
        data = str(error).encode()[:_MAX_REFUSAL]
    header = torch.tensor([len(data), status], dtype=torch.int64, device=device)
    headers = [row.tolist() for row in all_gather(header, group, timeout, what)]
    if any(not 0 <= size <= MAX_MESSAGE_BYTES or flag not in (0, *_REFUSALS)
           for size, flag in headers):
        raise StructureError(f"expected sizes of at most {MAX_MESSAGE_BYTES} bytes and a status "
                             f"among 0, 1, 2 from every rank for {what}, got {short(headers)}")
    padded = _padded(data, max(size for size, _ in headers), device)
    if any(flag for _, flag in headers):  # rare: every rank reads the refusals, to name them
        blobs = [_bytes(row, size) for row, (size, _) in
                 zip(all_gather(padded, group, timeout, what), headers)]
        rank, flag = next((r, f) for r, (_, f) in enumerate(headers) if f)
        raise _REFUSALS[flag](f"rank {rank} could not send its part of {what}: "
                              f"{blobs[rank][:_MAX_REFUSAL].decode('utf-8', 'replace')}"
                              ) from refusal
    first = ranks.rank == 0
    rows = [torch.empty_like(padded) for _ in headers] if first else None
    wait(dist.gather(padded, rows, group=group, group_dst=0, async_op=True), what, group,
         timeout)
    if rows is None:
        return None, failure
    values = []
    for rank, (row, (size, _)) in enumerate(zip(rows, headers)):
        entry = decode(_bytes(row, size))
        _check_envelope(entry, rank, what)
        if entry["failed"] is not None and failure is None:
            failure = _PeerFailure(f"rank {rank} failed {what}: {entry['failed']}")
        values.append(entry["value"])
    return values, failure


def answer(ranks: Ranks, answers: list[Any] | None, failure: BaseException | None, what: str,
           device: torch.device) -> Any:
    """This rank's entry of the first rank's ``answers`` (one a rank), once the first rank
    answered; a failure (``failure`` on the first rank, or any rank's own) raised on every
    rank, naming the rank that failed.

    Raises:
        CheckpointError: a rank failed (the failing rank raises its own error).
        StructureError: the first rank sent bytes that ``encode`` never writes.
        PeerError: the first rank did not answer within the timeout.
    """
    if not isinstance(ranks, RankGroup):
        if failure is not None:
            raise failure
        assert answers is not None
        return answers[0]
    group, timeout, first = ranks.group, ranks.timeout, ranks.rank == 0
    blobs: list[bytes] = []
    if first:
        if failure is None and (answers is None or len(answers) != ranks.size):
            failure = CheckpointError(f"the first rank has no answer for every rank {what}")
        if failure is None:
            assert answers is not None
            try:
                blobs = [encode({"failed": None, "value": value}) for value in answers]
            except (TypeError, ValueError) as error:
                failure = CheckpointError(f"the first rank could not answer {what}: {error}")
        if failure is not None:
            text = str(failure) if isinstance(failure, _PeerFailure) else \
                f"rank 0 failed {what}: {_text(failure)}"
            blobs = [encode({"failed": text, "value": None})] * ranks.size
    largest = max((len(blob) for blob in blobs), default=0)
    sizes = [torch.tensor([len(blob), largest], dtype=torch.int64, device=device)
             for blob in blobs] if first else None
    header = torch.empty(2, dtype=torch.int64, device=device)
    wait(dist.scatter(header, sizes, group=group, group_src=0, async_op=True), what, group,
         timeout)
    size, largest = header.tolist()
    if not 8 <= size <= largest <= MAX_MESSAGE_BYTES:
        raise StructureError(f"expected an answer of 8 to {MAX_MESSAGE_BYTES} bytes from the "
                             f"first rank for {what}, got {short([size, largest])}")
    parts = [_padded(blob, largest, device) for blob in blobs] if first else None
    received = torch.empty(largest, dtype=torch.uint8, device=device)
    wait(dist.scatter(received, parts, group=group, group_src=0, async_op=True), what, group,
         timeout)
    entry = decode(_bytes(received, size))
    _check_envelope(entry, 0, what)
    if failure is not None:
        raise failure
    if entry["failed"] is not None:
        raise CheckpointError(entry["failed"])
    return entry["value"]


def _text(failure: BaseException | None) -> str | None:
    return None if failure is None else f"{type(failure).__name__}: {failure}"


def _check_envelope(entry: Any, rank: int, what: str) -> None:
    if not (isinstance(entry, dict) and set(entry) == {"failed", "value"}
            and (entry["failed"] is None or isinstance(entry["failed"], str))):
        raise CheckpointError(f"rank {rank} sent something else than its part while {what}: a "
                              f"rank of another version, or corrupt")


def _padded(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    padded = torch.zeros(size, dtype=torch.uint8, device=device)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return padded


def _bytes(row: torch.Tensor, size: int) -> bytes:
    return bytes(row[:size].cpu().numpy().tobytes())
