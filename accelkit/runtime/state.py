"""Process state: who this process is, which device it uses, and the process group.

The launcher (`accelkit launch`, i.e. `torch.distributed.run`, or `notebook_launcher`) describes
each worker through environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). :class:`PartialState` reads them once and
initialises the ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) when there is more
than one process.

Unlike the reference implementation, state is not shared through a class-level dict: every
``PartialState`` is an ordinary object. The process-wide values are the process group, which
``torch.distributed`` owns (:func:`destroy_process_group` resets it), and the record behind the
compatibility view :class:`AcceleratorState` (``AcceleratorState._reset_state()`` clears it),
which scripts written for the reference read but accelkit never consults.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import functools
import os
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist

from accelkit.errors import ConfigurationError, UsageError
from accelkit.runtime import ops
from accelkit.runtime.environment import (
    ENV_MIXED_PRECISION,
    ENV_USE_CPU,
    PrecisionType,
    env_flag,
    env_value,
    parse_mixed_precision,
)
from accelkit.runtime.splitting import split_for_process
from accelkit.runtime.teardown import settle_collective_threads
from accelkit.runtime.trail import entering

__all__ = [
    "ENV_MIXED_PRECISION",
    "ENV_USE_CPU",
    "AcceleratorState",
    "DistributedType",
    "PartialState",
    "PrecisionType",
    "destroy_process_group",
    "env_flag",
    "env_value",
    "get_distributed_backend",
    "get_torch_accelerator_backend",
    "parse_mixed_precision",
]

F = TypeVar("F", bound=Callable[..., Any])


class DistributedType(str, enum.Enum):
    """How the processes of this run are connected.

    accelkit runs ``NO``, ``MULTI_CPU``, ``MULTI_GPU`` and ``FSDP``. The other members are the
    reference's names for accelerators and engines accelkit does not drive (DeepSpeed,
    Megatron-LM, XLA/TPU, NPU, MLU, XPU, HPU, ...): they exist so that a script's
    ``if state.distributed_type == DistributedType.XLA:`` guard keeps working, and they simply
    never match.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"Environment variable {name}={raw!r} is not an integer; it is set by the launcher "
            "(accelkit launch / torchrun): unset it or launch through one of them."
        ) from None


def destroy_process_group() -> None:
    """Tear down the default process group, if any (used at the end of a run and in tests)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_exit = {"hooked": False, "destroy": False}


def _leave_at_exit() -> None:
    """At interpreter exit: tear down the process group accelkit created (unless the script
    did), then let gloo's worker threads finish with their last collective before the
    interpreter finalizes; otherwise one may abort a run that succeeded ("terminate called
    without an active exception", see :mod:`accelkit.runtime.teardown`). Saves in flight
    finish before this runs (their exit hook runs before atexit's)."""
    if _exit["destroy"]:
        destroy_process_group()
    settle_collective_threads()


def _arrange_exit(destroy: bool) -> None:
    """Register :func:`_leave_at_exit` once per process; ``destroy``: the group is ours."""
    _exit["destroy"] = _exit["destroy"] or destroy
    if not _exit["hooked"]:
        atexit.register(_leave_at_exit)
        _exit["hooked"] = True


#: Set by torchrun's agent (and ``notebook_launcher``'s) for its workers: ``"True"`` when the
#: workers' store is the one the agent hosts, which outlives a failed worker group.
ENV_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
#: Set by the agent: how many times it restarted the worker group (0 for the first group).
ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"


def attempt_store(timeout: Any = None) -> Any:
    """The process group's store for this attempt of an elastic worker group, or ``None`` when
    ``torch.distributed``'s own ``env://`` store is right (no agent's store, or no agent).

    torchrun's agent keeps one ``TCPStore`` for the whole job, and its restarted worker group
    connects to that same store without a prefix of its own (torch's ``env://`` code assumes a
    new store per attempt). Every key the failed group wrote is still there: gloo's addresses of
    the dead workers and the counters of the store barrier. A restarted rank then reads a dead
    peer's address (``Gloo connectFullMesh failed ... Connection refused``) or a barrier that
    is already counted (a hang): 4 restarts in 6 failed so. Each attempt's keys here live under
    a prefix of its own (the agent's run id and ``TORCHELASTIC_RESTART_COUNT``), so a restarted
    group never sees an earlier attempt's keys.

    Args:
        timeout: the store's timeout (a ``timedelta``; ``None``: torch's default for a process
            group).
    """
    if os.environ.get(ENV_USE_AGENT_STORE) != "True":
        return None
    import datetime

    from torch.distributed.constants import default_pg_timeout

    host = os.environ.get("MASTER_ADDR", "")
    port = _env_int("MASTER_PORT", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    attempt = _env_int(ENV_RESTART_COUNT, 0)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    wait = timeout if isinstance(timeout, datetime.timedelta) else default_pg_timeout
    client = dist.TCPStore(host, port, world_size, is_master=False, timeout=wait)
    return dist.PrefixStore(f"accelkit/{run}/attempt_{attempt}", client)


# The collective backend of each device type accelkit drives: NCCL on CUDA (RCCL under ROCm,
# which torch also names "nccl"). The CPU has no entry, as in the reference: a CPU run uses gloo.
_DISTRIBUTED_BACKENDS = {"cuda": "nccl"}


def get_torch_accelerator_backend(
    check_available: bool = True,
) -> tuple[str | None, types.ModuleType | None]:
    """The accelerator this process would run on and torch's module for it, as Accelerate's.

    accelkit drives the CPU and CUDA, so the answer is ``("cuda", torch.cuda)`` or
    ``(None, None)``; the devices accelkit does not drive (MPS, XPU, NPU, HPU, ...) give
    ``(None, None)``, as on a machine without them, and a run there uses the CPU.

    Args:
        check_available: with False, answer from how torch was built, without probing for a
            device (e.g. before forking workers): a CUDA build gives ``("cuda", torch.cuda)``
            even on a machine without a GPU.

    Returns:
        ``(device_type, device_module)``, or ``(None, None)`` when there is no accelerator.

    Example:
        >>> device_type, device_module = get_torch_accelerator_backend()
        >>> device = torch.device(device_type or "cpu")
    """
    cuda = torch.cuda.is_available() if check_available else torch.backends.cuda.is_built()
    return ("cuda", torch.cuda) if cuda else (None, None)


def get_distributed_backend(device_type: str | None) -> str | None:
    """The default ``torch.distributed`` backend of ``device_type``, as Accelerate's.

    ``"nccl"`` for ``"cuda"``; None for the CPU (a CPU run uses gloo), for None and for the
    devices accelkit does not drive.

    Example:
        >>> get_distributed_backend("cuda")
        'nccl'
    """
    return _DISTRIBUTED_BACKENDS.get(device_type) if device_type is not None else None


class PartialState:
    """The state of this process in the run: rank, world size, device and process group.

    Args:
        cpu: force the CPU even when CUDA is available (also ``ACCELKIT_USE_CPU=1``, which
            ``accelkit launch --cpu`` sets).
        backend: the ``torch.distributed`` backend; default gloo on CPU, NCCL on CUDA.
        timeout_s: collective timeout for a process group this object creates.
        **kwargs: passed on to ``torch.distributed.init_process_group`` when this object creates
            the process group, as in the reference (e.g. ``timeout=timedelta(minutes=5)``,
            ``init_method=...``).

    Example:
        >>> state = PartialState()
        >>> state.num_processes, state.process_index
        (1, 0)
    """

    def __init__(
        self,
        cpu: bool = False,
        backend: str | None = None,
        timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        self.process_index = _env_int("RANK", 0)
        self.num_processes = _env_int("WORLD_SIZE", 1)
        self.local_process_index = _env_int("LOCAL_RANK", 0)
        self.local_num_processes = _env_int("LOCAL_WORLD_SIZE", self.num_processes)
        if not 0 <= self.process_index < self.num_processes:
            raise ConfigurationError(
                f"RANK={self.process_index} is outside WORLD_SIZE={self.num_processes}; "
                "launch with `accelkit launch` or torchrun, which set both consistently."
            )
        self.cpu = cpu or env_flag(ENV_USE_CPU)
        use_cuda = torch.cuda.is_available() and not self.cpu
        if use_cuda:
            index = self.local_process_index % max(torch.cuda.device_count(), 1)
            self.device = torch.device("cuda", index)
            torch.cuda.set_device(self.device)
        elif self.num_processes > 1:
            # The reference's device on several CPU processes: index 0 of the CPU "device
            # module" on every rank (scripts print it; tensors on it are plain CPU tensors).
            self.device = torch.device("cpu", 0)
        else:
            self.device = torch.device("cpu")
        self.backend = backend or get_distributed_backend(self.device.type) or "gloo"
        if self.num_processes > 1:
            if dist.is_initialized():
                self.backend = str(dist.get_backend())
                _arrange_exit(destroy=False)  # the script's group: the script tears it down
            else:
                self._init_process_group(timeout_s, kwargs)
            self.distributed_type = (
                DistributedType.MULTI_GPU if use_cuda else DistributedType.MULTI_CPU
            )
        else:
            self.distributed_type = DistributedType.NO

    def _init_process_group(self, timeout_s: float | None, extra: dict[str, Any]) -> None:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise UsageError(
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
        kwargs.update(extra)
        if "store" not in kwargs and kwargs.get("init_method") in (None, "env://"):
            store = attempt_store(kwargs.get("timeout"))
            if store is not None:
                kwargs.pop("init_method", None)
                kwargs["store"] = store
        dist.init_process_group(**kwargs)
        _arrange_exit(destroy=True)

    @classmethod
    def _reset_state(cls) -> None:
        """Accepted for scripts written for the reference, whose process state is shared by every
        instance; a ``PartialState`` here is an ordinary object, so there is nothing to reset.
        Use :meth:`destroy_process_group` to tear down the process group."""

    def destroy_process_group(self, group: Any = None) -> None:
        """Tear down ``group`` (default: the default process group), if it exists."""
        if group is not None:
            dist.destroy_process_group(group)
        else:
            destroy_process_group()

    @property
    def initialized(self) -> bool:
        """Always True: the state is read when the object is created."""
        return True

    def set_device(self) -> None:
        """Make :attr:`device` the current CUDA device (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @property
    def debug(self) -> bool:
        """Whether collectives check tensor shapes across processes first and raise
        :class:`~accelkit.runtime.ops.DistributedOperationException` on a mismatch.

        On from ``ACCELKIT_DEBUG_MODE``/``ACCELERATE_DEBUG_MODE``; setting it applies to every
        collective of this process (as in the reference, where the state is shared).
        """
        return ops.debug_mode()

    @debug.setter
    def debug(self, value: bool) -> None:
        ops.set_debug_mode(value)

    @property
    def fork_launched(self) -> bool:
        """Whether the process was forked by ``notebook_launcher``/``debug_launcher``."""
        return env_flag("FORK_LAUNCHED")

    @property
    def default_device(self) -> torch.device:
        """The device a process of this run would use: CUDA when available, else the CPU."""
        device_type, _ = get_torch_accelerator_backend()
        return torch.device(device_type or "cpu")

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
        # The reference's text, which scripts print (its config_yaml_templates/run_me.py):
        # the enum as ``DistributedType.X``, and the backend of a distributed run.
        backend = f"  Backend: {self.backend}" if self.use_distributed else ""
        return (
            f"Distributed environment: DistributedType.{self.distributed_type.name}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
        )

    # ------------------------------------------------------------ synchronisation

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point (a no-op on one process)."""
        if self.use_distributed:
            with entering("barrier (accelkit wait_for_everyone)"):
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
            raise ConfigurationError(
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
            raise ConfigurationError(
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


# ------------------------------------------------------------------ AcceleratorState

_ACCELERATOR_STATE: dict[str, Any] = {}
"""The one process-wide record behind :class:`AcceleratorState` (cleared by ``_reset_state``)."""

_OUT_OF_SCOPE_PLUGINS = {
    "deepspeed_plugin": "DeepSpeed",
    "megatron_lm_plugin": "Megatron-LM",
    "torch_tp_plugin": "tensor parallelism (torch_tp_plugin)",
    "parallelism_config": "ParallelismConfig (tensor/context parallelism)",
}


def refuse_out_of_scope_plugins(**plugins: Any) -> None:
    """Raise ``ValueError`` for a plugin of an engine accelkit does not drive.

    Raises:
        ValueError: naming the argument and what to use instead.
    """
    for name, value in plugins.items():
        if value is not None and name in _OUT_OF_SCOPE_PLUGINS:
            raise ConfigurationError(
                f"accelkit does not support {_OUT_OF_SCOPE_PLUGINS[name]}: got {name}={value!r}. "
                f"Remove {name}=... (use fsdp_plugin / FullyShardedDataParallelPlugin for "
                "sharded training)."
            )


class AcceleratorState(PartialState):
    """The reference's process-wide state of "the" accelerator, for scripts that read it.

    Every ``AcceleratorState()`` is a view of one process-wide record: the
    :class:`~accelkit.Accelerator` created last fills it (process identity, ``mixed_precision``,
    ``distributed_type``, the plugins), and an ``AcceleratorState()`` created anywhere in the
    script reads the same values, as in the reference. accelkit itself never reads this record
    to decide anything: each ``Accelerator`` keeps its own settings. Created before any
    ``Accelerator``, it is initialised from the launcher's environment.

    The reference's engine plugins that accelkit does not drive are always None
    (``deepspeed_plugin``, ``megatron_lm_plugin``, ``torch_tp_plugin``); passing one raises
    ``ValueError``.

    ``AcceleratorState._reset_state()`` clears the record; until the next ``Accelerator`` (or
    ``AcceleratorState(...)`` with arguments) is created, reading it raises ``AttributeError``
    saying so, as in the reference.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` (default: the launcher's setting).
        cpu: force the CPU.
        dynamo_plugin: a :class:`~accelkit.training.dynamo.TorchDynamoPlugin`, or None.
        deepspeed_plugin: must be None (out of scope).
        fsdp_plugin: a :class:`~accelkit.fsdp.runtime.FullyShardedDataParallelPlugin`, or None.
        torch_tp_plugin: must be None (out of scope).
        megatron_lm_plugin: must be None (out of scope).
        parallelism_config: must be None (out of scope).
        **kwargs: passed to :class:`PartialState`.
    """

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        parallelism_config: Any = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        refuse_out_of_scope_plugins(
            deepspeed_plugin=deepspeed_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            torch_tp_plugin=torch_tp_plugin,
            parallelism_config=parallelism_config,
        )
        self.__dict__ = _ACCELERATOR_STATE
        explicit = (
            _from_accelerator
            or mixed_precision is not None
            or cpu
            or dynamo_plugin is not None
            or fsdp_plugin is not None
            or bool(kwargs)
        )
        if _ACCELERATOR_STATE and not explicit:
            return  # a view of the state the last Accelerator set up
        precision = parse_mixed_precision(mixed_precision).value
        _ACCELERATOR_STATE.clear()
        super().__init__(cpu=cpu, **kwargs)
        self.mixed_precision: str = precision
        self.dynamo_plugin = dynamo_plugin
        self.fsdp_plugin = fsdp_plugin
        self.deepspeed_plugin: Any = None
        self.megatron_lm_plugin: Any = None
        self.torch_tp_plugin: Any = None
        self.parallelism_config: Any = None
        self.use_ipex = False
        if fsdp_plugin is not None:
            self.distributed_type = DistributedType.FSDP

    def __getattr__(self, name: str) -> Any:
        # Only reached when the record lacks ``name``: after _reset_state(), or a typo.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"`AcceleratorState` object has no attribute `{name}`. This happens if "
            "`AcceleratorState._reset_state()` was called and an `Accelerator` or `PartialState` "
            "was not reinitialized."
        )

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = False) -> None:
        """Clear the process-wide record (for tests and notebooks).

        Args:
            reset_partial_state: accepted for compatibility; :class:`PartialState` objects are
                not shared, so there is nothing more to reset. The process group stays up (tear
                it down with :meth:`destroy_process_group`).
        """
        _ACCELERATOR_STATE.clear()

    @property
    def initialized(self) -> bool:
        """Whether the process-wide record is filled (False after :meth:`_reset_state`)."""
        return bool(_ACCELERATOR_STATE)

    @property
    def use_fp16(self) -> bool:
        """Whether ``mixed_precision`` is ``"fp16"``."""
        return bool(self.mixed_precision == "fp16")

    @property
    def is_fsdp2(self) -> bool:
        """True when FSDP is used (accelkit's FSDP is always FSDP2, ``fully_shard``)."""
        return bool(self.distributed_type == DistributedType.FSDP)

    def get_deepspeed_plugin(self, name: str) -> Any:
        """Refused: DeepSpeed is out of accelkit's scope.

        Raises:
            ValueError: always.
        """
        refuse_out_of_scope_plugins(deepspeed_plugin=name)

    def select_deepspeed_plugin(self, name: str | None = None) -> None:
        """Refused: DeepSpeed is out of accelkit's scope.

        Raises:
            ValueError: always.
        """
        refuse_out_of_scope_plugins(deepspeed_plugin=name or "default")

    def __repr__(self) -> str:
        # As the reference's: the process state, then the precision.
        return super().__repr__() + f"\nMixed precision type: {self.mixed_precision}\n"

    @property
    def mixed_precision_enum(self) -> PrecisionType:
        """``mixed_precision`` as a :class:`PrecisionType`."""
        return PrecisionType(self.mixed_precision)
