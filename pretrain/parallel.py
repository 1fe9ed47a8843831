r"""``--parallel ddp`` and ``--parallel fsdp``: how a training step is spread over processes.

**DDP** (:func:`ddp`): the model is wrapped in ``DistributedDataParallel``, which
averages the gradients, and the optimizer work is sharded by parameter: each parameter
has one owner rank (:func:`geomuon.pretrain.train.owners`, a greedy balance of the
matrix work), every rank steps only the parameters it owns, and :class:`OwnerGather`
then sends the updated parameters to every rank with **one**
``all_gather_into_tensor`` per dtype: rank $r$ packs its parameters into a flat
buffer of $L = \max_r L_r$ entries ($L_r$ = the entries it owns), the gather fills a
$w\times L$ buffer, and each rank copies the others' parameters out of it. Per step a
rank receives $(w-1)\,L$ entries, $\approx \tfrac{w-1}{w}\,P$ for $P$ parameter entries
when the owners' loads are even ($L \approx P/w$); the collectives of all dtypes are
issued before the first is waited on. Ranks hold bit-identical parameters.

**FSDP2** (:func:`fsdp`): every transformer block and the root are ``fully_shard``-ed,
so each parameter is a ``DTensor`` of row shards; the optimizers' sharded matrix step
(:mod:`geomuon.optimizers.distributed`) maps whole matrices on owner ranks with two
all-to-alls per same-shape batch.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from geomuon.optimizers.distributed import as_shard, is_sharded, local_rows, whole

__all__ = ["OwnerGather", "ddp", "fsdp", "full_state"]


@dataclass
class OwnerGather:
    """Bucketed hand-out of owner-updated parameters (one ``all_gather_into_tensor`` per dtype).

    Args:
        params: every parameter the optimizers step, in the same order on every rank.
        owner: owner rank of each parameter.
        rank: this rank; ``world``: the number of ranks.
        group: the process group (default: the world).

    Attributes:
        bytes_received: bytes this rank received from the others, summed over calls.
        collectives: gathers issued, summed over calls.
    """

    params: list[torch.Tensor]
    owner: list[int]
    rank: int
    world: int
    group: object = None
    bytes_received: int = 0
    collectives: int = 0
    _buckets: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        by_dtype: dict[tuple, list[list[torch.Tensor]]] = {}
        for p, r in zip(self.params, self.owner):
            by_dtype.setdefault((p.dtype, p.device), [[] for _ in range(self.world)])[r].append(p)
        self._buckets = list(by_dtype.values())

    def others(self) -> list[torch.Tensor]:
        """The parameters another rank owns (their gradients are dropped before the step)."""
        return [p for p, r in zip(self.params, self.owner) if r != self.rank]

    @torch.no_grad()
    def gather(self) -> None:
        """Give every rank the parameters their owners just updated."""
        pending = []
        for owned in self._buckets:
            length = max(sum(p.numel() for p in ps) for ps in owned)
            mine = owned[self.rank]
            reference = next(p for ps in owned for p in ps)
            send = torch.zeros(length, dtype=reference.dtype, device=reference.device)
            if mine:
                torch.cat([p.detach().reshape(-1) for p in mine], out=send[:sum(p.numel() for p in mine)])
            recv = torch.empty(self.world * length, dtype=send.dtype, device=send.device)
            pending.append((dist.all_gather_into_tensor(recv, send, group=self.group, async_op=True),
                            recv, length, owned))
            self.collectives += 1
            self.bytes_received += (self.world - 1) * length * send.element_size()
        for work, recv, length, owned in pending:
            work.wait()
            for r, ps in enumerate(owned):
                if r == self.rank:
                    continue
                offset = r * length
                for p in ps:
                    p.detach().copy_(recv[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()


def ddp(model, assignment, cfg, ddp):
    """``--parallel ddp``: DDP gradients, the optimizer step sharded by parameter owner,
    the owners' updates handed out by :class:`OwnerGather`."""
    from torch.nn.parallel import DistributedDataParallel

    from geomuon.pretrain.train import Parallel, owners

    params = [p for group in assignment.param_groups for p in group["params"]]
    handout = OwnerGather(params, owners(params, ddp.world), ddp.rank, ddp.world)
    others = handout.others()

    def before_step():  # only the owner steps a parameter
        for p in others:
            p.grad = None

    module = DistributedDataParallel(model, find_unused_parameters=bool(model.config.n_experts))
    return Parallel(module, before_step, handout.gather)


def fsdp(model, assignment, cfg, ddp):
    """``--parallel fsdp``: ``fully_shard`` every block and the root (in place, so the
    model's parameters become ``Shard(0)`` DTensors), the optimizers moved onto the
    sharded parameters (their state too: entries of a parameter's shape are split into
    its row shards, the others kept), and a full replica for evaluation and checkpoints,
    refreshed by ``Parallel.full_model`` (an all-gather per parameter, on every rank)."""
    from torch.distributed.fsdp import fully_shard

    from geomuon.pretrain.train import Parallel

    replica = copy.deepcopy(model)
    before = dict(model.named_parameters())
    for block in model.h:
        fully_shard(block)
    fully_shard(model)
    after = dict(model.named_parameters())
    moved = {id(before[name]): after[name] for name in before}
    for opt in assignment.optimizers.values():
        for group in opt.param_groups:
            group["params"] = [moved[id(p)] for p in group["params"]]
        opt.state = collections.defaultdict(
            dict, {moved[id(p)]: {k: _shard_like(v, moved[id(p)]) for k, v in s.items()} for p, s in opt.state.items()})
    mirror = [(p, after[name]) for name, p in replica.named_parameters()]

    @torch.no_grad()
    def full_model():
        for full, sharded in mirror:
            full.copy_(whole(sharded.detach()))
        return replica

    return Parallel(model, _nothing, _nothing, full_model)


def _nothing() -> None:
    pass


def _shard_like(value, param):
    """``value`` split like ``param`` when it is a full tensor of ``param``'s shape."""
    if isinstance(value, torch.Tensor) and not is_sharded(value) and value.shape == param.shape:
        return as_shard(local_rows(value, param).clone(), param)
    return value


def full_state(state):
    """``state`` (nested dicts/lists of tensors) with every ``DTensor`` replaced by its full
    tensor: a collective, so every rank calls it in the same order."""
    if isinstance(state, dict):
        return {k: full_state(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_state(v) for v in state)
    return whole(state) if isinstance(state, torch.Tensor) else state
