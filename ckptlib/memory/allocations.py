"""What the live-storage meter reads at each aten op: where the op's schema says it may
allocate, and which blocks of memory a tensor holds (:mod:`ckptlib.memory.storages` counts
with them).

An op's schema says, per return, whether it aliases an input (a view such as ``w.t()``, an
in-place or ``out=`` result: no new memory), and marks each argument the op writes ``(a!)``.
It is read once per op (:func:`op_shape`) and kept by the meter.

Not every tensor is one storage (:func:`memory_of`). A sparse COO tensor holds an index and a
value tensor (a compressed one, CSR and the like, three); a wrapper subclass that says what it
wraps (``__tensor_flatten__``: nested jagged tensors, DTensor) holds its inner tensors; each of
those storages is counted. An MKL-DNN tensor holds an opaque buffer of ``numel * element_size``
bytes, freed with the tensor.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from torch.utils._pytree import tree_flatten

from ckptlib.core.checks import storage_ptr

__all__ = ["OpShape", "op_shape", "memory_of", "address", "input_addresses", "resizable_written",
           "storage_bytes"]


def storage_bytes(value: Any) -> dict[int, int]:
    """storage pointer -> its size in bytes, for every tensor in ``value`` (a tensor, or any
    nesting of lists, tuples and dicts of them), each storage once, those without memory left out.

    >>> a = torch.zeros(4)
    >>> list(storage_bytes({"a": a, "view": a[1:], "b": [torch.zeros(2)]}).values())
    [16, 8]
    """
    sizes: dict[int, int] = {}
    for tensor in tree_flatten(value)[0]:
        if isinstance(tensor, torch.Tensor):
            ptr = storage_ptr(tensor)
            if ptr:
                sizes[ptr] = tensor.untyped_storage().nbytes()
    return sizes


class OpShape(NamedTuple):
    """What the meter needs to know about one aten op, read once from its schema."""

    name: str
    may_be_new: tuple[bool, ...] | None  # per return: may it hold new memory? None: no return may
    written: tuple[int | str, ...]  # positions (or keyword names) of the tensors it writes
    resizes: bool  # may it give a strided tensor it writes memory of another size?
    keeps_storage: bool  # writes only its first argument, in place (add_): same storage
    fresh: bool  # aten.lift_fresh: hands over a tensor made outside dispatch


# In-place ops keep a strided tensor's storage, except these (and ``out=`` arguments, which are
# resized to fit); a sparse tensor written in place may get new index and value tensors.
_RESIZING_OPS = {"resize_", "resize_as_", "set_", "_resize_output_"}


def op_shape(func: Any) -> OpShape:
    """A return may hold new memory unless it is no tensor (``aten._local_scalar_dense`` returns a
    number) or the schema says it aliases an input; an argument marked ``(a!)`` is written."""
    schema = func._schema
    may_be_new = tuple(
        ret.alias_info is None and "Tensor" in str(ret.type) for ret in schema.returns
    )
    written = [
        (position, argument)
        for position, argument in enumerate(schema.arguments)
        if argument.alias_info is not None
        and argument.alias_info.is_write
        and "Tensor" in str(argument.type)
    ]
    name = func._overloadpacket.__name__
    places = tuple(
        argument.name if argument.kwarg_only else position for position, argument in written
    )
    resizes = name in _RESIZING_OPS or any(argument.kwarg_only for _, argument in written)
    return OpShape(
        name,
        may_be_new if any(may_be_new) else None,
        places,
        resizes,
        not resizes and places == (0,) and "[]" not in str(written[0][1].type),
        func is torch.ops.aten.lift_fresh.default,
    )


_COMPRESSED_PARTS = {
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def memory_of(tensor: torch.Tensor) -> list[tuple[Any, int]]:
    """(owner, bytes) for each block of memory ``tensor`` holds; the owner lives exactly as long
    as the block.

    A strided tensor holds its storage. A sparse COO tensor holds no storage of its own but two
    tensors, indices and values; a compressed one (CSR, CSC, BSR, BSC) three. A wrapper subclass
    that says what it wraps (``__tensor_flatten__``: a nested jagged tensor, DTensor, ...) holds
    its inner tensors. An MKL-DNN tensor holds an opaque buffer of its elements, freed with the
    tensor itself. Anything else that has no storage shows no memory (the meter cannot see it).
    """
    layout = tensor.layout
    if layout is torch.strided and type(tensor) is torch.Tensor:  # the common case, first
        storage = tensor.untyped_storage()
        return [(storage, storage.nbytes())]
    if layout is torch.sparse_coo:
        return memory_of(tensor._indices()) + memory_of(tensor._values())
    if layout in _COMPRESSED_PARTS:
        return [
            block
            for part in _COMPRESSED_PARTS[layout]
            for block in memory_of(getattr(tensor, part)())
        ]
    if layout is torch._mkldnn:  # type: ignore[attr-defined]
        return [(tensor, tensor.numel() * tensor.element_size())]
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is not None and type(tensor) is not torch.Tensor:
        inner = [getattr(tensor, name) for name in flatten()[0]]
        return [
            block for part in inner if isinstance(part, torch.Tensor) for block in memory_of(part)
        ]
    try:
        storage = tensor.untyped_storage()
        return [(storage, storage.nbytes())]
    except (RuntimeError, NotImplementedError):
        return []


def address(owner: Any) -> int:
    """Where a block of memory is: a storage's data pointer, an opaque tensor's identity."""
    return owner.data_ptr() if isinstance(owner, torch.UntypedStorage) else id(owner)


def input_addresses(args: tuple) -> set[int]:
    """Addresses of the memory an op's tensor arguments hold (also inside list arguments)."""
    addresses = set()
    for arg in args:
        for tensor in arg if isinstance(arg, (list, tuple)) else (arg,):
            if type(tensor) is torch.Tensor and tensor.layout is torch.strided:  # the common case
                addresses.add(storage_ptr(tensor))
            elif isinstance(tensor, torch.Tensor):
                addresses.update(address(owner) for owner, _ in memory_of(tensor))
    return addresses


def resizable_written(shape: OpShape, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes that it may give memory of another size (see ``_RESIZING_OPS``)."""
    found = []
    for where in shape.written:
        value = (
            kwargs.get(where)
            if isinstance(where, str)
            else args[where]
            if where < len(args)
            else None
        )
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if (
                isinstance(tensor, torch.Tensor)
                and not tensor.is_meta
                and (shape.resizes or tensor.layout is not torch.strided)
            ):
                found.append(tensor)
    return found
