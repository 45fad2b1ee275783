"""Data parallelism under torchrun: one process per GPU (or per CPU share), each holding the whole model.

    torchrun --standalone --nproc_per_node 8 train.py ...     # the launcher sets RANK, WORLD_SIZE, LOCAL_RANK

Not the paper's (RAGEN runs on verl + Ray): plain PyTorch data parallelism. Every rank rolls out its share of
the prompt groups, the ranks exchange small Python objects and [B, T] tensors with the helpers below, and
DistributedDataParallel averages gradients. Without torchrun (a plain `python train.py`) or with WORLD_SIZE=1
no process group is created and every helper returns its input. NCCL on CUDA, gloo on CPU; collectives time
out after 30 minutes (rank 0 evaluates while the others wait); docs/scaling.md.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init(device: torch.device) -> torch.device:
    """Join torchrun's process group when launched by it; -> this process's device."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # (a test may have joined already)
        # torch.distributed.nn's functions default to `group=group.WORLD`, a value taken when it is imported,
        # and DDP imports it when first built. Imported after the group exists, those defaults hold the group
        # for good: destroy_process_group() cannot free it, and gloo's worker threads live on into the
        # interpreter's shutdown, where one still releasing a finished collective's tensors must take the GIL
        # and aborts the process ("terminate called without an active exception": measured ~1 torchrun exit
        # in 40, a core dump showed it). Imported first, the defaults are None.
        # (`import torch.distributed.nn` here would make `torch` a local name of this whole function, unbound
        # where the CUDA branch above reads it; the alias binds only `_functional`.)
        import torch.distributed.nn as _functional  # noqa: F401
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(minutes=30),
                                device_id=device if device.type == "cuda" else None)
    return device


def close() -> None:
    """Free the process group now, joining gloo's worker threads while the interpreter is whole. Every DDP
    wrapper holds the group: drop them first (`del`); the collection here frees those caught in cycles."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (it builds or downloads the model into the cache once), then the others."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def check_groups(prompts: int, online_k: int = 1) -> None:
    """A ValueError unless the prompt groups (--prompts x --online-k) split evenly over the processes: a
    group never splits, its rollouts are normalised together."""
    what = f"--prompts {prompts}" + (f" x --online-k {online_k}" if online_k > 1 else "")
    if prompts * online_k % world_size():
        raise ValueError(f"{what}: must be divisible by the number of processes ({world_size()}); a prompt "
                         f"group never splits across processes")


def my_range(n: int) -> range:
    """This rank's contiguous share of n items (prompt groups, batch rows): ceil(n / W) each, the last ranks
    may get fewer or none. Concatenating the shares in rank order gives 0..n-1 back (see gather_rows)."""
    c = math.ceil(n / world_size())
    lo = min(n, rank() * c)
    return range(lo, min(n, lo + c))


def all_gather_objects(items: list) -> list:
    """Every rank's list (picklable objects), concatenated in rank order, on every rank."""
    if world_size() == 1:
        return items
    out = [None] * world_size()
    dist.all_gather_object(out, items)
    return [x for part in out for x in part]


def gather_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """This rank's rows my_range(n) of a [n, ...] tensor -> all n rows on every rank (padded all_gather)."""
    if world_size() == 1:
        return x
    c = math.ceil(n / world_size())
    # [c, ...]: all_gather needs equal shapes
    padded = torch.cat([x, x.new_zeros((c - len(x), *x.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(parts, padded)
    return torch.cat(parts)[:n]  # only the tail ranks are short, so the real rows are the first n


def broadcast_object(obj):
    """Rank 0's value on every rank."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def ddp(module: torch.nn.Module | None, device: torch.device):
    """DistributedDataParallel(module) when there are several ranks, else the module itself. DDP all-reduces
    gradients only for what runs inside its own forward: wrap the module whose forward the loss calls."""
    if module is None or world_size() == 1:
        return module
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def weights_digest(*modules: torch.nn.Module | None) -> str:
    """sha256 of every parameter's bytes: equal digests = bitwise equal weights."""
    h = hashlib.sha256()
    for m in modules:
        for p in (m.parameters() if m is not None else []):
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def assert_in_sync(*modules: torch.nn.Module | None) -> str:
    """Raise when the ranks' weights differ (a DDP mistake is otherwise silent); -> the common digest."""
    digests = all_gather_objects([weights_digest(*modules)])
    if len(set(digests)) != 1:
        raise RuntimeError(f"weights differ across ranks after training (sha256 per rank: {digests})")
    return digests[0]


def map_rows(fn, ids: torch.Tensor, attn: torch.Tensor, micro: int) -> torch.Tensor:
    """fn(ids, attn) -> [b, T] on this rank's share of the B rows, `micro` rows at a time, gathered: every
    rank ends with all of them [B, T] (one process: fn over every row)."""
    mine = my_range(len(ids))
    my_ids, my_attn = ids[mine.start:mine.stop], attn[mine.start:mine.stop]
    parts = [fn(my_ids[j:j + micro], my_attn[j:j + micro]) for j in range(0, len(my_ids), micro)]
    return gather_rows(torch.cat(parts) if parts else torch.zeros(my_ids.shape, device=ids.device), len(ids))


def micro_batches(n: int, micro: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """Row indices of an n-row mini-batch that `rank` trains, micro-batch by micro-batch: rows rank,
    rank + world, ... in groups of `micro`. Every rank gets ceil(ceil(n / world) / micro) micro-batches; a
    rank with fewer rows gets empty lists at the end (starpo.update runs a zero-weight micro-batch there).
    world = 1: consecutive slices, as a single process accumulates."""
    mine = list(range(rank, n, world))
    return [mine[j * micro:(j + 1) * micro] for j in range(math.ceil(math.ceil(n / world) / micro))]


def no_sync(*modules) -> contextlib.ExitStack:
    """Enter `no_sync()` of every DistributedDataParallel among `modules` (gradient accumulation: DDP then
    all-reduces at the last backward only); others have none."""
    stack = contextlib.ExitStack()
    for module in modules:
        if hasattr(module, "no_sync"):
            stack.enter_context(module.no_sync())
    return stack


def check_shard(world: int, generator, *modules) -> None:
    """starpo.update's inputs under torchrun: one generator (the same mini-batches on every rank) and every
    module wrapped in DDP (without DDP the ranks' gradients are never averaged)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if world > 1 and (generator is None or not all(isinstance(m, ddp) for m in modules if m)):
        raise ValueError("with shard: the same `generator` on every rank, DDP(TokenLogprobs(model)) and "
                         "DDP(critic) (without DDP the ranks' gradients are never averaged)")


def all_ranks(ok: torch.Tensor, world: int) -> torch.Tensor:
    """A boolean that holds on every rank (one all-reduce MIN), so that all ranks step or skip together."""
    if world == 1:
        return ok
    ok = ok.float()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return ok


def sum_ranks(stacked: torch.Tensor, per_step: list[bool], world: int) -> torch.Tensor:
    """Each rank's share of the metric sums -> their totals; the per-step entries (one value a step on every
    rank, e.g. the grad norm) averaged instead."""
    if world == 1:
        return stacked
    dist.all_reduce(stacked)
    return torch.where(torch.tensor(per_step, device=stacked.device), stacked / world, stacked)
