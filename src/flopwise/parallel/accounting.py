"""Measure what a layout really holds and sends, to check against plan/memory.py and plan/comm.py.

`model_state_bytes_on_rank`: bytes of parameters (as the rank computes with them, i.e. after
forward: gathered under ZeRO ≤ 2, shards under ZeRO-3), gradients and optimizer state on this rank.
`saved_activation_bytes`: the peak bytes of what autograd keeps for backward (not parameters).
`CommCounter`: every collective and point-to-point op that passes through the dispatcher
(c10d and functional collectives: DDP's reducer, FSDP2, DTensor, pipelining all do), with bytes.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def param_bytes(modules) -> int:
    return sum(local_bytes(p) for m in modules for p in m.parameters())


def grad_bytes(modules) -> int:
    return sum(local_bytes(p.grad) for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Moments only (the per-parameter step counters are scalars)."""
    return sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


class SavedPeak:
    """Bytes of the storages autograd holds for backward now, and the most it held at once."""

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, saved tensors using it]
        self.now = 0
        self.peak = 0

    def hold(self, key: int, nbytes: int) -> None:
        if key in self.live:
            self.live[key][1] += 1
            return
        self.live[key] = [nbytes, 1]
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def drop(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]


class _Held:
    """Rides with a packed tensor; autograd frees it with the saved tensor (after the backward)."""

    def __init__(self, peak: SavedPeak, key: int):
        self.peak, self.key = peak, key

    def __del__(self):
        self.peak.drop(self.key)


_VIEWS_AND_CASTS = {"TBackward0", "ViewBackward0", "TransposeBackward0", "UnsafeViewBackward0", "ToCopyBackward0",
                    "PermuteBackward0", "ExpandBackward0", "SliceBackward0", "SplitBackward0"}


def _is_state(t: torch.Tensor) -> bool:
    """A leaf (parameter, buffer, input) or a view or dtype cast of one (autocast's bf16 weight)."""
    fn = t.grad_fn
    while fn is not None and fn.name() in _VIEWS_AND_CASTS:
        fn = fn.next_functions[0][0]
    return fn is None or fn.name() == "torch::autograd::AccumulateGrad"


@contextlib.contextmanager
def saved_activation_bytes() -> Iterator[SavedPeak]:
    """Count, while inside, the activations autograd saves for backward: unique storages (a view
    saved twice counts once) that are not parameters, buffers, inputs or casts of them; `.peak`
    is the most held at once (one micro-batch with accumulation; the in-flight ones in a pipeline).
    Regions that recompute (activation checkpointing) save through their own hooks and are not seen."""
    peak = SavedPeak()

    def pack(t: torch.Tensor):
        local = t
        while is_traceable_wrapper_subclass(local):  # DTensor, a collective's async result: the tensor inside
            local = getattr(local, local.__tensor_flatten__()[0][0])
        if _is_state(t) or local.device.type == "meta" or not local.untyped_storage().nbytes():
            return t, None
        storage = local.untyped_storage()
        peak.hold(storage.data_ptr(), storage.nbytes())
        return t, _Held(peak, storage.data_ptr())

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed[0]):
        yield peak


class CommCounter(TorchDispatchMode):
    """Counts collectives by kind: calls and elements of the full (unsharded) buffer each moves.

    all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the input; broadcast,
    send, recv: the tensor."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_to_all")

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)
        self.sizes: dict[str, list[int]] = defaultdict(list)

    def volumes(self) -> dict[str, int]:
        """Elements moved by kind, leaving out single-element collectives (the loss, the gradient
        norm, the non-finite flag: bookkeeping, not the model's traffic)."""
        out = {k: sum(n for n in v if n > 1) for k, v in self.sizes.items()}
        return {k: v for k, v in out.items() if v}

    def _kind(self, name: str) -> str | None:
        for k in self.KINDS:
            if k.replace("_", "") in name.replace("_", ""):
                return k
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "c10d_functional"):
            name = func._schema.name.split("::")[-1]
            kind = self._kind(name)
            if kind is not None and "wait" not in name:
                n = _elements(kind, args, out, inplace=ns == "c10d" and name.startswith("_reduce_scatter_base"))
                self.calls[kind] += 1
                self.elements[kind] += n
                self.sizes[kind].append(n)
        return out


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


def _elements(kind: str, args, out, inplace: bool = False) -> int:
    if kind == "reduce_scatter" and inplace:  # c10d::_reduce_scatter_base_(output, input)
        return sum(t.numel() for t in _tensors(args[1]))
    if kind == "all_gather":  # output is the gathered buffer (the first tensor argument for in-place ops)
        ts = _tensors(out)[:1] or _tensors(args)[:1]
        return ts[0].numel() if ts else 0
    ts = _tensors(args[0]) if args else []
    return sum(t.numel() for t in ts)


class HostSyncCounter(TorchDispatchMode):
    """Counts the points where the host waits for a tensor's value: `.item()`/`float()`/`bool()`
    (aten::_local_scalar_dense), data-dependent shapes (nonzero, masked_select, unique), copies of a
    device tensor to the CPU, and `.tolist()`/`.numpy()` (not dispatched ops: wrapped while counting).
    On CPU nothing actually waits, but the same points are where a GPU's host would stall."""

    DATA_DEPENDENT = ("_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "is_nonzero", "equal")

    def __init__(self):
        super().__init__()
        self.count = 0
        self.ops: dict[str, int] = defaultdict(int)
        self._saved: dict[str, object] = {}

    def _hit(self, name: str) -> None:
        self.count += 1
        self.ops[name] += 1

    def __enter__(self):
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(t, *a, _original=original, _name=method, **k):
                self._hit(_name)
                return _original(t, *a, **k)

            setattr(torch.Tensor, method, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in self.DATA_DEPENDENT:
            self._hit(name)
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self._hit("boolean index")
        elif name == "_to_copy" and first is not None and first.device.type != "cpu" and str(kwargs.get("device")) == "cpu":
            self._hit("to_cpu")
        return func(*args, **kwargs)
