"""Unit tests of the update rules (embshard/spec/optim.py) against the formulas written out in float64."""

from __future__ import annotations

import pytest
import torch

from embshard.lookup.updates import apply_update, optimizer_state, sparse_update
from embshard.spec.optim import FusedOptimizerConfig

KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]


def _formula(o: FusedOptimizerConfig, w, state, g, t):
    """One step of the rule on every row, in float64 (the module docstring of embshard/spec/optim.py)."""
    w, g = w.double(), g.double()
    g = g + o.weight_decay * w
    st = {k: v.double().clone() for k, v in state.items()}
    if o.kind.value == "sgd":
        return w - o.lr * g, st
    if o.kind.value == "adagrad":
        st["m"] += g * g
        return w - o.lr * g / (st["m"].sqrt() + o.eps), st
    if o.kind.value == "rowwise_adagrad":
        st["m"] += (g * g).mean(1)
        return w - o.lr * g / (st["m"].sqrt() + o.eps)[:, None], st
    st["m"] = o.beta1 * st["m"] + (1 - o.beta1) * g
    st["v"] = o.beta2 * st["v"] + (1 - o.beta2) * g * g
    m_hat, v_hat = st["m"] / (1 - o.beta1**t), st["v"] / (1 - o.beta2**t)
    return w - o.lr * m_hat / (v_hat.sqrt() + o.eps), st


@pytest.mark.parametrize("wd", [0.0, 0.03])
@pytest.mark.parametrize("kind", KINDS)
def test_apply_update_matches_the_formula_and_leaves_untouched_rows(kind, wd):
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    o = FusedOptimizerConfig(kind, lr=0.07, eps=1e-4, weight_decay=wd)
    R, D = 9, 6
    w = torch.randn(R, D, generator=gen)
    state = optimizer_state(o, w)
    for k in state:
        state[k].copy_(torch.rand(state[k].shape, generator=gen))
    touched = torch.rand(R, generator=gen) > 0.4
    touched[0], touched[1] = True, False
    g = torch.randn(R, D, generator=gen) * touched[:, None]  # untouched rows have a zero gradient
    want_w, want_st = _formula(o, w, state, g, t=3)
    w_new, st_new = w.clone(), {k: v.clone() for k, v in state.items()}
    apply_update(o, w_new, st_new, g, 3, False, touched)
    torch.testing.assert_close(w_new[touched].double(), want_w[touched], rtol=1e-5, atol=1e-6)
    assert torch.equal(w_new[~touched], w[~touched])  # untouched rows and their state stay exactly
    for k in state:
        torch.testing.assert_close(st_new[k][touched].double(), want_st[k][touched], rtol=1e-5, atol=1e-6)
        assert torch.equal(st_new[k][~touched], state[k][~touched])
    if kind != "adam" and not wd:  # the all-rows fast path (no mask) gives the same result
        w_all, st_all = w.clone(), {k: v.clone() for k, v in state.items()}
        apply_update(o, w_all, st_all, g, 3, False, None)
        torch.testing.assert_close(w_all, w_new)


def test_sparse_update_touches_only_its_rows_and_rounds_fp16():
    gen = torch.Generator().manual_seed(5)
    o = FusedOptimizerConfig("rowwise_adagrad", lr=0.1)
    w = torch.randn(8, 4, generator=gen).half().float()
    st = optimizer_state(o, w)
    rows = torch.tensor([1, 5, 6])
    g = torch.randn(3, 4, generator=gen)
    w0 = w.clone()
    sparse_update(o, w, st, rows, g, 1, fp16=True)
    others = torch.tensor([0, 2, 3, 4, 7])
    assert torch.equal(w[others], w0[others]) and torch.equal(st["m"][others], torch.zeros(5))
    assert torch.equal(w[rows], w[rows].half().float())  # values representable in fp16
    want, _ = _formula(o, w0[rows], {"m": torch.zeros(3)}, g, 1)
    torch.testing.assert_close(w[rows].double(), want.half().double(), rtol=0, atol=0)
