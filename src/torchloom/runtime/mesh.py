"""The device mesh of a run: its named dimensions and the process groups every part uses.

:func:`make_mesh` lays the ranks of the default process group out on a
``torch.distributed.device_mesh.DeviceMesh`` with the dimensions
``("pp", "dp_replicate", "dp_shard", "cp", "tp")``, outermost first (tensor-parallel ranks
adjacent, pipeline stages farthest apart), and flattens three more views of it:

* ``"dp"``: every data-parallel rank (``dp_replicate x dp_shard``): the group DDP averages
  gradients over and a data-parallel rank's share of the batch is taken from;
* ``"stage"``: every rank of one pipeline stage (``dp_replicate x dp_shard x cp x tp``):
  the group a stage's checkpoint is written by;
* ``"model"``: the ``pp x tp`` ranks of one data-parallel replica and context-parallel
  rank: together they hold the whole model once (without FSDP, the group one replica
  writes a checkpoint with);
* ``"dp_cp"``: every data-parallel and context-parallel rank (``dp_replicate x dp_shard
  x cp``): the ranks that hold the same parameters and average their gradients (the
  context-parallel ranks compute parts of the same sequences); ``"dp"`` itself when
  ``cp`` is 1.

With expert parallelism (``ep``, folded into the data-parallel ranks) it also makes two
sets of process groups over the ``dp`` view: ``"ep"``, each ``ep`` consecutive
data-parallel ranks (the ranks one mixture-of-experts module's experts are split
between), and ``"ep_replicas"``, the data-parallel (and context-parallel) ranks that
hold the same experts (every ``ep``-th; what their gradients are averaged over). They are process groups, not
mesh dimensions: :meth:`Mesh.group`, :meth:`Mesh.size` and :meth:`Mesh.local_rank` take
their names.

A :class:`Mesh` holds them; ``mesh[name]`` is the 1-D mesh of a dimension (or a
flattened view), :meth:`Mesh.group` its process group and :meth:`Mesh.local_rank` this
rank's place in it, :attr:`Mesh.fsdp_mesh` what FSDP2 shards over (``dp_shard``, or the
2-D ``(dp_replicate, dp_shard)`` mesh of HSDP; with context parallelism ``dp_shard x cp``
flattened, as torchtitan does), :attr:`Mesh.grad_view` the view DDP averages gradients over. Every group torchloom uses for a layout
comes from here: the tensor-parallel group of the schedule, the pipeline group of
``build``, the data-parallel group of DDP, FSDP2's mesh.

A world of one rank has no mesh (None): nothing is distributed.

>>> import torch.distributed as dist
>>> from torch.testing._internal.distributed.fake_pg import FakeStore
>>> dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
>>> mesh = make_mesh(pp=2, dp_shard=2, tp=2, device_type="cpu")
>>> [mesh.local_rank(d) for d in ("pp", "dp_shard", "tp", "dp", "stage", "model")]
[1, 0, 1, 0, 1, 3]
>>> mesh.size("stage"), mesh.fsdp_mesh.mesh_dim_names
(4, ('dp_shard',))
>>> dist.destroy_process_group()
>>> dist.init_process_group("fake", rank=5, world_size=8, store=FakeStore())
>>> mesh = make_mesh(dp_shard=4, tp=2, ep=2, device_type="cpu")
>>> [(mesh.size(d), mesh.local_rank(d)) for d in ("dp", "ep", "ep_replicas")]
[(4, 2), (2, 0), (2, 1)]
>>> dist.destroy_process_group()
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..core.errors import BuildError
from .process_group import device_type_of

__all__ = ["DIMS", "Mesh", "make_mesh"]

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimensions, outermost first."""
FLAT = ("dp", "stage", "model", "dp_cp")
"""The flattened views: every data-parallel rank; every rank of one pipeline stage; every
rank of one copy of the model; every rank that averages the same gradients."""
EXPERT = ("ep", "ep_replicas")
"""The expert-parallel process groups (not mesh dimensions)."""


@dataclass(frozen=True)
class Mesh:
    """A run's device mesh and its flattened views (see the module docstring)."""

    root: Any
    """The ``DeviceMesh`` of :data:`DIMS`."""
    dp: Any
    """The flattened ``(dp_replicate, dp_shard)`` mesh."""
    stage: Any
    """The flattened ``(dp_replicate, dp_shard, cp, tp)`` mesh."""
    model: Any
    """The flattened ``(pp, tp)`` mesh."""
    dp_cp: Any = None
    """The flattened ``(dp_replicate, dp_shard, cp)`` mesh (None: ``cp`` is 1, ``dp``)."""
    dp_shard_cp: Any = None
    """The flattened ``(dp_shard, cp)`` mesh FSDP2 shards over (None: ``cp`` is 1)."""
    ep: Any = None
    """This rank's expert-parallel process group (None: ``ep`` is 1)."""
    ep_replicas: Any = None
    """The process group of the data-parallel ranks holding this rank's experts (None:
    ``ep`` is 1)."""

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The dimensions and flattened views ``mesh[name]`` takes."""
        return DIMS + FLAT

    @property
    def device_type(self) -> str:
        return str(self.root.device_type)

    def __getitem__(self, name: str) -> Any:
        if name == "dp":
            return self.dp
        if name == "stage":
            return self.stage
        if name == "model":
            return self.model
        if name == "dp_cp":
            return self.dp_cp if self.dp_cp is not None else self.dp
        if name not in DIMS:
            raise BuildError(f"the mesh has no dimension {name!r}", primitive="Mesh",
                             values={"name": name, "dims": list(DIMS + FLAT)},
                             fix=f"one of {', '.join(DIMS + FLAT)}")
        return self.root[name]

    def size(self, name: str) -> int:
        if name in EXPERT:
            group = getattr(self, name)
            return 1 if group is None else dist.get_world_size(group)
        return int(self[name].size())

    def group(self, name: str) -> Any:
        """The process group of dimension (or view, or expert group) ``name``."""
        if name in EXPERT:
            return getattr(self, name)
        return self[name].get_group()

    def local_rank(self, name: str) -> int:
        """This rank's index along dimension (or view, or expert group) ``name``."""
        if name in EXPERT:
            group = getattr(self, name)
            return 0 if group is None else dist.get_rank(group)
        return int(self[name].get_local_rank())

    def shard_group(self) -> Any:
        """The process group FSDP2 shards each parameter over (``dp_shard``, or
        ``dp_shard x cp`` with context parallelism); HSDP's replicas are not in it."""
        return self.dp_shard_cp.get_group() if self.dp_shard_cp is not None \
            else self.group("dp_shard")

    @property
    def grad_view(self) -> str:
        """The view whose ranks average gradients: ``"dp_cp"`` with context parallelism,
        else ``"dp"``."""
        return "dp_cp" if self.dp_cp is not None else "dp"

    @property
    def fsdp_mesh(self) -> Any:
        """What FSDP2 shards over: the 2-D ``(dp_replicate, dp_shard)`` mesh of HSDP when
        both are above 1 (``(dp_replicate, dp_shard_cp)`` with context parallelism, also
        when ``dp_shard`` is 1), else the flattened shard mesh (``dp_shard x cp``,
        ``dp_shard`` alone, or ``build(target="fsdp")`` over the replicas of
        :func:`init_mesh`'s ``dp``)."""
        shard = "dp_shard_cp" if self.dp_shard_cp is not None else "dp_shard"
        if self.size("dp_replicate") > 1 and (self.size("dp_shard") > 1
                                              or self.dp_shard_cp is not None):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return self.root["dp_replicate", shard]
        if self.dp_shard_cp is not None:
            return self.dp_shard_cp
        if self.size("dp_shard") > 1:
            return self.root["dp_shard"]
        return self.dp


def make_mesh(*, pp: int = 1, dp_replicate: int = 1, dp_shard: int = 1, cp: int = 1,
              tp: int = 1, ep: int = 1, device_type: str | None = None) -> Mesh:
    """The :class:`Mesh` of these degrees over the default process group (which must be
    initialised, e.g. by ``torchrun``, and hold ``pp x dp_replicate x dp_shard x cp x tp``
    ranks), with the expert-parallel groups of ``ep`` (which divides the data-parallel
    ranks). ``device_type`` None: the device of the group's backend."""
    from torch.distributed.device_mesh import init_device_mesh

    degrees = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp,
               "tp": tp}
    if not (dist.is_available() and dist.is_initialized()):
        raise BuildError(
            "a device mesh needs an initialised process group", primitive="init_mesh",
            values=degrees,
            fix="start with torchrun (or torch.distributed.init_process_group) first")
    world = dist.get_world_size()
    product = pp * dp_replicate * dp_shard * cp * tp
    if product != world:
        rest = product // (dp_replicate * dp_shard)
        raise BuildError(
            f"the mesh pp x dp_replicate x dp_shard x cp x tp = {pp} x {dp_replicate} x "
            f"{dp_shard} x {cp} x {tp} = {product} does not cover the {world} ranks",
            primitive="init_mesh", values={**degrees, "world_size": world},
            fix=f"data-parallel degrees whose product is {world // rest}"
            if world % rest == 0 else f"choose degrees whose product is {world}")
    root = init_device_mesh(device_type or device_type_of(), (pp, dp_replicate, dp_shard, cp, tp),
                            mesh_dim_names=DIMS)
    dp = root["dp_replicate", "dp_shard"]._flatten("dp")
    stage = root["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
    model = root["pp", "tp"]._flatten("model")
    experts = _expert_groups(root, ep) if ep > 1 else {}
    if cp == 1:
        return Mesh(root, dp, stage, model, **experts)
    dp_cp = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    dp_shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp")
    if dp_cp.get_group().group_name == root["cp"].get_group().group_name:
        # the cp ranks are the whole world, and torch gives every view of them its default
        # group: the gradients' reductions (DDP's, FSDP2's) get a group of their own, so
        # that they and the context-parallel exchange are told apart (counted, planned)
        # and do not share one communicator
        from torch.distributed.device_mesh import DeviceMesh

        whole = dist.new_group(list(range(world)))
        dp_cp, dp_shard_cp = (DeviceMesh.from_group(whole, root.device_type,
                                                    mesh_dim_names=(name,))
                              for name in ("dp_cp", "dp_shard_cp"))
    return Mesh(root, dp, stage, model, dp_cp, dp_shard_cp, **experts)


def _expert_groups(root: Any, ep: int) -> dict[str, Any]:
    """This rank's ``ep`` and ``ep_replicas`` process groups: over the data-parallel ranks
    of each (pp, cp, tp) position, ``ep`` consecutive ones; and every ``ep``-th one of
    every context-parallel position of each (pp, tp) position.
    Every rank makes every group, in the same order (``new_subgroups_by_enumeration``)."""
    ranks = root.mesh  # (pp, dp_replicate, dp_shard, cp, tp) global ranks
    pp, rep, shard, cp, tp = ranks.shape
    if (rep * shard) % ep:
        raise BuildError(f"ep={ep} does not divide the {rep * shard} data-parallel ranks",
                         primitive="init_mesh", values={"ep": ep, "dp": rep * shard},
                         fix="an ep that divides dp_shard (or dp_replicate without FSDP2)")
    dp = rep * shard
    # (pp, tp) positions x (cp, dp): an ep group is ep consecutive data-parallel ranks of
    # one context-parallel position; the replicas of an expert are the ranks at the same
    # place in every ep group, of every context-parallel position (they hold the same
    # experts and see other tokens)
    blocks = ranks.reshape(pp, dp, cp, tp).permute(0, 3, 2, 1).reshape(-1, cp, dp)
    groups = [row[i:i + ep].tolist() for block in blocks for row in block
              for i in range(0, dp, ep)]
    replicas = [block[:, j::ep].reshape(-1).tolist() for block in blocks for j in range(ep)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    others = None
    if dp * cp > ep:
        others, _ = dist.new_subgroups_by_enumeration(replicas)
    return {"ep": mine, "ep_replicas": others}
