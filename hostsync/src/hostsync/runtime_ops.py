"""Which aten ops host-sync: copies, scalar reads and data-dependent shapes.

:class:`OpClassifier` maps the aten ops that can make the host wait to a handler that decides,
from the arguments alone (it never reads device memory), whether this call does, and reports it
through a ``record(kind, op, tensor, devices)`` callback. Its companion function mode
(:meth:`OpClassifier.function_mode`) names the Python call behind each aten op and sees the
copies that ``torch.tensor``/``torch.as_tensor`` make inside C++, where the dispatch mode
cannot. Part of :mod:`hostsync.runtime`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["OpClassifier", "Record", "default_is_device"]

# record(kind, op, tensor, devices): the tensor is the one moved or inspected
Record = Callable[[str, str, torch.Tensor, str], None]


def default_is_device(device: torch.device) -> bool:
    """Any non-CPU device is "the device" (so ``meta`` stands in for CUDA on CPU-only torch)."""
    return device.type != "cpu"


def _is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill one contiguous span in some dim order."""
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1))
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _same_strides(a: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    if tuple(a.shape) != tuple(shape):
        return False
    return all(
        sz == 1 or sa == sb for sz, sa, sb in zip(shape, a.stride(), stride, strict=True)
    )


def _h2d_stages_through_pageable(
    src: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> bool:
    """Would a non_blocking copy of pinned ``src`` into this destination use a pageable temp?

    Mirrors ``copy_kernel_cuda``: a same-dtype copy between identically strided dense tensors
    is one memcpy; otherwise it needs temporaries, and for a non_blocking H2D copy the source
    temporary is ``src.expand_as(dst).contiguous()`` -- a fresh pageable tensor unless ``src``
    already is contiguous in that shape.
    """
    if src.dtype == dtype and _is_dense(src) and _same_strides(src, shape, stride):
        return False
    try:
        return not src.expand(shape).is_contiguous()
    except RuntimeError:  # not broadcastable: the copy itself will raise
        return False


def _overloads(packet_name: str) -> Iterator[Any]:
    packet = getattr(torch.ops.aten, packet_name, None)
    if packet is None:
        return
    for name in packet.overloads():
        yield getattr(packet, name)


class OpClassifier:
    """Decides which aten calls host-sync and reports each through ``record``.

    Attributes
    ----------
    devices_seen : set[str]
        Every device the ``is_device`` predicate accepted (empty: nothing could sync).
    pageable_h2d_seen : int
        Pageable host->device memcpys attributed so far (what the profiler check subtracts).
    """

    def __init__(
        self,
        record: Record,
        *,
        is_pinned: Callable[[torch.Tensor], bool] | None = None,
        is_device: Callable[[torch.device], bool] | None = None,
    ) -> None:
        self._record = record
        self._is_pinned_fn = is_pinned
        self._device_predicate = is_device or default_is_device
        self._pinned_storages: set[int] = set()
        # Python-level calls in progress (innermost last), pushed by the function mode
        self._api_stack: list[str] = []
        self.devices_seen: set[str] = set()
        self.pageable_h2d_seen = 0
        aten = torch.ops.aten
        handlers: dict[Any, Callable[[Any, tuple, dict], None]] = {
            aten._to_copy.default: self._on_to_copy,
            aten.copy_.default: self._on_copy,
            aten._local_scalar_dense.default: self._on_item,
            aten.index.Tensor: self._on_index,
            # Under torch.inference_mode() composite ops reach the mode undecomposed: the copy
            # shows up as aten.to.* and .item() as aten.item, not as _to_copy /
            # _local_scalar_dense (inference engines run there, so both spellings count).
            aten.item.default: self._on_item,
        }
        for overload in _overloads("to"):
            handlers[overload] = self._on_to
        for packet in ("index_put_", "index_put", "_index_put_impl_"):
            for overload in _overloads(packet):
                handlers[overload] = self._on_index_put
        for packet in ("nonzero", "nonzero_numpy", "argwhere", "masked_select", "_unique",
                       "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
                       "bincount"):
            for overload in _overloads(packet):
                handlers[overload] = self._on_data_dependent
        for packet in ("equal", "allclose"):  # return a host bool computed on the device
            for overload in _overloads(packet):
                handlers[overload] = self._on_item
        for overload in _overloads("histc"):
            handlers[overload] = self._on_histc
        for overload in _overloads("repeat_interleave"):
            if overload.__name__.split(".")[-1] != "self_int":
                handlers[overload] = self._on_repeat_interleave
        self._handlers = handlers

    def treat_as_pinned(self, *tensors: torch.Tensor) -> None:
        """Treat the storages of ``tensors`` (and every view of them) as pinned."""
        for t in tensors:
            self._pinned_storages.add(t.untyped_storage().data_ptr())

    def observe(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Report ``func(*args, **kwargs)`` if it host-syncs; called before the op runs."""
        handler = self._handlers.get(func)
        if handler is not None:
            handler(func, args, kwargs)

    def function_mode(self) -> TorchFunctionMode:
        """A fresh function mode to enter together with the dispatch mode."""
        return _FunctionLayer(self)

    # ------------------------------------------------------------------ predicates

    def _is_device(self, device: torch.device) -> bool:
        on_device = bool(self._device_predicate(device))
        if on_device:
            self.devices_seen.add(str(device))
        return on_device

    def _pinned(self, t: torch.Tensor) -> bool:
        if self._pinned_storages and t.untyped_storage().data_ptr() in self._pinned_storages:
            return True
        if self._is_pinned_fn is not None:
            return bool(self._is_pinned_fn(t))
        try:
            return bool(t.is_pinned())
        except RuntimeError:
            return False

    def _report(self, kind: str, func: Any, t: torch.Tensor, devices: str) -> None:
        op = f"aten.{func.__name__}"
        if self._api_stack:
            op = f"{self._api_stack[-1]} ({op})"
        self._record(kind, op, t, devices)

    # ------------------------------------------------------------------ copies

    def _h2d(self, func: Any, src: torch.Tensor, non_blocking: bool,
             shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
             devices: str) -> None:
        if src.numel() == 0:
            return
        pinned = self._pinned(src)
        if not pinned:
            self.pageable_h2d_seen += 1
        if not non_blocking:
            self._report("sync_h2d", func, src, devices)
        elif not pinned:
            self._report("pageable_h2d", func, src, devices)
        elif _h2d_stages_through_pageable(src, shape, stride, dtype):
            self.pageable_h2d_seen += 1
            self._report("strided_pinned_h2d", func, src, devices)

    def _on_to_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        src = args[0]
        dst_device = kwargs.get("device")
        if dst_device is None:
            return
        dst_device = torch.device(dst_device)
        src_on_device = self._is_device(src.device)
        dst_on_device = self._is_device(dst_device)
        devices = f"{src.device}->{dst_device}"
        non_blocking = bool(kwargs.get("non_blocking", False))
        if not src_on_device and dst_on_device:
            fmt = kwargs.get("memory_format")
            if fmt in (None, torch.preserve_format) and _is_dense(src):
                stride = tuple(src.stride())
            else:
                fmt = torch.contiguous_format if fmt in (None, torch.preserve_format) else fmt
                stride = tuple(torch.empty(tuple(src.shape), device="meta",
                                           memory_format=fmt).stride())
            dtype = kwargs.get("dtype") or src.dtype
            self._h2d(func, src, non_blocking, tuple(src.shape), stride, dtype, devices)
        elif src_on_device and not dst_on_device and src.numel() > 0 and not non_blocking:
            # non_blocking D2H through _to_copy allocates a pinned output: truly async.
            self._report("d2h", func, src, devices)

    def _on_to(self, func: Any, args: tuple, kwargs: dict) -> None:
        """aten.to.* (seen instead of _to_copy under inference mode): bind, then as _to_copy."""
        bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(func._schema.arguments)}
        other = bound.get("other")
        device = other.device if isinstance(other, torch.Tensor) else bound.get("device")
        dtype = other.dtype if isinstance(other, torch.Tensor) else bound.get("dtype")
        if device is None or torch.device(device) == args[0].device:
            return  # no device change: no copy, or a same-device dtype cast
        self._on_to_copy(func, (args[0],), {
            "device": device, "dtype": dtype if isinstance(dtype, torch.dtype) else None,
            "non_blocking": bool(bound.get("non_blocking") or False),
            "memory_format": bound.get("memory_format")})

    def _on_copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        dst, src = args[0], args[1]
        if not isinstance(src, torch.Tensor):
            return
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        src_on_device = self._is_device(src.device)
        dst_on_device = self._is_device(dst.device)
        devices = f"{src.device}->{dst.device}"
        if not src_on_device and dst_on_device:
            self._h2d(func, src, non_blocking, tuple(dst.shape), tuple(dst.stride()),
                      dst.dtype, devices)
        elif (src_on_device and not dst_on_device and dst.numel() > 0
              and not (non_blocking and dst.is_contiguous() and self._pinned(dst))):
            self._report("d2h", func, src, devices)

    # ------------------------------------------------------------------ reads and shapes

    def _on_item(self, func: Any, args: tuple, kwargs: dict) -> None:
        if self._is_device(args[0].device):
            self._report("item", func, args[0], str(args[0].device))

    def _on_data_dependent(self, func: Any, args: tuple, kwargs: dict) -> None:
        t = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if t is not None and self._is_device(t.device):
            self._report("data_dependent_shape", func, t, str(t.device))

    def _on_histc(self, func: Any, args: tuple, kwargs: dict) -> None:
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        if lo == hi:  # the range is then read back from the device (min/max)
            self._on_data_dependent(func, args, kwargs)

    def _on_repeat_interleave(self, func: Any, args: tuple, kwargs: dict) -> None:
        if kwargs.get("output_size") is None:
            self._on_data_dependent(func, args, kwargs)

    def _on_index(self, func: Any, args: tuple, kwargs: dict) -> None:
        self_, indices = args[0], args[1]
        if self._is_device(self_.device) and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        ):
            self._report("data_dependent_shape", func, self_, str(self_.device))

    def _on_index_put(self, func: Any, args: tuple, kwargs: dict) -> None:
        self_, indices, value = args[0], args[1], args[2]
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        defined = [i for i in indices if i is not None]
        if (not accumulate and value.numel() == 1 and value.device.type == "cpu"
                and len(defined) == 1 and defined[0].dtype in (torch.bool, torch.uint8)
                and defined[0].device == self_.device):
            return  # torch dispatches this to masked_fill_ with a host scalar: no sync
        self._on_index(func, args, kwargs)


class _FunctionLayer(TorchFunctionMode):
    """Python-level companion of the dispatch mode (names ops; sees ``torch.tensor`` copies)."""

    def __init__(self, ops: OpClassifier) -> None:
        super().__init__()
        self._ops = ops
        base = torch._C.TensorBase
        self._named: dict[Any, str] = {
            getattr(base, n): f"Tensor.{n}"
            for n in ("item", "tolist", "cpu", "numpy", "to", "cuda", "copy_", "nonzero",
                      "unique", "masked_select", "repeat_interleave", "__getitem__",
                      "__setitem__", "__bool__", "__int__", "__float__", "__index__")
            if hasattr(base, n)
        }
        self._factories = {torch.tensor: "torch.tensor", torch.as_tensor: "torch.as_tensor"}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = self._named.get(func)
        if name is not None:
            stack = self._ops._api_stack
            stack.append(name)
            try:
                return func(*args, **kwargs)
            finally:
                stack.pop()
        factory = self._factories.get(func)
        if factory is None:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        data = args[0] if args else kwargs.get("data")
        if (
            isinstance(out, torch.Tensor)
            and not isinstance(data, torch.Tensor)
            and self._ops._is_device(out.device)
            and out.numel() > 0
        ):
            self._ops.pageable_h2d_seen += 1  # built in a fresh pageable host tensor
            self._ops._record("sync_h2d", factory, out, f"cpu->{out.device}")
        return out
