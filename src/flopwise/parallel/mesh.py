"""The process group and the one DeviceMesh every parallelism is cut from.

Dims, outermost first: pp, dp_replicate, dp_shard, cp, tp (innermost tp, so tensor-parallel ranks
are neighbours inside a node). Flattened views the engine uses:
  dp      = dp_replicate × dp_shard   ranks that see different data
  dp_cp   = dp × cp                   ranks that hold the same weights (DDP averages over these)
  shard   = dp_shard × cp             ranks FSDP shards over (HSDP replicates over dp_replicate)
A single process gets the same object with every degree 1 and no process group.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flopwise.config.schema import Config
from flopwise.layout.rules import Layout, layout_of

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# torch 2.13 warns, on every rank, that slicing a flattened dim (mesh["dp"], what FSDP2 and DDP are
# given) "will be deprecated in PT 2.11", a release already past: the slicing is still torch's own
# documented way, and the warning told a user nothing but made a job's output read like a failure.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command of a one-machine launch of `nproc` ranks running ARGS (`--standalone`: a free
    rendezvous port, so launches beside each other never meet)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


@dataclass
class Parallel:
    """Where this process sits: the layout, the mesh (None on one process) and its coordinates."""

    layout: Layout
    mesh: DeviceMesh | None
    device: torch.device
    nodes: list[int] = field(default_factory=lambda: [0])  # each rank's node (torchrun's GROUP_RANK)
    store: dist.Store | None = None  # the job's store, to find who is still there when a peer went away

    def size(self, dim: str) -> int:
        return 1 if self.mesh is None else self.mesh[dim].size()

    def rank(self, dim: str) -> int:
        return 0 if self.mesh is None else self.mesh[dim].get_local_rank()

    def group(self, dim: str):
        return None if self.mesh is None else self.mesh[dim].get_group()

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def is_main(self) -> bool:
        return is_rank0()


def is_rank0() -> bool:
    """This process is rank 0 of the job (or the only process): the one that writes shared files
    and reports. (Before the process group exists, flopwise.train.launch reads torchrun's RANK instead.)"""
    return not dist.is_initialized() or dist.get_rank() == 0


def init(cfg: Config, device: torch.device) -> Parallel:
    """Join the process group torchrun/srun set up (gloo on CPU, NCCL on GPU) and build the mesh.
    A collective that waits longer than watchdog.collective_timeout_s fails instead of hanging."""
    world = world_size()
    layout = layout_of(cfg, world)
    if world == 1:
        return Parallel(layout, None, device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    store = None
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.watchdog.collective_timeout_s)
        store, rank, size = _attempt_store(timeout)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size, timeout=timeout
        )
    nodes: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
    return Parallel(layout, make_mesh(layout, device), device, nodes, store)


def make_mesh(lo: Layout, device: torch.device) -> DeviceMesh:
    """The job's mesh over the initialised process group, with the flattened views of DIMS' doc
    (also for a one-rank group, e.g. FSDP2 on one GPU)."""
    mesh = init_device_mesh(device.type, (lo.pp, lo.dp_replicate, lo.dp_shard, lo.cp, lo.tp), mesh_dim_names=DIMS)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    mesh["dp_shard", "cp"]._flatten("shard")
    return mesh


def across_nodes(mesh: DeviceMesh, nodes: list[int]) -> list[str]:
    """The mesh dims (of DIMS, size > 1) whose groups hold ranks of more than one node: with
    torchrun's contiguous ranks per node and tp innermost, tensor parallelism stays inside a node
    as long as tp divides the ranks per node."""
    grid, out = mesh.mesh, []
    for i, dim in enumerate(DIMS):
        if grid.size(i) > 1:
            groups = grid.movedim(i, -1).reshape(-1, grid.size(i)).tolist()
            if any(len({nodes[r] for r in g}) > 1 for g in groups):
                out.append(dim)
    return out


def missing_ranks(par: Parallel, wait_s: float = 5.0) -> list[int] | None:
    """After a collective failed because a peer went away: the ranks that did not check in through
    the job's store within `wait_s` (every survivor checks in as it fails). None when there is no
    store to ask, or it is gone too (it lived on the lost node)."""
    if par.store is None:
        return None
    world, key = len(par.nodes), "flopwise/alive/{}".format
    try:
        par.store.set(key(dist.get_rank()), "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not par.store.check([key(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except (RuntimeError, OSError):  # the store's connection is gone (DistStoreError is a RuntimeError)
        return None


def _attempt_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """torchrun's (or MASTER_ADDR's) store, namespaced by restart attempt.

    Why not plain env:// init: in torch 2.13 the workers of a restarted torchrun attempt share the
    agent's store with the dead attempt, so gloo reads the old ranks' addresses, fails to connect
    and hangs until the timeout. A per-attempt prefix gives each attempt its own keys."""
    from torch.distributed.rendezvous import rendezvous

    store, rank, size = next(rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"flopwise/attempt-{attempt}", store), rank, size


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_mean(x: torch.Tensor, par: Parallel, dim: str = "dp_cp") -> torch.Tensor:
    """Average a scalar over a mesh dim (the logged loss over the ranks that saw different data)."""
    if par.size(dim) > 1:
        x = x.clone()
        dist.all_reduce(x, group=par.group(dim))
        x /= par.size(dim)
    return x
