"""One training step's forward and backward for any layout: plain micro-batch accumulation, or a
pipeline schedule; context-parallel token sharding; tensor-parallel vocab-sharded loss.

The loss each rank backpropagates is the mean over its own tokens; DDP/FSDP average gradients over
the data- and context-parallel ranks, so the update equals one process on the whole global batch.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel

from flopwise.config.schema import Config
from flopwise.layout.rules import loss_chunk_tokens
from flopwise.model.layers import Span
from flopwise.model.transformer import document_ids, document_positions
from flopwise.parallel.apply import config_compiles
from flopwise.parallel.context import ContextParallel
from flopwise.parallel.mesh import Parallel, all_mean
from flopwise.parallel.pipeline import V_SHAPED, build_schedule, releasing_sends


def autocast(device: torch.device, dtype: str):
    if dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, in fp32 (on vocab shards under tensor parallel)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def lm_loss(model: nn.Module, batch: torch.Tensor, device: torch.device, dtype: str) -> torch.Tensor:
    """Mean next-token cross-entropy of a (b, s + 1) batch through a whole model (one process)."""
    with autocast(device, dtype):
        return token_loss(model(batch[:, :-1].to(device)), batch[:, 1:].to(device))


class Engine:
    """The parallelized model parts of this rank and how to run a step through them.

    `parts` are (stage id, parallelized module) pairs, one (0, model) without pipelining; each
    rank holds only its stages and shards of them (flopwise.train.build)."""

    def __init__(self, cfg: Config, par: Parallel, parts: list[tuple[int, nn.Module]], eos_id: int | None = None):
        self.cfg, self.par, self.device = cfg, par, par.device
        if cfg.data.document_mask and eos_id is None:
            raise ValueError("data.document_mask needs the data's EOS id to find document boundaries")
        self.eos = eos_id if cfg.data.document_mask else None
        lo = par.layout
        self.local_batch = cfg.train.global_batch // lo.dp
        self.n_micro = self.local_batch // cfg.train.micro_batch
        # This rank's one context-parallel sharder: it cuts each batch and gives the model its span
        self.cp = ContextParallel(par.rank("cp"), lo.cp, par.group("cp")) if lo.cp > 1 else None
        # A later pipeline stage's input under sequence parallel is 1/tp of the sequence: its span says how long
        self.split_hidden = lo.pp > 1 and lo.sequence_parallel
        self.parts = [m for _, m in parts]
        # Compiled, the loss never materialises the fp32 copy of the logits nor a separate
        # log-softmax pass (at vocab 512 eager log_softmax forward + backward was 22% of a ladder
        # step). Vocab-sharded DTensor logits (tensor parallel) keep the eager loss_parallel path.
        self.loss = torch.compile(token_loss) if config_compiles(cfg, lo) and lo.tp == 1 else token_loss
        # Or the model's own head and loss, chunk by chunk (Transformer.head_loss): never the fp32
        # logits of the whole micro-batch (the rule the planner books: layout.rules.loss_chunk_tokens)
        tokens = cfg.train.micro_batch * cfg.data.seq_len // lo.cp
        self.loss_chunk = loss_chunk_tokens(cfg.train.loss_chunk_tokens, tokens, cfg.model.vocab_size, lo.tp)
        self.schedule = None
        self.first = self.last = True
        if lo.pp > 1:
            self.schedule = build_schedule(parts, par, self.n_micro, self._loss_fn)
            ids = [s for s, _ in parts]
            self.first, self.last = 0 in ids, lo.n_stages - 1 in ids

    @property
    def can_eval(self) -> bool:
        """torch 2.13's ZB-V and DualPipeV runtime schedules still run their backward actions under
        `schedule.eval()` and deadlock (seen on gloo), so those layouts skip validation: export the
        checkpoint and run `flopwise eval`."""
        return self.schedule is None or self.par.layout.pp_schedule not in V_SHAPED

    @property
    def modules(self) -> nn.ModuleList:
        return nn.ModuleList(self.parts)

    def _loss_ctx(self):
        return loss_parallel() if self.par.size("tp") > 1 else contextlib.nullcontext()

    def _loss_fn(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss: its output already is, where the stage chunks its head and loss."""
        return out.squeeze(0) if self.loss_chunk else self.loss(out, targets)

    def _model_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        """Mean loss of one micro-batch through a whole (unpipelined) model."""
        if self.loss_chunk:
            return model(x, targets=y, loss_chunk=self.loss_chunk, **extra).squeeze(0)
        return self.loss(model(x, **extra), y)

    def model_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Whole (b, s) input sequences -> this rank's tokens (its context shard) and the model's
        keyword inputs, made once per batch: with data.document_mask, the document ids (and
        positions) over the whole sequence; the span of the sequence the model computes where its
        input does not show it (a context-parallel shard; a later stage under sequence parallel)."""
        extra: dict[str, Any] = {}
        if self.eos is not None:
            docs = document_ids(x, self.eos)
            extra["documents"] = docs.to(self.device)
            if self.cfg.data.reset_positions:
                extra["positions"] = document_positions(docs).to(self.device)
        if self.cp is not None:
            extra["span"] = self.cp.span(x.shape[1], self.device)
            x = self.cp.shard(x)
        elif self.split_hidden:
            extra["span"] = Span.after(0, x.shape[1], self.device)
        return x.to(self.device), extra

    def _inputs(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Inputs and targets (this rank's context shard), and the model's keyword inputs."""
        x, extra = self.model_inputs(batch[:, :-1])
        y = batch[:, 1:]
        return x, (self.cp.shard(y) if self.cp is not None else y).to(self.device), extra

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        """Backpropagate this rank's share of a global batch; returns the global mean loss."""
        x, y, extra = self._inputs(batch)
        dtype = self.cfg.train.dtype
        with self._loss_ctx(), autocast(self.device, dtype):
            if self.schedule is not None:
                local = self._pipeline(x, y, extra, train=True)
            else:
                local = torch.zeros((), device=self.device)
                model = self.parts[0]
                mb = self.cfg.train.micro_batch
                for i in range(0, x.shape[0], mb):
                    xm, ym = x[i : i + mb], y[i : i + mb]
                    last = i + mb >= x.shape[0]
                    if isinstance(model, ReplicateModule):  # all-reduce once per step, as DDP
                        model.set_requires_gradient_sync(last)
                    # DDP all-reduces on the last micro-batch only
                    with (
                        model.no_sync()
                        if isinstance(model, DistributedDataParallel) and not last
                        else contextlib.nullcontext()
                    ):
                        loss = self._model_loss(model, xm, ym, _rows(extra, i, i + mb)) * (
                            xm.shape[0] / self.local_batch
                        )
                        loss.backward()
                    local += _local(loss.detach())
        return all_mean(local, self.par)

    def _pipeline(self, x: torch.Tensor, y: torch.Tensor, extra: dict[str, Any], train: bool) -> torch.Tensor:
        """Run the schedule; the mean micro-batch loss, shared from the last stage to every pp rank.
        `extra` goes to every stage: document ids and positions cut into micro-batches like x, the
        span (not a tensor) whole to each."""
        losses: list[torch.Tensor] = []
        assert self.schedule is not None  # built whenever pp > 1, the only case that runs a schedule
        run = self.schedule.step if train else self.schedule.eval
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        if self.last and self.loss_chunk:  # the last stage's module computes its loss (Transformer.head_loss)
            kwargs |= {"targets": y, "loss_chunk": self.loss_chunk}
        with releasing_sends():  # torch keeps every micro-batch's output unless return_outputs=False
            run(*args, **kwargs, **extra, return_outputs=False)
        local = (
            torch.stack([_local(v.detach()) for v in losses]).mean()
            if self.last
            else torch.zeros((), device=self.device)
        )
        dist.all_reduce(local, group=self.par.group("pp"))
        return local

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """The loss on one batch, without gradients. Compiled blocks run their compiled code if they
        have one valid here and eagerly otherwise: no-grad would recompile them, which costs more than a
        short evaluation saves (~1 s a run on a 2-core CPU with a warm cache)."""
        x, y, extra = self._inputs(batch)
        for m in self.parts:
            m.eval()
        with (
            self._loss_ctx(),
            autocast(self.device, self.cfg.train.dtype),
            torch.compiler.set_stance("eager_on_recompile"),
        ):
            if self.schedule is not None:
                local = self._pipeline(x, y, extra, train=False)
            else:
                local = _local(self._model_loss(self.parts[0], x, y, extra))
        for m in self.parts:
            m.train()
        return float(all_mean(local, self.par, "cp"))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm over all of the model's gradients, across tensor/pipeline shards; the
        norm stays on the device (no host sync)."""
        params = [p for m in self.parts for p in m.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)
        norm = _local(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if self.par.size("pp") > 1:
            sq = norm.pow(2)
            dist.all_reduce(sq, group=self.par.group("pp"))
            norm = sq.sqrt()
        if math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    def weights_nonfinite(self, agreed: bool = False) -> torch.Tensor:
        """1.0 where any of this rank's weights is NaN or infinite, else 0.0, on the device (no host
        sync): the largest magnitude over its local shards (a finite maximum means every weight is
        finite), from each tensor's min and max (NaN propagates): torch's max-abs norm reduces without
        vectors on CPU, 37 ms against 3 ms a step at the GPT-2 reference shape on one thread;
        `agreed`: the flag of every rank (an all-reduce)."""
        params = [p.detach() for m in self.parts for p in m.parameters()]
        local = [t for p in params if (t := p.to_local() if isinstance(p, DTensor) else p).numel()]
        ends = [e for t in local for e in torch.aminmax(t)]
        peak = torch.stack(ends).abs().max() if ends else torch.zeros(())
        flag = (~torch.isfinite(peak)).float().to(self.par.device)
        if agreed and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag


def _rows(extra: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """The keyword inputs of batch rows [start, stop): per-row tensors cut, the span kept."""
    return {k: v[start:stop] if isinstance(v, torch.Tensor) else v for k, v in extra.items()}


def _local(x: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (loss under loss_parallel) as a plain tensor."""
    return x.full_tensor() if isinstance(x, DTensor) else x
