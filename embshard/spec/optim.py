"""The sparse optimizer fused into the embedding backward (FBGEMM applies it inside the TBE kernel): its kind and
hyper-parameters. The update math on tensors is embshard/lookup/updates.py.

Update rules, for a row w that the batch touched with aggregated gradient g (rows the batch did not touch are
left alone, optimizer state included; weight decay is L2, added to the gradient, and only on touched rows):
- sgd:             w -= lr * g
- adagrad:         s += g*g (per element);          w -= lr * g / (sqrt(s) + eps)
- rowwise_adagrad: s += mean(g*g) (one value a row); w -= lr * g / (sqrt(s) + eps)
- adam:            m = b1 m + (1-b1) g; v = b2 v + (1-b2) g*g (per element, lazy: touched rows only);
                   w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps), t = steps taken so far
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from embshard.spec.tables import ConfigError


class OptimizerKind(str, enum.Enum):
    """Which fused sparse optimizer runs in the embedding backward."""

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"


@dataclass(frozen=True)
class FusedOptimizerConfig:
    """Hyper-parameters of the fused sparse optimizer."""

    kind: OptimizerKind = OptimizerKind.ROWWISE_ADAGRAD
    """Update rule: sgd, adagrad, rowwise_adagrad or adam."""
    lr: float = 0.01
    """Learning rate (dimensionless step scale)."""
    eps: float = 1e-8
    """Added to the denominator of adagrad/adam updates."""
    weight_decay: float = 0.0
    """L2 penalty added to the gradient of touched rows."""
    beta1: float = 0.9
    """Adam: decay of the first moment."""
    beta2: float = 0.999
    """Adam: decay of the second moment."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", OptimizerKind(self.kind))
        except ValueError:
            raise ConfigError(
                f"optimizer kind {self.kind!r} is unknown: choose one of {[k.value for k in OptimizerKind]}"
            ) from None
        if not self.lr > 0:
            raise ConfigError(f"optimizer lr={self.lr!r} is invalid: it must be > 0")
        if not self.eps > 0:
            raise ConfigError(f"optimizer eps={self.eps!r} is invalid: it must be > 0")
        if not self.weight_decay >= 0:
            raise ConfigError(f"optimizer weight_decay={self.weight_decay!r} is invalid: it must be >= 0")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ConfigError(f"optimizer {name}={value!r} is invalid: it must be in [0, 1)")

    def state_bytes_per_row(self, dim: int, weight_bytes: int = 4) -> int:
        """Bytes of optimizer state that one row of width `dim` carries (fp32 state)."""
        if self.kind is OptimizerKind.SGD:
            return 0
        if self.kind is OptimizerKind.ROWWISE_ADAGRAD:
            return 4
        if self.kind is OptimizerKind.ADAGRAD:
            return 4 * dim
        return 8 * dim  # adam: two moments

    def fbgemm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for SplitTableBatchedEmbeddingBagsCodegen."""
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

        kind = {
            OptimizerKind.SGD: EmbOptimType.EXACT_SGD,
            OptimizerKind.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
            OptimizerKind.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            OptimizerKind.ADAM: EmbOptimType.ADAM,
        }[self.kind]
        kwargs: dict[str, Any] = {"optimizer": kind, "learning_rate": self.lr, "eps": self.eps}
        if self.kind is OptimizerKind.ADAM:
            kwargs.update(beta1=self.beta1, beta2=self.beta2)
        if self.weight_decay:
            kwargs.update(weight_decay=self.weight_decay, weight_decay_mode=WeightDecayMode.L2)
        return kwargs
