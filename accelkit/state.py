"""Process state: who this process is, which device it uses, and the process group.

The launcher (`accelkit launch`, i.e. `torch.distributed.run`, or `notebook_launcher`) describes
each worker through environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). :class:`PartialState` reads them once and
initialises the ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) when there is more
than one process.

Unlike the reference implementation, state is not shared through a class-level dict: every
``PartialState`` is an ordinary object. The only process-wide value is the process group itself,
which ``torch.distributed`` owns; :func:`destroy_process_group` is the one way to reset it.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist

from accelkit.environment import (
    ENV_MIXED_PRECISION,
    ENV_USE_CPU,
    PrecisionType,
    env_flag,
    env_value,
    parse_mixed_precision,
)

__all__ = [
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "DistributedType",
    "PartialState",
    "PrecisionType",
    "destroy_process_group",
    "env_flag",
    "env_value",
    "parse_mixed_precision",
]

F = TypeVar("F", bound=Callable[..., Any])


class DistributedType(str, enum.Enum):
    """How the processes of this run are connected."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"Environment variable {name}={raw!r} is not an integer; it is set by the launcher "
            "(accelkit launch / torchrun): unset it or launch through one of them."
        ) from None


def destroy_process_group() -> None:
    """Tear down the default process group, if any (used at the end of a run and in tests)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class PartialState:
    """The state of this process in the run: rank, world size, device and process group.

    Args:
        cpu: force the CPU even when CUDA is available (also ``ACCELKIT_USE_CPU=1``, which
            ``accelkit launch --cpu`` sets).
        backend: the ``torch.distributed`` backend; default gloo on CPU, NCCL on CUDA.
        timeout_s: collective timeout for a process group this object creates.

    Example:
        >>> state = PartialState()
        >>> state.num_processes, state.process_index
        (1, 0)
    """

    def __init__(
        self, cpu: bool = False, backend: str | None = None, timeout_s: float | None = None
    ) -> None:
        self.process_index = _env_int("RANK", 0)
        self.num_processes = _env_int("WORLD_SIZE", 1)
        self.local_process_index = _env_int("LOCAL_RANK", 0)
        self.local_num_processes = _env_int("LOCAL_WORLD_SIZE", self.num_processes)
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(
                f"RANK={self.process_index} is outside WORLD_SIZE={self.num_processes}; "
                "launch with `accelkit launch` or torchrun, which set both consistently."
            )
        self.cpu = cpu or env_flag(ENV_USE_CPU)
        use_cuda = torch.cuda.is_available() and not self.cpu
        if use_cuda:
            index = self.local_process_index % max(torch.cuda.device_count(), 1)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.backend = backend or ("nccl" if use_cuda else "gloo")
        if self.num_processes > 1:
            if dist.is_initialized():
                self.backend = str(dist.get_backend())
            else:
                self._init_process_group(timeout_s)
            self.distributed_type = (
                DistributedType.MULTI_GPU if use_cuda else DistributedType.MULTI_CPU
            )
        else:
            self.distributed_type = DistributedType.NO

    def _init_process_group(self, timeout_s: float | None) -> None:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise RuntimeError(
                    f"WORLD_SIZE={self.num_processes} but {var} is not set; start the script "
                    "with `accelkit launch --num_processes N script.py` (or torchrun)."
                )
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "rank": self.process_index,
            "world_size": self.num_processes,
        }
        if timeout_s is not None:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device
        dist.init_process_group(**kwargs)
        # The group we created is torn down at exit unless the script did it: otherwise gloo's
        # worker threads can outlive the interpreter's teardown and abort a run that succeeded
        # ("terminate called without an active exception"). Saves in flight finish first (their
        # exit hook runs before atexit's).
        atexit.register(destroy_process_group)

    # ---------------------------------------------------------------- identity

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part in the run."""
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """True on the process of global index 0 (once across all machines)."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the process of local index 0 (once per machine)."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the process of the highest global index."""
        return self.process_index == self.num_processes - 1

    @property
    def num_machines(self) -> int:
        """Number of machines (nodes), assuming the same process count on each."""
        return max(1, self.num_processes // max(1, self.local_num_processes))

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    # ------------------------------------------------------------ synchronisation

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a no-op on one process)."""
        if self.use_distributed:
            dist.barrier()

    @contextlib.contextmanager
    def _goes_first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Let the main process run the block first; the others run it after it has finished."""
        with self._goes_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Let each machine's local main process run the block first, then the others."""
        with self._goes_first(self.is_local_main_process):
            yield

    # ----------------------------------------------------------- run-on decorators

    def _only_if(self, condition: bool, function: F) -> F:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if condition:
                return function(*args, **kwargs)
            return None

        return wrapper  # type: ignore[return-value]

    def on_main_process(self, function: F | None = None) -> Any:
        """Decorator: run the function on the main process only (returns None elsewhere)."""
        if function is None:
            return self.on_main_process
        return self._only_if(self.is_main_process, function)

    def on_local_main_process(self, function: F | None = None) -> Any:
        """Decorator: run the function on each machine's local main process only."""
        if function is None:
            return self.on_local_main_process
        return self._only_if(self.is_local_main_process, function)

    def on_last_process(self, function: F | None = None) -> Any:
        """Decorator: run the function on the last process only."""
        if function is None:
            return self.on_last_process
        return self._only_if(self.is_last_process, function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> Any:
        """Decorator: run the function on the process of global index ``process_index``.

        Usable as ``@state.on_process(process_index=1)`` or ``state.on_process(fn, 1)``.
        """
        if process_index is None:
            raise ValueError(
                "on_process needs process_index=<int>, e.g. @on_process(process_index=0)"
            )
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_if(self.process_index == process_index, function)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> Any:
        """Decorator: run the function on the process of local index ``local_process_index``."""
        if local_process_index is None:
            raise ValueError(
                "on_local_process needs local_process_index=<int>, "
                "e.g. @on_local_process(local_process_index=0)"
            )
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_if(self.local_process_index == local_process_index, function)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process)."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    # ---------------------------------------------------------------- splitting

    @overload
    def split_between_processes(
        self, inputs: list[Any], apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[list[Any]]: ...

    @overload
    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]: ...

    def split_between_processes(
        self, inputs: Any, apply_padding: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """Give each process its contiguous share of ``inputs``.

        Works on lists, tuples, dicts (every value split the same way; all must have the same
        length) and tensors (split on the first dimension). With ``apply_padding=True`` the
        shorter shares are padded with their last element so every process gets the same count.

        Example:
            >>> with state.split_between_processes(["A", "B", "C"]) as part:
            ...     print(part)   # ["A", "B"] on process 0, ["C"] on process 1
        """
        return contextlib.nullcontext(
            split_for_process(inputs, self.num_processes, self.process_index, apply_padding)
        )


def _share(length: int, num_processes: int, index: int) -> tuple[int, int]:
    per, extra = divmod(length, num_processes)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    return start, end


def split_for_process(inputs: Any, num_processes: int, index: int, apply_padding: bool) -> Any:
    """Pure splitting rule behind :meth:`PartialState.split_between_processes`."""
    if num_processes == 1:
        return inputs
    if isinstance(inputs, Mapping):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                "split_between_processes needs every value of the dict to have the same length; "
                f"got lengths {lengths}."
            )
        return cast(Any, type(inputs))(
            {
                k: split_for_process(v, num_processes, index, apply_padding)
                for k, v in inputs.items()
            }
        )
    if isinstance(inputs, torch.Tensor):
        length = inputs.shape[0]
    elif isinstance(inputs, (list, tuple)):
        length = len(inputs)
    else:
        raise TypeError(
            f"split_between_processes takes a list, tuple, dict or tensor, not "
            f"{type(inputs).__name__}."
        )
    start, end = _share(length, num_processes, index)
    part = inputs[start:end]
    if apply_padding:
        target = -(-length // num_processes)
        missing = target - (end - start)
        if missing > 0 and length > 0:
            filler = part[-1:] if end > start else inputs[-1:]
            if isinstance(inputs, torch.Tensor):
                part = torch.cat([part, *([filler] * missing)])
            else:
                part = part + type(part)(filler) * missing
    return part
