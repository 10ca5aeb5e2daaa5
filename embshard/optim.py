"""The sparse optimizer fused into the embedding backward (FBGEMM applies it inside the TBE kernel).

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

import torch

from embshard.tables import ConfigError


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


def optimizer_state(o: FusedOptimizerConfig, w: torch.Tensor, rows: int | None = None) -> dict[str, torch.Tensor]:
    """Zero state of the rule for weights `w` (fp32, on w's device): per element like `w`, or one value per row
    for rowwise_adagrad (`rows`, default `w.shape[0]`)."""
    zeros = lambda: torch.zeros(w.shape, dtype=torch.float32, device=w.device)  # noqa: E731
    if o.kind is OptimizerKind.ADAGRAD:
        return {"m": zeros()}
    if o.kind is OptimizerKind.ADAM:
        return {"m": zeros(), "v": zeros()}
    if o.kind is OptimizerKind.ROWWISE_ADAGRAD:
        return {"m": torch.zeros(rows if rows is not None else w.shape[0], dtype=torch.float32, device=w.device)}
    return {}


def apply_update(
    o: FusedOptimizerConfig,
    w_RD: torch.Tensor,
    state: dict[str, torch.Tensor],
    g_RD: torch.Tensor,
    t: int,
    fp16: bool,
    touched_R: torch.Tensor | None,
) -> None:
    """Apply the update rule (module docstring) in place to every row of `w_RD`, whose summed gradient is `g_RD`.

    `state`: the rule's state for these rows (`m`, `v`: `[R, D]`; rowwise_adagrad's `m`: `[R]`); `t`: steps taken
    so far, this one included; `fp16`: round the new values to fp16. `touched_R` (bool `[R]`): only these rows
    change; None: all rows follow the rule (exact for rules that leave zero-gradient rows alone)."""
    if touched_R is None and not o.weight_decay and o.kind is not OptimizerKind.ADAM:
        _update_all_rows_in_place(o, w_RD, state, g_RD, fp16)
        return
    g = g_RD + o.weight_decay * w_RD if o.weight_decay else g_RD
    new: dict[str, torch.Tensor] = {}
    if o.kind is OptimizerKind.SGD:
        step = g * o.lr
    elif o.kind is OptimizerKind.ADAGRAD:
        new["m"] = state["m"] + g * g
        step = (g * o.lr).div_(new["m"].sqrt().add_(o.eps))
    elif o.kind is OptimizerKind.ROWWISE_ADAGRAD:
        new["m"] = state["m"] + (g * g).mean(dim=1)
        step = (g * o.lr).div_(new["m"].sqrt().add_(o.eps).unsqueeze(1))
    else:
        new["m"] = (state["m"] * o.beta1).add_(g, alpha=1 - o.beta1)
        new["v"] = (state["v"] * o.beta2).addcmul_(g, g, value=1 - o.beta2)
        denom = (new["v"] / (1 - o.beta2**t)).sqrt_().add_(o.eps)
        step = (new["m"] / (1 - o.beta1**t)).div_(denom).mul_(o.lr)
    if touched_R is not None:
        keep_R1 = touched_R.unsqueeze(1)
        step.mul_(keep_R1)  # finite steps: untouched rows move by exactly 0
        new = {k: torch.where(keep_R1 if v.dim() == 2 else touched_R, v, state[k]) for k, v in new.items()}
    w_RD.sub_(step)
    if fp16:  # untouched rows hold fp16 values already: rounding leaves them as they are
        w_RD.copy_(w_RD.half())
    for k, v in new.items():
        state[k].copy_(v)


def _update_all_rows_in_place(
    o: FusedOptimizerConfig, w_RD: torch.Tensor, state: dict[str, torch.Tensor], g_RD: torch.Tensor, fp16: bool
) -> None:
    """sgd, adagrad, rowwise_adagrad on every row, without weight decay: in place, few passes over the rows."""
    if o.kind is OptimizerKind.SGD:
        w_RD.add_(g_RD, alpha=-o.lr)
    elif o.kind is OptimizerKind.ADAGRAD:
        state["m"].addcmul_(g_RD, g_RD)
        w_RD.addcdiv_(g_RD, state["m"].sqrt().add_(o.eps), value=-o.lr)
    else:  # rowwise_adagrad: mean of g^2 over the row, as ||g||^2 / D (no [R, D] temporary)
        state["m"].add_(torch.linalg.vector_norm(g_RD, dim=1).square_().div_(g_RD.shape[1]))
        w_RD.addcdiv_(g_RD, state["m"].sqrt().add_(o.eps).unsqueeze(1), value=-o.lr)
    if fp16:
        w_RD.copy_(w_RD.half())


def sparse_update(
    o: FusedOptimizerConfig,
    w: torch.Tensor,
    st: dict[str, torch.Tensor],
    rows: torch.Tensor,
    g: torch.Tensor,
    t: int,
    fp16: bool = False,
) -> None:
    """apply_update on rows `rows` (unique) of `w` and its state `st`, whose aggregated gradient is
    `g` `[len(rows), cols]`: gather, update, scatter back."""
    wr = w[rows]
    sr = {k: v[rows] for k, v in st.items()}
    apply_update(o, wr, sr, g, t, fp16, None)
    w[rows] = wr
    for k, v in sr.items():
        st[k][rows] = v
