"""Config files of ``accelerate config``, read by ``accelkit launch`` and written by
``accelkit config``.

The file is YAML (JSON is YAML too, which is what ``accelerate config default`` writes). Its
default place is the reference tool's: ``$HF_HOME/accelerate/default_config.yaml``, with
``HF_HOME`` defaulting to ``$XDG_CACHE_HOME/huggingface`` and that to ``~/.cache/huggingface``.
As in the reference, ``--config_file`` is always read and the default file is read unless
``--cpu`` is given; a flag on the command line wins over the file.

Keys map to launch flags (``use_cpu`` -> ``--cpu``; ``fsdp_config``, ``dynamo_config`` entries ->
``--fsdp_*``, ``--dynamo_*``); ``distributed_type`` picks ``--multi_gpu`` or ``--use_fsdp``.
A key for a refused feature is refused with its reason unless its value asks for nothing, as the
``tpu_use_cluster: false`` in every default file does.

A config file is read as untrusted input, within bounds far above what ``accelerate config``
writes (a few hundred bytes, two levels, no anchors): a regular file of at most 1 MiB of UTF-8
text, at most 16 levels deep and 10,000 values with every YAML alias expanded (counted while the
document is composed, so an alias bomb is refused before anything walks it), with distinct text
keys. Anything else is a :class:`~accelkit.errors.ConfigurationError` (a ``ValueError``) of one
line naming the file and what is wrong.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Literal

from accelkit._text import clip, short
from accelkit.errors import ConfigurationError
from accelkit.launch.flags import Setting, refusal_for
from accelkit.runtime.environment import parse_mixed_precision

__all__ = [
    "default_config_path",
    "default_settings",
    "read_config_file",
    "write_basic_config",
    "write_config_file",
]

# Top-level keys that map to a flag of another name; the other top-level keys are flag names.
_RENAMED = {"use_cpu": "cpu"}
# Keys of the reference's ClusterConfig that are not flags, handled here.
_STRUCTURE = {"compute_environment", "distributed_type"}
_SECTIONS = {  # nested sections: their keys become flags with this prefix
    "fsdp_config": "fsdp_",
    "dynamo_config": "dynamo_",
    "fp8_config": "fp8_",
    "deepspeed_config": "deepspeed_",
    "megatron_lm_config": "megatron_lm_",
    "parallelism_config": "parallelism_config_",
    "mpirun_config": "mpirun_",
}
# Settings of `accelerate tpu-config` kept in the same file: TPU settings.
_TPU_KEYS = {"tpu_name", "tpu_zone", "tpu_vm", "tpu_env", "commands", "command_file"}
_TOP_LEVEL = {
    "mixed_precision", "use_cpu", "debug", "num_processes", "machine_rank", "num_machines",
    "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
    "main_training_function", "enable_cpu_affinity", "downcast_bf16", "tpu_use_cluster",
    "tpu_use_sudo",
    "num_cpu_threads_per_process", "max_restarts", "monitor_interval", "tee", "log_dir", "role",
    "rdzv_conf", "module", "no_python", "quiet",
}  # fmt: skip
_DISTRIBUTED_TYPES = {
    "NO": {},
    "MULTI_CPU": {},
    "MULTI_GPU": {"multi_gpu": True},
    "FSDP": {"use_fsdp": True},
}
_REFUSED_TYPES = {
    "DEEPSPEED": "DeepSpeed is not supported by accelkit; use distributed_type FSDP.",
    "MEGATRON_LM": "Megatron-LM is not supported by accelkit (out of scope).",
    "XLA": "TPU/XLA execution is out of scope for accelkit.",
    "TPU": "TPU/XLA execution is out of scope for accelkit.",
}


def default_config_path() -> str:
    """Where ``accelerate config`` puts its file, and where ``accelkit launch`` looks for it."""
    hf_home = os.environ.get(
        "HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    )
    return os.path.join(os.path.expanduser(hf_home), "accelerate", "default_config.yaml")


# What a config file may be. Accelerate's own files are under 1 KB, two levels deep, with some
# fifty values and no anchors; these bounds are far above that and far below a hang.
MAX_CONFIG_BYTES = 1 << 20  # 1 MiB
_MAX_DEPTH = 16
_MAX_VALUES = 10_000  # nodes of the document with every alias expanded
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _read_text(path: str) -> str:
    """The file's text: a regular file of at most :data:`MAX_CONFIG_BYTES` bytes of UTF-8."""
    try:
        # O_NONBLOCK: opening a named pipe nobody writes to would block forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigurationError(
            f"Config file {path!r} does not exist. Write one with `accelkit config` (or "
            "`accelkit config default`), or pass an existing file to --config_file."
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"Config file {path!r} cannot be opened: {exc.strerror}."
        ) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            # A device (/dev/zero) never ends; a folder or a socket is not a file at all.
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigurationError(
                f"Config file {path!r} is {kind}; pass the path of an `accelerate config` "
                "YAML file."
            )
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigurationError(
            f"Config file {path!r} is larger than {MAX_CONFIG_BYTES} bytes (1 MiB); a launch "
            "config file is a few hundred bytes. Pass the `accelerate config` YAML file."
        )
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigurationError(
            f"Config file {path!r} is not a text file (it holds a NUL byte at offset {nul}); "
            "pass the `accelerate config` YAML file."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigurationError(
            f"Config file {path!r} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8."
        ) from None
    return text.removeprefix("\ufeff")


class _Refused(Exception):
    """A document outside the bounds, raised while composing it."""


def _bounded_loader() -> type[Any]:
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """PyYAML's safe loader, composing at most ``_MAX_DEPTH`` levels and ``_MAX_VALUES``
        nodes counted with every alias expanded (an alias costs what it stands for), so that
        nested aliases (9 aliases of 9 aliases of ...) are refused instead of being expanded
        by whatever walks the result."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self._depth = 0
            self._sizes: dict[int, int] = {}  # id(node) -> nodes with aliases expanded

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                node = super().compose_node(parent, index)
                if id(node) not in self._sizes:
                    raise _Refused("an alias refers to a value that contains it (a cycle)")
                return node
            self._depth += 1
            if self._depth > _MAX_DEPTH:
                raise _Refused(f"values are nested more than {_MAX_DEPTH} levels deep")
            try:
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if isinstance(node, yaml.MappingNode):
                children = [part for pair in node.value for part in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = []
            size = 1 + sum(self._sizes[id(child)] for child in children)
            if size > _MAX_VALUES:
                raise _Refused(
                    f"it holds more than {_MAX_VALUES} values once its aliases (*name) are expanded"
                )
            self._sizes[id(node)] = size
            return node

        def construct_object(self, node: Any, deep: bool = False) -> Any:
            try:
                return super().construct_object(node, deep)
            except (ValueError, OverflowError):
                # PyYAML converts with int(), float(), base64: a 5,000-digit number, for one,
                # ends here. Said with the value's place, as every other YAML error is.
                kind = str(node.tag).rsplit(":", 1)[-1]
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"this {kind} cannot be converted (too long or malformed)",
                    node.start_mark,
                ) from None

    return BoundedLoader


def _yaml_problem(exc: Exception) -> str:
    """One line saying what PyYAML found wrong, and where."""
    import yaml
    from yaml.reader import ReaderError

    if isinstance(exc, yaml.MarkedYAMLError):
        problem = " ".join(part for part in (exc.context, exc.problem) if part)
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return f"{clip(problem, 200)}{where}"
    if isinstance(exc, ReaderError):
        return f"character #x{exc.character:04x} at position {exc.position} is not allowed in YAML"
    return clip(str(exc), 200)


def _check_keys(path: str, root: Any) -> None:
    """Every mapping's keys are distinct strings: refuse the first that is not, by name."""
    import yaml

    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, where) for item in node.value)
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        place = f"in {where}" if where else "at the top level"
        names: set[str] = set()
        for key, value in node.value:
            if key.tag == _MERGE_TAG:
                stack.append((value, where))
                continue
            if not isinstance(key, yaml.ScalarNode):
                kind = "a list" if isinstance(key, yaml.SequenceNode) else "a mapping"
                raise ConfigurationError(
                    f"Config file {path!r}: a key {place} (line {key.start_mark.line + 1}) is "
                    f"{kind}; keys are setting names such as num_processes."
                )
            if key.tag != _STR_TAG:
                kind = key.tag.rsplit(":", 1)[-1]
                raise ConfigurationError(
                    f"Config file {path!r}: the key {short(key.value)} {place} (line "
                    f"{key.start_mark.line + 1}) is read as {'a' if kind != 'int' else 'an'} "
                    f"{kind}, not a setting name; keys are names such as num_processes (quote "
                    "it if it is meant as text)."
                )
            if key.value in names:
                raise ConfigurationError(
                    f"Config file {path!r}: the key {short(key.value)} appears twice {place} "
                    f"(line {key.start_mark.line + 1}); keep one."
                )
            names.add(key.value)
            stack.append((value, f"{where}.{key.value}" if where else key.value))


def _load(path: str) -> dict[str, Any]:
    import yaml

    text = _read_text(path)
    try:
        loader = _bounded_loader()(text)
    except yaml.YAMLError as exc:  # the reader refuses control characters at once
        raise ConfigurationError(
            f"Config file {path!r} is not valid YAML: {_yaml_problem(exc)}."
        ) from None
    try:
        try:
            node = loader.get_single_node()
        except _Refused as exc:
            raise ConfigurationError(
                f"Config file {path!r} is refused: {exc}; a launch config file is a short "
                "mapping of settings."
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigurationError(
                f"Config file {path!r} is not valid YAML: {_yaml_problem(exc)}."
            ) from None
        if node is None:
            return {}
        if not isinstance(node, yaml.MappingNode):
            kind = "a list" if isinstance(node, yaml.SequenceNode) else "a single value"
            raise ConfigurationError(
                f"Config file {path!r} must hold a mapping of settings (key: value lines), "
                f"got {kind}."
            )
        _check_keys(path, node)
        try:
            data = loader.construct_document(node)
        except yaml.YAMLError as exc:
            raise ConfigurationError(
                f"Config file {path!r} is not valid YAML: {_yaml_problem(exc)}."
            ) from None
    finally:
        loader.dispose()
    return dict(data)


def read_config_file(path: str) -> dict[str, Setting]:
    """The launch settings in the config file at ``path``, by flag name.

    Raises:
        ConfigurationError: (a ``ValueError``) the file is missing or malformed, or asks
            for something accelkit refuses (naming the file, the key and the reason).
    """
    data = _load(path)

    def origin(key: str) -> str:
        # A key is named as it is when it looks like one, and cut short when it does not.
        return f"config file {path}: {key if len(key) <= 80 and key.isprintable() else short(key)}"

    settings: dict[str, Setting] = {}
    environment = str(data.get("compute_environment", "LOCAL_MACHINE"))
    if environment != "LOCAL_MACHINE":
        raise ConfigurationError(
            f"{origin('compute_environment')} ({environment!r}): only LOCAL_MACHINE is "
            "supported (launching on Amazon SageMaker is not)."
        )
    kind = data.get("distributed_type", "NO")
    # YAML 1.1 reads an unquoted NO as false; the reference quotes it, a hand-written file may not.
    kind = "NO" if kind is False else str(kind).upper()
    if kind in _REFUSED_TYPES:
        raise ConfigurationError(f"{origin('distributed_type')} ({kind!r}): {_REFUSED_TYPES[kind]}")
    if kind not in _DISTRIBUTED_TYPES:
        raise ConfigurationError(
            f"{origin('distributed_type')} ({kind!r}) is not supported; accelkit runs "
            f"{', '.join(_DISTRIBUTED_TYPES)} (CPUs and CUDA GPUs)."
        )
    for flag, value in _DISTRIBUTED_TYPES[kind].items():
        settings[flag] = Setting(value, origin("distributed_type"))
    for key, value in data.items():
        if key in _STRUCTURE or value is None:
            continue
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ConfigurationError(f"{origin(key)} must be a mapping, got {value!r}.")
            prefix = _SECTIONS[key]
            for sub, sub_value in value.items():
                flag = sub if sub.startswith(prefix) else prefix + sub
                settings[flag] = Setting(sub_value, origin(f"{key}.{sub}"))
            continue
        flag = _RENAMED.get(key, key)
        if key in _TPU_KEYS:
            flag = key if key.startswith("tpu_") else f"tpu_{key}"
        elif key not in _TOP_LEVEL and refusal_for(key) is None:
            raise ConfigurationError(
                f"{origin(key)} is not a setting of `accelerate launch` that accelkit knows; "
                "remove it from the file."
            )
        settings[flag] = Setting(value, origin(key))
    return settings


def write_config_file(path: str, settings: dict[str, Any]) -> None:
    """Write ``settings`` (reference key names) to ``path`` as YAML, creating its folder.

    Raises:
        FileExistsError: ``path`` exists, or is a symbolic link (the caller decides whether to
            overwrite).
        OSError: the folder cannot be created or written; nothing is left behind.
    """
    import yaml

    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:  # a file has the folder's name: not "the config file exists"
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), folder) from None
    text = yaml.safe_dump(settings, sort_keys=True)
    # Written whole under a temporary name, then linked to its name: link() fails if anything,
    # a dangling symbolic link included, already has the name (it never follows one), and no
    # reader ever sees half a file, whatever stops this process. Created with mode 0o666 less
    # the umask (and as the folder's default ACL says), as any new file: a config file may
    # hold secrets, and a umask of 077 keeps it the user's own.
    temporary = os.path.join(folder, f".accelkit-config-{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(temporary, flags | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(temporary, path)
    finally:
        os.unlink(temporary)


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())


def default_settings(mixed_precision: str = "no", gpus: int | None = None) -> dict[str, Any]:
    """The settings for this machine that ``accelkit config default`` and
    :func:`write_basic_config` write: every GPU here, or one CPU process."""
    gpus = _gpu_count() if gpus is None else gpus
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
        "mixed_precision": mixed_precision,
        "num_processes": max(gpus, 1),
        "num_machines": 1,
        "machine_rank": 0,
        "use_cpu": gpus == 0,
        "debug": False,
        "enable_cpu_affinity": False,
        "rdzv_backend": "static",
        "same_network": True,
    }


def write_basic_config(
    mixed_precision: str = "no", save_location: str | None = None
) -> Literal[False] | Path:
    """Write the launch config file for this machine, as ``accelkit config default`` does
    (Accelerate's ``write_basic_config``): every GPU here, or one CPU process.

    An existing file is kept: a message says so and False is returned.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        save_location: where to write (default: :func:`default_config_path`, where
            ``accelkit launch`` and ``accelerate launch`` look); pass it to ``--config_file``
            otherwise.

    Returns:
        The path written, or False when the file already existed.

    Raises:
        ValueError: for another ``mixed_precision`` (``"fp8"`` is out of scope).
    """
    precision = parse_mixed_precision(mixed_precision.lower()).value
    path = Path(save_location or default_config_path())
    try:
        write_config_file(str(path), default_settings(precision))
    except FileExistsError:
        print(
            f"Configuration already exists at {path}, will not override. Run `accelkit config` "
            "or pass a different save_location."
        )
        return False
    return path
