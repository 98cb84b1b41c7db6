"""Sharded training under ``torchrun`` with FSDP2 (gloo on CPU, NCCL on CUDA).

Rank 0 samples rollouts, pushes weights and writes metrics and checkpoints;
every rank trains on its share of each batch. Parity is unchanged by sharding:
FSDP2 all-gathers the bf16 parameters bit-exactly before each layer runs, so
each rank's forward is the single-process forward (tested). The model's fp32
parameters (GDN ``A_log``) are left out of sharding (FSDP2 wants one dtype per
unit) and stay replicated; their gradients are summed with an all-reduce.
Gradients are summed, not averaged, across ranks: the loss is already divided
by the batch's total token count.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["Dist"]


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


SQ_SUM_PIECE = 1 << 24  # elements per float64 piece: 128 MiB of temporaries, whatever the gradient's size


def _sq_sum(g: torch.Tensor) -> float:
    """The sum of squares of ``g`` in float64, taken in fixed pieces of the flattened tensor: a float64 copy of a
    248K-vocabulary embedding's gradient would need 7.6 GiB at once. Deterministic: the pieces are the same at
    every call."""
    flat = g.reshape(-1)
    return sum(float(p.double().pow(2).sum()) for p in flat.split(SQ_SUM_PIECE))


class Dist:
    """``rank``, ``world``; no-op helpers when not under torchrun."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.replicated: list[torch.nn.Parameter] = []
        # The trainer runs where the server runs: CPU and GPU math libraries round exp/log differently.
        self.device = "cpu"
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local)
            self.device = f"cuda:{local}"
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def shard(self, model: torch.nn.Module) -> None:
        if self.world == 1:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.replicated = [p for p in model.parameters() if p.dtype != torch.bfloat16]
        ignored = set(self.replicated)
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        units = list(model.layers) + [model]
        for unit in units:
            fully_shard(unit, mp_policy=mp, ignored_params=ignored)
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    def sum_replicated_grads(self, grads: list[torch.Tensor]) -> None:
        if self.world > 1:
            for g in grads:
                dist.all_reduce(g)

    def sq_norm(self, sharded: list[torch.Tensor], replicated: list[torch.Tensor]) -> float:
        """Squared global norm of gradients: local shards summed over ranks, replicated ones counted once."""
        local = sum(_sq_sum(g.to_local()) if _is_dtensor(g) else 0.0 for g in sharded)
        if self.world > 1:
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            local = float(t)
        return local + sum(_sq_sum(g) for g in replicated)

    def broadcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce(self, value: float, op: str = "sum") -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return float(t)

    def close(self) -> None:
        """Leave together: a rank that tears its process group down while a peer is still finishing its
        last step aborted once in CI ("terminate called without an active exception")."""
        if self.world > 1 and dist.is_initialized():
            try:
                if dist.get_backend() == "gloo":
                    import datetime

                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
                else:
                    dist.barrier()
            except RuntimeError:
                pass  # a peer is gone already (it failed); nothing left to wait for
            dist.destroy_process_group()
