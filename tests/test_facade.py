"""The composed ``Accelerator``: its public surface did not move, and no class types another's
private attributes.

``PUBLIC_SURFACE`` was generated from the mixin-based ``Accelerator`` before it was rebuilt from
parts (``inspect.signature`` with annotations dropped: the constructor's annotations became the
real classes on purpose, the names, kinds, order and defaults did not change).
"""

from __future__ import annotations

import ast
import inspect
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import accelkit
from accelkit import Accelerator

PUBLIC_SURFACE = {
    "__init__": (
        "(self, device_placement=True, split_batches=None, mixed_precision=None, "
        "gradient_accumulation_steps=1, cpu=False, dataloader_config=None, "
        "deepspeed_plugin=None, fsdp_plugin=None, torch_tp_plugin=None, "
        "megatron_lm_plugin=None, rng_types=None, log_with=None, project_dir=None, "
        "project_config=None, gradient_accumulation_plugin=None, "
        "step_scheduler_with_optimizer=True, kwargs_handlers=None, dynamo_backend=None, "
        "dynamo_plugin=None, deepspeed_plugins=None, parallelism_config=None, "
        "logging_dir=None, tracker_errors='warn', save_policy=None, tracker_options=None, "
        "strict_resume=False, hang_timeout_seconds=None, straggler_fraction=None, "
        "straggler_steps=50)"
    ),
    "accumulate": "(self, *models)",
    "autocast": "(self, autocast_handler=None)",
    "backward": "(self, loss, **kwargs)",
    "check_trigger": "(self)",
    "clear": "(self, *objects)",
    "clip_grad_norm_": "(self, parameters, max_norm, norm_type=2)",
    "clip_grad_value_": "(self, parameters, clip_value)",
    "deepspeed_plugin": "property",
    "device": "property",
    # Instance attributes before the parts existed; now properties over the Training part.
    "device_placement": "property+setter",
    "dispatch_batches": "property",
    "distributed_type": "property",
    "end_training": "(self)",
    "even_batches": "property+setter",
    "fp8_backend": "property",
    # Attributes Accelerate's scripts read (issue 30): kwargs handlers, FP8 and LOMO constants.
    "ao_recipe_handler": "property",
    "autocast_handler": "property",
    "ddp_handler": "property",
    "delayed_fp8_autocast": "property",
    "fp8_enabled": "property",
    "fp8_recipe_handler": "property",
    "has_fp8_handler": "property",
    "has_lomo_optimizer": "property",
    "init_handler": "property",
    "msamp_recipe_handler": "property",
    "profile_handler": "property",
    "scaler_handler": "property",
    "te_recipe_handler": "property",
    "free_memory": "(self, *objects)",
    "gather": "(self, tensor)",
    "gather_for_metrics": "(self, input_data, use_gather_object=False)",
    "get_state_dict": "(self, model, unwrap=True)",
    "get_tracker": "(self, name, unwrap=False)",
    "gradient_accumulation_steps": "property+setter",
    "init_trackers": "(self, project_name, config=None, init_kwargs=None)",
    "is_fsdp2": "property",
    "is_last_process": "property",
    "is_local_main_process": "property",
    "is_main_process": "property",
    "join_uneven_inputs": "(self, joinables, even_batches=None)",
    "load_state": "(self, input_dir=None, load_kwargs=None, *, fork=False, **kwargs)",
    "local_main_process_first": "(self)",
    "local_process_index": "property",
    "log": "(self, values, step=None, log_kwargs=None)",
    "log_with": "property",
    "logging_dir": "property",
    "main_process_first": "(self)",
    "multi_device": "property",
    "native_amp": "property",
    "no_sync": "(self, model)",
    "non_blocking": "property",
    "num_processes": "property",
    "on_last_process": "(self, function=None)",
    "on_local_main_process": "(self, function=None)",
    "on_local_process": "(self, function=None, local_process_index=None)",
    "on_main_process": "(self, function=None)",
    "on_process": "(self, function=None, process_index=None)",
    "optimizer_step_was_skipped": "property",
    "pad_across_processes": "(self, tensor, dim=0, pad_index=0, pad_first=False)",
    "parallelism_config": "property",
    "preemption_requested": "property",  # issue 25
    "prepare": "(self, *args, device_placement=None)",
    "prepare_data_loader": "(self, data_loader, device_placement=None, slice_fn_for_dispatch=None)",
    "prepare_model": "(self, model, device_placement=None, evaluation_mode=False)",
    "prepare_optimizer": "(self, optimizer, device_placement=None)",
    "prepare_scheduler": "(self, scheduler)",
    "print": "(self, *args, **kwargs)",
    "process_index": "property",
    "profile": "(self, profile_handler=None)",
    "project_dir": "property",
    "reduce": "(self, tensor, reduction='sum', scale=1.0)",
    "register_for_checkpointing": "(self, *objects)",
    "register_load_state_pre_hook": "(self, hook)",
    "register_save_state_pre_hook": "(self, hook)",
    "save": "(self, obj, f, safe_serialization=False)",
    "save_iteration": "property",
    "should_save": "(self)",  # issue 25
    "not_a_hang": "(self)",  # issue 39: the watchdog's "not a hang" block
    "save_model": "(self, model, save_directory, max_shard_size='10GB', safe_serialization=True)",
    "save_state": "(self, output_dir=None, safe_serialization=True, *, async_save=None, **kwargs)",
    # An instance attribute before the parts existed; now a property over the registry.
    "scaler": "property+setter",
    "set_trigger": "(self)",
    "should_save_model": "property",
    "skip_first_batches": "(self, dataloader, num_batches=0)",
    "split_batches": "property",
    "split_between_processes": "(self, inputs, apply_padding=False)",
    "step": "property+setter",
    "step_scheduler_with_optimizer": "property+setter",
    "sync_gradients": "property+setter",
    "torch_device_mesh": "property",
    "trackers": "property",
    "trigger_sync_in_backward": "(self, model)",
    "unscale_gradients": "(self, optimizer=None)",
    "unwrap_model": "(self, model, keep_fp32_wrapper=True, keep_torch_compile=True)",
    "use_distributed": "property",
    "use_fp16": "property",
    "use_seedable_sampler": "property",
    "use_stateful_dataloader": "property",
    "wait_for_checkpoints": "(self)",
    "wait_for_snapshot": "(self)",  # issue 29: the fence of overlapped async saves
    "wait_for_everyone": "(self)",
}

# What Accelerate scripts read on an instance (assigned in __init__, not class members).
INSTANCE_ATTRIBUTES = [
    "state",
    "gradient_state",
    "dataloader_config",
    "project_configuration",
    "kwargs_handlers",
    "mixed_precision",
    "rng_types",
    "dynamo_plugin",
    "_models",
    "_optimizers",
    "_schedulers",
    "_dataloaders",
]


def _surface(cls: type) -> dict[str, str]:
    surface = {}
    for name in dir(cls):
        if name.startswith("_") and name != "__init__":
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, property):
            surface[name] = "property+setter" if member.fset else "property"
        elif callable(member):
            signature = inspect.signature(getattr(cls, name))
            params = [
                p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
            ]
            bare = signature.replace(parameters=params, return_annotation=inspect.Signature.empty)
            surface[name] = str(bare)
    return surface


def test_public_surface_is_unchanged() -> None:
    surface = _surface(Accelerator)
    assert sorted(surface) == sorted(PUBLIC_SURFACE), set(surface) ^ set(PUBLIC_SURFACE)
    changed = {n: (PUBLIC_SURFACE[n], s) for n, s in surface.items() if s != PUBLIC_SURFACE[n]}
    assert changed == {}


def test_every_public_member_is_documented() -> None:
    undocumented = [
        name
        for name in PUBLIC_SURFACE
        if name != "__init__"  # documented in the class docstring's Args
        and not (inspect.getattr_static(Accelerator, name).__doc__ or "").strip()
    ]
    assert undocumented == []
    assert "log_with:" in (Accelerator.__doc__ or "")


def test_delegated_members_keep_their_signature_for_binding() -> None:
    # The forwarded methods bind like the reference's: a wrong keyword fails at the call.
    acc = Accelerator(cpu=True)
    with pytest.raises(TypeError, match="process_indx"):
        acc.on_process(print, process_indx=0)  # type: ignore[call-arg]
    assert acc.reduce(torch.tensor([2.0]), reduction="mean").item() == 2.0


def test_instance_state_scripts_read_is_there_and_pickles() -> None:
    acc = Accelerator(cpu=True)
    model, optimizer = acc.prepare(
        torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    )
    for name in INSTANCE_ATTRIBUTES:
        assert hasattr(acc, name), name
    # The reference's registry lists are the registry the parts share, not copies.
    assert acc._models == [model] and acc._optimizers == [optimizer]
    acc.free_memory()
    assert acc._models == [] and acc._optimizers == []
    # Settings scripts change after construction reach the part that uses them.
    acc.step_scheduler_with_optimizer = False
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    _, scheduler = acc.prepare(sgd, torch.optim.lr_scheduler.StepLR(sgd, step_size=1))
    assert scheduler.step_with_optimizer is False
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    assert acc._prepared.scaler is acc.scaler
    copy = pickle.loads(pickle.dumps(acc))
    assert copy.num_processes == acc.num_processes and copy.device == acc.device


def _plain_class(node: ast.ClassDef) -> bool:
    """Not a dataclass, NamedTuple, TypedDict, Protocol or Enum (whose annotations are fields)."""
    names = {ast.unparse(d).split("(")[0].split(".")[-1] for d in node.decorator_list}
    bases = {ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases}
    fields = {"dataclass", "NamedTuple", "TypedDict", "Protocol", "Enum", "IntEnum", "BaseModel"}
    return not (names & fields or bases & fields or any("Enum" in b for b in bases))


def _assigned_on_self(node: ast.ClassDef) -> set[str]:
    assigned = set()
    for sub in ast.walk(node):
        targets: list[ast.expr] = []
        if isinstance(sub, (ast.Assign,)):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        for target in targets:
            elements = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
            for t in elements:  # self.x = ..., not self.x.y = ... (that writes x's attribute)
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) in ("self", "cls"):
                    assigned.add(t.attr)
    return assigned


def _foreign_declarations(source: str) -> list[str]:
    """Class-body annotations that the class never assigns (it declares a host's attributes),
    and ``if TYPE_CHECKING`` blocks in a class body (stubs of a host's methods)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        own = _assigned_on_self(node)
        for stmt in node.body:
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                found.append(f"{node.name}: if TYPE_CHECKING stubs")
            if (
                isinstance(stmt, ast.AnnAssign)
                and stmt.value is None
                and isinstance(stmt.target, ast.Name)
                and "ClassVar" not in ast.unparse(stmt.annotation)
                and _plain_class(node)
                and stmt.target.id not in own
            ):
                found.append(f"{node.name}.{stmt.target.id}")
    return found


def test_the_checker_sees_a_mixin_declaring_its_hosts_attributes() -> None:
    mixin = (
        "class Mixin:\n"
        "    _models: list[int]\n"
        "    if TYPE_CHECKING:\n"
        "        def unwrap_model(self) -> None: ...\n"
        "    def count(self) -> int:\n"
        "        self._models.append(1)\n"
        "        return len(self._models)\n"
    )
    assert _foreign_declarations(mixin) == ["Mixin._models", "Mixin: if TYPE_CHECKING stubs"]
    owner = "class Owner:\n    size: int\n    def __init__(self) -> None:\n        self.size = 1\n"
    assert _foreign_declarations(owner) == []


def test_no_module_declares_another_classs_attributes() -> None:
    package = Path(accelkit.__file__).parent
    found: dict[str, Any] = {}
    for path in sorted(package.rglob("*.py")):
        declared = _foreign_declarations(path.read_text(encoding="utf-8"))
        if declared:
            found[str(path.relative_to(package))] = declared
    assert found == {}


def test_the_attributes_accelerate_scripts_read_exist() -> None:
    """``config_yaml_templates/run_me.py`` reads ``fp8_recipe_handler``; the handler views
    give back what ``kwargs_handlers`` holds, as Accelerate's attributes do."""
    from accelkit.utils import DistributedDataParallelKwargs, GradScalerKwargs, ProfileKwargs

    plain = Accelerator(cpu=True)
    for name in ("fp8_recipe_handler", "te_recipe_handler", "ao_recipe_handler"):
        assert getattr(plain, name) is None
    assert (plain.has_fp8_handler, plain.fp8_enabled, plain.has_lomo_optimizer) == (
        False,
        False,
        False,
    )
    assert plain.ddp_handler is None and plain.profile_handler is None
    ddp = DistributedDataParallelKwargs(find_unused_parameters=True)
    profile = ProfileKwargs(activities=["cpu"])
    given = Accelerator(cpu=True, kwargs_handlers=[ddp, profile, GradScalerKwargs()])
    assert given.ddp_handler is ddp and given.profile_handler is profile
    assert isinstance(given.scaler_handler, GradScalerKwargs) and given.init_handler is None
