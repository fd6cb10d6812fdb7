"""Where a value lives, as the static lint sees it: the kinds, how paths merge, and names.

Pure functions over short strings, shared by the flow analysis in
:mod:`hostsync.lint_flow`. A *kind* is one of

=============  ==============================================================================
``pinned``     host tensor in page-locked memory (``pin_memory=True``, ``.pin_memory()``)
``pageable``   host tensor (or NumPy array) known to be in ordinary pageable memory: made on
               the host by a torch/NumPy call without pinning, or computed from host tensors
``host``       on the host, pinnedness unknown (e.g. a name ending in ``_cpu``)
``device``     on an accelerator (made with ``device=`` something not known to be the CPU,
               moved with ``.cuda()`` / ``.to(dev)``, computed from device tensors, ...)
``dev-call``   what a call the lint cannot see into returns when it is given device tensors and
               no host ones (``self.sampler(logits_dev)``, a Triton launcher's output): a host
               read of it (``.tolist()``) waits for the device; its truth value (``if f(x):``)
               may be a plain bool from metadata, so it is not a device tensor for ``if``
``none``       the constant ``None`` (absent on that path; merges as "no information")
``cpu-dev``    a device *object or string* naming the CPU (``"cpu"``, ``torch.device("cpu")``)
``acc-dev``    a device object or string naming an accelerator (``"cuda:0"``, ...)
``same-dev``   the device of a tensor whose place is unknown (``x.device`` for an unknown ``x``):
               what is made there lives wherever ``x`` does, which is unknown too
``unknown``    bound, but nothing is known (kept distinct from "never bound")
``arg``        a parameter not rebound yet: unknown, but a device passed in by the caller is
               the caller's choice (CPU in tests, the GPU in production), so what is made on it
               is not known to live on the device
=============  ==============================================================================
"""

from __future__ import annotations

import re

__all__ = [
    "ACC_DEV",
    "ARG",
    "CPU_DEV",
    "DEVICE",
    "DEV_CALL",
    "HOST",
    "HOST_KINDS",
    "NONE",
    "PAGEABLE",
    "PINNED",
    "SAME_DEV",
    "TENSOR_KINDS",
    "UNKNOWN",
    "join",
    "name_kind",
    "op_result",
]

PINNED, PAGEABLE, HOST, DEVICE = "pinned", "pageable", "host", "device"
DEV_CALL = "dev-call"
NONE, UNKNOWN, ARG = "none", "unknown", "arg"
CPU_DEV, ACC_DEV, SAME_DEV = "cpu-dev", "acc-dev", "same-dev"
HOST_KINDS = frozenset({PINNED, PAGEABLE, HOST})
TENSOR_KINDS = HOST_KINDS | {DEVICE}

# Engine naming conventions (vLLM, SGLang, this project): the suffix says where a tensor lives.
_HOST_NAME = re.compile(
    r"(?:^|_)(?:cpu|host|np|numpy)(?:_tensor|_buf|_buffer)?$|^(?:cpu|host)_|_cpu_")
_DEVICE_NAME = re.compile(r"(?:^|_)(?:gpu|cuda|dev|device)(?:_tensor|_buf|_buffer)?$|^gpu_|_gpu_")
_PINNED_NAME = re.compile(r"pinned")
# Attribute names that are the host/device half of a paired buffer (``buf.cpu`` / ``buf.gpu``).
_HOST_ATTRS = frozenset({"cpu", "np", "host"})
_DEVICE_ATTRS = frozenset({"gpu", "cuda_tensor", "device_tensor"})


def join(a: str | None, b: str | None) -> str | None:
    """Merge the kinds a value has on two paths (``None``: never bound on that path).

    A path that does not bind the value, or binds ``None``, adds nothing. Host kinds merge to
    ``host`` (on the host, pinnedness unknown). ``pageable`` or ``device`` merged with
    ``unknown`` stays what it was: one path is known to make it so and no path is known to make
    it otherwise, so a non_blocking upload (a host read) of it stalls on that path.
    ``device`` merged with ``dev-call`` is ``dev-call`` (a host read of either waits for the
    device; only ``device`` is read in conditions). Anything else that disagrees is
    ``unknown``: the lint reports only what holds on a path it knows.
    """
    if a is None or a == NONE:
        return b if b is not None else a
    if b is None or b == NONE:
        return a
    if a == b:
        return a
    if UNKNOWN in (a, b) and {a, b} & {PAGEABLE, DEVICE}:
        return a if b == UNKNOWN else b
    if a in HOST_KINDS and b in HOST_KINDS:
        return HOST
    if {a, b} == {DEVICE, DEV_CALL}:
        return DEV_CALL  # on the device on one path, a device call's result on the other
    return UNKNOWN


def name_kind(name: str, *, attribute: bool = False) -> str | None:
    """The kind an engine's naming convention gives ``name`` (None: the name says nothing).

    ``*_cpu`` / ``*_host`` / ``*_np`` / ``cpu_*`` are host values of unknown pinnedness
    (vLLM's ``*_cpu`` buffers are often pinned); ``*_gpu`` / ``*_cuda`` / ``*_dev`` /
    ``*_device`` are device values; ``*pinned*`` is pinned. With ``attribute``, the halves of
    a paired buffer (``.cpu`` / ``.np`` / ``.gpu``) count too.
    """
    low = name.lower()
    if _PINNED_NAME.search(low):
        return PINNED
    if attribute and low in _HOST_ATTRS:
        return HOST
    if attribute and low in _DEVICE_ATTRS | {"gpu"}:
        return DEVICE
    if _HOST_NAME.search(low):
        return HOST
    if _DEVICE_NAME.search(low):
        return DEVICE
    return None


def op_result(kinds: list[str | None]) -> str | None:
    """Kind of a new tensor computed from inputs of these kinds (operands of ``+``, ``==``,
    ``torch.cat``, ...).

    Operands of one op live on one device, so one known operand places the result: any
    device operand makes a device result, any host operand a fresh pageable host tensor.
    """
    if DEVICE in kinds:
        return DEVICE
    if any(k in HOST_KINDS for k in kinds):
        return PAGEABLE
    if DEV_CALL in kinds:
        return DEV_CALL
    return None
