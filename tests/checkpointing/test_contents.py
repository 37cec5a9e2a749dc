"""contents: what a checkpoint holds and how it is put back (parts not covered end to end)."""

from __future__ import annotations

import copy

import torch

from accelkit.checkpointing.objects.contents import _fast_param_lookup, _ParamIds


def test_optimizer_state_loads_through_set_backed_param_ids() -> None:
    """torch's Optimizer.load_state_dict checks ``id in group["params"]`` per state tensor;
    accelkit hands it set-backed lists (quadratic -> linear) that behave like the lists."""
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(50)]
    saved = torch.optim.AdamW([{"params": params[:20]}, {"params": params[20:], "lr": 0.5}])
    for p in params:
        p.grad = torch.ones_like(p)
    saved.step()
    state = saved.state_dict()
    fast = _fast_param_lookup(state)
    groups = fast["param_groups"]
    assert all(isinstance(g["params"], _ParamIds) for g in groups)
    assert state["param_groups"][0]["params"].__class__ is list  # the original is untouched
    assert 19 in groups[0]["params"] and 20 not in groups[0]["params"]
    clone = copy.deepcopy(groups[1]["params"])  # torch deep-copies the groups first
    assert clone == list(range(20, 50)) and 49 in clone and 0 not in clone
    clone.append(99)  # a stale lookup would miss it
    assert 99 in clone

    fresh = torch.optim.AdamW([{"params": params[:20]}, {"params": params[20:]}])
    fresh.load_state_dict(fast)
    assert fresh.param_groups[1]["lr"] == 0.5
    for p in params:
        assert torch.equal(fresh.state[p]["exp_avg"], saved.state[p]["exp_avg"])


def test_states_that_are_not_torch_optimizer_states_pass_through() -> None:
    for state in ({"count": 3}, {"param_groups": "x"}, {"param_groups": [{"lr": 1}]}, [1, 2]):
        assert _fast_param_lookup(state) is state
