"""``ckpt diff``'s value comparison (:func:`accelkit.checkpointing.catalog.diff._compare_values`)
against the rules of its module docstring, written out elementwise, on tensors full of the
awkward values (zeros of both signs, NaN, infinities, subnormals), in several dtypes and with
chunks small enough that the special values fall in some chunks only."""

from __future__ import annotations

import math

import pytest
import torch

from accelkit.checkpointing.catalog import diff

_SPECIAL = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, 1.0, -2.5, 3e38]


def _rules(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int] | None:
    """The docstring's rules, one float64 pass with no shortcut: ``max |a - b|`` (inf for a NaN
    on one side only), ``max |a - b| / |a|`` (inf where ``a`` is 0 and ``b`` is not, and where
    the quotient is NaN), the count of elements that differ (a NaN equals a NaN)."""
    x, y = a.reshape(-1).double(), b.reshape(-1).double()
    same = (x == y) | (x.isnan() & y.isnan())
    changed = int((~same).sum())
    if not changed:
        return None
    d = (x - y).abs()
    d[d.isnan()] = math.inf
    d[same] = 0.0
    rel = d / x.abs()
    rel[rel.isnan()] = math.inf
    rel[same] = 0.0
    return float(d.max()), float(rel.max()), changed


def _awkward(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(n, generator=g, dtype=torch.float64)
    picks = torch.randint(0, len(_SPECIAL), (n,), generator=g)
    where = torch.rand(n, generator=g) < 0.3
    t[where] = torch.tensor(_SPECIAL, dtype=torch.float64)[picks[where]]
    return t.to(dtype)


@pytest.mark.parametrize("chunk", [5, 64, 1 << 18])
@pytest.mark.parametrize(
    "dtype_a,dtype_b",
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.bfloat16),
        (torch.float64, torch.float64),
        (torch.float32, torch.float64),
    ],
)
def test_same_figures_as_the_rules(
    monkeypatch: pytest.MonkeyPatch, chunk: int, dtype_a: torch.dtype, dtype_b: torch.dtype
) -> None:
    monkeypatch.setattr(diff, "_CHUNK", chunk)
    for seed in range(12):
        a = _awkward(203, seed, dtype_a)
        b = a.to(dtype_b).clone()
        g = torch.Generator().manual_seed(100 + seed)
        edit = torch.rand(203, generator=g) < (0.05 * (seed % 4))  # none, few or many changed
        b[edit] = _awkward(int(edit.sum()), 200 + seed, dtype_b)
        assert diff._compare_values(a, b) == _rules(a, b), (seed, a, b)
        assert diff._compare_values(b.to(dtype_a), a.to(dtype_b)) == _rules(
            b.to(dtype_a), a.to(dtype_b)
        )


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.uint8, torch.bool])
def test_integer_and_bool_tensors(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 2 if dtype == torch.bool else 100, (50,), generator=g).to(dtype)
    b = a.clone()
    b[[0, 7, 31]] = torch.tensor([1, 0, 1]).to(dtype) if dtype == torch.bool else b[[0, 7, 31]] + 1
    assert diff._compare_values(a, b) == _rules(a, b)


def test_zero_in_a_is_an_infinite_relative_difference() -> None:
    """The docstring's rule (the float64 pass before this one reported 1.8e308 here)."""
    found = diff._compare_values(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 1.0]))
    assert found == (0.5, math.inf, 1)


def test_nan_rules() -> None:
    nan, inf = math.nan, math.inf
    same = torch.tensor([nan, inf, -inf, 0.0, 1.0])
    assert diff._compare_values(same, same.clone()) is None  # the bytes are the same
    other_nan = same.clone().view(torch.int32)
    other_nan[0] += 1  # another NaN payload: other bytes, equal values
    assert diff._compare_values(same, other_nan.view(torch.float32)) is None
    assert diff._compare_values(torch.tensor([0.0]), torch.tensor([-0.0])) is None
    assert diff._compare_values(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0])) == (
        inf,
        inf,
        1,
    )
    assert diff._compare_values(torch.tensor([1.0, 1.0]), torch.tensor([nan, 1.0])) == (
        inf,
        inf,
        1,
    )
    assert diff._compare_values(torch.tensor([inf, 2.0]), torch.tensor([-inf, 1.0])) == (
        inf,
        inf,
        2,
    )
    assert diff._compare_values(torch.tensor([4.0, inf]), torch.tensor([2.0, inf])) == (
        2.0,
        0.5,
        1,
    )


def test_empty_tensors_are_equal() -> None:
    assert diff._compare_values(torch.empty(0, 3), torch.empty(0, 3)) is None
    assert diff._compare_values(torch.empty(0), torch.empty(0, dtype=torch.float64)) is None
