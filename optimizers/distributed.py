r"""Matrix optimizers on FSDP2-sharded (``DTensor``) parameters: whole-matrix maps, sharded by matrix.

Under ``torch.distributed.fsdp.fully_shard`` every parameter $W\in\mathbb R^{m\times n}$
is a ``DTensor`` whose rank $r$ holds rows $[rc, \min((r+1)c, m))$, $c = \lceil m/w\rceil$
(``torch.chunk``'s rule: uneven, possibly empty, shards). Momentum is elementwise, so
it stays on the shards. The update maps of this package (the polar factor, the polar
maps, the manifold steepest directions and retractions, the regulators) act on the
**whole** matrix, so one step of a same-shape batch of $B$ matrices
(:meth:`geomuon.optimizers.base.MatrixOptimizer._direction`'s per-batch contract) runs
here as follows, in the style of microsoft/dion's distributed Muon (Ahn et al., *Dion:
Distributed Orthonormalized Updates*, 2025, arXiv:2504.05295):

1. every rank updates the momentum of its shards and forms its rows of $\tilde B_i$
   (the stack dtype of the optimizer, e.g. bf16 for Muon);
2. **all-to-all out**: matrix $i$ of the batch has one owner rank
   $o(i) = (i + k) \bmod w$ ($k$ the position of the batch's first parameter in the
   optimizer, so batches of one matrix spread over the ranks); every rank sends its
   rows of $\tilde B_i$ to $o(i)$, which concatenates the $w$ pieces;
3. each owner maps its $\le\lceil B/w\rceil$ whole matrices with the optimizer's own
   ``_direction`` (one batched kernel call), so no map is repeated on two ranks;
4. **all-to-all back**: the owner splits the update $U_i$ into the row shards and
   returns them; every rank applies ``_apply`` to its shard (decay, $-\eta s U$).

When the update after the map is not elementwise (a subclass that overrides
``_apply``, e.g. a retraction onto a manifold) or the group has a regulator, the owner
runs ``_direction``, ``_apply`` and the regulator on the whole matrix and returns the
new rows of $W_i$ in step 4. It needs the whole $W_i$, and keeps it: the **replica**,
the last whole matrix it returned, so that in steady state only the momentum travels
out. The rule that keeps a replica equal to the weights, with no host read:

* *host-side, the same on every rank*: a matrix has a replica when its current owner
  wrote it in an earlier step and ``optimizer.state[p]`` is still the dict of that step
  (``load_state_dict`` replaces it). Otherwise — the first step, a new owner (the batch
  changed), a loaded state — every rank sends its rows of $W_i$ with the momentum (the
  step is the same, the bytes those of a step without replicas). After a state loaded on
  some ranks only, this rule is made the same on every rank before the step (the loaded
  values are each rank's own: load the same state on every rank): the finiteness all-reduce
  carries a flag per matrix, whether the rank holds its replica, and where some ranks do and
  others do not, every rank drops it (the layouts of the all-to-all had differed: gloo aborted).
* *device-side, exact*: every rank keeps the rows it last wrote and compares their bits
  with its shard. Rows written by anything else (``p.data``, a rank-local
  ``to_local()`` write, ``torch.distributed.checkpoint.load`` into the model: none of
  them moves the ``DTensor``'s autograd version counter) travel **in place of** their
  momentum rows (the slot has the wider of the two dtypes) with a one-byte flag; the
  owner refreshes its replica from them and skips that matrix's step (its momentum is
  set to 0 and its ``keep`` flag to false, so Manifold Muon keeps its warm start and
  step count, and the weights are
  kept bit for bit, with the whole-matrix state the step replaces, e.g. a regulator's
  power-iteration vector; the momentum buffers keep the gradient). ``refreshed`` of
  :class:`ShardingStats` counts such skips on the device. A replica is never used where
  it differs from the weights; an unannounced write costs one skipped step of that
  matrix. Memory: the owner's replicas ($\approx P/w$ entries per rank for $P$ entries
  in all) and the rows last written ($P/w$).

**Bytes moved per step** (summed over ranks, the shard a rank keeps excluded), for a
batch of $P$ parameter entries, stack dtype of $b_M$ bytes, parameter dtype of $b_W$,
$b_S = \max(b_M, b_W)$, replicas held:

$$\text{elementwise apply: } 2\,\tfrac{w-1}{w}\,P\,b_M + (w-1)\,N,\qquad
\text{whole-matrix apply: } \tfrac{w-1}{w}\,P\,(b_S + b_W) + 2(w-1)\,N$$

for $N$ matrices (one-byte flags: an owner's failure flag back, and for a whole-matrix
apply the written-rows flag out); a step that sends the weights (the rule above) adds
$\tfrac{w-1}{w}Pb_W$. That is $\le 2\times$ the parameter bytes for every optimizer: $2\tfrac{w-1}{w}$ for Manifold
Muon in fp32 ($1.0\times$ at $w = 2$, $1.5\times$ at $w = 4$), $\tfrac{w-1}{w}$ for
Muon's bf16 momentum and update. Two ``all_to_all_single`` collectives per batch,
whatever $B$; the payload is sent as bytes, so every dtype travels exactly.

Transport in a lower precision was rejected: Manifold Muon's Gram path reads the
momentum in fp32 ($W^\top G$ and $Z_0 = G - W\Sigma_0$ are fp32 products,
:mod:`geomuon.optimizers.gram`), so bf16 momentum would change the step. The Gram
all-reduce (row shards all-reduce the $n\times n$ contractions $W^\top W$, $W^\top G$,
$Z_0^\top Z_0$, $Y^\top Y$ and assemble their rows locally) sends $2(w-1)$ times
$\approx 3n^2$ fp32 entries per tall matrix against this module's $2\tfrac{w-1}{w}mn$,
so it moves fewer bytes only when $m > 3wn$ (the bench's model: ``bench/distributed_step.py``);
it does not apply to wide matrices (their Gram side is the sharded one) and repeats the
$n\times n$ solves on every rank. No matrix of a GPT block has $m > 3wn$ at $w \ge 2$
($m \le 4n$), so it is not built.

**Row-wise maps** (the optimizer's ``_rowwise_direction(group)`` is true, e.g.
:class:`geomuon.optimizers.polar.RowNormM`) act on each row alone: a row shard is
mapped where it lives, with no communication, when the apply is elementwise.

**A failure on an owner** (an exception in its step 3: out of memory, a linalg error) would
leave the other ranks in the all-to-all back until the process group's timeout (30 min on
gloo, 10 on NCCL by default). The owner catches it and still sends step 4: no update for an
elementwise apply (weight decay still applies), the weights the step started from for a
whole-matrix one, and a one-byte failure flag per matrix. The step goes on for every other
matrix. The flags reach the host with no read of their own: with the read of the next
sharded group's finiteness check on the same mesh (in this step, or the next one) or with
:meth:`~geomuon.optimizers.base.MatrixOptimizer.check_finite`, where every rank raises
``RuntimeError`` naming the parameters (the owner's with its exception as the cause). The
failed matrices' momentum has moved and the owner's whole-matrix state may be part-written:
end the run or reload a checkpoint. A failure outside step 3 (before the all-to-all out)
is not caught.

Counts are kept in :class:`ShardingStats` (``optimizer.sharding_stats``): bytes this
rank sent and received, collectives, and the whole matrices this rank mapped (a
row-wise map on a shard of $r$ of $m$ rows counts $r/m$).

**Options that differ between ranks** (an ``lr``, ``compute_dtype``, ``update``, manifold or
regulator set on one rank only) had stepped silently wrong (each rank applied its own ``lr``
to its rows; an owner mapped with its own manifold) or broken the process group inside an
all-to-all (the ranks' payloads differ in size: gloo aborted the processes). Every rank now
compares each sharded group's options before the step's sharded work on their mesh:
:func:`check_group` records a fingerprint of the group's options and of its sharded parameters'
names, shapes and dtypes in order (a CRC-32 of their canonical text, plus for a tensor value,
e.g. a scheduled ``lr``, a checksum of its bits on the device), and the finiteness check of
the first sharded group on the mesh (:func:`compare_options`) all-reduces the maximum of the
groups' combined fingerprint and that of its negation ($\max_r f_r = \min_r f_r$ exactly when
every rank agrees) and reads it to the host, with the failure flags pending on the mesh, before
that check's own all-reduce: one all-reduce of 2 int64 and one host read per mesh and step,
whatever the number of groups. The read comes first because the finiteness all-reduce's length
is the group's number of sharded parameters: a rank listing one parameter more had sent a longer
vector into it (gloo aborted the processes; NCCL checks no sizes). A disagreement (another
number of sharded groups included) raises ``ValueError`` on every rank naming each group,
option and rank's value (an ``all_gather_object``, on that path only), before that mesh's
sharded groups do any work (plain groups ahead of them have stepped).

Placements: a 1-D device mesh with ``Shard(0)`` (FSDP2's default) is supported; other
placements, a gradient placed unlike its parameter, a group mixing ``DTensor`` and plain
tensors, and a group on several meshes raise ``ValueError`` naming the parameter before the
step starts, on every rank
(:func:`check_group`). Within a batch every parameter has
the same shape, so the same row split; the result on the owner is bit-for-bit the
single-process map of the same momentum up to the batch composition of the kernels. The
elementwise apply on a shard is the whole matrix's bit for bit too, except for bf16 and fp16
weights under a float ``lr`` on the CPU: torch's ``add_(U, alpha=-lr)`` rounds an element
differently in its vectorized body and in its scalar tail, whose boundaries differ between a
shard's rows and the whole matrix (1 ulp in some entries: torch 2.13, ``alpha=-0.02``, 200
random 6x6 bf16 pairs from ``manual_seed(0)`` split in two row halves, 136 differed; a tensor
``lr``, through ``addcmul_``, is exact). The one-process step
keeps ``add_``, which is ``torch.optim.Muon``'s step bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import sys
import traceback
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist


__all__ = ["ShardingStats", "is_sharded", "whole", "write_whole", "local_rows", "as_shard", "shard_rows",
           "sharded_matrix_step", "sharding_stats", "matrix_owner", "check_group", "compare_options",
           "read_failures"]



def _dtensor_module():
    # torch.distributed.tensor costs seconds to import; a tensor can only be a DTensor once
    # something has imported it, so asking sys.modules keeps that cost off plain runs
    return sys.modules.get("torch.distributed.tensor")


@dataclass
class ShardingStats:
    """Counters of the sharded steps of one optimizer on this rank (never reset by it)."""

    #: bytes this rank sent to other ranks (the piece it keeps is not counted)
    bytes_sent: int = 0
    #: bytes this rank received from other ranks
    bytes_received: int = 0
    #: ``all_to_all_single`` calls
    collectives: int = 0
    #: whole matrices this rank ran ``_direction`` on (row-wise shards count their fraction)
    matrices_mapped: float = 0.0
    #: ``_direction`` calls on this rank
    direction_calls: int = 0
    #: whole-matrix steps this rank skipped as owner because some rank's rows had been
    #: written outside the optimizer (a device tensor once any: counted without a host read)
    refreshed: torch.Tensor | int = 0


def sharding_stats(optimizer) -> ShardingStats:
    """The :class:`ShardingStats` of ``optimizer`` on this rank (created on first use)."""
    return optimizer.__dict__.setdefault("sharding_stats", ShardingStats())


def matrix_owner(optimizer, p: torch.Tensor) -> int | None:
    """The rank that mapped ``p``'s whole matrix in its last sharded step, so holds its
    whole-matrix state (warm starts, step counts, regulator state): its rank **on
    ``p.device_mesh``** (compare it with ``p.device_mesh.get_local_rank()``, which differs
    from the global rank on a sub-mesh); ``None`` before any (or for a row-wise map, whose
    state is all shards)."""
    return optimizer.__dict__.get("_matrix_owners", {}).get(id(p))


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a ``DTensor`` (an FSDP2 / DTensor parameter or gradient)."""
    module = _dtensor_module()
    return module is not None and isinstance(p, module.DTensor)


def whole(p: torch.Tensor) -> torch.Tensor:
    """The full tensor of a ``DTensor`` (an all-gather), or ``p`` itself."""
    return p.full_tensor() if is_sharded(p) else p


def write_whole(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.copy_(value)`` for a full ``value``; a ``DTensor`` keeps its own rows of it."""
    if is_sharded(p):
        p.to_local().copy_(local_rows(value, p))
    else:
        p.copy_(value)


def forget_replica(optimizer, p: torch.Tensor) -> None:
    """Drop the owner's whole-matrix replica of ``p`` (host state, the same on every rank)
    after a write from outside the step (:func:`write_whole`): its next step sends the weights
    once, as a first step does. Kept, the write had looked like an outside one and that
    matrix's next step was skipped."""
    optimizer.__dict__.get("_replicas", {}).pop(id(p), None)


def holds_replica(optimizer, p: torch.Tensor) -> bool:
    """Whether this rank's replica of ``p`` (host state) was written with ``optimizer.state[p]``
    as it is now (``load_state_dict`` replaces it): the host-side half of the replica rule, which
    :meth:`~geomuon.optimizers.base.MatrixOptimizer._finite_on_host` makes the same on every rank."""
    return _held_replica(optimizer, p) is not None


def _held_replica(optimizer, p: torch.Tensor) -> _Replica | None:
    """This rank's replica of ``p`` where it holds one (:func:`holds_replica`), else ``None``."""
    replica = optimizer.__dict__.get("_replicas", {}).get(id(p))
    return replica if replica is not None and replica.state is optimizer.state.get(p) else None


def local_rows(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the full tensor ``value``, split like the ``DTensor`` ``like``."""
    rows, rank = _layout(like, "local_rows: a parameter")
    start = sum(rows[:rank])
    return value[start:start + rows[rank]]


def as_shard(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The ``DTensor`` whose shard on this rank is ``local``, placed and shaped like ``like``."""
    return _dtensor_module().DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                                shape=like.shape, stride=like.stride())


def shard_rows(size: int, world: int) -> list[int]:
    """Rows of each rank for a dimension of ``size`` split ``torch.chunk``-wise in ``world``."""
    chunk = math.ceil(size / world) if size else 0
    return [max(0, min(chunk, size - r * chunk)) for r in range(world)]


def _layout(p: torch.Tensor, what, world_rank: tuple[int, int] | None = None) -> tuple[list[int], int]:
    """(rows per rank, this rank's index) of a ``Shard(0)`` DTensor on a 1-D mesh;
    ``ValueError`` for any other layout, its message starting with ``what`` (the parameter:
    a string, or a function making it, called for a message only). ``world_rank``: the
    mesh's (size, this rank's index) when known: :func:`check_group` runs this on every
    parameter at every step, and asking the mesh each time had made it 1.6x slower."""
    mesh = p.device_mesh
    if mesh.ndim != 1 or p.placements != (_dtensor_module().Shard(0),):
        what = what() if callable(what) else what
        raise ValueError(
            f"{what} of shape {tuple(p.shape)} is placed {tuple(p.placements)} on a {mesh.ndim}-D mesh; the "
            "sharded matrix step supports FSDP2's Shard(0) on a 1-D mesh: shard it with fully_shard's default "
            "placement (no shard_placement_fn, no HSDP/TP)"
        )
    world, rank = world_rank or (mesh.size(), mesh.get_local_rank())
    rows = shard_rows(p.shape[0], world)
    if p.to_local().shape[0] != rows[rank]:
        what = what() if callable(what) else what
        raise ValueError(
            f"{what} of shape {tuple(p.shape)}: rank {rank} holds {p.to_local().shape[0]} of its rows, the "
            f"torch.chunk split over {world} ranks gives {rows[rank]} (FSDP2's split: shard it with fully_shard)"
        )
    return rows, rank


def check_group(optimizer, group: dict, index: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Refuse, with a ``ValueError`` naming the parameter, the parameters of param group ``index``
    that its step could not take (``params``: those with a gradient on this rank): a group mixing
    trainable ``DTensor`` and plain tensors (``requires_grad``, the same on every rank, or a gradient
    here), sharded parameters on different device meshes, and, where the
    step needs whole matrices (a matrix group, a regulated AdamW group),
    any layout but FSDP2's ``Shard(0)`` rows on a 1-D mesh of a trainable parameter (with a
    gradient here or not: a ``Shard(1)`` weight whose gradient was on rank 0 alone had been refused
    there while rank 1 compared the options alone, until the process group's timeout), and in a
    matrix group a gradient placed unlike its parameter (the step reads the gradient's local rows
    as the parameter's: a ``Replicate`` or ``Partial`` gradient's whole local matrix had been sent
    where its owner expected rows, a mismatched all-to-all after the momentum had moved).
    :meth:`MatrixOptimizer.step` calls it for every group before any work or collective: these
    are host-side facts that are the same on every rank (placements, meshes), so every rank
    refuses together, where a torch error inside a collective step would leave the other
    ranks waiting. Three exceptions are
    rank-local, refused on their own rank only: a shard whose row count is not the ``torch.chunk``
    split (only a hand-made ``DTensor.from_local(..., run_check=False)`` has one), a gradient
    placed on some ranks only unlike its parameter (FSDP2 places every rank's gradient alike), and
    the layout of a frozen parameter (``requires_grad=False``) given a gradient by hand on some
    ranks only (checked where it has one).

    Returns the group's ``DTensor`` parameters (all of them, in the group's order) where its step
    reads their finiteness (:meth:`~geomuon.optimizers.base.MatrixOptimizer._finite_on_host`, a
    collective on their mesh), else ``[]``. The rule, host-side and the same on every rank: a
    group is read when a ``DTensor`` of it has a gradient here or requires one (a trainable group
    without a gradient on this rank reads too: another rank may have one, and waits for it; a
    frozen one costs no read). Such a group has its options recorded (:func:`_fingerprint`, no
    host read) for the comparison across ranks before the step's first finiteness all-reduce on
    its mesh (:func:`compare_options`): whether the options are the same on every rank is not a
    host-side fact of one rank."""
    pending = optimizer.__dict__.setdefault("_pending_options", [])
    if index == 0:  # a new step: what a refused step left unread is not this step's
        pending.clear()
    # asked once per parameter and step: the group's params may be edited between steps
    sharded = [is_sharded(p) for p in group["params"]]
    tracked = [p for p, s in zip(group["params"], sharded) if s]
    with_grad = {id(p) for p in params}
    stepped = [p for p in tracked if id(p) in with_grad]
    if not stepped and not any(p.requires_grad for p in tracked):
        return []
    where = f"{type(optimizer).__name__} param group {index}"

    def name(p):  # (for a message only: its position found by identity)
        position = next(i for i, q in enumerate(group["params"]) if q is p)
        return f"parameter {optimizer._name(group, position, index)}"

    # a trainable plain tensor, not one with a gradient here: which gradients exist is a rank's
    # own (a plain gradient on rank 0 alone had been refused there while rank 1 compared the
    # options alone, until the process group's timeout); which tensors require one is the model's
    # (a gradient set by hand on a frozen plain tensor on some ranks only is still that rank's
    # decision); the DTensor named likewise, a trainable one before one with a gradient here
    plain = next((p for p, s in zip(group["params"], sharded) if not s and (p.requires_grad or p.grad is not None)),
                 None)
    if plain is not None:  # beside a DTensor that has a gradient, or requires one
        dtensor = ([p for p in tracked if p.requires_grad] or stepped)[0]
        raise ValueError(
            f"{where}: {name(dtensor)} is a DTensor (FSDP2-sharded) and {name(plain)} a plain tensor; a param "
            "group's parameters are all sharded or none: build the optimizer after fully_shard has sharded every "
            "module it steps, or put the plain ones in a param group of their own")
    mesh = tracked[0].device_mesh
    for p in tracked[1:]:
        if p.device_mesh != mesh:
            raise ValueError(
                f"{where}: {name(p)} is on the device mesh of ranks {p.device_mesh.mesh.tolist()}, "
                f"{name(tracked[0])} on that of ranks {mesh.mesh.tolist()}; a param group's sharded parameters "
                "share one mesh (their step is collective on it): put the parameters of each mesh in a param "
                "group of their own")
    if group["update"] != "adamw" or optimizer._group_regulator(group, index) is not None:
        world_rank = None  # the mesh's, asked once: every parameter is on it
        # a parameter's layout is the model's, the same on every rank; its gradient is a rank's own
        for p in (p for p in tracked if p.requires_grad or id(p) in with_grad):
            rows, rank = _layout(p, lambda: f"{where}: {name(p)}", world_rank)  # called at once, in the loop
            world_rank = (len(rows), rank)
            grad = p.grad
            if id(p) in with_grad and group["update"] != "adamw" and not (
                    is_sharded(grad) and grad.device_mesh == mesh and grad.placements == p.placements):
                placed = "a plain tensor" if not is_sharded(grad) else (
                    f"placed {tuple(grad.placements)} on the device mesh of ranks {grad.device_mesh.mesh.tolist()}")
                raise ValueError(
                    f"{where}: the gradient of {name(p)} is {placed}, the parameter is placed {tuple(p.placements)} "
                    f"on that of ranks {mesh.mesh.tolist()}; the sharded matrix step reads the gradient's rows as "
                    "the parameter's: give it the parameter's placement (FSDP2's reduce-scatter does; by hand: "
                    "p.grad = p.grad.redistribute(p.device_mesh, p.placements))")
    _record_options(optimizer, group, index, mesh, sharded)
    return tracked


#: the entry of a group's compared options that lists its sharded parameters' names, shapes and dtypes
_PARAMETERS = "parameters"


def _record_options(optimizer, group: dict, index: int, mesh, sharded: list[bool]) -> None:
    """Record the options of sharded group ``index`` on ``mesh`` for :func:`compare_options`
    (every rank records every trainable sharded group, with gradients here or not:
    :meth:`~geomuon.optimizers.base.MatrixOptimizer._finite_on_host` reads each on every rank,
    and a rank without entries had skipped the all-reduce the others waited in), with the name
    (``param_names``' entry, or its position), global shape and dtype of each of its sharded
    parameters, in the group's order (:data:`_PARAMETERS`): a group listing its parameters in
    another order on one rank (built from a ``set``, say) had sent another batch's rows into the
    all-to-all, where gloo aborted every process, and one listing a parameter more had sent a
    longer vector into the finiteness all-reduce (two same-shape parameters swapped are told
    apart by their ``param_names`` only: without names they step each other's rows).
    ``sharded``: whether each of the group's params is a ``DTensor`` (:func:`check_group` asks once).

    That text is formatted again only where what it is made of changed (the group's names, its
    sharded parameters' positions, shapes and dtypes: a group edited between steps, a
    ``model.to(dtype)``): those are read at every step, the formatting is saved (on the CPU,
    this function took 2.4 us per sharded parameter at every step, 1.1 us with the text kept)."""
    options = {key: group.get(key) for key in optimizer._option_keys}  # (sorted: the same order on every rank)
    names = group.get("param_names")
    made_of = (tuple(names) if names else None,
               tuple((i, p.shape, p.dtype) for i, (p, s) in enumerate(zip(group["params"], sharded)) if s))
    texts = optimizer.__dict__.setdefault("_parameter_texts", {})  # {index: (made_of, text)}
    cached = texts.get(index)
    if cached is None or cached[0] != made_of:
        cached = texts[index] = (made_of, ", ".join(f"{optimizer._name(group, i, index)} {list(shape)} {dtype}"
                                                        for i, shape, dtype in made_of[1]))
    options[_PARAMETERS] = cached[1]
    optimizer._pending_options.append(_PendingOptions(index, mesh, options, *_fingerprint(options)))


#: fingerprints are residues modulo this prime (below $2^{31}$: a negated one fits in int64)
_FINGERPRINT_MODULUS = 2**31 - 1


@dataclass
class _PendingOptions:
    """A sharded group's options as this rank sees them, compared across the ranks of ``mesh``
    by :func:`compare_options`, before the step's first finiteness all-reduce there."""

    #: the param group's index
    group: int
    mesh: object
    #: ``{option: value}`` on this rank, the keys sorted, then :data:`_PARAMETERS`
    options: dict
    #: :func:`_fingerprint` of ``options``: the text's, and the tensors' (on their device; ``None``
    #: where no option is a tensor)
    text_fingerprint: int
    tensor_fingerprint: torch.Tensor | None


def _canonical(value, tensors: list[torch.Tensor] | None = None) -> str:
    """Text of an option value that is the same in every process for equal values (an object's
    default ``repr`` carries its address, a process's own: its type's name stands in).
    Tensors are appended to ``tensors`` (their values stay on the device) and named by dtype
    and shape; with ``tensors=None`` their values are written out (a host read)."""
    if isinstance(value, torch.Tensor):
        if tensors is None:
            return f"tensor({value.tolist()}, {value.dtype})"
        tensors.append(value)
        return f"tensor({value.dtype}, {tuple(value.shape)})"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(_canonical(v, tensors) for v in value)})"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda item: repr(item[0]))
        return "{" + ", ".join(f"{k!r}: {_canonical(v, tensors)}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):  # sorted: a set's order depends on the process's hash seed
        return f"{type(value).__name__}({', '.join(sorted(_canonical(v, tensors) for v in value))})"
    text = repr(value)
    if " at 0x" in text:
        kind = value if callable(value) and hasattr(value, "__qualname__") else type(value)
        return f"{kind.__module__}.{kind.__qualname__}"
    return text


def _fingerprint(value) -> tuple[int, torch.Tensor | None]:
    r"""$\mathrm{crc32}(t) \bmod p$ (a host int), $p = 2^{31} - 1$, of the canonical text $t$ of
    ``value`` (:func:`_canonical`), and for its tensors $k = 1, 2, \dots$ (``None`` without any)
    the 0-dim int64 on their device $\sum_k k\,\big(\sum_j j\,(31 h_{kj} + l_{kj}) \bmod p\big)$,
    $h_{kj}, l_{kj}$ the high and low 32 bits of entry $j$ (from 1) in float64 (exact for every
    floating dtype). Equal values give equal fingerprints in every process; a collision
    (probability $\approx 2^{-31}$) only misses a disagreement. No host read, and device work
    only for tensor options (a scheduled ``lr``)."""
    tensors: list[torch.Tensor] = []
    text = zlib.crc32(_canonical(value, tensors).encode()) % _FINGERPRINT_MODULUS
    term = None
    for k, t in enumerate(tensors, 1):
        bits = t.detach().reshape(-1).to(torch.float64).view(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        entries = ((bits >> 32) & 0xFFFFFFFF) * 31 + (bits & 0xFFFFFFFF)
        part = k * (entries.remainder(_FINGERPRINT_MODULUS) * weights).remainder(_FINGERPRINT_MODULUS).sum()
        term = part if term is None else term + part
    return text, term


def _options_agree(pending: list[_PendingOptions], mesh, device: torch.device) -> torch.Tensor:
    r"""1-element bool on ``device``: whether every rank of ``mesh`` recorded the same groups
    with the same options (:func:`_fingerprint` of each, its two parts summed as $f_j$, combined
    as $\big(\sum_j (j + 1) f_j + \mathrm{crc32}(\text{group indices})\big) \bmod p$, one number
    whatever the groups, so a rank with another number of groups meets the others' all-reduce),
    by $\max_r f_r = -\max_r(-f_r)$: one all-reduce of both. The text parts are summed on the
    host, the tensor parts (where an option is a tensor) on the device."""
    indices = zlib.crc32(repr([entry.group for entry in pending]).encode())
    texts = sum((j + 1) * entry.text_fingerprint for j, entry in enumerate(pending)) + indices
    combined = torch.full((1,), texts % _FINGERPRINT_MODULUS, dtype=torch.int64, device=device)
    for j, entry in enumerate(pending):
        if entry.tensor_fingerprint is not None:
            combined = combined + (j + 1) * entry.tensor_fingerprint.to(device)
    combined = combined.remainder(_FINGERPRINT_MODULUS)
    both = torch.cat([combined, -combined])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return both[:1] == -both[1:]


def _all_to_all(outgoing: list[list[torch.Tensor]], incoming: list[list[tuple[tuple, torch.dtype]]],
                group, rank: int, stats: ShardingStats, device: torch.device) -> list[list[torch.Tensor]]:
    """Send ``outgoing[d]`` (tensors) to rank ``d``; receive tensors of the (shape, dtype)
    list ``incoming[s]`` from rank ``s``. One ``all_to_all_single`` on a byte buffer on
    ``device`` (the parameters': NCCL takes no CPU buffer, even an empty one from a rank
    that sends nothing)."""
    pieces = [t.contiguous().reshape(-1).view(torch.uint8) for chunks in outgoing for t in chunks]
    send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
    send_sizes = [sum(t.numel() * t.element_size() for t in chunks) for chunks in outgoing]
    nbytes = [[math.prod(shape) * dtype.itemsize for shape, dtype in specs] for specs in incoming]
    recv_sizes = [sum(sizes) for sizes in nbytes]
    if len(outgoing) == 1:
        recv = send
    else:
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        stats.collectives += 1
        stats.bytes_sent += sum(send_sizes) - send_sizes[rank]
        stats.bytes_received += sum(recv_sizes) - recv_sizes[rank]
    received, offset = [], 0
    for specs, sizes in zip(incoming, nbytes):
        tensors = []
        for (shape, dtype), size in zip(specs, sizes):
            # clone: a slice at an odd byte offset cannot be viewed as a wider dtype
            tensors.append(recv[offset:offset + size].clone().view(dtype).reshape(shape))
            offset += size
        received.append(tensors)
    return received


@contextlib.contextmanager
def _standing_in(optimizer, group: dict, proxies: list[torch.Tensor], params: list[torch.Tensor]):
    """While the whole-matrix code runs, each full ``proxy`` stands in for its parameter:
    ``optimizer.state[proxy]`` is the parameter's state dict (what is written there stays
    with the parameter) and the group lists the proxy in its place (lookups by identity,
    e.g. a parameter's name, find it)."""
    positions = {id(p): i for i, p in enumerate(group["params"])}
    listed = list(group["params"])
    for q, p in zip(proxies, params):
        optimizer.state[q] = optimizer.state[p]
        group["params"][positions[id(p)]] = q
    try:
        yield
    finally:
        group["params"][:] = listed
        for q in proxies:
            del optimizer.state[q]


def sharded_matrix_step(optimizer, group: dict, params: list[torch.Tensor], lr: float) -> None:
    """One step of a same-shape batch of ``DTensor`` parameters (the module's recipe).

    Momentum in the parameters' dtype on the shards; the whole-matrix work in the
    optimizer's own kernels (their dtypes) on the owner ranks; bytes moved exactly. The
    batch has passed :func:`check_group` (one mesh, ``Shard(0)`` rows). An exception in an
    owner's work is raised later, on every rank (the module docstring's *failure on an owner*).
    """
    from .base import MatrixOptimizer

    index = optimizer._group_index(group)
    rows, rank = _layout(params[0], f"{type(optimizer).__name__} param group {index}: a parameter")
    stats = sharding_stats(optimizer)
    world = len(rows)
    momentum = group["momentum"]
    grads = [p.grad.to_local() for p in params]
    bufs = []
    for p in params:
        state = optimizer.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        bufs.append(state["momentum_buffer"].to_local())
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    dtype = optimizer._stack_dtype(group, params[0])
    local_momentum = [(g.lerp(b, momentum) if group["nesterov"] else b).to(dtype) for g, b in zip(grads, bufs)]
    regulator = optimizer._group_regulator(group, index)
    elementwise = type(optimizer)._apply is MatrixOptimizer._apply and regulator is None
    shape = optimizer._matrix_shape(group, params[0])

    if elementwise and optimizer._rowwise_direction(group):
        local_shape = (rows[rank], *shape[1:])
        stack = torch.stack([m.reshape(local_shape) for m in local_momentum])
        update = optimizer._direction(group, stack, params)
        stats.direction_calls += 1
        stats.matrices_mapped += len(params) * rows[rank] / params[0].shape[0]
        _apply_shards(optimizer, group, params, [u.reshape(m.shape) for u, m in zip(update, local_momentum)], lr)
        return

    # a matrix's owner is fixed by its place in its whole batch (the group's parameters of its
    # batch key), not in this step's: a batch-mate dropped for a non-finite gradient had moved
    # the matrices after it to other ranks, away from their warm starts and step counts
    key = optimizer._batch_key(group, params[0])
    batch = [q for q in group["params"] if optimizer._batch_key(group, q) == key]
    first = next(i for i, q in enumerate(q for g in optimizer.param_groups for q in g["params"]) if q is batch[0])
    place = {id(q): i for i, q in enumerate(batch)}
    owner = [(first + place[id(p)]) % world for p in params]
    optimizer.__dict__.setdefault("_matrix_owners", {}).update((id(p), o) for p, o in zip(params, owner))
    mine = [i for i, o in enumerate(owner) if o == rank]
    tail = tuple(params[0].shape[1:])
    replicas = optimizer.__dict__.setdefault("_replicas", {})
    # what every rank sends for matrix i: (kind, dtype, tensor) with kind "rows" (its rows)
    # or "flag" (one byte); every rank knows every matrix's layout (host state only)
    if elementwise:
        fields = [[("rows", dtype, m)] for m in local_momentum]
    else:
        slot = torch.promote_types(dtype, params[0].dtype)  # holds the momentum or the weights exactly
        fields = []
        for p, m, o in zip(params, local_momentum, owner):
            replica = _held_replica(optimizer, p)
            if replica is not None and replica.owner == o:
                # the rows differ in some bit from what this optimizer last wrote there: send
                # them instead of the momentum (the owner refreshes its copy, the step is skipped)
                changed = _bits(p.to_local()).ne(_bits(replica.rows)).any()
                fields.append([("rows", slot, torch.where(changed, p.to_local().to(slot), m.to(slot))),
                               ("flag", torch.uint8, changed.to(torch.uint8).reshape(1))])
            else:
                fields.append([("rows", dtype, m), ("rows", p.dtype, p.to_local())])
    # 2. out: every field of matrix i to its owner
    outgoing = [[t for i in range(len(params)) if owner[i] == d for _, _, t in fields[i]] for d in range(world)]
    incoming = [[((rows[s], *tail) if kind == "rows" else (1,), kind_dtype)
                 for i in mine for kind, kind_dtype, _ in fields[i]] for s in range(world)]
    group_handle = params[0].device_mesh.get_group()
    received = _all_to_all(outgoing, incoming, group_handle, rank, stats, params[0].device)
    pieces, offset = [], 0  # pieces[j][f]: field f of the j-th owned matrix, one tensor per rank
    for i in mine:
        pieces.append([[received[s][offset + f] for s in range(world)] for f in range(len(fields[i]))])
        offset += len(fields[i])
    # 3. the owner's whole-matrix work. An exception here (out of memory, a linalg error: an
    # owner's alone) must not leave the other ranks in the collective below until the process
    # group's timeout: the owner still takes part in it, returning its matrices unchanged
    # with a failure flag, and every rank raises at the next read of the flags
    results: list[torch.Tensor] = []
    error = None
    back_dtype = dtype if elementwise else params[0].dtype
    if mine:
        owned = [params[i] for i in mine]
        stats.direction_calls += 1
        stats.matrices_mapped += len(mine)
        try:
            if elementwise:
                stack = torch.stack([torch.cat(fs[0]).reshape(shape) for fs in pieces])
                update = optimizer._direction(group, stack, owned)
                results = [u.reshape(p.shape) for u, p in zip(update, owned)]
            else:
                results = _owner_step(optimizer, group, owned, pieces, replicas, rows, dtype, shape, regulator,
                                      lr, stats)
        except Exception as err:  # any error: raised on every rank by read_failures, this one its cause
            # the frames' locals (the stacks that ran out of memory, say) are freed now, not when
            # the error is raised; the traceback still says where it happened
            traceback.clear_frames(err.__traceback__)
            error = err
            # no update, or the weights the step started from (what the ranks sent)
            results = ([torch.zeros(p.shape, dtype=back_dtype, device=p.device) for p in owned] if elementwise
                       else [_received_weights(p, fs, replicas, rows) for p, fs in zip(owned, pieces)])
    # 4. back: the owner's rows for every rank, and its failure flag (one byte per matrix).
    # Updates travel in the stack's dtype, new weights in the parameters': every rank, owner
    # or not, knows what comes back without another message
    results = [r.to(back_dtype) for r in results]
    flags = torch.full((len(mine),), error is not None, dtype=torch.uint8, device=params[0].device)
    starts = [sum(rows[:r]) for r in range(world)]
    outgoing = [[*(r[starts[d]:starts[d] + rows[d]] for r in results), flags] for d in range(world)]
    by_owner = [[i for i in range(len(params)) if owner[i] == s] for s in range(world)]
    incoming = [[*(((rows[rank], *tail), back_dtype) for _ in ids), ((len(ids),), torch.uint8)] for ids in by_owner]
    back = _all_to_all(outgoing, incoming, group_handle, rank, stats, params[0].device)
    local = [None] * len(params)
    for s in range(world):
        for piece, i in zip(back[s], by_owner[s]):
            local[i] = piece
    # every rank holds every owner's flags now; they reach the host with the next read the
    # step makes anyway (no host synchronisation here)
    optimizer.__dict__.setdefault("_failures", []).append(_Failure(
        index, [params[i] for ids in by_owner for i in ids], [s for s, ids in enumerate(by_owner) for _ in ids],
        params[0].device_mesh, torch.cat([b[-1] for b in back]), error))
    if elementwise:
        _apply_shards(optimizer, group, params, local, lr)
        return
    full = dict(zip(mine, results))
    for i, (p, w) in enumerate(zip(params, local)):
        p.to_local().copy_(w)
        replicas[id(p)] = _Replica(owner[i], optimizer.state[p], w, full.get(i))


@dataclass
class _Failure:
    """The failure flags of one sharded batch step, read on the host later (:func:`read_failures`)."""

    #: the param group's index
    group: int
    #: the batch's parameters, in the order of ``flags``
    params: list
    #: their owners (ranks on ``mesh``)
    owners: list[int]
    mesh: object
    #: ``[B]`` uint8 on the device: 1 where the owner's work raised
    flags: torch.Tensor
    #: the exception, on the owner that raised it (``None`` elsewhere)
    error: BaseException | None


def read_failures(optimizer, values: torch.Tensor | None = None, mesh=None) -> list:
    """``values.tolist()`` (a host read the caller makes anyway; ``None``: nothing but the
    flags), with the failure flags of the sharded steps on ``mesh`` (every mesh: ``None``)
    not read yet carried in the same transfer; raises ``RuntimeError`` naming the
    parameters whose owner's work failed.

    Every rank of a mesh holds the same failure flags (each owner sent its own to every rank),
    so every rank raises for them here, at the same point, with no collective for them."""
    return _read(optimizer, values, mesh, [])


def compare_options(optimizer, mesh, device: torch.device) -> None:
    """Compare across the ranks of ``mesh`` the options of the sharded groups :func:`check_group`
    recorded on ``mesh`` in this step (none left: nothing to do, no collective): one all-reduce
    of 2 int64 on ``device`` (:func:`_options_agree`), a collective (every rank of ``mesh`` calls
    this at the same point, the step's first finiteness check there), read to the host with the
    failure flags pending on ``mesh`` (:func:`read_failures`, whose ``RuntimeError`` comes
    first); raises ``ValueError`` naming the group and the option where they differ. The read
    is its own, before the finiteness all-reduce: that one's length is the group's number of
    sharded parameters, which only this comparison shows to be the same on every rank."""
    options = optimizer.__dict__.get("_pending_options", [])
    compared = [entry for entry in options if entry.mesh == mesh]
    if compared:
        options[:] = [entry for entry in options if entry.mesh != mesh]
        _read(optimizer, torch.empty(0, dtype=torch.int64, device=device), mesh, compared)


def _read(optimizer, values: torch.Tensor | None, mesh, compared: list[_PendingOptions]) -> list:
    """:func:`read_failures`, with the options ``compared`` (their entries on ``mesh``, taken
    from the pending ones; ``values`` then on the device of the all-reduce) compared across the
    ranks of ``mesh`` in the same transfer (:func:`compare_options`)."""
    pending = optimizer.__dict__.get("_failures", [])
    read = [f for f in pending if mesh is None or f.mesh == mesh]
    if not read and not compared:
        return [] if values is None else values.tolist()
    pending[:] = [f for f in pending if not (mesh is None or f.mesh == mesh)]
    if values is None:
        values = torch.empty(0, dtype=torch.uint8, device=read[0].flags.device)
    agree = [_options_agree(compared, mesh, values.device).to(values.dtype)] if compared else []
    host = torch.cat([values.reshape(-1), *agree, *(f.flags.to(values.device, values.dtype) for f in read)]).tolist()
    agreed = host[values.numel():values.numel() + len(agree)]
    flags, start = host[values.numel() + len(agreed):], 0
    failed, errors = [], []
    for f in read:
        for p, o, flag in zip(f.params, f.owners, flags[start:start + len(f.params)]):
            if flag:
                group = optimizer.param_groups[f.group]
                position = next(i for i, q in enumerate(group["params"]) if q is p)
                failed.append(f"{optimizer._name(group, position, f.group)} (group {f.group}, owner rank {o})")
                if f.error is not None and not any(e is f.error for e in errors):
                    errors.append(f.error)
        start += len(f.params)
    if failed:
        cause = errors[0] if errors else None
        raise RuntimeError(
            f"{type(optimizer).__name__}: the sharded step of parameter(s) {', '.join(failed)} failed on the "
            f"owner rank ({f'here: {type(cause).__name__}: {cause}' if cause else 'see that rank for the error'}). "
            "Every rank raises this at the next read of the step's flags; the step went on for the other "
            "matrices, and these got no update (a whole-matrix step left their weights as they were; an "
            "elementwise one still applied weight decay) but their momentum was updated: end the run, or "
            "reload a checkpoint (geomuon.pretrain.parallel.load_distributed)") from cause
    # after the failures (the same flags on every rank: all raise above, or none does), so that a
    # failed owner step is named even when a schedule has also made the options diverge
    if not all(agreed):  # every rank of the mesh is here: the all-reduce's result is the same on each
        _raise_for_differing_options(optimizer, compared, mesh)
    return host[:values.numel()]


def _raise_for_differing_options(optimizer, compared: list[_PendingOptions], mesh) -> None:
    """``ValueError`` naming the groups and options that differ between the ranks of ``mesh``,
    with every rank's value: each rank's options as text (tensors' values read) gathered by
    ``all_gather_object`` (a collective and host reads, on this path only; every rank of
    ``mesh`` takes it together)."""
    mine = {entry.group: {key: value if key == _PARAMETERS else _canonical(value)  # (that one is text already)
                          for key, value in entry.options.items()} for entry in compared}
    gathered: list = [None] * mesh.size()
    dist.all_gather_object(gathered, (type(optimizer).__name__, mine), group=mesh.get_group())
    classes, gathered = [name for name, _ in gathered], [groups for _, groups in gathered]
    listed = [] if len(set(classes)) == 1 else \
        ["the optimizer: " + ", ".join(f"rank {r}: {name}" for r, name in enumerate(classes))]
    for index in sorted(set().union(*gathered)):
        groups = [ranks_groups.get(index) for ranks_groups in gathered]
        if any(g is None for g in groups):
            missing = [r for r, g in enumerate(groups) if g is None]
            listed.append(f"param group {index} is not a sharded group with gradients on rank(s) {missing}")
            continue
        # every rank's keys (another optimizer class has others), in the order the ranks list them
        for key in dict.fromkeys(key for g in groups for key in g):
            texts = [g.get(key, "(no such option)") for g in groups]
            if len(set(texts)) > 1:
                what = "sharded parameters" if key == _PARAMETERS else f"option {key!r}"
                listed.append(f"param group {index} {what}: "
                              + ", ".join(f"rank {r}: {t}" for r, t in enumerate(texts)))
    raise ValueError(
        f"{type(optimizer).__name__}: the options of its sharded groups differ between the ranks of the device "
        f"mesh {mesh.mesh.tolist()} ({'; '.join(listed) or 'a fingerprint collision: no difference in their text'}); "
        "a sharded step is collective (each rank steps its rows, an owner maps the whole matrix): give every rank "
        "the same options and parameters, in the same order (build the optimizer and run its schedule alike on "
        "every rank); nothing on this mesh was stepped")


def _received_weights(p: torch.Tensor, fs: list, replicas: dict, rows: list[int]) -> torch.Tensor:
    """The whole weights an owner's step of ``p`` starts from: the weight rows every rank sent
    (``fs[1]``, no replica held), or the replica with the rows a flag in ``fs[1]`` marks as
    written outside the optimizer taken from ``fs[0]``."""
    if fs[1][0].dtype != torch.uint8:  # no replica: the weights came
        return torch.cat(fs[1])
    kept = replicas[id(p)].full
    starts = [sum(rows[:r]) for r in range(len(rows))]
    return torch.cat([torch.where(f.bool().reshape(()), x.to(p.dtype), kept[a:a + r])
                      for f, x, a, r in zip(fs[1], fs[0], starts, rows)])


@dataclass
class _Replica:
    """What a rank keeps of a whole-matrix step's result: the replica rule of the module docstring."""

    #: the rank that holds the whole matrix
    owner: int
    #: ``optimizer.state[p]`` when it was written (``load_state_dict`` replaces it)
    state: dict
    #: this rank's rows as the optimizer wrote them
    rows: torch.Tensor
    #: the whole matrix, on its owner (``None`` elsewhere)
    full: torch.Tensor | None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers (an exact comparison, NaN included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _owner_step(optimizer, group: dict, owned: list[torch.Tensor], pieces: list, replicas: dict, rows: list[int],
                dtype: torch.dtype, shape: tuple, regulator, lr: float, stats: ShardingStats) -> list[torch.Tensor]:
    """The owner's whole matrices stepped with the whole-matrix apply and the regulator: the
    new whole weights. ``pieces[j]`` holds matrix ``j``'s fields from every rank: momentum
    and weight rows, or (a replica held) momentum-or-weight rows and their flags."""
    momenta, points, stale = [], [], []
    for p, fs in zip(owned, pieces):
        points.append(_received_weights(p, fs, replicas, rows))
        if fs[1][0].dtype != torch.uint8:  # no replica: the weights came
            momenta.append(torch.cat(fs[0]))
            stale.append(None)
            continue
        stale.append(torch.stack([f.bool().reshape(()) for f in fs[1]]).any())
        momenta.append(torch.where(stale[-1], 0, torch.cat(fs[0])).to(dtype))
    # a refreshed matrix keeps its weights and the whole-matrix state entries the step
    # replaces (warm starts, step counts, a regulator's power-iteration vector) exactly:
    # its momentum is 0, and the selections below undo decay and regulators
    before = [w.clone() if s is not None else None for w, s in zip(points, stale)]
    kept_state = [None if s is None else {k: v for k, v in optimizer.state[p].items()
                                          if isinstance(v, torch.Tensor) and not is_sharded(v)}
                  for p, s in zip(owned, stale)]
    stack = torch.stack([m.reshape(shape) for m in momenta])
    with _standing_in(optimizer, group, points, owned):
        keep = None
        if any(x is not None for x in stale):
            keep = torch.stack([torch.ones((), dtype=torch.bool, device=stack.device) if x is None else ~x
                                for x in stale])
        update = optimizer._direction(group, stack, points, keep)
        optimizer._apply(group, points, update, lr, keep)
        if regulator is not None:
            for q in points:
                q.copy_(optimizer._regulated(group, regulator, q, lr, optimizer.state[q]))
    for p, s, old in zip(owned, stale, kept_state):  # whole-matrix state the step replaced
        state = optimizer.state[p]
        for key, value in (old or {}).items():
            new = state.get(key)
            if new is not value and isinstance(new, torch.Tensor) and new.shape == value.shape:
                state[key] = torch.where(s, value, new)
    refreshed = [s for s in stale if s is not None]
    if refreshed:
        stats.refreshed = stats.refreshed + torch.stack(refreshed).sum()
    return [q if s is None else torch.where(s, b, q) for q, b, s in zip(points, before, stale)]


def _apply_shards(optimizer, group: dict, params: list[torch.Tensor], local_updates: list[torch.Tensor],
                  lr: float) -> None:
    """``_apply`` on the parameters with the update rows wrapped as ``DTensor`` shards
    (so shape-dependent factors see the global matrix shape), in the dtype ``_direction``
    returned them, as the one-process step hands them over: ``_apply`` scales them by the
    lr before they meet the parameter's dtype (an fp32 polar update of fp16 weights can
    exceed fp16's range, 65504, before the lr scales it, and rounding it first wrote inf)."""
    optimizer._apply(group, params, [as_shard(u, p) for u, p in zip(local_updates, params)], lr)
