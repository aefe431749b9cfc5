"""Measure what a layout really holds and sends, to check against plan/memory.py and plan/comm.py.

`model_state_bytes_on_rank`: bytes of parameters (as the rank computes with them, i.e. after
forward: gathered under ZeRO ≤ 2, shards under ZeRO-3), gradients and optimizer state on this rank.
`CommCounter`: every collective and point-to-point op that passes through the dispatcher
(c10d and functional collectives: DDP's reducer, FSDP2, DTensor, pipelining all do), with bytes.
`FsdpCopyBytes`: the bytes FSDP2 copies around its collectives, to check against plan/comm.py.
`SavedBytes`: bytes autograd keeps for backward (activations), to check against plan/memory.py.
`PeakMemory`: the high-water mark of everything allocated on the rank's device during a step.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def param_bytes(modules) -> int:
    return sum(_local_bytes(p) for m in modules for p in m.parameters())


def grad_bytes(modules) -> int:
    return sum(_local_bytes(p.grad) for m in modules for p in m.parameters() if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Moments only (the per-parameter step counters are scalars)."""
    return sum(
        _local_bytes(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding a tensor's local data, through DTensor and functional collectives' wrappers."""
    while is_traceable_wrapper_subclass(t):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t.untyped_storage()


# Autograd nodes that only view or cast their one input: a saved tensor reached from a parameter
# through these alone is that parameter (a view) or a copy of it (autocast's low-precision cast).
_WEIGHT_PATH = (
    "TBackward0",
    "ToCopyBackward0",
    "ViewBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "UnsafeViewBackward0",
    "AliasBackward0",
)


def _address(st: torch.UntypedStorage) -> int:
    return st.data_ptr()


def _fake_address(st: torch.UntypedStorage) -> int:
    """A fake tensor's storage has no data: its C++ object tells storages apart (views share it)."""
    return st._cdata


def _from_parameter(t: torch.Tensor, params: set[int], address=_address) -> bool:
    node = t.grad_fn
    while node is not None and type(node).__name__ in _WEIGHT_PATH:
        nxt = [n for n, _ in node.next_functions if n is not None]
        if len(nxt) != 1:
            return False
        node = nxt[0]
    # an AccumulateGrad node holds its leaf in .variable, which torch's Node stub does not declare
    return type(node).__name__ == "AccumulateGrad" and address(_storage(node.variable)) in params  # type: ignore[union-attr]


class _Held:
    """Rides with a packed tensor; autograd drops it with the saved tensor (after its backward)."""

    def __init__(self, owner: SavedBytes, ptr: int):
        self.owner, self.ptr = owner, ptr

    def __del__(self):
        self.owner._release(self.ptr)


class SavedBytes(saved_tensors_hooks):
    """Bytes of the distinct storages autograd keeps for backward while active: `bytes` is the most
    held at once (one forward: all of it; a step with accumulation or a pipeline schedule: the
    micro-batches in flight), `total` all that were ever saved.

    Storages are counted once however many saved tensors view them. Parameters (the module's own,
    or FSDP2's gathered ones) cost nothing here: the optimizer holds them anyway. Copies of
    parameters (autocast's bf16 cast of each weight, made once per autocast region, i.e. once per
    step in the engine, not per micro-batch) go to `weight_copies`, not `bytes`. `saved` lists
    every counted storage as (shape, dtype, bytes, autograd node) to see what a layer keeps.
    `gathered` is the bytes of FSDP2's all-gathered (unsharded) parameters allocated when the saved
    bytes peak, which add to them at the step's high-water mark: storage apart from the shards the
    optimizer steps.

        with SavedBytes(model) as s:
            loss = model(x).sum()
        s.bytes

    `fake`: the tensors are FakeTensorMode's (a rehearsal): their storages, all on the meta
    device with no data, are told apart by object rather than by address.
    """

    def __init__(self, *modules: nn.Module, fake: bool = False):
        self.modules = modules
        self._address, self._fake = (_fake_address if fake else _address), fake
        self.bytes = self.total = self.weight_copies = self.gathered = 0
        self._fsdp_groups = [
            g
            for m in modules
            for sub in m.modules()
            if isinstance(sub, FSDPModule)
            for g in sub._get_fsdp_state()._fsdp_param_groups
        ]
        self.saved: list[tuple[tuple[int, ...], torch.dtype, int, str]] = []
        self._live: dict[int, list[int]] = {}  # storage address -> [bytes, saved tensors holding it]
        self._now = 0
        self._copies: set[int] = set()
        super().__init__(self._pack, lambda packed: packed[0])

    def __enter__(self) -> SavedBytes:  # type: ignore[override]  # torch's stub returns None; `as` needs self
        super().__enter__()
        return self

    def _gathered_now(self) -> int:
        """Each parameter's all-gather output, and the flat buffer a group's all-gather lands in
        until it is copied out (a prefetched group's; in forward, the last group's until the next
        copy-out)."""
        if not self._fsdp_groups:
            return 0
        buffers = [o for g in self._fsdp_groups for fp in g.fsdp_params for o in fp.all_gather_outputs]
        for g in self._fsdp_groups:
            state = getattr(g.comm_ctx, "all_gather_state", None)  # set at the first forward
            flat = [g._all_gather_result, state.all_gather_result if state is not None else None]
            buffers += [r.all_gather_output for r in flat if r is not None]
        storages = {self._address(t.untyped_storage()): t.untyped_storage().nbytes() for t in buffers}
        return sum(storages.values())

    def _pack(self, t: torch.Tensor) -> tuple[torch.Tensor, _Held | None]:
        st = _storage(t)
        ptr = self._address(st)
        params = {self._address(_storage(p)) for m in self.modules for p in m.parameters()}
        meta = st.device.type == "meta" and not self._fake
        if ptr in params or st.nbytes() == 0 or meta or ptr in self._copies:
            return t, None
        if ptr in self._live:
            self._live[ptr][1] += 1
            return t, _Held(self, ptr)
        if _from_parameter(t, params, self._address):
            self._copies.add(ptr)
            self.weight_copies += st.nbytes()
            return t, None
        self._live[ptr] = [st.nbytes(), 1]
        self._now += st.nbytes()
        self.total += st.nbytes()
        if self._now > self.bytes:
            self.bytes, self.gathered = self._now, self._gathered_now()
        self.saved.append((tuple(t.shape), t.dtype, st.nbytes(), type(t.grad_fn).__name__))
        return t, _Held(self, ptr)

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if not entry[1]:
            self._now -= entry[0]
            del self._live[ptr]


class CommCounter(TorchDispatchMode):
    """Counts collectives by kind: calls, elements and bytes of the full (unsharded) buffer each moves.

    all_reduce: the buffer; all_gather: the gathered output; reduce_scatter: the input; broadcast,
    send, recv: the tensor."""

    KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_to_all")

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.elements: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.sizes: dict[str, list[int]] = defaultdict(list)
        self.paused = False  # while set, nothing is counted (a first step's one-off shape inference)

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
        if ns in ("c10d", "_c10d_functional", "c10d_functional") and not self.paused:
            name = func._schema.name.split("::")[-1]
            kind = self._kind(name)
            if kind is not None and "wait" not in name:
                n = _elements(kind, args, out, inplace=ns == "c10d" and name.startswith("_reduce_scatter_base"))
                self.calls[kind] += 1
                self.elements[kind] += n
                if n > 1:  # the model's traffic (as `volumes`)
                    self.bytes[kind] += n * next((t.element_size() for t in _tensors(args)), 0)
                self.sizes[kind].append(n)
        return out


class FsdpCopyBytes(TorchDispatchMode):
    """Bytes FSDP2's copy kernels read and write around its collectives (torch.distributed.fsdp's
    _fsdp_collectives): the foreach cast of the fp32 shards to the compute dtype, the copy into
    the all-gather buffer (fsdp.all_gather_copy_in), the split of the gathered buffer into the
    parameters (fsdp.split_with_sizes_copy), the gradients' concatenation into the reduce buffer
    (fsdp.chunk_cat) and, with no group to scatter over, that buffer's copy into the output. Groups
    of `modules` whose shard group is one rank (FSDP2's replicate; fully_shard over one rank)
    unshard without a collective (FSDPParamGroup.wait_for_unshard): each shard cast to the compute
    dtype on its own, then copied into the unsharded tensor; those are counted too."""

    def __init__(self, modules=()):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self._reduce_input: tuple[int, int] | None = None  # the last chunk_cat's output, until the next op
        self._unshard_inputs = _one_rank_shards(modules)  # data pointers a one-rank unshard reads
        self._casts: set[int] = set()  # its casts' outputs, until copied

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._foreach_copy_.default and len({_storage(t).data_ptr() for t in args[0]}) == 1:
            self.bytes["cast"] += _nbytes(args[0]) + _nbytes(args[1])  # into one flat buffer: FSDP2's
        elif func is torch.ops.fsdp.all_gather_copy_in.default:
            inputs, buffer = args[0], args[1]
            self.bytes["copy_in"] += _nbytes(inputs) + sum(t.numel() for t in inputs) * buffer.element_size()
        elif func is torch.ops.fsdp.split_with_sizes_copy.default:
            self.bytes["copy_out"] += _nbytes(args[:1]) + _nbytes(kwargs["out"])
        elif (
            func is torch.ops.aten.copy_.default
            and self._reduce_input is not None
            and (args[1].data_ptr(), args[1].numel()) == self._reduce_input
        ):
            self.bytes["reduce_copy"] += _nbytes(args[:2])
        elif func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self._unshard_inputs:
            self.bytes["unshard_cast"] += _nbytes([args[0], out])
            self._casts.add(out.data_ptr())  # what the copy below reads
        elif func is torch.ops.aten.copy_.default and (
            args[1].data_ptr() in self._unshard_inputs or args[1].data_ptr() in self._casts
        ):
            self._casts.discard(args[1].data_ptr())
            self.bytes["unshard_copy"] += _nbytes(args[:2])
        if func is torch.ops.fsdp.chunk_cat.default:
            self.bytes["chunk_cat"] += _nbytes(args[0]) + _nbytes([kwargs["out"]])
            self._reduce_input = (kwargs["out"].data_ptr(), kwargs["out"].numel())
        elif func is not torch.ops.aten.empty.memory_format:  # FSDP2 allocates the output in between
            self._reduce_input = None
        return out


def _one_rank_shards(modules) -> set[int]:
    """Data pointers of the sharded parameters of `modules`' FSDP2 groups whose all-gather group is
    one rank (no FSDPMeshInfo, as under replicate, or a shard mesh of size 1)."""
    ptrs: set[int] = set()
    for m in (x for part in modules for x in part.modules()):
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is not None and getattr(group.mesh_info, "shard_mesh_size", 1) == 1:
            ptrs |= {p._sharded_param_data.data_ptr() for p in group.fsdp_params}
    return ptrs


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


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

    DATA_DEPENDENT = (
        "_local_scalar_dense",
        "nonzero",
        "masked_select",
        "_unique2",
        "unique_dim",
        "is_nonzero",
        "equal",
    )

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
        elif (
            name == "_to_copy"
            and first is not None
            and first.device.type != "cpu"
            and str(kwargs.get("device")) == "cpu"
        ):
            self._hit("to_cpu")
        return func(*args, **kwargs)


class PeakMemory:
    """The most bytes allocated on `device` at once while active, above what was allocated when it
    began: a step's activations, gradients, gathered parameters, copies and temporaries, not the
    parameters and optimizer state it starts with. On a GPU the caching allocator's high-water
    mark; on a CPU, which keeps no such count, the running total torch.profiler's memory events
    carry (it counts the allocations made while profiling and their frees).

        with PeakMemory(device) as peak:
            train_step(...)
        peak.bytes
    """

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, 0
        self.held = 0  # allocated while active and still allocated at the end (what a forward keeps)

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._start
            self.held = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        from torch._C._profiler import _EventType, _ExtraFields_Allocation

        profiler = self._prof.profiler  # its results are set by the __exit__ above
        assert profiler is not None and profiler.kineto_results is not None
        events, nodes = [], list(profiler.kineto_results.experimental_event_tree())
        while nodes:
            n = nodes.pop()
            nodes.extend(n.children)
            alloc = n.extra_fields
            if (
                n.tag == _EventType.Allocation
                and isinstance(alloc, _ExtraFields_Allocation)
                and alloc.device.type == "cpu"
            ):
                events.append((n.start_time_ns, alloc.alloc_size, alloc.total_allocated, alloc.ptr))
        if events:  # the running total is the process's since it first profiled: start from the block's own
            _, size, total, _ = min(events)
            self.bytes = max(t for _, _, t, _ in events) - (total - size)
            live: dict[int, int] = {}  # what was allocated here and is not freed yet
            for _, size, _, ptr in sorted(events):
                if size > 0:
                    live[ptr] = size
                else:
                    live.pop(ptr, None)
            self.held = sum(live.values())
