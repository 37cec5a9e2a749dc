"""DistributedDataParallelKwargs(comm_hook=...) on two real gloo processes.

Accelerate's own ``test_ddp_comm_hook.py`` builds its reference model with CUDA device ids, so it
cannot run on CPU; this is the same check with a CPU reference model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p = torch.nn.Parameter(torch.randn(40, 20))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        return self.p * (x ** (1 + rank))


def _grads(model: torch.nn.Module, rank: int) -> torch.Tensor:
    torch.manual_seed(2024)
    model(torch.randn(40, 20), rank).mean().backward()
    grad = next(model.parameters()).grad
    assert grad is not None
    return grad.clone()


def _hooked_vs_plain(hook: str, wrapper: str, options: dict[str, Any]) -> tuple[Any, ...]:
    from accelkit import Accelerator, DistributedDataParallelKwargs

    accelerator = Accelerator(
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                comm_hook=hook, comm_wrapper=wrapper, comm_state_option=options
            )
        ]
    )
    model = accelerator.prepare(_Model())
    rank = accelerator.process_index
    hooked = _grads(model, rank)
    plain = _grads(torch.nn.parallel.DistributedDataParallel(_Model()), rank)
    alone = _grads(_Model(), rank)
    return hooked, plain, alone, model._get_ddp_logging_data().get("comm_hook")


# (The bf16 hooks need NCCL: torch refuses them on gloo with a TypeError naming CUDA/NCCL.)
@pytest.mark.parametrize(
    ("hook", "wrapper", "options", "registered"),
    [
        ("fp16", "no", {}, "fp16_compress_hook"),
        ("power_sgd", "fp16", {"matrix_approximation_rank": 2}, "fp16_compress_wrapper_hook"),
    ],
)
def test_comm_hook_is_registered_and_averages_gradients(
    hook: str, wrapper: str, options: dict[str, Any], registered: str
) -> None:
    for hooked, plain, alone, name in run_distributed(_hooked_vs_plain, hook, wrapper, options):
        assert name is not None and name.endswith(registered)
        torch.testing.assert_close(hooked, plain, rtol=1e-2, atol=1e-2)
        assert not torch.allclose(hooked, alone)  # the gradients really were all-reduced


def test_bad_hook_names_the_accepted_values() -> None:
    from accelkit import DistributedDataParallelKwargs

    with pytest.raises(ValueError, match=r"Unknown comm_hook 'fp8'.*'power_sgd'"):
        DistributedDataParallelKwargs(comm_hook="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="comm_wrapper='power_sgd' is not a wrapper"):
        DistributedDataParallelKwargs(comm_wrapper="power_sgd")  # type: ignore[arg-type]
