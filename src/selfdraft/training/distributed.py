"""Data parallel training under torchrun: the process group, the batch split and the wrapped drafter.

Under `torchrun --nproc_per_node N` (WORLD_SIZE, RANK, LOCAL_RANK in the environment) the training
loop runs on N processes (gloo on CPU, NCCL on GPU). `batch_size` stays the GLOBAL micro-batch:
every rank advances the same data cursor and takes its own batch_size / N slice, the drafter is
wrapped in DistributedDataParallel (or sharded with FSDP, `TrainConfig.fsdp`), and rank 0 alone writes
checkpoints, logs and the progress bar. So the optimisation trajectory does not depend on N, and a run
resumes under another world size. World 1 is the ordinary single-process run: every method is a no-op.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from selfdraft.config import ConfigError, DrafterConfig, TrainConfig
from selfdraft.target import Target
from selfdraft.training.strategy import Batch, LossOutput, Strategy


def bind_local_gpu() -> int:
    """Under torchrun on a GPU machine: make cuda:LOCAL_RANK this process's current device (before the
    target is loaded, so `--device cuda` puts it there) -> LOCAL_RANK."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {local} but this machine has {torch.cuda.device_count()} GPU(s): "
                          "use --nproc_per_node <= its GPU count (one GPU per rank)")
    torch.cuda.set_device(local)
    return local


class LossModule(torch.nn.Module):
    """forward(batch, gen) = strategy.loss(model, ...): the one call DDP / FSDP hook into.

    Strategies call the drafter's own methods (context, backbone, step, ...), not its forward, so the
    wrapper's forward is where DDP prepares its gradient all-reduce and FSDP gathers the shards. The
    target is held in a plain tuple: never a submodule, never broadcast, never sharded.
    """

    def __init__(self, model: torch.nn.Module, strategy: Strategy, target: Target, cfg: DrafterConfig) -> None:
        super().__init__()
        self.model = model
        self._ctx = (strategy, target, cfg)

    def forward(self, batch: Batch, gen: torch.Generator) -> LossOutput:
        strategy, target, cfg = self._ctx
        return strategy.loss(self.model, batch, target, cfg, gen)


@dataclass
class Distributed:
    """The process group of a torchrun launch (world 1 = the ordinary single-process run: every method is a no-op)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    fsdp: bool = False
    owns_group: bool = False  # this run initialised the group (and destroys it at the end)
    cuda: bool = False

    @classmethod
    def from_env(cls, target: Target, train_cfg: TrainConfig) -> "Distributed":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            if train_cfg.fsdp:
                raise ConfigError("--fsdp shards the drafter over ranks: launch with torchrun --nproc_per_node N (N >= 2)")
            return cls()
        import torch.distributed as td

        if train_cfg.batch_size % world:
            raise ConfigError(
                f"--batch-size {train_cfg.batch_size} is the global micro-batch, split over the {world} ranks: "
                f"make it a multiple of {world}"
            )
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        cuda = target.model.device.type == "cuda"
        if cuda:  # one GPU per rank: the target (and with it the drafter) lives on cuda:LOCAL_RANK
            gpu = torch.device("cuda", bind_local_gpu())
            if target.model.device != gpu:
                if target.native is not None:  # its own copies of the weights stay where they were built
                    raise ConfigError(f"rank {rank}: the target is on {target.model.device}, this rank's GPU is {gpu}; "
                                      "load it after torch.cuda.set_device(LOCAL_RANK) (selfdraft train does)")
                target.model.to(gpu)
        owns = not td.is_initialized()
        if owns and cuda:  # NCCL bound to this rank's GPU up front (its communicators are created for it)
            td.init_process_group("nccl", device_id=torch.device("cuda", local))
        elif owns:
            td.init_process_group("gloo")
        return cls(rank, world, local, train_cfg.fsdp, owns, cuda)

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as td

            td.barrier()
            td.destroy_process_group()

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            td.barrier()

    def shard(self, idx: list[int]) -> list[int]:
        """This rank's contiguous slice of a global batch."""
        b = len(idx) // self.world
        return idx[self.rank * b : (self.rank + 1) * b]

    def wrap(self, model: torch.nn.Module, strategy: Strategy, target: Target, cfg: DrafterConfig) -> torch.nn.Module:
        """The module whose forward(batch, gen) is strategy.loss: DDP over the drafter, FSDP shards of it, or
        (world 1) the plain `LossModule`. The optimizer is built after this (`optim.start_optimizer`)."""
        module = LossModule(model, strategy, target, cfg)
        if self.world == 1:
            return module
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # fully_shard's default mesh is on the accelerator whatever the batches: name the device the drafter is on
            mesh = init_device_mesh("cuda" if self.cuda else "cpu", (self.world,))
            fully_shard(module, mesh=mesh)  # one unit: parameters, gradients and optimizer state sharded over the ranks
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(module, device_ids=[self.local_rank] if self.cuda else None, broadcast_buffers=False,
                   find_unused_parameters=True)  # fmt: skip

    def no_sync(self, wrapped: torch.nn.Module):
        """Skip the gradient all-reduce of a micro-batch that is not the step's last (DDP)."""
        return wrapped.no_sync() if hasattr(wrapped, "no_sync") and not self.fsdp else nullcontext()

    def _reduce(self, value: float, dtype: torch.dtype) -> float:
        import torch.distributed as td

        t = torch.tensor([value], dtype=dtype, device=f"cuda:{self.local_rank}" if self.cuda else "cpu")
        td.all_reduce(t)
        return t.item()

    def sum_int(self, value: int) -> int:
        return value if self.world == 1 else int(self._reduce(value, torch.int64))

    def mean_float(self, value: float) -> float:
        return value if self.world == 1 else self._reduce(value, torch.float64) / self.world

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if self.fsdp and hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def full_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Model and optimizer state with every FSDP shard gathered (a collective: all ranks call it)."""
        if not self.fsdp:
            return model.state_dict(), opt.state_dict()
        from torch.distributed.tensor import DTensor

        full = lambda t: t.full_tensor().cpu() if isinstance(t, DTensor) else t  # noqa: E731
        model_state = {k: full(v) for k, v in model.state_dict().items()}
        osd = opt.state_dict()
        osd = {**osd, "state": {i: {k: full(v) for k, v in st.items()} for i, st in osd["state"].items()}}
        return model_state, osd

    def load_optimizer_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer, saved: dict) -> None:
        """Load a full (unsharded) optimizer state; under FSDP each state tensor is sharded like its parameter."""
        if self.fsdp:
            from torch.distributed.tensor import DTensor, distribute_tensor

            params = [p for g in opt.param_groups for p in g["params"]]  # the optimizer's own numbering
            state = {}
            for i, st in saved["state"].items():
                p = params[int(i)]
                state[i] = {
                    k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) and v.shape == p.shape else v
                    for k, v in st.items()
                }  # fmt: skip
            saved = {**saved, "state": state}
        scales = [g["lr_scale"] for g in opt.param_groups]
        opt.load_state_dict(saved)
        for g, scale in zip(opt.param_groups, scales):  # a state saved before groups had their own rate: this run's
            g.setdefault("lr_scale", scale)
