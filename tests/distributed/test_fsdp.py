"""FSDP2 sharded training and sharded checkpoints, on real gloo process groups (CPU).

Three multi-process jobs in all (4 processes on 2 cores is slow, so each job checks several
things): FSDP on 2 processes against DDP (+ bad input); FSDP on 4 processes against DDP, then a
sharded save; a resume of that save on 2 processes (+ an incomplete copy refused).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from accelkit.checkpointing.errors import CheckpointMismatchError, CorruptCheckpointError
from accelkit.checkpointing.storage import get_storage
from accelkit.fsdp.runtime import FullyShardedDataParallelPlugin
from tests.helpers.distributed import run_distributed

VOCAB, DIM, SEQ, GLOBAL_BATCH, STEPS = 16, 16, 8, 8, 4


class Block(nn.Module):
    """A pre-norm transformer block (single-head causal attention + MLP)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)


def _plugin() -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"])


def _train(kind: str, steps: int = STEPS) -> dict[str, Any]:
    """Train TinyLM with DDP or FSDP on this process's slice of each global batch."""
    import torch.distributed as dist

    from accelkit.fsdp import runtime as fsdp
    from accelkit.runtime.state import PartialState

    state = PartialState()
    rank, world = state.process_index, state.num_processes
    torch.manual_seed(0)
    model: nn.Module = TinyLM()
    # Created before sharding on purpose: prepare must re-point it to the sharded parameters.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if kind == "fsdp":
        runtime = fsdp.FSDPRuntime(_plugin(), state.device, "no")
        model = runtime.prepare_model(model, [optimizer])
    else:
        model = nn.parallel.DistributedDataParallel(model)
    losses, norms = [], []
    for batch in _data()[:steps]:
        local = batch[rank::world]
        logits = model(local[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1))
        loss.backward()
        norms.append(float(fsdp.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return {"model": model, "optimizer": optimizer, "losses": losses, "norms": norms}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from accelkit.fsdp import runtime as fsdp

    state = fsdp.get_state_dict(model)  # gathered on rank 0, {} elsewhere for a sharded model
    return {k.removeprefix("module."): v.detach().clone() for k, v in state.items()}


def _job_two_processes() -> dict[str, Any]:
    from accelkit.fsdp import runtime as fsdp

    ddp = _train("ddp")
    sharded = _train("fsdp")
    model = sharded["model"]
    out: dict[str, Any] = {
        "ddp": ddp["losses"],
        "fsdp": sharded["losses"],
        "ddp_norms": ddp["norms"],
        "fsdp_norms": sharded["norms"],
        "is_sharded": fsdp.is_sharded(model),
        "units": sum(fsdp.is_sharded(m) for m in model.modules()),
        "local_rows": model.embed.weight.to_local().shape[0],
    }
    ddp_params = _full_params(ddp["model"])
    fsdp_params = _full_params(model)
    out["max_param_diff"] = max(
        ((ddp_params[k] - fsdp_params[k]).abs().max().item() for k in fsdp_params), default=None
    )
    out["full_keys"] = sorted(fsdp_params)
    # bf16 mixed precision: compute in bf16, sharded parameters (and the update) stay fp32.
    torch.manual_seed(0)
    mixed = TinyLM()
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], mixed_precision_policy="bf16"
    )
    fsdp.FSDPRuntime(plugin, torch.device("cpu"), "no").prepare_model(mixed)
    tokens = _data()[0][:, :-1]
    logits = mixed(tokens)
    logits.float().mean().backward()
    out["bf16"] = (
        str(logits.dtype),
        str(mixed.embed.weight.dtype),
        str(mixed.embed.weight.grad.dtype),
        bool(mixed.embed.weight.grad.to_local().abs().sum() > 0),
    )
    # An optimizer that has already stepped cannot follow its parameters into shards.
    torch.manual_seed(0)
    late = TinyLM()
    stepped = torch.optim.Adam(late.parameters())
    late(torch.zeros(1, SEQ, dtype=torch.long)).sum().backward()
    stepped.step()
    runtime = fsdp.FSDPRuntime(_plugin(), torch.device("cpu"), "no")
    try:
        runtime.prepare_model(late, [stepped])
        out["stepped_error"] = None
    except RuntimeError as exc:
        out["stepped_error"] = str(exc)
    return out


def test_fsdp_two_processes_matches_ddp() -> None:
    r0, r1 = run_distributed(_job_two_processes, world_size=2, timeout=240)
    assert r0["fsdp"] == pytest.approx(r0["ddp"], rel=1e-4, abs=1e-5)
    assert r0["fsdp"][-1] < r0["fsdp"][0]  # it trains
    assert r0["fsdp_norms"] == pytest.approx(r0["ddp_norms"], rel=1e-4)
    assert r1["fsdp_norms"] == r0["fsdp_norms"]  # the norm is the same on every process
    assert r0["is_sharded"] and r0["units"] == 3  # two Block units + the root
    assert r0["local_rows"] == VOCAB // 2  # each process holds half of the embedding
    assert r0["max_param_diff"] < 2e-3  # AdamW turns float-rounding gaps into ~lr-sized steps
    assert "embed.weight" in r0["full_keys"] and r1["full_keys"] == []
    assert r0["bf16"] == ("torch.bfloat16", "torch.float32", "torch.float32", True)
    assert "already holds state" in r0["stepped_error"]
    assert "prepare(model, optimizer)" in r0["stepped_error"]


def _job_save_on_four(folder: str) -> dict[str, Any]:
    import torch.distributed as dist

    from accelkit.checkpointing import sharded
    from accelkit.fsdp import runtime as fsdp

    ddp = _train("ddp")
    run = _train("fsdp")
    storage = get_storage(folder)
    targets = sharded.sharded_targets([run["model"]], [run["optimizer"]])
    entries = sharded.save_sharded(storage, folder, targets)
    optim_full = fsdp.get_optimizer_state_dict(run["model"], run["optimizer"], True)
    return {
        "ddp": ddp["losses"],
        "fsdp": run["losses"],
        "entries": [(e.path, e.size, e.checksum) for e in entries],
        "params": _full_params(run["model"]),
        "exp_avg": optim_full["state"]["embed.weight"]["exp_avg"] if dist.get_rank() == 0 else None,
    }


def _job_resume_on_two(folder: str, broken: str, damaged: str, world_saved: int) -> dict[str, Any]:
    import torch.distributed as dist

    from accelkit.checkpointing import sharded
    from accelkit.checkpointing.formats.manifest import FileEntry, Manifest
    from accelkit.fsdp import runtime as fsdp
    from accelkit.runtime.state import PartialState

    state = PartialState()
    torch.manual_seed(99)  # different initial weights: everything must come from the checkpoint
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp.FSDPRuntime(_plugin(), state.device, "no").prepare_model(model, [optimizer])
    storage = get_storage(folder)
    targets = sharded.sharded_targets([model], [optimizer])
    entries = [FileEntry(p, s, c) for p, s, c in storage_entries(storage, folder)]
    manifest = Manifest(iteration=0, step=STEPS, world_size=world_saved, files=entries)
    sharded.load_sharded(storage, folder, targets, manifest)
    optim_full = fsdp.get_optimizer_state_dict(model, optimizer, True)
    out: dict[str, Any] = {
        "params": _full_params(model),
        "exp_avg": optim_full["state"]["embed.weight"]["exp_avg"] if dist.get_rank() == 0 else None,
        "local_rows": model.embed.weight.to_local().shape[0],
        "tensors": sharded.list_sharded_tensors(storage, folder),
    }
    # The copy lacks rank 3's shard: refused before anything is read, naming the file.
    try:
        sharded.load_sharded(get_storage(broken), broken, targets, manifest)
        out["incomplete_error"] = None
    except CorruptCheckpointError as exc:
        out["incomplete_error"] = str(exc)
    # A damaged shard (same size) fails the checksum check and leaves the model untouched.
    torch.manual_seed(99)
    other = TinyLM()
    fsdp.FSDPRuntime(_plugin(), state.device, "no").prepare_model(other)
    before = _full_params(other)
    try:
        sharded.load_sharded(
            get_storage(damaged), damaged, sharded.sharded_targets([other], []), manifest, True
        )
        out["damaged_error"] = None
    except CorruptCheckpointError as exc:
        out["damaged_error"] = str(exc)
    after = _full_params(other)
    out["untouched"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


def storage_entries(storage: Any, folder: str) -> list[tuple[str, int, str]]:
    from accelkit.checkpointing.formats.manifest import file_checksum

    out = []
    for rel, size in storage.walk_files(folder).items():
        _, checksum = file_checksum(storage, f"{folder}/{rel}", "sha256")
        out.append((rel, size, checksum))
    return out


def test_fsdp_four_processes_matches_ddp_and_resumes_on_two(tmp_path: Path) -> None:
    folder = str(tmp_path / "checkpoint_0")
    saved = run_distributed(_job_save_on_four, folder, world_size=4, timeout=300)
    assert saved[0]["fsdp"] == pytest.approx(saved[0]["ddp"], rel=1e-4, abs=1e-5)
    entries = saved[0]["entries"]
    assert all(r["entries"] == entries for r in saved)  # gathered: every process has the list
    names = sorted(path for path, _, _ in entries)
    assert names == ["sharded/.metadata"] + [f"sharded/__{r}_0.distcp" for r in range(4)]
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "checkpoint_0" / "sharded").iterdir()}
    assert {f"sharded/{n}": s for n, s in on_disk.items()} == {p: s for p, s, _ in entries}

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    os.remove(broken / "sharded" / "__3_0.distcp")
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    with open(damaged / "sharded" / "__1_0.distcp", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = run_distributed(
        _job_resume_on_two, folder, str(broken), str(damaged), 4, world_size=2
    )
    before, after = saved[0]["params"], resumed[0]["params"]
    assert sorted(after) == sorted(before)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert torch.equal(saved[0]["exp_avg"], resumed[0]["exp_avg"])
    assert resumed[0]["local_rows"] == VOCAB // 2  # resharded from quarters to halves
    tensors = dict((n, (d, s)) for n, d, s in resumed[0]["tensors"])
    assert tensors["model.embed.weight"] == ("float32", (VOCAB, DIM))
    from accelkit.checkpointing.sharded import sharded_tensor_infos

    rows = {t.name: t for t in sharded_tensor_infos(get_storage(folder), folder)}
    embed = rows["model.embed.weight"]
    assert (embed.dtype, embed.shape, embed.nbytes) == ("F32", (VOCAB, DIM), VOCAB * DIM * 4)
    assert rows["optimizer.state.embed.weight.exp_avg"].shape == (VOCAB, DIM)
    for r in resumed:
        assert "__3_0.distcp (rank 3)" in r["incomplete_error"]
        assert "earlier checkpoint" in r["incomplete_error"]
        assert "sharded/__1_0.distcp (checksum" in r["damaged_error"]
    assert resumed[0]["untouched"]


def test_bad_options_name_the_value_and_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fsdp_version=1.*FSDP2"):
        FullyShardedDataParallelPlugin(fsdp_version=1)
    with pytest.raises(ValueError, match=r"auto_wrap_policy='layer_wrap'.*size_based_wrap"):
        FullyShardedDataParallelPlugin(auto_wrap_policy="layer_wrap")
    with pytest.raises(ValueError, match="min_num_params"):
        FullyShardedDataParallelPlugin(auto_wrap_policy="size_based_wrap")
    with pytest.raises(ValueError, match=r"FULL_STATE_DICT.*save_model"):
        FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT")
    lacking = FullyShardedDataParallelPlugin(fully_shard_kwargs={"shard_everything_twice": True})
    with pytest.raises(
        ValueError, match=rf"'shard_everything_twice'.*torch \({re.escape(torch.__version__)}\)"
    ):
        lacking.fully_shard_kwargs_for(torch.device("cpu"), "no")
    policy = FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtype": "bf16"})
    kwargs = policy.fully_shard_kwargs_for(torch.device("cpu"), "no")
    assert kwargs["mp_policy"].param_dtype == torch.bfloat16
    bad_mp = FullyShardedDataParallelPlugin(mixed_precision_policy={"param_dtyp": "bf16"})
    with pytest.raises(ValueError, match=r"mixed_precision_policy.param_dtyp"):
        bad_mp.fully_shard_kwargs_for(torch.device("cpu"), "no")
    offload = FullyShardedDataParallelPlugin(cpu_offload=True)
    with pytest.warns(UserWarning, match="cpu_offload.*ignored on a CPU run"):
        assert "offload_policy" not in offload.fully_shard_kwargs_for(torch.device("cpu"), "no")
    # A checkpoint without sharded state refuses sharded models, and the reverse.
    from accelkit.checkpointing import sharded

    storage = get_storage(str(tmp_path))
    (tmp_path / "plain").mkdir()
    (tmp_path / "fsdp" / "sharded").mkdir(parents=True)
    with pytest.raises(CheckpointMismatchError, match=r"saved without FSDP.*model.safetensors"):
        sharded.check_load_compatible(
            storage, str(tmp_path / "plain"), sharded.ShardedTargets(models={0: nn.Linear(1, 1)})
        )
    with pytest.raises(CheckpointMismatchError, match=r"no prepared model is sharded.*fsdp_plugin"):
        sharded.check_load_compatible(storage, str(tmp_path / "fsdp"), sharded.ShardedTargets())
    with pytest.raises(CorruptCheckpointError, match=r"\.metadata is missing"):
        sharded.read_sharded_metadata(storage, str(tmp_path / "fsdp" / "sharded"))


def test_accelerates_fsdp1_options_translate_warn_or_are_refused_by_name() -> None:
    import warnings

    from torch.distributed.fsdp import CPUOffload, ShardingStrategy, StateDictType

    plugin = FullyShardedDataParallelPlugin
    cpu = torch.device("cpu")
    # Positional arguments bind as in Accelerate: (fsdp_version, sharding_strategy, ...).
    grad_op = plugin(2, "SHARD_GRAD_OP")
    assert grad_op.reshard_after_forward is False
    assert grad_op.fully_shard_kwargs_for(cpu, "no")["reshard_after_forward"] is False
    assert plugin(sharding_strategy=ShardingStrategy.FULL_SHARD).reshard_after_forward is True
    assert plugin(sharding_strategy=2).reshard_after_forward is False
    assert plugin(reshard_after_forward="SHARD_GRAD_OP").reshard_after_forward is False
    assert plugin().reshard_after_forward is True and plugin().fsdp_version == 2
    with pytest.raises(ValueError, match=r"'FULL_SHARD' means reshard_after_forward=True"):
        plugin(sharding_strategy="FULL_SHARD", reshard_after_forward=False)
    with pytest.raises(ValueError, match=r"sharding_strategy='NO_SHARD'.*DDP"):
        plugin(sharding_strategy="NO_SHARD")
    with pytest.raises(ValueError, match=r"sharding_strategy='ZERO3' is unknown"):
        plugin(sharding_strategy="ZERO3")
    assert plugin(cpu_offload=CPUOffload(offload_params=True)).cpu_offload is True
    assert plugin(cpu_offload=CPUOffload()).cpu_offload is False
    for sharded in (StateDictType.SHARDED_STATE_DICT, 3, "sharded_state_dict"):
        assert plugin(state_dict_type=sharded).state_dict_type == "SHARDED_STATE_DICT"
    with pytest.raises(ValueError, match=r"LOCAL_STATE_DICT.*FSDP1-only"):
        plugin(state_dict_type=StateDictType.LOCAL_STATE_DICT)
    upper = plugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_cls_names_to_wrap="B")
    assert upper.auto_wrap_policy == "transformer_based_wrap"
    # What Accelerate's FSDP2 mode ignores is ignored with a warning; its no-op values are quiet.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin(backward_prefetch="NO_PREFETCH", use_orig_params=True, limit_all_gathers=True)
    with pytest.warns(UserWarning, match=r"backward_prefetch='BACKWARD_PRE'.*ignored"):
        plugin(backward_prefetch="BACKWARD_PRE")
    with pytest.warns(UserWarning, match=r"sync_module_states=True.*ignored"):
        plugin(sync_module_states=True)
    # A full state dict is what save_model writes: accepted (its FSDP1-only fields warn); the
    # other state-dict configs are ignored with a warning, as in Accelerate's FSDP2 mode.
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        ShardedStateDictConfig,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        assert plugin(state_dict_config=full).state_dict_config is full
    with pytest.warns(UserWarning, match=r"offload_to_cpu=False, rank0_only=False is ignored"):
        plugin(state_dict_config=FullStateDictConfig())
    with pytest.warns(UserWarning, match=r"ShardedStateDictConfig.*is ignored: save_state"):
        plugin(state_dict_config=ShardedStateDictConfig())
    with pytest.warns(UserWarning, match=r"optim_state_dict_config=.*is ignored: save_state"):
        plugin(optim_state_dict_config=FullOptimStateDictConfig())
    with pytest.raises(ValueError, match=r"expected a torch.distributed.fsdp StateDictConfig"):
        plugin(state_dict_config=object())
    # What FSDP2 cannot honour is refused by name.
    refused = {
        "forward_prefetch": True,
        "param_init_fn": lambda m: None,
        "ignored_modules": [nn.Linear(1, 1)],
        "activation_checkpointing": True,
        "cpu_ram_efficient_loading": True,
    }
    for option, value in refused.items():
        with pytest.raises(ValueError, match=rf"\({option}=.*is not supported.*Remove {option}"):
            plugin(**{option: value})


# ------------------------------------------------------------------ through the Accelerator


def _facade_run(project_dir: str, seed: int, resume: bool) -> dict[str, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    from accelkit import Accelerator, DistributedType, ProjectConfiguration
    from accelkit.fsdp.runtime import get_state_dict, is_sharded

    config = ProjectConfiguration(project_dir, automatic_checkpoint_naming=True)
    if resume:  # the plugin as `accelkit launch --use_fsdp --fsdp_...` describes it
        os.environ["ACCELKIT_USE_FSDP"] = "1"
        os.environ["ACCELKIT_FSDP_TRANSFORMER_CLS_NAMES_TO_WRAP"] = "Block"
        accelerator = Accelerator(project_config=config)
    else:
        accelerator = Accelerator(fsdp_plugin=_plugin(), project_config=config)
    torch.manual_seed(seed)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # before prepare, on purpose
    loader = DataLoader(TensorDataset(_data().reshape(-1, SEQ + 1)), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    out: dict[str, Any] = {
        "type": accelerator.distributed_type == DistributedType.FSDP,
        "units": sum(is_sharded(m) for m in model.modules()),
    }
    if resume:
        out["loaded"] = accelerator.load_state()
    losses = []
    for epoch in range(1 if resume else 2):
        for (batch,) in loader:
            logits = model(batch[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), "mean").item())
        if epoch == 0 and not resume:
            out["saved"] = accelerator.save_state()
    out["losses"] = losses
    out["params"] = get_state_dict(model)
    out["state_dict"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    accelerator.save_model(model, f"{project_dir}/final", max_shard_size="4KB")
    return out


def _job_facade(project_dir: str) -> dict[str, Any]:
    first = _facade_run(project_dir, seed=0, resume=False)
    second = _facade_run(project_dir, seed=7, resume=True)
    return {"first": first, "second": second}


def test_accelerator_fsdp_prepare_save_state_resume_save_model(tmp_path: Path) -> None:
    from accelkit.checkpointing import load_checkpoint_in_model
    from accelkit.checkpointing.formats.manifest import read_manifest

    project = str(tmp_path / "run")
    r0, r1 = run_distributed(_job_facade, project, world_size=2, timeout=240)
    first, second = r0["first"], r0["second"]
    assert first["type"] and second["type"]
    assert first["units"] == second["units"] == 3  # two Blocks + the root, also from the env
    assert second["loaded"] == first["saved"] == f"{project}/checkpoints/checkpoint_0"
    # Resumed from the end of epoch 0, epoch 1 is the same as in the uninterrupted run.
    assert second["losses"] == pytest.approx(first["losses"][len(second["losses"]) :], abs=1e-6)
    for name, value in first["params"].items():
        assert torch.allclose(value, second["params"][name], atol=1e-6), name
    manifest = read_manifest(get_storage(project), first["saved"])
    assert manifest is not None and manifest.world_size == 2
    listed = {e.path for e in manifest.files}
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= listed
    assert not any(p.startswith(("model", "optimizer")) for p in listed)  # not written twice
    # get_state_dict gathers full tensors to the main process only.
    assert set(first["state_dict"]) == set(first["params"]) and r1["first"]["state_dict"] == {}
    # save_model writes the same consolidated safetensors (sharded by size) as unsharded models.
    final = tmp_path / "run" / "final"
    assert (final / "model.safetensors.index.json").exists()
    plain = TinyLM()
    load_checkpoint_in_model(plain, str(final))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, second["params"][name]), name


# ------------------------------------------------------------------ fsspec storages


def _job_save_to_url(url: str, options: dict[str, Any]) -> dict[str, Any]:
    from accelkit.checkpointing import sharded

    run = _train("fsdp", steps=1)
    entries = sharded.save_sharded(
        get_storage(url, options), url, sharded.sharded_targets([run["model"]], [run["optimizer"]])
    )
    return {"params": _full_params(run["model"]), "entries": [(e.path, e.size) for e in entries]}


def _job_load_one_process(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """One process (a private 1-rank group): load the 2-process S3 save, round-trip memory://."""
    from accelkit.checkpointing import sharded
    from accelkit.fsdp import runtime as fsdp

    def fresh() -> tuple[nn.Module, Any]:
        torch.manual_seed(5)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters())
        fsdp.FSDPRuntime(_plugin(), torch.device("cpu"), "no").prepare_model(model, [optimizer])
        return model, optimizer

    model, optimizer = fresh()
    sharded.load_sharded(
        get_storage(url, options), url, sharded.sharded_targets([model], [optimizer])
    )
    from_s3 = _full_params(model)
    memory = "memory://accelkit-fsdp-test/checkpoint_0"
    sharded.save_sharded(get_storage(memory), memory, sharded.sharded_targets([model], [optimizer]))
    again, optimizer2 = fresh()
    sharded.load_sharded(
        get_storage(memory), memory, sharded.sharded_targets([again], [optimizer2])
    )
    return {"from_s3": from_s3, "from_memory": _full_params(again)}


def test_sharded_state_on_s3_and_memory(s3_server: Any, s3_url: str) -> None:
    options = s3_server.storage_options
    url = f"{s3_url}/checkpoint_0"
    saved = run_distributed(_job_save_to_url, url, options, world_size=2)
    names = sorted(p for p, _ in saved[0]["entries"])
    assert names == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
    listing = get_storage(url, options).walk_files(url)
    assert listing == dict(saved[0]["entries"])
    (loaded,) = run_distributed(_job_load_one_process, url, options, world_size=1)
    for name, value in saved[0]["params"].items():
        assert torch.equal(loaded["from_s3"][name], value), name
        assert torch.equal(loaded["from_memory"][name], value), name


def test_launch_flags_reach_the_workers_plugin() -> None:
    import argparse

    from accelkit.fsdp import runtime as fsdp

    parser = argparse.ArgumentParser()
    fsdp.add_launch_arguments(parser)
    args = parser.parse_args(
        [
            "--use_fsdp",
            "--fsdp_transformer_layer_cls_to_wrap",
            "Block,Head",
            "--fsdp_reshard_after_forward",
            "false",
            "--fsdp_offload_params",
            "true",
        ]
    )
    env = fsdp.launch_env(args)
    assert env[fsdp.ENV_USE_FSDP] == "1"
    plugin = fsdp.FullyShardedDataParallelPlugin.from_env(env)
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Head"]
    assert plugin.reshard_after_forward is False and plugin.cpu_offload is True
    assert fsdp.launch_env(parser.parse_args([])) == {}  # no --use_fsdp: nothing set
    with pytest.raises(ValueError, match=r"--fsdp_version 1.*only FSDP2"):
        fsdp.launch_env(parser.parse_args(["--use_fsdp", "--fsdp_version", "1"]))
    with pytest.raises(TypeError, match="FullyShardedDataParallelPlugin, got dict"):
        fsdp.plugin_from_env_or({"reshard_after_forward": True})


def test_auto_wrap_policies_pick_the_units() -> None:
    from accelkit.fsdp.runtime import wrap_units

    model = TinyLM()
    blocks = list(model.blocks)

    def picked(**options: Any) -> list[nn.Module]:
        return wrap_units(model, FullyShardedDataParallelPlugin(**options))

    assert picked() == []  # no_wrap: only the root is sharded
    assert picked(transformer_cls_names_to_wrap=["Block"]) == blocks
    # Size: each Block's MLP (1,072 parameters) is a unit, then the rest of its Block (1,152).
    assert picked(min_num_params=1000) == [blocks[0].mlp, blocks[0], blocks[1].mlp, blocks[1]]
    assert picked(auto_wrap_policy=lambda m: isinstance(m, nn.Linear)) == [
        m for m in model.modules() if isinstance(m, nn.Linear)
    ]
    with pytest.raises(ValueError, match=r"\['Layer'\].*no module of that class.*Block"):
        picked(transformer_cls_names_to_wrap=["Layer"])


def test_repoint_swaps_only_the_parameters_that_were_sharded() -> None:
    import weakref

    from accelkit.fsdp.runtime import repoint_optimizer

    live, sharded_live = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.ones(2))
    gone = nn.Parameter(torch.zeros(2))
    gone_ref = weakref.ref(gone)
    del gone  # its id may now be reused by any new tensor: a stale entry must not match it
    optimizer = torch.optim.SGD([live], lr=0.1)
    stale = {id(live): (gone_ref, sharded_live)}
    assert repoint_optimizer(optimizer, stale) == 0
    assert optimizer.param_groups[0]["params"][0] is live
    fresh = {id(live): (weakref.ref(live), sharded_live)}
    assert repoint_optimizer(optimizer, fresh) == 1
    assert optimizer.param_groups[0]["params"][0] is sharded_live
