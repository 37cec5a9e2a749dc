"""One unwrap: the checkpoint code and Accelerator.unwrap_model reach the same module through
DataParallel and torch.compile, in any nesting."""

from __future__ import annotations

import pytest
import torch

from accelkit.checkpointing.objects.contents import unwrap_model as checkpoint_unwrap
from accelkit.training.loop import unwrap_model
from accelkit.training.wrapping import peel


@pytest.mark.slow
def test_peel_reaches_the_module_through_every_wrapper() -> None:
    net = torch.nn.Linear(2, 2)
    compiled = torch.compile(net)
    wrapped = torch.nn.DataParallel(compiled)
    assert peel(net) == (net, None)
    assert peel(wrapped) == (net, compiled)
    assert checkpoint_unwrap(wrapped) is net
    assert unwrap_model(wrapped) is compiled  # Accelerate's default keeps torch.compile
    assert unwrap_model(wrapped, keep_torch_compile=False) is net
    assert list(checkpoint_unwrap(wrapped).state_dict()) == ["weight", "bias"]


def test_a_compiled_parallel_model_unwraps_to_the_compiled_bare_model() -> None:
    """``torch.compile(DataParallel(m))`` (or DDP): Accelerate's unwrap keeps the compile
    wrapper around ``m`` itself, so the state-dict keys are ``_orig_mod.*``; the model being
    trained keeps its parallel wrapper."""
    net = torch.nn.Linear(2, 2)
    parallel = torch.nn.DataParallel(net)
    compiled = torch.compile(parallel)
    unwrapped = unwrap_model(compiled)
    assert list(unwrapped.state_dict()) == ["_orig_mod.weight", "_orig_mod.bias"]
    assert unwrapped._orig_mod is net  # type: ignore[comparison-overlap]
    assert unwrapped.state_dict()["_orig_mod.weight"].data_ptr() == net.weight.data_ptr()
    assert compiled._orig_mod is parallel  # the given model is left as it was
    assert unwrap_model(compiled, keep_torch_compile=False) is net
