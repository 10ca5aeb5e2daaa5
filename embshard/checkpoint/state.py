"""What a training run's checkpoint holds besides the tables: the dense model and its optimizer (DCP's
`get_state_dict` / `set_state_dict`, replicated on every rank, written once), Adam's step count of each
collection, extra per-row tensors (a retrieval catalog's sampler counts and target counts), and per rank its data
position and random number generator states (torch CPU and CUDA, numpy, Python's `random`)."""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from embshard.checkpoint.layout import Piece


@dataclass(frozen=True)
class Counter:
    """An integer of the run that a checkpoint saves and restores."""

    get: Callable[[], int]
    set: Callable[[int], None]


@dataclass
class TrainState:
    """The parts of a training run a checkpoint saves and restores."""

    collections: dict[str, Any]
    """Sharded embedding collections by name (the prefix of their tensors), e.g. {'ebc': ..., 'catalog': ...}."""
    dense: nn.Module | None = None
    """The dense model (DistributedDataParallel-wrapped or not), or None."""
    dense_optimizer: torch.optim.Optimizer | None = None
    """The dense model's optimizer, or None."""
    row_tensors: list[Piece] = field(default_factory=list)
    """Other state kept per table row, this rank's rows (live tensors), saved and resharded like the tables."""
    counters: dict[str, Counter] = field(default_factory=dict)
    """Other integers of the run, the same on every rank (a catalog sampler's step), by name."""

    @classmethod
    def of_model(cls, model: Any, dense_optimizer: torch.optim.Optimizer | None) -> TrainState:
        """A RecModel's state: its collection 'ebc', with sequence tables 'sequences' (its sequence collection), in
        catalog mode 'catalog' and the catalog sampler's counts."""
        collections = {"ebc": model.ebc}
        if getattr(model, "ec", None) is not None:
            collections["sequences"] = model.ec
        rows: list[Piece] = []
        counters: dict[str, Counter] = {}
        catalog = getattr(model, "catalog", None)
        if catalog is not None:
            collections["catalog"] = catalog.ebc
            sampler = getattr(catalog, "sampler", None)
            if sampler is not None:  # sampled softmax: its counts of targets per row and its step (the seeds)
                if sampler.num_rows > 0:
                    key = f"catalog/{catalog.table.name}/sampler_counts"
                    rows.append(Piece(key, (catalog.table.num_embeddings,), (sampler.row_offset,), sampler.counts))
                counters["catalog/sampler_step"] = Counter(
                    lambda: catalog.sampler_step, lambda v: setattr(catalog, "sampler_step", v)
                )
            counts = getattr(catalog, "target_counts", None)
            if counts is not None and catalog.num_rows > 0:  # a catalog's count of training targets per row
                key = f"catalog/{catalog.table.name}/target_counts"
                rows.append(Piece(key, (catalog.table.num_embeddings,), (catalog.row_offset,), counts))
        return cls(collections, model.dense, dense_optimizer, rows, counters)


def dense_state(state: TrainState) -> dict[str, Any]:
    """{'model': ..., 'optimizer': ...} of the dense part (live tensors; DCP's FQN-keyed form), or {}."""
    if state.dense is None:
        return {}
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = [state.dense_optimizer] if state.dense_optimizer is not None else []
    model_sd, optim_sd = get_state_dict(state.dense, optimizers)
    return {"model": model_sd, "optimizer": optim_sd} if optimizers else {"model": model_sd}


def set_dense_state(state: TrainState, loaded: dict[str, Any]) -> None:
    """Apply what `dense_state` returned, after DCP loaded it."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    optimizers = [state.dense_optimizer] if state.dense_optimizer is not None else []
    set_state_dict(
        state.dense, optimizers, model_state_dict=loaded["model"], optim_state_dict=loaded.get("optimizer", {})
    )


def host_copy(tree: Any) -> Any:
    """`tree` with every tensor copied to the CPU (a snapshot that training cannot change)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: host_copy(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(host_copy(v) for v in tree)
    return tree


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def rng_states() -> dict[str, Any]:
    """This process's random number generator states, as JSON-able data."""
    np_state = np.random.get_state()
    out: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [np_state[0], np_state[1].tolist(), *[v.item() if hasattr(v, "item") else v for v in np_state[2:]]],
        "python": json.loads(json.dumps(random.getstate())),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned (CUDA states only where this process has CUDA)."""
    torch.set_rng_state(_unb64(states["torch"]))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        for i, s in enumerate(states["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_unb64(s), i)
