"""The engine's layout checks and pure helpers (no process group needed)."""

import threading
from types import SimpleNamespace

import pytest
import torch

from flopwise.config.schema import ModelConfig, load_config
from flopwise.errors import ConfigError
from flopwise.layout.rules import FIXED_VIRTUAL_STAGES, SCHEDULES, Layout, balanced_stages, check_layout, layout_of
from flopwise.model.layers import Span
from flopwise.model.transformer import build_model, document_ids, document_positions
from flopwise.parallel.context import ContextParallel
from flopwise.parallel.pipeline import SCHEDULE_CLASSES


def cfg(**kw):
    base = {
        "model.preset": '"demo-tiny"',
        "model.n_layers": 4,
        "model.tie_embeddings": "false",
        "data.seq_len": 32,
        "train.global_batch": 8,
        "train.micro_batch": 2,
    }
    base.update(kw)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def test_dp_defaults_to_what_is_left():
    lo = layout_of(cfg(**{"parallel.tp": 2, "parallel.zero": 3}), 8)
    assert (lo.dp, lo.tp, lo.world) == (4, 2, 8)


@pytest.mark.parametrize(
    "kw, world, match",
    [
        ({"parallel.tp": 2}, 1, r"= 2 but the world size is 1.*torchrun --nproc-per-node 2"),
        ({"parallel.dp": 2, "parallel.tp": 2}, 8, r"pp=1 × dp=2 × cp=1 × tp=2 = 4 but the world size is 8"),
        ({"parallel.pp": 2, "model.tie_embeddings": "true"}, 2, "tie_embeddings"),
        ({"parallel.tp": 4}, 4, "exceeds model.n_kv_heads=2"),
        ({"parallel.tp": 2, "parallel.zero": 1}, 4, "use parallel.zero=0, 2 or 3"),
        ({"parallel.pp": 2, "parallel.pp_layers": "[1, 2]"}, 2, "pp_layers"),
        # torch's DDP reducer asserts in the first backward of a rank running two stages
        (
            {"parallel.pp": 2, "parallel.pp_schedule": '"interleaved-1f1b"', "parallel.virtual_stages": 2},
            4,
            r"runs 2 stages per rank, which torch's DDP \(parallel.zero=0\) cannot; use parallel.zero=2 or 3",
        ),
        # the tester's DualPipeV run: torch refused it on every rank after the process groups were up
        (
            {
                "parallel.pp": 2,
                "parallel.pp_schedule": '"dualpipev"',
                "parallel.virtual_stages": 2,
                "train.micro_batch": 4,
            },
            2,
            r"dualpipev needs at least 4 micro-batches.*gives 2; set train.micro_batch=2",
        ),
        (
            {"parallel.pp": 4, "train.micro_batch": 1, "train.global_batch": 2},
            4,
            r"1f1b needs at least 4 micro-batches.*raise train.global_batch to 4",
        ),
    ],
)
def test_unrunnable_layouts_get_one_line_errors(kw, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        layout_of(cfg(**kw), world)
    assert "\n" not in str(e.value)


def torch_takes(schedule: str, pp: int, v: int, n_micro: int) -> bool:
    """Whether torch's own class for `schedule` (the engine's SCHEDULE_CLASSES) builds a schedule for
    n_micro micro-batches on pp ranks with v stages each: torch's dry-run helper constructs it with
    mock stages, so the constructor's checks run without a process group."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    try:
        get_schedule_ops(SCHEDULE_CLASSES[schedule], pp, n_micro, num_stages_per_rank=v)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    "schedule, v",
    [(s, v) for s in SCHEDULES for v in ([2, 3] if s == "interleaved-1f1b" else [FIXED_VIRTUAL_STAGES.get(s, 1)])],
)
def test_micro_batch_counts_check_layout_takes_are_torchs(schedule, v):
    """For every schedule the engine offers, on pp = 2..4 and 1..3·pp+1 micro-batches, check_layout
    accepts exactly the counts torch's schedule class accepts (so the smallest too): a run is refused
    in one line before any process group exists, and the search never offers what torch refuses."""
    m = ModelConfig(preset="demo-tiny", n_layers=12, tie_embeddings=False)
    for pp in (2, 3, 4):
        for n in range(1, 3 * pp + 2):
            lo = Layout(pp=pp, pp_schedule=schedule, virtual_stages=v)
            ours = check_layout(lo, m, 32, n, world=pp)
            assert (ours is None) == torch_takes(schedule, pp, v, n), (schedule, pp, v, n, ours)


def test_searched_dualpipev_layouts_are_ones_torch_builds():
    """The tester's `flopwise plan ... parallel.pp_schedule=dualpipev` (llama3-70b, 256 H100s, batch
    32) listed layouts with fewer micro-batches than DualPipeV's 2·pp stages; every one it lists now
    builds in torch."""
    from flopwise.hardware.catalogue import get_hardware
    from flopwise.plan.search import search_layouts
    from flopwise.plan.shape import model_shape
    from flopwise.plan.stack import STACKS

    m = ModelConfig(preset="llama3-70b", max_seq_len=8192)
    res = search_layouts(
        model_shape(m, 8192),
        get_hardware("h100-sxm"),
        256,
        8192,
        32,
        STACKS["flopwise"],
        {"pp_schedule": "dualpipev"},
        keep=10**6,
    )
    piped = [e.layout for e in res.ranked if e.layout.pp > 1]
    assert res.fitting and piped
    for lo in {(lo.pp, lo.microbatches(32)) for lo in piped}:
        assert torch_takes("dualpipev", lo[0], 2, lo[1]), lo


def test_stages_balance_parameters_not_layers():
    assert balanced_stages(4, 2, 10, 0, 0) == (2, 2)
    assert balanced_stages(8, 4, 10, 25, 5) == (1, 2, 3, 2)  # the embedding's stage takes fewer layers
    assert balanced_stages(4, 4, 1, 100, 100) == (1, 1, 1, 1)


def test_context_parallel_chunks_pair_head_and_tail():
    """cp=2, 16 tokens -> 4 chunks of 4: rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2; together
    they cover the sequence once, and each rank has the same number of causal (query, key) pairs."""
    ranks = [ContextParallel(r, 2, None) for r in range(2)]
    pos = [cp.positions(16) for cp in ranks]
    assert pos[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and pos[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(torch.cat(pos).tolist()) == list(range(16))
    assert [int((p + 1).sum()) for p in pos] == [68, 68]
    assert ranks[0].key_positions(16).tolist() == torch.cat(pos).tolist()
    x = torch.arange(32).view(2, 16)
    assert ranks[1].shard(x).tolist() == [list(range(4, 12)), list(range(20, 28))]
    span = ranks[1].span(16)  # what the model is handed: the same positions, and the gather
    assert span.q_pos.tolist() == pos[1].tolist() and span.k_pos.tolist() == ranks[1].key_positions(16).tolist()
    assert span.gather_kv == ranks[1].gather and not span.whole and span.length == 16


class ThreadGather:
    """cp ranks as threads of one process: each rank's K/V all-gathered in rank order (the order of
    ContextParallel.key_positions), as the collective does."""

    def __init__(self, size: int):
        self.barrier, self.slots = threading.Barrier(size), [None] * size

    def for_rank(self, rank: int):
        def gather(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            out = torch.cat(self.slots, dim=2)
            self.barrier.wait()  # nobody overwrites a slot before every rank has read it
            return out

        return gather


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "bloom", "neox"])
@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_shards_equal_the_whole_sequence(arch, documents):
    """Each cp rank's logits, computed from its shard, the span ContextParallel hands the model and
    the gathered keys, are the one-process model's at its positions: RoPE, sliding window, learned
    positions (with per-document positions), ALiBi, partial RoPE; with and without documents."""
    m = ModelConfig(
        arch=arch,
        n_layers=2,
        d_model=32,
        n_heads=4,
        vocab_size=97,
        max_seq_len=32,
        **({"sliding_window": 5} if arch == "mistral" else {}),
    )
    model = build_model(m, seed=0).eval()
    x = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    x[:, ::7] = 0
    kw = {}
    if documents:
        kw["documents"] = document_ids(x, 0)
        kw["positions"] = document_positions(kw["documents"]) if arch == "gpt2" else None
    with torch.no_grad():
        whole = model(x, **kw)
    size, out = 3, {}
    gathers = ThreadGather(size)

    def run(rank: int):
        cp = ContextParallel(rank, size, None)
        span = Span(cp.positions(24), cp.key_positions(24), gathers.for_rank(rank))
        with torch.no_grad():
            out[rank] = model(cp.shard(x), span=span, **kw)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for rank in range(size):
        torch.testing.assert_close(
            out[rank], whole[:, ContextParallel(rank, size, None).positions(24)], rtol=1e-5, atol=1e-5
        )


def test_releasing_sends_drops_finished_sends_and_keeps_the_rest():
    """While a step runs, a send whose Work is finished is emptied out of the list the schedule
    keeps (so its tensor can go), an unfinished one is kept for the schedule's own wait, receives
    are never touched, and torch's function is back when the step ends."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from flopwise.parallel.pipeline import releasing_sends

    class Work:
        def __init__(self):
            self.done = False

        def is_completed(self):
            return self.done

    def fake_batch_p2p(ops, desc=None):
        return [Work() for _ in ops]

    send, recv = SimpleNamespace(op=dist.isend), SimpleNamespace(op=dist.irecv)
    saved = schedules._batch_p2p
    schedules._batch_p2p = fake_batch_p2p
    try:
        with releasing_sends():
            first, second, received = (schedules._batch_p2p([op]) for op in (send, send, recv))
            first[0].done = received[0].done = True
            schedules._batch_p2p([send])
            assert first == [] and len(second) == 1 and len(received) == 1
        assert schedules._batch_p2p is fake_batch_p2p
    finally:
        schedules._batch_p2p = saved
