"""TorchRec's table, constraint and optimizer configuration as embshard's.

    tables = tables_from_torchrec(ebc)                               # or a list of EmbeddingBagConfig
    constraints = constraints_from_torchrec(tr_constraints, tables)  # embshard planner constraints
    tables = with_pooling_factors(tables, tr_constraints)            # ids_per_bag from pooling_factors
    optimizer = optimizer_from_torchrec(ebc)                         # from apply_optimizer_in_backward, or
    optimizer = optimizer_from_torchrec(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, ...})

`EmbeddingBagConfig` -> `TableConfig`: name, num_embeddings, embedding_dim, feature_names, pooling (sum, mean),
data_type (fp32, fp16), the collection's `is_weighted` and a symmetric init range (weight_init_max; TorchRec's
default range is embshard's, +-sqrt(1 / rows)). An EmbeddingCollection or a list of `EmbeddingConfig` (sequence
embeddings: one per id) gives sequence tables, `pooling="none"` (never pooled in their place: an embedding-bag
collection refuses them; embshard's sequence collection and the item catalog take them). Refused with an error
naming the table: an EmbeddingBagConfig with pooling NONE, other data types, virtual (key-value) tables, a sequence
table with per-id positions (need_pos). A custom `init_fn` or an asymmetric init range is not carried (embshard
draws from a symmetric range): a warning says so; loaded weights are unaffected.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from embshard.planner.constraints import ParameterConstraints
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError, TableConfig

_KERNEL_TIERS = {
    "fused": MemoryTier.HBM,
    "dense": MemoryTier.HBM,
    "fused_uvm": MemoryTier.UVM,
    "fused_uvm_caching": MemoryTier.UVM_CACHING,
}
_OPTIMIZERS = {  # TorchRec / torch optimizer class name or FBGEMM EmbOptimType name -> embshard kind
    "SGD": "sgd",
    "EXACT_SGD": "sgd",
    "Adagrad": "adagrad",
    "EXACT_ADAGRAD": "adagrad",
    "RowWiseAdagrad": "rowwise_adagrad",
    "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
    "Adam": "adam",
    "ADAM": "adam",
}


def tables_from_torchrec(configs: Any, weighted: bool | None = None) -> list[TableConfig]:
    """embshard TableConfigs of a TorchRec EmbeddingBagCollection (its configs and `is_weighted()`) or of a list
    of `EmbeddingBagConfig` (`weighted`: whether its features carry per-id weights; default False); of an
    EmbeddingCollection or a list of `EmbeddingConfig`: sequence tables (`pooling="none"`, unweighted)."""
    if hasattr(configs, "embedding_bag_configs"):
        weighted = configs.is_weighted() if weighted is None else weighted
        configs = configs.embedding_bag_configs()
    elif hasattr(configs, "embedding_configs"):
        configs = configs.embedding_configs()
    elif isinstance(configs, str | bytes | Mapping) or not isinstance(configs, Iterable):
        raise ConfigError(
            f"tables_from_torchrec takes a TorchRec EmbeddingBagCollection or EmbeddingCollection, or a list of "
            f"EmbeddingBagConfig or EmbeddingConfig, not a {type(configs).__name__}"
        )
    return [_table(c, bool(weighted)) for c in configs]


def _table(c: Any, weighted: bool) -> TableConfig:
    if not all(hasattr(c, f) for f in ("name", "num_embeddings", "embedding_dim", "feature_names")):
        raise ConfigError(
            f"tables_from_torchrec: {c!r} is a {type(c).__name__}, not a TorchRec EmbeddingBagConfig (name, "
            "num_embeddings, embedding_dim, feature_names, pooling)"
        )
    where = f"TorchRec table {c.name!r}"
    sequence = getattr(c, "pooling", None) is None  # EmbeddingConfig: a sequence table, one embedding per id
    if sequence and weighted:
        raise ConfigError(f"{where} ({type(c).__name__}) is a sequence table: its ids carry no weights")
    if sequence and getattr(c, "need_pos", False):
        raise ConfigError(
            f"{where} ({type(c).__name__}) has need_pos=True (per-id positions in the lookup): embshard's sequence "
            "tables take none; set need_pos=False, or keep this table in TorchRec"
        )
    pooling = "none" if sequence else c.pooling.name.lower()
    if pooling not in ("sum", "mean", "none") or (pooling == "none" and not sequence):
        raise ConfigError(
            f"{where}: {type(c).__name__} with pooling {pooling.upper()} is not an embshard table: pool it with SUM "
            "or MEAN, or make it an EmbeddingConfig of an EmbeddingCollection (a sequence table, one embedding per id)"
        )
    data_type = c.data_type.name.lower()
    if data_type not in ("fp32", "fp16"):
        raise ConfigError(
            f"{where}: data_type {c.data_type.name} is not supported: embshard trains fp32 or fp16 tables"
        )
    if getattr(c, "use_virtual_table", False):
        raise ConfigError(
            f"{where}: virtual (key-value) tables have no embshard equivalent: give it num_embeddings rows"
        )
    init_std = None
    lo, hi = c.weight_init_min, c.weight_init_max
    if getattr(c, "init_fn", None) is not None:
        warnings.warn(f"{where}: its init_fn is not carried; embshard draws initial weights uniformly", stacklevel=3)
    if hi is not None and (lo is None or abs(lo + hi) > 1e-12 * max(1.0, abs(hi))):
        warnings.warn(f"{where}: init range [{lo}, {hi}] is not symmetric; embshard uses [-{hi}, {hi}]", stacklevel=3)
    if hi is not None and hi > 0:
        init_std = float(hi)
    return TableConfig(
        c.name,
        c.num_embeddings,
        c.embedding_dim,
        tuple(c.feature_names),
        pooling=pooling,
        weighted=weighted,
        data_type=data_type,
        init_std=init_std,
    )


def with_pooling_factors(tables: Sequence[TableConfig], constraints: Mapping[str, Any] | None) -> list[TableConfig]:
    """The tables with `ids_per_bag` set to the mean of each table's TorchRec `pooling_factors` (the planner's
    expected ids per bag), where its constraints give them."""
    out = []
    for t in tables:
        c = (constraints or {}).get(t.name)
        factors = getattr(c, "pooling_factors", None)
        out.append(dataclasses.replace(t, ids_per_bag=sum(factors) / len(factors)) if factors else t)
    return out


def constraints_from_torchrec(
    constraints: Mapping[str, Any], tables: Sequence[TableConfig] | None = None
) -> dict[str, ParameterConstraints]:
    """embshard planner constraints from TorchRec `ParameterConstraints` by table: sharding_types (the same
    names), compute_kernels -> tiers (fused/dense: hbm, fused_uvm: uvm, fused_uvm_caching: uvm_caching),
    cache_params.load_factor -> cache_load_factor, min_partition -> column_shards (the block counts whose width is
    at least min_partition; needs `tables`). pooling_factors go to the tables (`with_pooling_factors`); TorchRec's
    other fields (num_poolings, batch_sizes, enforce_hbm, stochastic_rounding, bounds_check_mode, output_dtype,
    device_group, key_value_params) have no per-table planner constraint in embshard and are not carried."""
    dims = {t.name: t.embedding_dim for t in tables or []}
    out: dict[str, ParameterConstraints] = {}
    for name, c in constraints.items():
        kernels = [k for k in (c.compute_kernels or [])]
        unknown = [k for k in kernels if k not in _KERNEL_TIERS]
        if unknown:
            raise ConfigError(
                f"TorchRec constraints of table {name!r}: compute kernels {unknown} have no embshard tier; embshard "
                f"has {sorted(_KERNEL_TIERS)}"
            )
        tiers = tuple(dict.fromkeys(_KERNEL_TIERS[k] for k in kernels))
        load_factor = getattr(getattr(c, "cache_params", None), "load_factor", None)
        column_shards: tuple[int, ...] = ()
        if c.min_partition:
            if name not in dims:
                raise ConfigError(f"TorchRec constraints of table {name!r}: min_partition needs tables=[...]")
            dim = dims[name]
            column_shards = tuple(n for n in range(1, dim // 4 + 1) if dim % n == 0 and dim // n >= c.min_partition)
        out[name] = ParameterConstraints(
            sharding_types=tuple(c.sharding_types or ()),
            tiers=tiers,
            column_shards=column_shards,
            cache_load_factor=load_factor,
        )
    return out


def optimizer_from_torchrec(
    ebc: Any = None, fused_params: Mapping[str, Any] | None = None, world_size: int | None = None
) -> FusedOptimizerConfig:
    """embshard's fused optimizer from what a TorchRec job configures: the optimizer that
    `apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)` attached to the collection's tables, or a
    sharder's `fused_params` ({'optimizer': EmbOptimType, 'learning_rate', 'eps', 'weight_decay', 'beta1',
    'beta2'}). Every table must use the same optimizer (embshard fuses one per collection). `world_size`: the
    TorchRec job's world size W, to give embshard TorchRec's updates (it divides the embeddings' gradients by W:
    embshard.interop.common.GRADIENT_DIVISION): SGD's lr / W, the others' eps x W; None: the hyper-parameters
    as they are."""
    if fused_params is not None:
        kind = getattr(fused_params.get("optimizer"), "name", fused_params.get("optimizer"))
        return _scaled(_config(str(kind), {k: v for k, v in fused_params.items() if k != "optimizer"}), world_size)
    found = set()
    for name, p in ebc.named_parameters():
        classes, kwargs = getattr(p, "_optimizer_classes", None), getattr(p, "_optimizer_kwargs", None)
        if not classes:
            raise ConfigError(
                f"TorchRec parameter {name!r} has no optimizer applied in backward: call apply_optimizer_in_backward "
                "on the collection's parameters, or pass embshard a FusedOptimizerConfig"
            )
        found.add((classes[0].__name__, tuple(sorted(kwargs[0].items()))))
    if len(found) != 1:
        raise ConfigError(f"the collection's tables use several optimizers {sorted(found)}: embshard fuses one")
    cls_name, kwargs = found.pop()
    return _scaled(_config(cls_name, dict(kwargs)), world_size)


def _scaled(o: FusedOptimizerConfig, world_size: int | None) -> FusedOptimizerConfig:
    if not world_size or world_size == 1:
        return o
    if o.kind is OptimizerKind.SGD:
        return dataclasses.replace(o, lr=o.lr / world_size)
    return dataclasses.replace(o, eps=o.eps * world_size)


def _config(kind: str, kwargs: dict[str, Any]) -> FusedOptimizerConfig:
    if kind not in _OPTIMIZERS:
        raise ConfigError(f"TorchRec optimizer {kind!r} has no embshard equivalent: use one of {sorted(_OPTIMIZERS)}")
    names = {"lr": "lr", "learning_rate": "lr", "eps": "eps", "weight_decay": "weight_decay"}
    names.update(beta1="beta1", beta2="beta2")
    args: dict[str, Any] = {names[k]: float(v) for k, v in kwargs.items() if k in names}
    if "betas" in kwargs:
        args["beta1"], args["beta2"] = (float(b) for b in kwargs["betas"])
    extra = {k: v for k, v in kwargs.items() if k not in names and k != "betas" and v}
    if extra.get("momentum"):
        raise ConfigError(f"{kind} with momentum={extra['momentum']} has no embshard fused equivalent (plain SGD only)")
    if extra:
        warnings.warn(f"optimizer arguments {extra} have no embshard equivalent and are not carried", stacklevel=3)
    return FusedOptimizerConfig(kind=_OPTIMIZERS[kind], **args)
