"""Every collective and process-control function, in a real 2-process gloo job.

One job runs all checks (each spawn costs time on a 2-core machine); the parent asserts on what
each rank returned, so a failure names the exact check and rank.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed


def _collectives() -> dict[str, Any]:
    from accelkit import Accelerator
    from accelkit.utils import broadcast, gather_object

    acc = Accelerator(cpu=True)
    rank = acc.process_index
    out: dict[str, Any] = {
        "num_processes": acc.num_processes,
        "process_index": rank,
        "local_process_index": acc.local_process_index,
        "is_main": acc.is_main_process,
        "is_local_main": acc.is_local_main_process,
        "is_last": acc.is_last_process,
        "use_distributed": acc.use_distributed,
        "distributed_type": acc.distributed_type.value,
        "device": str(acc.device),
    }
    # Documented examples.
    out["gather"] = acc.gather(torch.tensor([rank])).tolist()
    out["gather_scalar"] = acc.gather(torch.tensor(rank * 10)).tolist()
    out["gather_nested"] = {
        k: v.tolist()
        for k, v in acc.gather(
            {"a": torch.tensor([rank]), "b": torch.tensor([[rank, rank]])}
        ).items()
    }
    out["gather_bool"] = acc.gather(torch.tensor([rank == 0])).tolist()
    t = torch.arange(acc.num_processes) + 1 + 2 * rank
    out["reduce_sum"] = acc.reduce(t, reduction="sum").tolist()
    out["reduce_mean"] = acc.reduce(t.float(), reduction="mean").tolist()
    out["reduce_none"] = acc.reduce(t, reduction="none").tolist()
    out["reduce_scale"] = acc.reduce(t.float(), reduction="sum", scale=0.5).tolist()
    out["reduce_tuple"] = [x.tolist() for x in acc.reduce((t, t * 10))]
    out["reduce_max"] = acc.reduce(t, reduction="max").tolist()
    try:
        acc.reduce(t, reduction="median")
    except ValueError as exc:
        out["reduce_bad"] = str(exc)
    padded = acc.pad_across_processes(torch.arange(rank + 1))
    out["pad"] = padded.tolist()
    out["pad_first"] = acc.pad_across_processes(
        torch.arange(rank + 1) + 1, pad_index=-1, pad_first=True
    ).tolist()
    out["pad_dim1"] = acc.pad_across_processes(torch.ones(2, rank + 1), dim=1).shape
    out["broadcast"] = broadcast(torch.tensor([rank + 7])).tolist()
    out["gather_object"] = gather_object([{"rank": rank}])
    out["gather_object_scalar"] = gather_object(f"r{rank}")
    with acc.split_between_processes(["A", "B", "C"]) as part:
        out["split_list"] = part
    with acc.split_between_processes(["A", "B", "C"], apply_padding=True) as part:
        out["split_list_pad"] = part
    with acc.split_between_processes(("a", "b", "c", "d")) as part:
        out["split_tuple"] = part
    with acc.split_between_processes({"x": [1, 2, 3], "y": ["p", "q", "r"]}) as part:
        out["split_dict"] = part
    with acc.split_between_processes(torch.arange(5), apply_padding=True) as part:
        out["split_tensor_pad"] = part.tolist()
    # Process control.
    calls: list[str] = []

    @acc.on_main_process
    def main_only() -> str:
        calls.append("main")
        return "main"

    @acc.on_local_main_process
    def local_main_only() -> None:
        calls.append("local_main")

    @acc.on_last_process
    def last_only() -> None:
        calls.append("last")

    @acc.on_process(process_index=1)
    def one_only() -> None:
        calls.append("process1")

    @acc.on_local_process(local_process_index=1)
    def local_one_only() -> None:
        calls.append("local1")

    main_only()
    local_main_only()
    last_only()
    one_only()
    local_one_only()
    acc.on_process(lambda: calls.append("call_form"), process_index=0)()
    out["calls"] = calls
    buf = io.StringIO()
    with redirect_stdout(buf):
        acc.print("hello")
    out["printed"] = buf.getvalue()
    # main_process_first: main writes a file that the others must see inside the block.
    order: list[str] = []
    import os
    import tempfile

    marker = os.path.join(tempfile.gettempdir(), f"accelkit-first-{os.environ['MASTER_PORT']}")
    with acc.main_process_first():
        if acc.is_main_process:
            with open(marker, "w") as f:
                f.write("x")
        order.append(f"exists={os.path.exists(marker)}")
    acc.wait_for_everyone()
    with acc.local_main_process_first():
        order.append("local")
    acc.wait_for_everyone()
    if acc.is_main_process:
        os.remove(marker)
    out["order"] = order
    # Triggers: only rank 1 sets it; every rank sees it, and it resets.
    if rank == 1:
        acc.set_trigger()
    out["trigger"] = acc.check_trigger()
    out["trigger_after"] = acc.check_trigger()
    acc.wait_for_everyone()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_collectives, world_size=2)


def test_process_state(results: list[dict[str, Any]]) -> None:
    r0, r1 = results
    assert (r0["num_processes"], r0["process_index"], r1["process_index"]) == (2, 0, 1)
    assert (r0["is_main"], r1["is_main"]) == (True, False)
    assert (r0["is_local_main"], r1["is_local_main"]) == (True, False)
    assert (r0["is_last"], r1["is_last"]) == (False, True)
    assert r0["use_distributed"] and r0["distributed_type"] == "MULTI_CPU"
    assert r0["device"] == "cpu:0"  # as the reference: index 0 of the CPU on every rank


def test_gather(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["gather"] == [0, 1]
        assert r["gather_scalar"] == [0, 10]
        assert r["gather_nested"] == {"a": [0, 1], "b": [[0, 0], [1, 1]]}
        assert r["gather_bool"] == [True, False]


def test_reduce_documented_example(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["reduce_sum"] == [4, 6]
        assert r["reduce_mean"] == [2.0, 3.0]
        assert r["reduce_scale"] == [2.0, 3.0]
        assert r["reduce_tuple"] == [[4, 6], [40, 60]]
    assert results[0]["reduce_none"] == [1, 2]
    assert results[1]["reduce_none"] == [3, 4]
    assert results[0]["reduce_max"] == results[1]["reduce_max"] == [3, 4]
    assert "'median'" in results[0]["reduce_bad"] and "'max'" in results[0]["reduce_bad"]


def test_pad_across_processes(results: list[dict[str, Any]]) -> None:
    assert results[0]["pad"] == [0, 0]
    assert results[1]["pad"] == [0, 1]
    assert results[0]["pad_first"] == [-1, 1]
    assert results[1]["pad_first"] == [1, 2]
    assert results[0]["pad_dim1"] == torch.Size([2, 2])


def test_broadcast_and_gather_object(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["broadcast"] == [7]
        assert r["gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert r["gather_object_scalar"] == ["r0", "r1"]


def test_split_between_processes(results: list[dict[str, Any]]) -> None:
    r0, r1 = results
    assert (r0["split_list"], r1["split_list"]) == (["A", "B"], ["C"])
    assert (r0["split_list_pad"], r1["split_list_pad"]) == (["A", "B"], ["C", "C"])
    assert (r0["split_tuple"], r1["split_tuple"]) == (("a", "b"), ("c", "d"))
    assert r0["split_dict"] == {"x": [1, 2], "y": ["p", "q"]}
    assert r1["split_dict"] == {"x": [3], "y": ["r"]}
    assert (r0["split_tensor_pad"], r1["split_tensor_pad"]) == ([0, 1, 2], [3, 4, 4])


def test_process_control(results: list[dict[str, Any]]) -> None:
    r0, r1 = results
    assert r0["calls"] == ["main", "local_main", "call_form"]
    assert r1["calls"] == ["last", "process1", "local1"]
    assert (r0["printed"], r1["printed"]) == ("hello\n", "")
    # The main process created the marker inside the block, so the other saw it already there.
    assert r1["order"][0] == "exists=True"
    for r in results:
        assert r["trigger"] is True and r["trigger_after"] is False
