"""Several nodes on one machine: separate torchrun agents (one process tree each) that meet through
torchrun's c10d rendezvous, as `srun torchrun` starts them on a cluster. Their losses equal one
process's; the mesh keeps tensor parallelism inside a node; parallel.layout=auto plans for the
ranks each node really has; a node that dies is named by the survivors, and the job restarts on
fewer nodes from the resharded checkpoint.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flopwise.checkpoints import checkpoint
from flopwise.config.schema import load_config
from flopwise.layout.rules import config_layout
from flopwise.plan.planner import resolve_layout
from flopwise.train.launch import train
from flopwise.train.trainer import layout_label
from tests.conftest import tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multinode]


def overrides(run_dir, data, **extra) -> list[str]:
    """A 4-layer untied Llama (pp2 splits it), 8 sequences of 32 tokens a step, 2 per micro-batch."""
    kw = {
        "model.n_layers": 4,
        "model.tie_embeddings": "false",
        "train.steps": 3,
        "train.micro_batch": 2,
        "train.eval_every": 0,
        "checkpoint.interval": 0,
        "train.eval_batches": 1,
    }
    return tiny_overrides(run_dir, data, **{**kw, **extra})


def reference(tmp: Path, data, **extra) -> list[float]:
    """One process's per-step losses for the same run."""
    return train(load_config(None, overrides(tmp, data, **extra))).losses


@pytest.fixture(scope="module")
def one_process(tiny_data, tmp_path_factory) -> list[float]:
    """The 3-step reference of every parametrisation of test_nodes_train_like_one_process (the layout
    does not change it): computed once."""
    return reference(tmp_path_factory.mktemp("one_process") / "ref", tiny_data)


def logged_losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def start_nodes(n: int, nproc: int, port: int, args: list[str], logs: Path, env: dict | None = None) -> list:
    """`n` torchrun agents, each its own process group (a node: killing it kills its workers),
    meeting at 127.0.0.1:`port`; stdout/stderr to logs/node{i}.out/.err."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(n),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"job{port}",
        "--max-restarts",
        "0",
        "-m",
        "flopwise",
        "train",
        *args,
    ]
    logs.mkdir(exist_ok=True)
    procs = []
    for i in range(n):
        with open(logs / f"node{i}.out", "w") as out, open(logs / f"node{i}.err", "w") as err:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True))
        if i == 0:  # node 0 hosts the rendezvous endpoint (whichever agent binds it first does)
            _wait_listening(port, procs[0])
    return procs


def _wait_listening(port: int, agent: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert agent.poll() is None and time.monotonic() < deadline, "the first agent did not open its endpoint"
            time.sleep(0.2)


def finish(procs: list, logs: Path, timeout: float = 400) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each agent; an agent still running after `timeout` is killed
    with its workers and fails the test."""
    deadline = time.monotonic() + timeout
    out = []
    for i, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill_node(q)
            pytest.fail(f"node {i} still running after {timeout} s: {(logs / f'node{i}.err').read_text()[-3000:]}")
        out.append((p.returncode, (logs / f"node{i}.out").read_text(), (logs / f"node{i}.err").read_text()))
    return out


def _kill_node(p: subprocess.Popen) -> None:
    """SIGKILL the agent and every worker it started: a node going down. (torchrun starts each
    worker in a session of its own, so the agent's process group alone would leave them running.)"""
    children = Path(f"/proc/{p.pid}/task/{p.pid}/children")
    workers = [int(c) for c in children.read_text().split()] if children.exists() else []
    for group in [p.pid, *workers]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


LAYOUT_LINE = re.compile(r"layout (.+) on (\d+) processes on (\d+) nodes \((.+)\) \(gloo\)")


@pytest.mark.parametrize(
    "nodes,name,extra,where",
    [
        # zero3: pp with DDP (zero 0/1) trips an internal assert in torch 2.13's reducer, on one node too
        (
            2,
            "pp2xdp2",
            {"parallel.pp": 2, "parallel.pp_schedule": '"1f1b"', "parallel.zero": 3},
            "dp inside a node; pp across",
        ),
        (4, "auto", {"parallel.layout": '"auto"', "cluster.hardware": '"h100-sxm"'}, None),
    ],
)
def test_nodes_train_like_one_process(nodes, name, extra, where, tiny_data, one_process, tmp_path):
    """pp2 × dp2 over 2 nodes of 2 ranks (pipeline stages on different nodes, data parallel inside
    each), and parallel.layout=auto over 4 nodes of 1 rank, which plans for 1 device per node (a
    layout other than the one it plans for 4 devices in one node): per-step losses equal one
    process's."""
    nproc = 4 // nodes
    results = finish(
        start_nodes(nodes, nproc, 29710 + nodes, overrides(tmp_path / "run", tiny_data, **extra), tmp_path / "logs"),
        tmp_path / "logs",
    )
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    line = LAYOUT_LINE.search("".join(o for _, o, _ in results))
    assert line, results[0][1][-2000:]
    assert (line[2], line[3]) == ("4", str(nodes))
    if where is not None:
        assert line[4] == where
    else:  # auto: what the planner chooses for 4 nodes of 1 device, not for 1 node of 4
        cfg = load_config(None, overrides(tmp_path, tiny_data, **extra))
        per_node = {
            n: layout_label(config_layout(resolve_layout(cfg, cfg.model_dump(exclude_unset=True), 4, n), 4))
            for n in (1, 4)
        }
        assert per_node[1] != per_node[4] and line[1] == per_node[1], (line[0], per_node)
    assert logged_losses(tmp_path / "run") == pytest.approx(one_process, rel=1e-5)


@pytest.mark.waits  # a 20 s sleep in step 5, which the kill lands in
def test_node_lost_then_restart_on_fewer_nodes(tiny_data, tmp_path):
    """tp2 × dp2 over 2 nodes (tp inside each): the second node's agent is killed with its workers
    during step 5 (not the first's: the node holding the rendezvous endpoint is torchrun's single
    point of failure, whose loss ends the other agents with RendezvousConnectionError); the other
    node names it and the step in one line and exits non-zero at once; the checkpoint of step 4 is
    complete; the job restarted on one node (tp2) resumes from it, says so,
    and every step's loss, before and after, equals one uninterrupted process's."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    layout = {"parallel.tp": 2, "parallel.zero": 3}
    args = overrides(
        run, tiny_data, **{**layout, "train.steps": 8, "checkpoint.interval": 2, "watchdog.collective_timeout_s": 120}
    )
    # every rank sleeps 20 s in step 5, after its backward: the node dies there, mid-step
    procs = start_nodes(2, 2, 29720, args, logs, env={"FLOPWISE_FAULTS": "slow:step=5:seconds=20"})
    deadline = time.monotonic() + 300
    while (
        latest := checkpoint.latest(run) if (run / "checkpoints").exists() else None
    ) is None or latest.name != "step-00000004":
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (logs / "node0.err").read_text()[
            -3000:
        ]
        time.sleep(0.1)
    # step 4's checkpoint is on disk before its save ends on every rank: killed at once, the node went
    # in step 4 (the survivor, rightly, named step 2 as the last checkpoint it knew complete; seen in a
    # sequential run, 2026-12-06). 5 s on, every rank is in step 5, whose 20 s sleep the kill lands in
    time.sleep(5)
    t_kill = time.monotonic()
    _kill_node(procs[1])
    ((rc, out, err),) = finish(procs[:1], logs, timeout=120)
    assert time.monotonic() - t_kill < 60  # told at once, not after the collective timeout
    assert rc != 0
    told = [line for line in err.splitlines() if "went away" in line]
    assert len(told) == 1, err[-3000:]
    # the lost node is named by the ranks missing from the job's store, or, when it held that store, as such
    m = re.search(
        r"rank \d \(node (\d)\): another rank's connection closed at step 5: node (\d) \((rank \d-\d|it "
        r"held the job's store)\) went away; .* from the last complete checkpoint, step-00000004",
        told[0],
    )
    assert m and m[1] != m[2], told[0]
    assert "tp inside a node; dp across" in out
    assert [p.name for p in checkpoint.list_complete(run)] == ["step-00000002", "step-00000004"]

    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "flopwise",
            "train",
            *args,
            "parallel.dp=1",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"resumed from \S+step-00000004 at step 4 \(written by layout dp2·tp2 zero3", again.stdout), (
        again.stdout[-2000:]
    )
    ref = reference(tmp_path / "ref", tiny_data, **{"train.steps": 8, "checkpoint.interval": 2})
    assert logged_losses(run) == pytest.approx(ref, rel=1e-5)
