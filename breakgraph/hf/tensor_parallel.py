"""A model that transformers loaded tensor parallel (``from_pretrained(..., tp_plan="auto")``).

transformers splits each attention layer's heads among the ranks (colwise
query, key and value projections, a rowwise output projection whose results
it all-reduces) and the MLP likewise, so every rank runs the same decode
step on its share of the heads, its collectives pairing with the other
ranks'. A Generator on such a model sizes its cache with this rank's heads
(:func:`tensor_parallel_size`), and gives its runners the ranks' process
group (:func:`tensor_parallel_group`), so that every rank keeps each capture
or none does.
"""

from __future__ import annotations

from typing import Any

import torch


def tensor_parallel_size(model: torch.nn.Module) -> int:
    """The ranks ``model``'s heads are split among: ``model.tp_size``, 1 where transformers did not
    load it tensor parallel (or is a release without the property)."""
    return getattr(model, "tp_size", None) or 1


def tensor_parallel_group(model: torch.nn.Module) -> Any:
    """The process group of ``model``'s tensor-parallel ranks, from the device mesh transformers
    loaded it on; None for a model on one rank.

    Arguments:
        model (torch.nn.Module): a transformers model, loaded with ``tp_plan`` or without.
    """
    size = tensor_parallel_size(model)
    if size == 1:
        return None
    # A private attribute: transformers keeps the mesh there and has no public way to it.
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ValueError(
            f"{type(model).__name__} says it is split among {size} tensor-parallel ranks (tp_size), but it has no "
            "device mesh to find their process group on: load it with from_pretrained(..., tp_plan='auto')"
        )
    if mesh.ndim > 1:  # tensor parallel beside other dimensions (data, pipeline): its "tp" dimension
        if "tp" not in (mesh.mesh_dim_names or ()):
            raise ValueError(
                f"{type(model).__name__}'s device mesh has {mesh.ndim} dimensions, none of them named 'tp' "
                f"(names: {mesh.mesh_dim_names}), so breakgraph.hf cannot tell which are its tensor-parallel ranks: "
                "load it with from_pretrained(..., tp_plan='auto'), or name that dimension 'tp'"
            )
        mesh = mesh["tp"]
    if mesh.size() != size:
        raise ValueError(
            f"{type(model).__name__} is split among {size} tensor-parallel ranks (tp_size), but its mesh's "
            f"tensor-parallel dimension holds {mesh.size()}: load it with from_pretrained(..., tp_plan='auto')"
        )
    return mesh.get_group()
