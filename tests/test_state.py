"""Single-process behaviour of the process state and the pure splitting rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from accelkit.runtime.splitting import split_for_process
from accelkit.runtime.state import PartialState, parse_mixed_precision


def test_single_process_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    state = PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert not state.use_distributed
    assert state.distributed_type.value == "NO"
    assert state.device == torch.device("cpu")
    state.wait_for_everyone()  # a no-op, must not need a process group
    with state.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]


def test_cpu_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELKIT_USE_CPU", "1")
    assert PartialState().device.type == "cpu"


def test_rank_outside_world_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK=3 is outside WORLD_SIZE=2"):
        PartialState(cpu=True)


def test_missing_master_addr_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="accelkit launch"):
        PartialState(cpu=True)


@pytest.mark.parametrize(
    ("value", "expected"), [("fp16", "fp16"), ("BF16", "bf16"), ("no", "no"), (None, "no")]
)
def test_mixed_precision_parsing(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: str
) -> None:
    monkeypatch.delenv("ACCELKIT_MIXED_PRECISION", raising=False)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert parse_mixed_precision(value).value == expected


def test_mixed_precision_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELKIT_MIXED_PRECISION", raising=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert parse_mixed_precision(None).value == "bf16"


def test_bad_mixed_precision_lists_accepted_values() -> None:
    with pytest.raises(ValueError, match=r"'fp8'.*'no', 'fp16', 'bf16'"):
        parse_mixed_precision("fp8")


def test_split_rule_covers_every_item_once() -> None:
    items = list(range(10))
    for world in (1, 2, 3, 4, 7):
        parts = [split_for_process(items, world, i, False) for i in range(world)]
        assert [x for p in parts for x in p] == items
        assert max(map(len, parts)) - min(map(len, parts)) <= 1


class _Rows:
    """The part of a Hugging Face datasets.Dataset that splitting uses: len() and select()."""

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: object) -> object:
        raise AssertionError("a Dataset's slice is a dict of columns; select() must be used")

    def select(self, indices: list[int]) -> _Rows:
        return _Rows([self.rows[i] for i in indices])


def test_split_dataset_like_inputs_with_select() -> None:
    parts = [split_for_process(_Rows([10, 11, 12]), 2, i, True).rows for i in range(2)]
    assert parts == [[10, 11], [12, 12]]
    assert split_for_process(_Rows([10, 11, 12]), 2, 1, False).rows == [12]


def test_split_rejects_uneven_dict_and_bad_type() -> None:
    with pytest.raises(ValueError, match="same length"):
        split_for_process({"a": [1, 2], "b": [1]}, 2, 0, False)
    with pytest.raises(TypeError, match="set"):
        split_for_process({1, 2}, 2, 0, False)


# ----------------------------------------------------------- compatibility with the reference


def test_every_reference_distributed_type_exists_and_never_matches() -> None:
    from accelkit.runtime.state import DistributedType

    names = {m.name for m in DistributedType}
    assert {"XLA", "DEEPSPEED", "MEGATRON_LM", "MULTI_NPU", "MULTI_XPU", "MULTI_HPU"} <= names
    state = PartialState(cpu=True)
    assert state.distributed_type != DistributedType.XLA


def test_fp8_exists_and_is_refused_by_name() -> None:
    from accelkit.runtime.state import PrecisionType

    assert PrecisionType.FP8.value == "fp8"
    with pytest.raises(ValueError, match="does not do FP8 training"):
        parse_mixed_precision(PrecisionType.FP8)


def test_accelerator_state_is_a_view_of_the_last_accelerator() -> None:
    from accelkit import Accelerator
    from accelkit.runtime.state import AcceleratorState

    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    view = AcceleratorState()
    assert view.mixed_precision == "bf16" and view.deepspeed_plugin is None
    assert view.num_processes == accelerator.num_processes == 1
    assert accelerator.state.mixed_precision == "bf16"


def test_reset_state_breaks_old_views_until_a_new_accelerator_exists() -> None:
    from accelkit import Accelerator
    from accelkit.runtime.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    old_view = accelerator.state
    AcceleratorState._reset_state()
    assert not old_view.initialized
    with pytest.raises(AttributeError, match=r"AcceleratorState._reset_state\(\)"):
        accelerator.prepare(torch.nn.Linear(1, 1))
    Accelerator(cpu=True, mixed_precision="fp16")
    assert old_view.mixed_precision == "fp16"  # shared, as in the reference


@pytest.mark.parametrize(
    "kwargs",
    [
        {"deepspeed_plugin": object()},
        {"megatron_lm_plugin": object()},
        {"torch_tp_plugin": object()},
        {"parallelism_config": object()},
        {"deepspeed_plugins": {"a": object()}},
    ],
)
def test_out_of_scope_plugins_are_refused_by_name(kwargs: dict[str, object]) -> None:
    from accelkit import Accelerator

    (name,) = kwargs
    with pytest.raises(ValueError, match=rf"accelkit does not support .*{name.rstrip('s')}"):
        Accelerator(cpu=True, **kwargs)  # type: ignore[arg-type]


def _init_through_a_file_store(path: str) -> bool:
    import os

    state = PartialState(init_method=f"file://{path}")
    used = os.path.exists(path)  # the store file exists only if init_method reached torch
    state.wait_for_everyone()
    state.destroy_process_group()
    return used


def test_partial_state_forwards_kwargs_to_init_process_group(tmp_path: Path) -> None:
    from tests.helpers.distributed import run_distributed

    store = str(tmp_path / "store")
    assert run_distributed(_init_through_a_file_store, store) == [True, True]


def _fsdp_state() -> tuple[str, str, bool]:
    from accelkit import Accelerator, FullyShardedDataParallelPlugin
    from accelkit.runtime.state import AcceleratorState

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    return (
        accelerator.distributed_type.value,
        AcceleratorState().distributed_type.value,
        accelerator.is_fsdp2,
    )


@pytest.mark.slow
def test_fsdp_shows_in_the_accelerator_state() -> None:
    from tests.helpers.distributed import run_distributed

    assert run_distributed(_fsdp_state) == [("FSDP", "FSDP", True)] * 2


def test_each_restart_attempt_keeps_its_keys_apart_in_the_agents_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torchrun's agent hosts one store for the whole job (here: this process); a restarted
    # group used to read the dead group's keys there (issue #39).
    from datetime import timedelta

    import torch.distributed as dist

    from accelkit.runtime.state import attempt_store
    from tests.helpers.distributed import free_port

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store() is None  # no agent's store: torch's own env:// store is right
    port = free_port()
    agent = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    first = attempt_store(timedelta(seconds=30))
    first.set("rank_1", "address of a worker that died")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    second = attempt_store(timedelta(seconds=30))
    assert not second.check(["rank_1"])  # the dead group's key is not the restarted one's
    second.set("rank_1", "a live address")
    assert agent.get("accelkit/job7/attempt_0/rank_1") == b"address of a worker that died"
    assert agent.get("accelkit/job7/attempt_1/rank_1") == b"a live address"
