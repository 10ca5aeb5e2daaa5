"""The fused sparse optimizers' update rules on tensors (embshard/spec/optim.py has the rules and their
hyper-parameters): what the host lookups, the data-parallel replicas and the small-table kernels' torch path apply.
"""

from __future__ import annotations

import torch

from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind


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
