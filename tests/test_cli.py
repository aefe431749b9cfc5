"""The command line's shape: `plan` planning by default beside its `measure` and `max-micro-batch`
subcommands, the old flag spellings still working (with a note) for one release, and the commands
that plan or print a config never importing torch."""

import json
import subprocess
import sys

import pytest

from flopwise.cli.plan import route
from flopwise.errors import ConfigError

OLD_MEASURE = "note: `plan --measure` is now `plan measure`; the flag goes in the next release"
OLD_MAX_MB = "note: `plan --max-micro-batch` is now `plan max-micro-batch`; the flag goes in the next release"
COMMANDS = ("search", "measure", "max-micro-batch", "serve")


def test_route_puts_the_subcommand_first():
    assert route([], COMMANDS) == ["search"]
    assert route(["demo", "--top", "2"], COMMANDS) == ["search", "demo", "--top", "2"]
    assert route(["--hf", "x", "--json"], COMMANDS) == ["search", "--hf", "x", "--json"]
    assert route(["measure", "demo"], COMMANDS) == ["measure", "demo"]
    assert route(["--help"], COMMANDS) == ["--help"]


def test_route_turns_an_old_flag_into_its_subcommand_with_a_note(capsys):
    assert route(["demo", "--measure", "--steps", "2"], COMMANDS) == ["measure", "demo", "--steps", "2"]
    assert capsys.readouterr().err.strip() == OLD_MEASURE
    assert route(["--max-micro-batch", "demo"], COMMANDS) == ["max-micro-batch", "demo"]
    assert capsys.readouterr().err.strip() == OLD_MAX_MB
    with pytest.raises(ConfigError, match="choose one"):
        route(["--measure", "--max-micro-batch"], COMMANDS)


def test_a_flag_after_a_subcommand_is_the_subcommands_own(capsys):
    """`plan serve --measure` measures serving; it is not the old `plan --measure`."""
    assert route(["serve", "demo", "--measure"], COMMANDS) == ["serve", "demo", "--measure"]
    assert capsys.readouterr().err == ""


def test_plan_plans_by_default(cli):
    keys = ["model.preset=llama3-8b", "cluster.gpus=64"]
    default = cli("plan", *keys, "--top", "2", "--json")
    named = cli("plan", "search", *keys, "--top", "2", "--json")
    assert default.returncode == named.returncode == 0, default.stderr
    assert json.loads(default.stdout) == json.loads(named.stdout)
    assert len(json.loads(default.stdout)["layouts"]) == 2
    bare = cli("plan")
    assert bare.returncode == 0 and "layouts, best first" in bare.stdout, bare.stderr


def test_max_micro_batch_new_and_old_spelling(cli):
    new = cli("plan", "max-micro-batch", "demo", "--json")
    old = cli("plan", "demo", "--max-micro-batch", "--json")
    assert new.returncode == old.returncode == 0, old.stderr
    assert json.loads(new.stdout) == json.loads(old.stdout)
    assert new.stderr == "" and old.stderr.strip() == OLD_MAX_MB


def test_measure_new_and_old_spelling_refuse_alike(cli):
    """A refused measure: the same one-line error either way; the old spelling adds its note first."""
    new = cli("plan", "measure", "--steps", "0")
    old = cli("plan", "--measure", "--steps", "0")
    assert new.returncode == old.returncode == 2
    assert new.stderr.strip().splitlines() == ["error: --steps=0: measure at least one step"]
    assert old.stderr.strip().splitlines() == [OLD_MEASURE, *new.stderr.strip().splitlines()]
    both = cli("plan", "--measure", "--max-micro-batch")
    assert both.returncode == 2 and both.stderr.strip() == "error: --measure and --max-micro-batch: choose one"


def test_help_lists_the_subcommands(cli):
    r = cli("plan", "--help")
    assert r.returncode == 0
    for command in COMMANDS:
        assert command in r.stdout
    for group in ("config", "data", "scale", "convert", "checkpoint", "hardware"):
        assert cli(group, "--help").returncode == 0
    assert "contamination" in cli("--help").stdout  # `data` says all three of its jobs


def test_help_types_no_flag_and_points_train_at_the_keys(cli):
    train = cli("train", "--help").stdout
    assert "flopwise config docs" in train and "docs/config.md" in train
    assert "[key=value ...]" in train  # not read as a rich style tag
    text = cli("--help").stdout + cli("eval", "--help").stdout
    assert "--json" in text and "--quiet" in text and "<bool>" not in text
    assert "<int range>" in text  # an option that takes a value keeps its type


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["plan", "model.preset=llama3-8b", "cluster.gpus=64"],
        ["plan", "--help"],
        ["config", "show"],
        ["train", "model.n_layer=3"],  # a typo is answered before torch (0.4 s, not 4 s idle, 40-67 s busy)
    ],
)
def test_planning_and_config_commands_import_no_torch(args):
    code = "import sys; from flopwise.cli import main; sys.argv = ['flopwise', *sys.argv[1:]]\n"
    code += "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
