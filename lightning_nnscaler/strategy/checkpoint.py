"""What ``NnScalerStrategy`` saves and restores: the full module refreshed from the pieces, and
sharded checkpoints (``lightning_nnscaler.checkpoint`` holds the format).

The full LightningModule is refreshed from every rank's pieces (``strategy.full_module``) before
evaluation loops the plan does not run and at the end of training.

Saving: each rank lists the pieces it holds (model boxes; optimizer state of the boxes or ZeRO
chunks its optimizer updates); the lists are gathered (small: locations only) so that a box held
by several ranks (data-parallel replicas) is written once, by the lowest of them, and state the
plan never touches (e.g. a head used only in ``validation_step``) is written whole by rank 0. Each
rank then writes its own file, hashing it as it goes; no rank ever holds the whole model state.

Before any collective the ranks agree that all of them are saving (``every_rank_is_saving``), so a
save called on rank 0 only is refused by name. After writing, rank 0 checks it sees every rank's
file (ranks on machines without a shared filesystem write where rank 0 cannot read) and commits;
every rank learns the outcome, so the save succeeds or raises on all of them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections import defaultdict
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_nnscaler.checkpoint import (
    COMMON, POINTER, README, SAVE_RECORD, CheckpointError, claim, commit, partial_directory, rank_file_name, rank_payload,
    write_atomically, write_readme,
)
from lightning_nnscaler.checkpoint.index import INDEX_KEY, piece_index
from lightning_nnscaler.ir.box import PieceLocation, full_box
from lightning_nnscaler.runtime.executor import RankExecutor

_Entry = tuple[Any, ...]  # a piece's identity: ("model", location) or ("optimizer", index, location)


def tied_key_groups(module: nn.Module) -> list[list[str]]:
    """State_dict keys that name one tensor (tied weights), in groups of two or more."""
    keys_by_tensor: dict[int, list[str]] = defaultdict(list)
    for key, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        keys_by_tensor[id(tensor)].append(key)
    return [keys for keys in keys_by_tensor.values() if len(keys) > 1]


def group_keys_of(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[list[str]]:
    """Per param group, the state_dict key of each of its (full) parameters, in order."""
    key_of = _parameter_keys(module)
    return [[key_of[id(parameter)] for parameter in group["params"]] for group in optimizer.param_groups]


def _parameter_keys(module: nn.Module) -> dict[int, str]:
    """The first state_dict key of each parameter, by ``id`` (a tied parameter has several)."""
    keys: dict[int, str] = {}
    for key, parameter in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(parameter), key)
    return keys


def single_device_param_groups(optimizer: torch.optim.Optimizer, group_keys: list[list[str]]) -> dict[str, Any]:
    """The ``param_groups`` a single-device ``optimizer.state_dict()`` would have (``params`` as indices
    in key order), with an empty ``state``: the state itself lies in the rank files."""
    groups, index = [], 0
    for group, keys in zip(optimizer.param_groups, group_keys):
        groups.append({**{name: value for name, value in group.items() if name != "params"}, "params": list(range(index, index + len(keys)))})
        index += len(keys)
    return {"state": {}, "param_groups": groups}


def held_model_pieces(executor: Optional[RankExecutor]) -> list[tuple[PieceLocation, torch.Tensor]]:
    """This rank's parameter and buffer boxes with their current values (ZeRO-3 gathers them: a collective)."""
    if executor is None:
        return []
    return [(shard.location, shard.tensor) for shard in executor.full_shards().values()]


def held_optimizer_pieces(
    optimizer: torch.optim.Optimizer, locations: dict[int, PieceLocation], module: nn.Module
) -> list[tuple[PieceLocation, dict[str, Any]]]:
    """The optimizer state of each piece it updates. ``locations`` is empty before planning, when the
    optimizer still updates the full module's parameters."""
    key_of = _parameter_keys(module)
    pieces = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if not state:
                continue
            location = locations.get(id(parameter)) or PieceLocation(key_of[id(parameter)], full_box(parameter.shape))
            pieces.append((location, state))
    return pieces


AGREEMENT_TIMEOUT_S = 120.0  # how long the ranks may reach a save apart before it is refused


def every_rank_is_saving(path: str | os.PathLike, timeout_s: Optional[float] = None) -> None:
    """Agree that every rank is saving ``path`` before any collective of the save (gloo: ``monitored_barrier``).

    A save is a collective (each rank writes its own pieces): a ``trainer.save_checkpoint`` called on
    rank 0 only would otherwise meet the other ranks' next collective, or their exit, and fail with
    gloo's "remote worker crashing" or hang. NCCL has no monitored barrier; there a missing rank shows
    as the collective timeout.

    Raises:
        CheckpointError: some rank did not reach the save within ``timeout_s`` (default ``AGREEMENT_TIMEOUT_S``).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() != "gloo":
        return
    timeout = AGREEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"saving {path}: not every rank reached the save within {timeout:g} s ({reason}). Saving a checkpoint is a collective: "
            "every rank must call trainer.save_checkpoint (each writes its own pieces), not only rank 0 (e.g. not under "
            "`if trainer.is_global_zero:`)"
        ) from None


def save_sharded(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    rank: int,
    world_size: int,
    module: nn.Module,
    model_pieces: list[tuple[PieceLocation, torch.Tensor]],
    optimizer_pieces: list[list[tuple[PieceLocation, dict[str, Any]]]],
    group_keys: list[list[list[str]]],
    plan: dict[str, Any],
    gather: Callable[[Any], list[Any]],
    materialize: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
) -> None:
    """Write ``checkpoint`` as a sharded checkpoint directory at ``path`` (all ranks call it).

    Rank 0 first claims ``path`` (``checkpoint.claim``): it refuses a file or a directory holding files this
    format did not write, and a path another job is saving to; every rank learns of it before writing.
    Every rank writes its file into ``path/.partial-<token>`` and reports its size and content hash;
    rank 0 checks it can see every rank's file (else the ranks write to different machines' disks),
    then commits (``checkpoint.commit``); every rank learns the outcome, so all succeed or all raise.

    Args:
        checkpoint: What Lightning dumped (its ``state_dict`` and optimizer states are replaced by the pieces).
        module: The full LightningModule (shapes, tied keys, and the values of state the plan does not hold).
        model_pieces / optimizer_pieces: ``held_model_pieces`` / per optimizer ``held_optimizer_pieces``.
        group_keys: Per optimizer, ``group_keys_of``.
        plan: Recipe, parameters and code hash, recorded in the metadata.
        gather: Every rank's object, by rank (a collective).
        materialize: The whole values of a tensor of ``module`` on the meta device that no plan piece holds.

    Raises:
        CheckpointError: ``path`` is refused or busy (nothing written), a rank failed to write its file, rank 0
            cannot see some rank's file (no shared filesystem), or the commit failed; the earlier checkpoint is kept.
    """
    with ExitStack() as claimed:  # rank 0 holds the claim until every rank knows the outcome
        refusal = _claim(path, claimed) if rank == 0 else None
        token, refusal = gather((uuid.uuid4().hex[:12], refusal))[0]
        if refusal is not None:
            raise CheckpointError(refusal)
        _write_and_commit(
            checkpoint, path, token, rank=rank, world_size=world_size, module=module, model_pieces=model_pieces, materialize=materialize,
            optimizer_pieces=optimizer_pieces, group_keys=group_keys, plan=plan, gather=gather,
        )


def _claim(path: str | os.PathLike, claimed: ExitStack) -> Optional[str]:
    """Rank 0: hold ``path`` for this save (``checkpoint.claim``) until ``claimed`` closes, or the refusal every rank raises."""
    try:
        claimed.enter_context(claim(path))
    except CheckpointError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - e.g. no permission to create it: every rank must learn of it
        return f"saving {path} failed on rank 0 before writing anything: {type(error).__name__}: {error}"
    return None


def _write_and_commit(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    token: str,
    *,
    rank: int,
    world_size: int,
    module: nn.Module,
    model_pieces: list[tuple[PieceLocation, torch.Tensor]],
    optimizer_pieces: list[list[tuple[PieceLocation, dict[str, Any]]]],
    group_keys: list[list[list[str]]],
    plan: dict[str, Any],
    gather: Callable[[Any], list[Any]],
    materialize: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
) -> None:
    """The save under rank 0's claim: every rank writes its file into the partial directory; rank 0 commits (see ``save_sharded``)."""
    save = {"token": token, "world_size": world_size, "global_step": checkpoint.get("global_step"), "epoch": checkpoint.get("epoch")}
    with_optimizers = "optimizer_states" in checkpoint
    optimizer_pieces = optimizer_pieces if with_optimizers else []
    entries = [("model", location) for location, _ in model_pieces]
    entries += [("optimizer", index, location) for index, pieces in enumerate(optimizer_pieces) for location, _ in pieces]
    writers = _first_holders(gather(entries))
    mine = [(location, value) for location, value in model_pieces if writers[("model", location)] == rank]
    if rank == 0:
        mine += _state_the_plan_does_not_hold(module, {entry[1].state_key for entry in writers if entry[0] == "model"}, materialize)
    my_optimizer_pieces = [
        [(location, state) for location, state in pieces if writers[("optimizer", index, location)] == rank]
        for index, pieces in enumerate(optimizer_pieces)
    ]
    partial = partial_directory(path, token)
    failure, records = None, {}
    try:
        if os.path.exists(path) and not os.path.isdir(path):
            raise CheckpointError(f"{path} is a file, not a sharded checkpoint directory: remove it or save under another name")
        partial.mkdir(parents=True, exist_ok=True)
        name = rank_file_name(rank, world_size)
        records[name] = write_atomically(rank_payload(mine, my_optimizer_pieces, save={**save, "rank": rank}), partial / name)
        if rank == 0:
            records[COMMON] = write_atomically({**_common_part(checkpoint), SAVE_RECORD: {**save, "rank": 0}}, partial / COMMON)
    except Exception as error:  # noqa: BLE001 - every rank must learn of it before anyone commits
        failure = f"{type(error).__name__}: {error}"
    reports = gather((failure, records))
    verdict = None
    if rank == 0:
        verdict = _commit_or_refuse(path, partial, reports, {
            "world_size": world_size, **plan, "save": save, **_model_description(module),
            "param_group_keys": group_keys if with_optimizers else [],
            INDEX_KEY: _piece_index(writers, [location for location, _ in mine], world_size, len(optimizer_pieces)),
        })
    verdict = gather(verdict)[0]  # nobody goes on (e.g. to load or remove it) before the checkpoint is in place
    if verdict is not None:
        shutil.rmtree(partial, ignore_errors=True)  # this rank's copy, where rank 0 cannot see it
        _remove_if_empty(path)
        raise CheckpointError(verdict)


def _commit_or_refuse(path: str | os.PathLike, partial: Path, reports: list[tuple[Any, dict[str, Any]]], metadata: dict[str, Any]) -> Optional[str]:
    """Rank 0: commit the save, or the message every rank raises (the partial directory then removed)."""
    failures = [(index, message) for index, (message, _) in enumerate(reports) if message]
    files = {name: record for _, records in reports for name, record in records.items()}
    unseen = [index for index, (_, records) in enumerate(reports) for name, record in records.items()
              if not (partial / name).is_file() or (partial / name).stat().st_size != record["size"]]
    verdict = None
    if failures:
        verdict = f"saving {path} failed on rank {failures[0][0]}: {failures[0][1]}; the earlier checkpoint is kept"
    elif unseen:
        verdict = (
            f"saving {path} failed: rank 0 cannot see the files that rank(s) {', '.join(map(str, sorted(set(unseen))))} wrote into "
            f"{partial} (no shared filesystem: each machine wrote to its own disk). Every rank must save to one directory that all "
            "nodes share (e.g. NFS or Lustre): point the Trainer's default_root_dir / ModelCheckpoint's dirpath there; "
            "the earlier checkpoint is kept"
        )
    else:
        try:
            write_readme(path)  # what the directory is, for torch.load and strategy="auto" users (see the layout)
            commit(partial, path, metadata, files)
        except Exception as error:  # noqa: BLE001 - every rank must learn of it
            verdict = f"saving {path} failed while committing it: {type(error).__name__}: {error}; the earlier checkpoint is kept"
    if verdict is not None:
        shutil.rmtree(partial, ignore_errors=True)
        if not (Path(path) / POINTER).exists():  # a failed first save: the README describes no checkpoint
            (Path(path) / README).unlink(missing_ok=True)
    return verdict


def _remove_if_empty(path: str | os.PathLike) -> None:
    """Remove ``path`` if a failed first save left it an empty directory."""
    try:
        os.rmdir(path)
    except OSError:
        pass


def _model_description(module: nn.Module) -> dict[str, Any]:
    """The metadata's description of the full module: its keys, shapes, dtypes and tied groups."""
    state = module.state_dict(keep_vars=True)
    return {
        "state_keys": list(state), "shapes": {key: list(value.shape) for key, value in state.items()},
        "dtypes": {key: str(value.dtype).removeprefix("torch.") for key, value in state.items()},
        "tied": tied_key_groups(module),
    }


def _piece_index(writers: dict[_Entry, int], rank0_model: list[PieceLocation], world_size: int, optimizers: int) -> dict[str, Any]:
    """The metadata's index of which rank file holds which pieces (``checkpoint.index``), as ``writers`` assigned them;
    rank 0's model pieces are ``rank0_model`` (its share and the state the plan does not hold)."""
    model: list[list[PieceLocation]] = [list(rank0_model)] + [[] for _ in range(world_size - 1)]
    states: list[list[list[PieceLocation]]] = [[[] for _ in range(optimizers)] for _ in range(world_size)]
    for entry, rank in writers.items():
        if entry[0] == "model" and rank != 0:
            model[rank].append(entry[1])
        elif entry[0] == "optimizer":
            states[rank][entry[1]].append(entry[2])
    return piece_index({rank_file_name(rank, world_size): (model[rank], states[rank]) for rank in range(world_size)})


def _first_holders(per_rank: list[list[_Entry]]) -> dict[_Entry, int]:
    """The lowest rank holding each piece: the one that writes it."""
    writers: dict[_Entry, int] = {}
    for rank, entries in enumerate(per_rank):
        for entry in entries:
            writers.setdefault(entry, rank)
    return writers


def _state_the_plan_does_not_hold(
    module: nn.Module, held_keys: set[str], materialize: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None,
) -> list[tuple[PieceLocation, torch.Tensor]]:
    """Whole values of every tensor of ``module`` that no rank holds a piece of (one key per tied group); a tensor on
    the meta device (a module built under deferred init) by ``materialize(key, tensor)``."""
    tied = {key: group for group in tied_key_groups(module) for key in group}
    written: set[str] = set()
    pieces = []
    for key, value in module.state_dict(keep_vars=True).items():
        group = tied.get(key, [key])
        if held_keys.intersection(group) or written.intersection(group):
            continue
        written.add(key)
        whole = materialize(key, value) if value.is_meta and materialize is not None else value.detach()
        pieces.append((PieceLocation(key, full_box(value.shape)), whole))
    return pieces


def _common_part(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Everything but the model state and the optimizer states' tensors (those are in the rank files)."""
    common = {key: value for key, value in checkpoint.items() if key != "state_dict"}
    if "optimizer_states" in common:
        common["optimizer_states"] = [{"param_groups": state["param_groups"]} for state in common["optimizer_states"]]
    return common
