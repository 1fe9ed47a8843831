r"""``--parallel ddp`` and ``--parallel fsdp``: how a training step is spread over processes.

**DDP** (:func:`ddp`): the model is wrapped in ``DistributedDataParallel``, which
averages the gradients, and the optimizer work is sharded by parameter: each parameter
has one owner rank (:func:`geomuon.pretrain.train.owners`, a greedy balance of the
matrix work), every rank steps only the parameters it owns, and :class:`OwnerGather`
then sends the updated parameters to every rank with **one**
``all_gather_single`` (``all_gather_into_tensor``) per dtype: rank $r$ packs its parameters into a flat
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
import contextlib
import copy
import os
import pickle
import re
import shutil
import warnings
import zipfile
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from geomuon.optimizers.assign import check_same_groups
from geomuon.optimizers.distributed import as_shard, is_sharded, local_rows, matrix_owner, whole
from geomuon.pretrain.config import option_text

__all__ = ["OwnerGather", "RunWriteError", "DamagedCheckpoint", "ddp", "fsdp", "save_distributed", "load_distributed", "read_record",
           "checked_record", "read_distributed", "file_sum", "dcp_folder", "dcp_folders", "agreed", "from_rank_0"]


#: ``torch.distributed.all_gather_single`` where this torch has it (its ``all_gather_into_tensor``,
#: the same collective, warns that it is deprecated on every rank at every DDP step), else the old name.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass
class OwnerGather:
    """Bucketed hand-out of owner-updated parameters (one ``all_gather_single`` per dtype).

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
            pending.append((_all_gather_single(recv, send, group=self.group, async_op=True),
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
    owned = {id(p) for p, r in zip(params, handout.owner) if r == ddp.rank}
    return Parallel(module, before_step, handout.gather, owned=owned)


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
            dict, {moved[id(p)]: {k: _shard_like(k, v, moved[id(p)]) for k, v in s.items()}
                   for p, s in opt.state.items()})
    mirror = [(p, after[name]) for name, p in replica.named_parameters()]

    @torch.no_grad()
    def full_model():
        for full, sharded in mirror:
            full.copy_(whole(sharded.detach()))
        return replica

    return Parallel(model, _nothing, _nothing, full_model)


def _nothing() -> None:
    pass


#: Optimizer state entries that are elementwise in their parameter (torch's optimizers and
#: this package's): under FSDP2 they are split into the parameter's row shards. Any other
#: entry — a warm start, a step count — is whole-matrix state, kept whole (the shape is
#: no guide: the $n\times n$ warm start of a square matrix has the matrix's shape).
ELEMENTWISE_STATE = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})


def _elementwise(key: str, value_shape, param) -> bool:
    return key in ELEMENTWISE_STATE and tuple(value_shape) == tuple(param.shape)


def _shard_like(key: str, value, param):
    """``value`` split like ``param`` when it is a full elementwise state tensor (:data:`ELEMENTWISE_STATE`)."""
    if isinstance(value, torch.Tensor) and not is_sharded(value) and _elementwise(key, value.shape, param):
        return as_shard(local_rows(value, param).clone(), param)
    return value


# ----------------------------------------------------------------------------- distributed checkpoints

#: A distributed checkpoint is a folder ``dcp-step<step>`` of the run folder: the tensors
#: written by ``torch.distributed.checkpoint`` (``.metadata``, one ``.distcp`` file per
#: rank) and :data:`RUN_RECORD`, the plain data (step, config, log, param groups, and the size
#: and CRC-32 of every other file: DCP checks none of the bytes it reads back).
DCP_FOLDER = re.compile(r"dcp-step(\d+)")
RUN_RECORD = "run.pt"
METADATA = ".metadata"
#: bytes read at a time when a checkpoint file is summed (:func:`file_sum`)
SUM_CHUNK = 1 << 24
DCP_FORMAT = "geomuon-dcp/1"
#: distributed checkpoints a run keeps: the latest and the one before it
DCP_KEEP = 2


def dcp_folder(out_dir: str, step: int) -> str:
    """The folder of the distributed checkpoint of ``step`` in the run folder ``out_dir``."""
    return os.path.join(out_dir, f"dcp-step{step:08d}")


def dcp_folders(out_dir: str) -> list[tuple[int, str]]:
    """The complete distributed checkpoints of a run folder as ``(step, path)``, oldest
    first (a folder still being written ends in ``.tmp`` and is not listed)."""
    if not os.path.isdir(out_dir):
        return []
    found = [(int(m.group(1)), os.path.join(out_dir, name)) for name in os.listdir(out_dir)
             if (m := DCP_FOLDER.fullmatch(name))]
    return sorted(found)


def _state_key(optimizer: str, name: str, key: str) -> str:
    return f"optimizer/{optimizer}/{name}/{key}"


def _parameter_names(model) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _holds(optimizer, p, value, owned) -> bool:
    """Whether this rank's copy of ``optimizer.state[p]``'s ``value`` is the one to save.

    DDP (``owned``: ids of this rank's parameters): the owner holds the whole state.
    FSDP2: shards of the parameter's shape are held by every rank; whole-matrix state
    (warm starts, step counts, regulator state) by the rank that mapped the matrix last
    (:func:`geomuon.optimizers.distributed.matrix_owner`; before any sharded step, e.g.
    just after a load, every rank holds the same copy)."""
    if owned is not None:
        return id(p) in owned
    if is_sharded(value) or not is_sharded(p):
        return True
    owner = matrix_owner(optimizer, p)
    # the owner is a rank on p's mesh: on a sub-mesh (the dp dimension of a larger mesh) the
    # global rank differs, and comparing with it had saved no whole-matrix state at all
    return owner is None or owner == p.device_mesh.get_local_rank()


class RunWriteError(OSError):
    """A checkpoint or the log of a run could not be written (a full disk, a quota, a folder
    gone): the run stops, and its folder keeps the checkpoint it held before, if any."""


def checkpoint_write_error(path: str, err: OSError, kept: str | None, rank: int | None = None) -> RunWriteError:
    """The :class:`RunWriteError` of the checkpoint ``path`` that ``err`` (on process ``rank``, under
    torchrun) stopped: it names ``path``, the previous checkpoint ``kept`` (``None``: there is
    none) and what to do."""
    cause = (err.strerror or str(err)) + ("" if rank is None else f" on rank {rank}")
    then = (f"{kept!r} still holds the previous checkpoint: make room and continue with {option_text('resume', True)}"
            if kept
            else "no earlier checkpoint exists: make room and start again")
    return RunWriteError(err.errno, f"checkpoint {path!r} could not be written ({cause}); {then}")


def save_distributed(folder: str, model, assignment, record: dict | None, owned=None) -> None:
    r"""Write a distributed checkpoint to ``folder`` (every rank calls it; collective).

    Tensors through ``torch.distributed.checkpoint.save`` — the model's
    (``get_model_state_dict``: the ``Shard(0)`` ``DTensor``\ s of FSDP2 as shards, DDP's
    replicas once) and the optimizer state each rank holds (:func:`_holds`), keyed
    ``optimizer/<name>/<parameter name>/<key>`` so a different world size or layout
    finds them by name. Plain data — ``record`` (step, config, log…) and each optimizer's
    param groups (manifold and regulator specs) and non-tensor state — goes to
    :data:`RUN_RECORD` on rank 0 (read with ``weights_only=True``; DCP would pickle it):
    rank 0's ``record``, the other ranks pass ``None``. The record lists the size and CRC-32
    (:func:`file_sum`) of every file a load reads (``files``), each rank summing a share of them
    once DCP has written them all, so that :func:`checked_record` can refuse damaged bytes.

    Atomic: everything is written to ``folder + ".tmp"`` (files fsynced), and rank 0
    renames it to ``folder`` once every rank has finished; the older checkpoints beyond
    :data:`DCP_KEEP` are removed after that. A write that fails (``OSError``, a full disk) on
    any rank raises :class:`RunWriteError` on every rank, naming ``folder``, the rank and the
    previous checkpoint, which stays intact; the partial ``.tmp`` folder is removed.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    together = dist.is_initialized()
    main = not together or dist.get_rank() == 0
    tmp = folder + ".tmp"
    root = os.path.dirname(folder) or "."
    if main:  # folders left by a run killed while writing
        for name in os.listdir(root):
            if name.endswith(".tmp") and DCP_FOLDER.fullmatch(name[:-len(".tmp")]):
                shutil.rmtree(os.path.join(root, name))
    _barrier(together)
    names = _parameter_names(model)
    tensors = {f"model/{k}": v for k, v in get_model_state_dict(model).items()}
    plain: dict[str, dict] = {}
    for opt_name, opt in assignment.optimizers.items():
        extra = plain.setdefault(opt_name, {})
        for p, state in opt.state.items():
            for key, value in state.items():
                if not _holds(opt, p, value, owned):
                    continue
                if isinstance(value, torch.Tensor):
                    tensors[_state_key(opt_name, names[id(p)], key)] = value
                else:
                    extra.setdefault(names[id(p)], {})[key] = value
    failure = None  # (rank, OSError) of a write that failed
    try:
        written = dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not together)
    except CheckpointException as err:  # raised on every rank, whichever rank failed
        failure = _disk_failure(err)
    except OSError as err:  # (one process: DCP raises the error itself)
        failure = 0, err
    if failure is None:
        # every file a load reads, as DCP's metadata (the same on every rank) names them, and the
        # .metadata: each rank sums its share (:func:`_share`)
        rank, world = _rank_world(together)
        share = _share({info.relative_path for info in written.storage_data.values()} | {METADATA}, rank, world)
        try:
            sums = {name: file_sum(os.path.join(tmp, name)) for name in share}
        except OSError as err:  # rank 0 writes no record without every share; agreed() stops every rank
            sums, failure = None, (rank, err)
        gathered = [(plain, sums)]
        if together:
            gathered = [None] * world
            dist.all_gather_object(gathered, (plain, sums))
    if main and failure is None and all(share is not None for _, share in gathered):
        optimizers = {}
        for opt_name, opt in assignment.optimizers.items():
            extra = {}
            for other, _ in gathered:
                extra.update(other[opt_name])
            optimizers[opt_name] = {"param_groups": opt.state_dict()["param_groups"],
                                    "names": [names[id(p)] for g in opt.param_groups for p in g["params"]],
                                    "plain_state": extra}
        try:
            with open(os.path.join(tmp, RUN_RECORD), "wb") as f:
                torch.save({"format": DCP_FORMAT, **record, "optimizers": optimizers,
                            "files": {name: value for _, share in gathered for name, value in share.items()}}, f)
                f.flush()
                os.fsync(f.fileno())
            _move_into_place(tmp, folder, root)
        except OSError as err:
            failure = 0, err
    failure = agreed(failure, together)  # rank 0's own failure too: every rank raises, none waits for it
    if failure is not None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # the space a retry needs
        _barrier(together)  # every rank raises once it is gone
        rank, err = failure
        previous = dcp_folders(root)
        raise checkpoint_write_error(folder, err, previous[-1][1] if previous else None,
                                     rank if together else None) from err
    if main:
        with contextlib.suppress(OSError):  # the next checkpoint removes them again
            for _, stale in dcp_folders(root)[:-DCP_KEEP]:
                shutil.rmtree(stale)
    _barrier(together)


def _disk_failure(err) -> tuple[int, OSError]:
    """The first rank's ``OSError`` among the failures DCP gathered in ``err``; ``err`` itself when
    no rank failed to write (a fault of the program, not of the disk)."""
    for rank, (failure, _) in sorted(err.failures.items()):
        if isinstance(failure, OSError):
            return rank, failure
    raise err


def _rank_world(together: bool) -> tuple[int, int]:
    """This process's ``(rank, world size)``: the process group's under torchrun, ``(0, 1)`` alone."""
    return (dist.get_rank(), dist.get_world_size()) if together else (0, 1)


def agreed(failure, together: bool):
    """The first failure of any rank, on every rank (a collective under torchrun)."""
    if not together:
        return failure
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f is not None), None)


def from_rank_0(value, together: bool):
    """``value()`` (a callable) of rank 0 on every rank, or the exception it raised, raised on every
    rank; the other ranks do not call it (``together``, under torchrun: one broadcast, a collective).
    Alone, ``value()``. A result that cannot be pickled raises a ``RuntimeError`` saying so on every
    rank (rank 0 had raised pickle's error alone, before the broadcast the others waited in); one
    that cannot be unpickled (an exception whose ``__init__`` takes other arguments) raises one on
    the ranks that receive it."""
    if not together:
        return value()
    rank, _ = _rank_world(together)
    box = [None]
    if rank == 0:
        try:
            outcome = (value(), None)
        except Exception as err:  # every rank raises it: none is left waiting for rank 0
            outcome = (None, err)
        try:
            box[0] = pickle.dumps(outcome)
        except Exception as err:
            outcome = (None, RuntimeError(f"rank 0's result cannot be sent to the other ranks ({err})"))
            box[0] = pickle.dumps(outcome)
    dist.broadcast_object_list(box, src=0)
    if rank != 0:
        try:
            outcome = pickle.loads(box[0])
        except Exception as err:
            outcome = (None, RuntimeError(f"rank 0's result cannot be read on this rank ({err})"))
    result, err = outcome
    if err is not None:
        raise err
    return result


def _move_into_place(tmp: str, folder: str, root: str) -> None:
    """Rename the complete ``tmp`` to ``folder``. A ``folder`` already there (the same step
    written again: a run resumed and stopped at once) is replaced, and put back when the rename
    fails."""
    old = folder + ".old"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(folder):
        os.replace(folder, old)
    try:
        os.replace(tmp, folder)
    except OSError:
        if os.path.exists(old):
            os.replace(old, folder)
        raise
    _fsync_dir(root)
    if os.path.exists(old):
        shutil.rmtree(old)


def load_checked(path: str):
    """``torch.load(path, weights_only=True)`` on the CPU, after checking every entry of the zip
    archive ``torch.save`` wrote against its CRC-32: ``torch.load`` does not, and flipped bytes
    inside a tensor had loaded as weights (a resumed run then diverged). Raises ``ValueError``
    naming the damaged entry; a file that is no zip archive is left to ``torch.load``'s errors."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
        if damaged is not None:
            raise ValueError(f"its entry {damaged!r} fails its CRC check (damaged bytes)")
    return torch.load(path, map_location="cpu", weights_only=True)


class DamagedCheckpoint(ValueError):
    """A distributed checkpoint folder that is incomplete or whose files cannot be read (the
    previous folder may be whole), as against one written by other settings (which no folder of
    the run resumes under these)."""


def _dcp_name(folder: str) -> str:
    """How a message names the distributed checkpoint ``folder``: ``distributed checkpoint '<folder>'``."""
    return f"distributed checkpoint {folder!r}"


def file_sum(path: str) -> dict[str, int]:
    """``{"bytes": size, "crc32": zlib's CRC-32}`` of the file ``path``, read in chunks of
    :data:`SUM_CHUNK` bytes."""
    crc = size = 0
    with open(path, "rb") as f:
        while chunk := f.read(SUM_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


def _share(names, rank: int, world: int) -> list[str]:
    """The files of ``names`` (a checkpoint's) that process ``rank`` of ``world`` sums at a save and
    checks at a load: :data:`METADATA` on rank 0 (when listed), and every ``world``-th tensor file in
    name order from the ``rank``-th on (for fewer than 11 ranks the ``__<rank>_<n>.distcp`` the rank
    wrote). One process's share is every file."""
    tensors = sorted(set(names) - {METADATA})
    return ([METADATA] if rank == 0 and METADATA in names else []) + tensors[rank::world]


def read_record(folder: str, together: bool = False) -> dict:
    """The plain data of a distributed checkpoint (:data:`RUN_RECORD`); ``ValueError``
    (:class:`DamagedCheckpoint`) naming the folder when it is not a complete geomuon distributed
    checkpoint. Its files' bytes are not read: :func:`checked_record` checks them too.

    ``together`` (every rank calls it; collective): the ranks agree on the verdict, so that a read
    failing on one rank alone (an I/O error on its machine) raises the same refusal on every rank
    rather than leave the others waiting in their next collective."""
    record, problem = _record_problem(folder)
    _refuse_together(folder, problem, together)
    return record


def _refuse_together(folder: str, problem: str | None, together: bool) -> None:
    """Raise :class:`DamagedCheckpoint` naming ``folder`` with the first rank's ``problem`` (this
    process's alone, or ``together``: every rank calls it, a collective, :func:`agreed`); nothing
    when no rank has one."""
    problem = agreed(problem, together)
    if problem is not None:
        raise DamagedCheckpoint(f"{_dcp_name(folder)} {problem}")


def _record_problem(folder: str) -> tuple[dict | None, str | None]:
    """``(record, None)``: the plain data of ``folder`` (:func:`read_record`); ``(None, problem)``:
    what makes it no complete geomuon distributed checkpoint."""
    path = os.path.join(folder, RUN_RECORD)
    if not os.path.isfile(os.path.join(folder, METADATA)):
        return None, "has no .metadata (torch.distributed.checkpoint did not finish it)"
    if not os.path.isfile(path):
        return None, f"has no {RUN_RECORD}"
    try:
        record = load_checked(path)
    except Exception as err:  # torch raises several types for a damaged zip archive
        return None, f"has an unreadable {RUN_RECORD} ({str(err).split('. ')[0]})"
    if not isinstance(record, dict) or record.get("format") != DCP_FORMAT:
        return None, f"has a {RUN_RECORD} that is not a {DCP_FORMAT} record"
    return record, None


def checked_record(folder: str, together: bool, record: dict | None = None) -> dict:
    """:func:`read_record` of ``folder`` once every file the record lists (the tensor files and
    ``.metadata``) is read and checked against the size and CRC-32 written with it
    (:func:`file_sum`): DCP reads raw tensor bytes unchecked, and a flipped byte had loaded as a
    weight of 63. One that differs or is missing raises :class:`DamagedCheckpoint` naming it.

    ``together`` (every rank calls it; collective): the checkpoint is read once, as the save summed
    it: each rank checks its share (:func:`_share`) and the ranks agree on the verdict (the
    record's read included, in the same collective), so that all raise the first rank's finding and
    none is left waiting in a later collective. Alone, this process checks every file. ``record``:
    the folder's :func:`read_record`, when it was read already (a resume reads it first, to check
    its settings)."""
    rank, world = _rank_world(together)
    problem = None
    if record is None:
        record, problem = _record_problem(folder)
    if problem is None:
        problem = _damaged_file(folder, record, rank, world)
    _refuse_together(folder, problem, together)
    return record


def _damaged_file(folder: str, record: dict, rank: int, world: int) -> str | None:
    """What is wrong with the first file of process ``rank``'s share (:func:`_share`; of one
    process: every file) of ``folder`` that differs from the size and CRC-32 its ``record`` lists;
    ``None`` when all match. A checkpoint written before records listed them has no ``files``: it
    is read unchecked, as before."""
    listed = record.get("files", {})
    for name in _share(listed, rank, world):
        written = listed[name]
        try:
            found = file_sum(os.path.join(folder, name))
        except FileNotFoundError:
            return f"has no {name}"
        except OSError as err:
            return f"has an unreadable {name} ({err.strerror or err})"
        if found["bytes"] != written["bytes"]:
            return f"has a {name} of {found['bytes']} bytes, written with {written['bytes']}"
        if found["crc32"] != written["crc32"]:
            return f"has a {name} that fails its CRC-32 check (damaged bytes)"
    return None


def load_distributed(folder: str, model, assignment, owned=None, record: dict | None = None) -> dict:
    r"""Load the distributed checkpoint ``folder`` into ``model`` (as parallelized: FSDP2
    shards, DDP replicas or a plain model) and ``assignment``'s optimizers; returns its
    record. Collective when a process group is initialized; a single process reads it
    alone. Any world size: ``torch.distributed.checkpoint.load`` reads every tensor
    into the layout of this run (``Shard(0)`` rows of this world size, or whole).

    Optimizer state is loaded for the parameters this rank holds (``owned`` under DDP,
    every parameter otherwise); elementwise state (:data:`ELEMENTWISE_STATE`) takes the
    parameter's layout, any other (warm starts, step counts) is loaded whole, on the parameter's
    device but a ``"step"`` count, on the CPU as a one-process resume loads it. ``record``: the
    folder's :func:`read_record`, when it was read already (it is not read again).

    Raises:
        ValueError: naming ``folder``, for an incomplete folder, one written by another
            model or strategy (the names that differ; or, as a one-process resume refuses it,
            :func:`geomuon.optimizers.assign.check_same_groups`, an optimizer's param group
            holding other parameters, the same ones in another order, or another geometry: its
            state is matched by position; or saved options the optimizer's load refuses), or
            (:class:`DamagedCheckpoint`) an incomplete folder, unreadable files or files whose
            size or CRC-32 differs from the record's (each rank reads its share of the files,
            :func:`_share`, and every rank raises the first rank's finding); raised before
            anything is loaded.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    together = dist.is_initialized()
    record = checked_record(folder, together, record)  # (before DCP's collectives, which a refusing rank would leave)
    saved = _saved_entries(folder, together)
    model_state = get_model_state_dict(model)
    expected = {f"model/{k}" for k in model_state}
    present = {k for k in saved if k.startswith("model/")}
    if expected != present or set(record["optimizers"]) != set(assignment.optimizers):
        differ = sorted(expected ^ present) + sorted(set(record["optimizers"]) ^ set(assignment.optimizers))
        raise ValueError(f"{_dcp_name(folder)} was written for another model or strategy "
                         f"(entries that differ: {', '.join(differ[:6])}{' …' if len(differ) > 6 else ''}); "
                         "resume with the run's original settings")
    for key, value in model_state.items():
        size = tuple(saved[f"model/{key}"].size)
        if size != tuple(value.shape):
            raise ValueError(f"{_dcp_name(folder)}: {key} has shape {size}, this model's "
                             f"{tuple(value.shape)}; resume with the run's original settings")
    names = _parameter_names(model)
    for opt_name, opt in assignment.optimizers.items():
        # what a one-process resume refuses, with both sides named as this checkpoint keys their
        # state: by the model's names (an optimizer built without param_names is compared by name too)
        saved_opt = record["optimizers"][opt_name]
        here = [{**g, "param_names": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]
        there = [{**g, "param_names": [saved_opt["names"][i] for i in g["params"]]} for g in saved_opt["param_groups"]]
        try:
            check_same_groups(opt_name, assignment.strategy, here, there)
            # the saved options too, as the optimizer's load checks them, before the model is
            # loaded (a refusal there had left this run's weights overwritten)
            check_loadable = getattr(opt, "_check_loadable", None)
            if check_loadable is not None:
                check_loadable({"state": {}, "param_groups": saved_opt["param_groups"]})
        except ValueError as err:
            raise ValueError(f"{_dcp_name(folder)}: {err}") from None
    templates: dict[str, torch.Tensor] = {f"model/{k}": v for k, v in model_state.items()}
    wanted = []  # (optimizer, parameter, key, state key)
    for opt_name, opt in assignment.optimizers.items():
        for group in opt.param_groups:
            for p in group["params"]:
                if owned is not None and id(p) not in owned:
                    continue
                prefix = _state_key(opt_name, names[id(p)], "")
                for state_key in (k for k in saved if k.startswith(prefix)):
                    meta = saved[state_key]
                    key = state_key[len(prefix):]
                    if _elementwise(key, meta.size, p):
                        template = torch.empty_like(p.detach(), dtype=meta.properties.dtype)
                    else:
                        # a step count where a one-process resume puts it (map_location="cpu"), and a
                        # fresh torch.optim.AdamW keeps it: on the GPU, AdamW had read it back every step
                        device = "cpu" if key == "step" else _local_device(p)
                        template = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=device)
                    templates[state_key] = template
                    wanted.append((opt_name, p, key, state_key))
    _load_tensors(folder, templates, together)
    set_model_state_dict(model, {k: templates[f"model/{k}"] for k in model_state},
                         options=StateDictOptions(strict=True))
    for opt_name, opt in assignment.optimizers.items():
        saved_opt = record["optimizers"][opt_name]
        index = {name: i for i, name in enumerate(saved_opt["names"])}
        state: dict[int, dict] = {}
        for name, entries in saved_opt["plain_state"].items():
            state.setdefault(index[name], {}).update(entries)
        for owner_name, p, key, state_key in wanted:
            if owner_name == opt_name:
                state.setdefault(index[names[id(p)]], {})[key] = templates[state_key]
        if owned is not None:  # under DDP a rank keeps the state of its own parameters only
            mine = {names[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in owned}
            state = {i: s for i, s in state.items() if saved_opt["names"][i] in mine}
        opt.load_state_dict({"state": state, "param_groups": saved_opt["param_groups"]})
    return record


def read_distributed(folder: str, prefix: str = "model/") -> dict[str, torch.Tensor]:
    """The whole tensors of a distributed checkpoint whose keys start with ``prefix``
    (default: the model's, keyed by parameter name), read in this one process (no
    process group needed): to inspect a run, or compare it with another. An incomplete or
    damaged folder (:func:`checked_record`, or a file DCP cannot read) raises
    :class:`DamagedCheckpoint` naming it."""
    checked_record(folder, together=False)
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in _saved_entries(folder).items()
               if k.startswith(prefix) and hasattr(m, "size")}
    _load_tensors(folder, tensors, together=False)
    return {k[len(prefix):]: v for k, v in tensors.items()}


def _saved_entries(folder: str, together: bool = False) -> dict:
    """The entries DCP's ``.metadata`` of ``folder`` lists (name → tensor or bytes metadata);
    :class:`DamagedCheckpoint` naming ``folder`` when it cannot be read. ``together`` (every rank
    calls it; collective): the ranks agree on the verdict (a read failing on one rank alone had left
    the others in DCP's collectives)."""
    import torch.distributed.checkpoint as dcp

    entries = problem = None
    try:
        entries = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as err:
        problem = f"has an unreadable .metadata ({err})"
    _refuse_together(folder, problem, together)
    return entries


def _load_tensors(folder: str, tensors: dict[str, torch.Tensor], together: bool) -> None:
    """``torch.distributed.checkpoint.load`` of ``folder`` into ``tensors`` (collective when
    ``together``, else read by this process alone); any failure — DCP's ``CheckpointException``
    included, a ``BaseException`` — raises :class:`DamagedCheckpoint` naming ``folder``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with contextlib.nullcontext() if together else _one_process():
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder), no_dist=not together)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        cause = str(err).strip().splitlines()[-1]  # DCP's message ends with the rank's error
        raise DamagedCheckpoint(f"{_dcp_name(folder)} could not be read ({cause}); its tensor files "
                                "are damaged or missing") from None


def _local_device(p: torch.Tensor) -> torch.device:
    """The device of ``p``'s local data (a ``DTensor``'s shard, or ``p``)."""
    return p.to_local().device if is_sharded(p) else p.device


@contextlib.contextmanager
def _one_process():
    """Silence DCP's notice that it reads without a process group: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(together: bool) -> None:
    if together:
        dist.barrier()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
