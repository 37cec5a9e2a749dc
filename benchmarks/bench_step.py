"""The cost of a prepared training step against the same plain PyTorch step (CPU, one process).

Both sides train the same small MLP on the same data with the same optimizer; a "step" is
everything the loop does per batch: fetch the batch from the dataloader, forward, loss,
backward, ``optimizer.step()``, ``optimizer.zero_grad()``. The plain side uses a ``DataLoader``
and ``loss.backward()``; the prepared side uses ``accelerator.prepare(...)`` objects and
``accelerator.backward(loss)``, and, as a second accelkit case, the same inside
``with accelerator.accumulate(model):`` (with one accumulation step), and, as a third, with
``preemption_signals`` and ``save_every_steps`` set and ``should_save()`` asked every step
(issue 25: the step boundaries' agreement; on one process it is a local decision, no
collective). Its target: at most 1% over the prepared step.

Blocks of steps alternate between the cases (rotating their order every round) and every step
is timed on its own; the figure is the ratio of the medians. Target (issue 3): the prepared
step costs at most 3% more than the plain one.

Run: ``python -m benchmarks.bench_step [--quick]``; writes ``benchmarks/results/step.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import Target, alternate, median, print_table, section, write_result

FEATURES, HIDDEN, CLASSES, BATCH = 64, 256, 10, 64
PREEMPTION_CASE = "accelkit prepared + preemption_signals, save_every_steps, should_save()"
WATCHDOG_CASE = "accelkit prepared + hang_timeout_seconds (the watchdog)"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    )


def _dataset(batches: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = batches * BATCH
    return TensorDataset(
        torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    )


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _plain_case(batches: int) -> Callable[[int], list[float]]:
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches_it = _forever(DataLoader(_dataset(batches), batch_size=BATCH, shuffle=True))
    loss_fn = torch.nn.functional.cross_entropy

    def run(steps: int) -> list[float]:
        times = []
        clock = time.perf_counter
        for _ in range(steps):
            start = clock()
            x, y = next(batches_it)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(clock() - start)
        return times

    return run


_TRACKERS = ["jsonl", "tensorboard", "mlflow", "wandb"]


def _prepared_case(
    batches: int,
    use_accumulate: bool,
    journal: bool | None = None,
    preemption: bool = False,
    watchdog: bool = False,
) -> Callable[[int], list[float]]:
    """The prepared step; with ``journal`` set, it also logs the loss to 4 trackers (jsonl,
    TensorBoard, MLflow on sqlite, wandb offline) with the tracker journal on or off; with
    ``preemption``, signals are watched, an interval is set and ``should_save()`` is asked
    every step (issue 25)."""
    import os

    from accelkit import Accelerator, ProjectConfiguration

    logging = journal is not None
    config = None
    if preemption:
        config = ProjectConfiguration(
            project_dir=tempfile.mkdtemp(prefix="accelkit-bench-step-"),
            automatic_checkpoint_naming=True,
            preemption_signals=("SIGTERM", "SIGUSR1"),
            save_every_steps=10**9,  # never due: the decision's cost, not a save's
        )
    if logging:
        os.environ.update(
            WANDB_MODE="offline", WANDB_SILENT="true", MLFLOW_DISABLE_TELEMETRY="true"
        )
        os.environ["ACCELKIT_TRACKER_JOURNAL"] = "1" if journal else "0"
        work = tempfile.mkdtemp(prefix="bench-step-trackers-")
        accelerator = Accelerator(
            cpu=True, mixed_precision="no", log_with=_TRACKERS, project_dir=work
        )
        uri = f"sqlite:///{work}/mlflow.db"
        accelerator.init_trackers(
            "bench", init_kwargs={"mlflow": {"tracking_uri": uri}, "wandb": {"dir": work}}
        )
        os.environ.pop("ACCELKIT_TRACKER_JOURNAL")
        assert accelerator._trackers.journal is journal
    else:
        accelerator = Accelerator(
            cpu=True,
            mixed_precision="no",
            project_config=config,
            hang_timeout_seconds=3600 if watchdog else None,
        )
    step_number = [0]
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(_dataset(batches), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches_it = _forever(loader)
    loss_fn = torch.nn.functional.cross_entropy

    def run(steps: int) -> list[float]:
        times = []
        clock = time.perf_counter
        for _ in range(steps):
            start = clock()
            x, y = next(batches_it)
            if use_accumulate:
                with accelerator.accumulate(model):
                    loss = loss_fn(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                loss = loss_fn(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if logging:
                accelerator.log({"loss": loss.detach(), "lr": 0.01}, step=step_number[0])
                step_number[0] += 1
            if preemption and accelerator.should_save():
                accelerator.save_state()
            times.append(clock() - start)
        if logging:
            # Untimed: deliver this case's backlog now, so that the trackers' threads do not
            # run (and steal the CPU) during the next case's timed steps.
            accelerator._trackers.flush()
        return times

    run.accelerator = accelerator  # type: ignore[attr-defined]  # for the 2-process figures
    return run


def _two_process_worker(rank: int, port: int, rounds: int, steps: int, out: str) -> None:
    """One of 2 gloo processes: the prepared step without and with preemption watched (the
    agreement's all_reduce at every boundary), alternating blocks; rank 0 writes the medians."""
    import json
    import os

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
    )
    torch.set_num_threads(1)
    cases = {
        "prepared": _prepared_case(16, use_accumulate=False),
        "preemption": _prepared_case(16, use_accumulate=False, preemption=True),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run(steps)
    decider = cases["preemption"].accelerator._preemption.decider  # type: ignore[attr-defined]
    rounds_before = decider.agreement.rounds
    for i in range(rounds):
        order = list(cases) if i % 2 == 0 else list(reversed(cases))
        for name in order:
            times[name] += cases[name](steps)
    if rank == 0:
        # The agreement's own figures, immune to the step timings' noise: rounds started during
        # the timed steps, what one costs on this process (smoothed), and their share.
        agreed = decider.agreement.rounds - rounds_before
        cost = decider._round_cost
        extra = {
            "agreement_rounds": agreed,
            "round_every": decider.round_every,
            "round_cost_us": cost * 1e6,
            "agreement_share_pct": agreed * cost / sum(times["preemption"]) * 100.0,
        }
        # Medians, and means: a round of the agreement runs only every ~50 ms of training, so
        # the median step does not see it; the mean carries its cost spread over the steps.
        found = {name: median(t) for name, t in times.items()}
        found.update({f"mean {name}": sum(t) / len(t) for name, t in times.items()})
        found.update(extra)
        with open(out, "w") as f:
            json.dump(found, f)
    import torch.distributed as dist

    dist.barrier()


def _two_processes(rounds: int, steps: int) -> dict[str, float]:
    """Medians of the 2-process prepared step (DDP, gloo) without and with preemption."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/medians.json"
        mp.spawn(_two_process_worker, args=(port, rounds, steps, out), nprocs=2, join=True)
        with open(out) as f:
            medians: dict[str, float] = json.load(f)
    return medians


def _preemption_hook_us(number: int) -> float:
    """What the preemption part adds per step on one process, alone (us, best of 15, no
    compute): the prepared dataloader's and optimizer's step boundaries and ``should_save()``
    against the same step without them."""
    from accelkit import Accelerator, ProjectConfiguration

    config = ProjectConfiguration(
        project_dir=tempfile.mkdtemp(prefix="accelkit-bench-hook-"),
        automatic_checkpoint_naming=True,
        preemption_signals=("SIGTERM", "SIGUSR1"),
        save_every_steps=10**9,
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(list(range(4)), batch_size=1, collate_fn=_identity)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = accelerator.gradient_state
    boundary = state.on_boundary
    assert boundary.hooks
    next(iter(loader))  # the optimizer's loader (what the hook compares with)

    def hooked() -> None:
        state.optimizer_steps += 1
        boundary("batch", loader)
        boundary("step", optimizer)
        accelerator.should_save()

    def bare() -> None:
        state.optimizer_steps += 1

    cost = _extra_us(hooked, bare, number)
    accelerator.end_training()
    return cost


def _identity(batch: Any) -> Any:
    return batch


def _extra_us(
    wrapped: Callable[[], Any], bare: Callable[[], Any], number: int, repeat: int = 15
) -> float:
    """Best-of-``repeat`` time of ``wrapped`` minus that of ``bare``, measured alternately."""
    best = {"wrapped": float("inf"), "bare": float("inf")}
    for _ in range(repeat):
        for name, fn in (("wrapped", wrapped), ("bare", bare)):
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best["wrapped"] - best["bare"]


def _wrapper_costs(number: int) -> dict[str, float]:
    """The Python cost of each wrapper alone, in microseconds per call (best of 15, no compute).

    Immune to the compute noise of the step timings: what accelkit adds per step, measured
    against the bare PyTorch call it wraps.
    """
    from accelkit import Accelerator
    from accelkit.data.preparation import prepare_data_loader
    from accelkit.training.optim import AcceleratedOptimizer, GradientState

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))

    def accumulate() -> None:
        with accelerator.accumulate(model):
            pass

    def null() -> None:
        with contextlib.nullcontext():
            pass

    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.zeros(1)
    inner = torch.optim.SGD([param], lr=0.1)
    wrapped = AcceleratedOptimizer(inner, GradientState())

    def plain_opt() -> None:
        inner.step()
        inner.zero_grad(set_to_none=False)

    def wrapped_opt() -> None:
        wrapped.step()
        wrapped.zero_grad(set_to_none=False)

    items = list(range(2000))
    plain_loader = DataLoader(items, batch_size=1, collate_fn=_identity)
    prepared_loader = prepare_data_loader(DataLoader(items, batch_size=1, collate_fn=_identity))

    def drain(loader: Any) -> Callable[[], None]:
        def run() -> None:
            for _ in loader:
                pass

        return run

    passes = max(2, number // 1000)
    per_pass = _extra_us(drain(prepared_loader), drain(plain_loader), passes)
    return {
        "accumulate_context_us": _extra_us(accumulate, null, number),
        "optimizer_step_zero_grad_us": _extra_us(wrapped_opt, plain_opt, number),
        "dataloader_per_batch_us": per_pass / len(items),
    }


def main(argv: list[str] | None = None) -> None:
    """Measure, print a table, and write ``benchmarks/results/step.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args(argv)
    rounds, steps = (10, 50) if args.quick else (60, 100)
    torch.set_num_threads(1)  # one core: less noise from the machine's other work

    # Two groups, measured one after the other: the tracker cases leave background work behind
    # them (TensorBoard's and wandb's writer threads, MLflow's worker) that slows whichever case
    # runs next; mixed into one rotation, the case after them read ~2.5% slower whatever it was
    # (a copy of the prepared step included), which once showed as the preemption case's "cost".
    groups = {
        "steps": {
            "plain PyTorch": lambda: _plain_case(16),
            "accelkit prepared": lambda: _prepared_case(16, use_accumulate=False),
            "accelkit prepared + accumulate()": lambda: _prepared_case(16, use_accumulate=True),
            PREEMPTION_CASE: lambda: _prepared_case(16, use_accumulate=False, preemption=True),
            WATCHDOG_CASE: lambda: _prepared_case(16, use_accumulate=False, watchdog=True),
        },
        "trackers": {
            "+ log to 4 trackers, journal off": lambda: _prepared_case(16, False, journal=False),
            "+ log to 4 trackers, journal on": lambda: _prepared_case(16, False, journal=True),
        },
    }
    samples: dict[str, Any] = {}
    for group, makers in groups.items():
        cases = {name: make() for name, make in makers.items()}  # trackers start only now
        with section(
            f"training step ({group}), {rounds} rounds x {steps} steps per case, alternating"
        ):
            for run in cases.values():
                run(steps)  # warm up: allocator, first-step lazy imports
            samples.update(
                alternate(
                    {name: (lambda run=run: {"steps": run(steps)}) for name, run in cases.items()},
                    rounds,
                    measure_memory=False,
                )
            )
    per_step = {name: [t for s in runs for t in s.info["steps"]] for name, runs in samples.items()}
    medians = {name: median(times) for name, times in per_step.items()}
    base = medians["plain PyTorch"]
    rows = []
    results: dict[str, Any] = {"model": f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}"}
    results.update({"batch_size": BATCH, "threads": 1, "rounds": rounds, "steps": steps})
    for name, value in medians.items():
        overhead = (value / base - 1.0) * 100.0
        rows.append([name, value * 1e6, value / base, overhead])
        results[name] = {
            "median_step_us": value * 1e6,
            "ratio_vs_plain": value / base,
            "overhead_pct": overhead,
            "steps_timed": len(per_step[name]),
        }
    print_table(rows, ["case", "median step (us)", "ratio", "overhead %"])
    with section("wrapper costs alone (us per call, best of 15, alternating, no compute)"):
        costs = _wrapper_costs(1000 if args.quick else 5000)
        print_table([[k, v] for k, v in costs.items()], ["wrapper", "extra us"])
    results["wrapper_costs_us"] = costs
    off = results["+ log to 4 trackers, journal off"]["median_step_us"]
    on = results["+ log to 4 trackers, journal on"]["median_step_us"]
    results["journal_step_change_pct"] = (on / off - 1.0) * 100.0
    print(f"\njournal on vs off, step with 4 trackers: {results['journal_step_change_pct']:+.2f}%")
    overhead = results["accelkit prepared"]["overhead_pct"]
    overhead_acc = results["accelkit prepared + accumulate()"]["overhead_pct"]
    # Issue 25: what watching for preemption and deciding saves adds to the prepared step.
    preempt = (medians[PREEMPTION_CASE] / medians["accelkit prepared"] - 1.0) * 100.0
    results[PREEMPTION_CASE]["overhead_vs_prepared_pct"] = preempt
    hook_us = _preemption_hook_us(1000 if args.quick else 5000)
    hook_pct = hook_us / (medians["accelkit prepared"] * 1e6) * 100.0
    results[PREEMPTION_CASE]["hook_alone_us"] = hook_us
    results[PREEMPTION_CASE]["hook_alone_pct_of_prepared_step"] = hook_pct
    print(f"preemption + should_save() vs the prepared step: {preempt:+.2f}%")
    # Issue 39: the hang watchdog's step-boundary hook (one increment per boundary).
    watch = (medians[WATCHDOG_CASE] / medians["accelkit prepared"] - 1.0) * 100.0
    results[WATCHDOG_CASE]["overhead_vs_prepared_pct"] = watch
    print(f"hang watchdog vs the prepared step: {watch:+.2f}%")
    print(f"  its hooks alone (no compute): {hook_us:.2f} us per step = {hook_pct:.2f}% of it")
    with section("2 processes (gloo, DDP): the prepared step without and with preemption"):
        two = _two_processes(max(4, rounds // 4), steps)
    preempt2 = (two["preemption"] / two["prepared"] - 1.0) * 100.0
    preempt2_mean = (two["mean preemption"] / two["mean prepared"] - 1.0) * 100.0
    results["two_processes"] = {
        "median_step_us": {n: two[n] * 1e6 for n in ("prepared", "preemption")},
        "mean_step_us": {n: two[f"mean {n}"] * 1e6 for n in ("prepared", "preemption")},
        "preemption_overhead_pct": preempt2,
        "preemption_overhead_of_means_pct": preempt2_mean,
        "steps_timed_per_case": max(4, rounds // 4) * steps,
        "agreement_rounds": two["agreement_rounds"],
        "round_every_steps": two["round_every"],
        "round_cost_us": two["round_cost_us"],
        "agreement_share_of_step_time_pct": two["agreement_share_pct"],
    }
    print(
        f"2 processes: preemption + should_save() vs the prepared step: {preempt2:+.2f}% "
        f"(medians {two['prepared'] * 1e6:.0f} us, {two['preemption'] * 1e6:.0f} us); "
        f"means: {preempt2_mean:+.2f}%"
    )
    print(
        f"  the agreement: {two['agreement_rounds']:.0f} rounds (every {two['round_every']:.0f} "
        f"steps), {two['round_cost_us']:.0f} us each on rank 0 = "
        f"{two['agreement_share_pct']:.2f}% of the timed step time"
    )
    targets = [
        Target("prepared step overhead vs plain PyTorch (CPU MLP)", overhead, 3.0, "%", False),
        Target("prepared + accumulate() overhead vs plain", overhead_acc, 3.0, "%", False),
        Target(
            "step with 4 trackers: journal on vs off (#27)",
            results["journal_step_change_pct"],
            1.0,
            "%",
            False,
        ),
        Target("preemption signals + should_save() vs prepared step", preempt, 1.0, "%", False),
        Target("the same, its hooks alone (% of the prepared step)", hook_pct, 1.0, "%", False),
        Target("the same on 2 processes (the agreement's all_reduce)", preempt2, 1.0, "%", False),
        Target(
            "the same, ratio of the mean steps (rounds every ~50 ms)",
            preempt2_mean,
            1.0,
            "%",
            False,
        ),
        Target(
            "the same, the agreement's rounds' share of the step time",
            two["agreement_share_pct"],
            1.0,
            "%",
            False,
        ),
    ]
    notes = [
        "Each step is timed alone (batch fetch + forward + backward + step + zero_grad); the "
        "figure is the ratio of per-step medians over alternating blocks on 1 thread.",
        "Shared 2-core machine: other work adds noise to both sides equally (alternation); the "
        "step medians move by a few % between runs, so wrapper_costs_us gives the noise-free "
        "per-step Python cost of each wrapper.",
        "The tracker cases run in a rotation of their own, after the others: the background "
        "work they leave behind slowed whichever case ran next by ~2.5% when all six shared one "
        "rotation (a copy of the prepared step read +2.54%, the preemption case +2.51%).",
    ]
    path = write_result(
        "step", results, quick=args.quick, targets=targets, notes=notes, title="Training step"
    )
    print(f"\nprepared step overhead: {overhead:+.2f}% (accumulate(): {overhead_acc:+.2f}%)")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
