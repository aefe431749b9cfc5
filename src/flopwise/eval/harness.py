"""flopwise as an lm-evaluation-harness client: a registered `flopwise` model class and offline task configs.

lm-eval discovers models only from its own registry (no plugin entry points in 0.4.x), so the class is
registered when this module is imported; `flopwise lm-eval ARGS` (or `python -m flopwise.eval.harness
ARGS`) imports it, writes YAML configs for the built-in JSONL tasks, and hands ARGS to lm-eval's own CLI:

    flopwise lm-eval --model flopwise --model_args path=runs/demo --tasks flopwise_shakespeare-cloze

Scoring is flopwise's (`tasks.score`): context and continuation are tokenized separately and
concatenated, exactly as `flopwise eval` does, so the two report the same numbers.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
from pathlib import Path

import lm_eval.models  # noqa: F401  (fills the registry first: registering into an empty one hides "hf")
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from flopwise.data.tasks import builtin_tasks, load_task
from flopwise.errors import ConfigError
from flopwise.eval.tasks import encode_pair, score

TASK_PREFIX = "flopwise_"


@register_model("flopwise")
class FlopwiseLM(LM):
    """A flopwise checkpoint (or run dir: its newest checkpoint), consolidated for inference."""

    def __init__(
        self,
        path: str,
        batch_size: int | str = 8,
        device: str | None = None,
        max_gen_toks: int = 64,
        max_batch_size: int | None = None,
    ) -> None:
        """`max_batch_size` is accepted because lm-eval's CLI always passes it; there is no auto
        batching here (`batch_size=auto` means 8)."""
        super().__init__()
        import torch

        from flopwise.data.tokenizer import eos_id
        from flopwise.eval.load import load_for_inference

        # lm-eval's CLI passes device="cuda" unless told otherwise; a CPU-only torch runs on the CPU
        device = device if device and (torch.cuda.is_available() or not device.startswith("cuda")) else "cpu"
        self.model, self.cfg, self.tok = load_for_inference(path, device)
        self.eos = eos_id(self.tok)
        self.batch = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> FlopwiseLM:
        """lm-eval's CLI passes its own batch_size, max_batch_size and device (its defaults 1 and
        cuda:0 included) beside model_args, and its base class fails on a key given twice; here a
        key in model_args wins, so `--model_args path=runs/demo,batch_size=16` means 16."""
        known = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
        unknown = [k for k in arg_dict if k not in known]
        if unknown or "path" not in arg_dict:
            raise ConfigError(
                f"--model_args {unknown[0] if unknown else 'has no path'}: the flopwise model takes "
                f"{', '.join(known)} (path=RUN_OR_CHECKPOINT required)"
            )
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FlopwiseLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def _enc(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # An empty context is conditioned on EOS, the document separator the model was trained with.
        pairs = [
            encode_pair(self.tok, ctx, cont) if ctx else ([self.eos], self._enc(cont))
            for ctx, cont in (r.args for r in requests)
        ]
        return score(self.model, pairs, self.batch)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document alone, every token predicted once, windows of the model's context length."""
        out = []
        for (text,) in (r.args for r in requests):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    self._enc(text), prefix_token=self.eos, max_seq_len=self.model.cfg.max_seq_len, context_len=1
                )
            ]
            out.append(sum(lp for lp, _ in score(self.model, windows, self.batch)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation with the KV cache, cut at the first stop string. As lm-eval's `hf`
        model does, a context is cut from the left to leave room for max_gen_toks new tokens."""
        from flopwise.eval.generate import generate_tokens

        out = []
        for ctx, kwargs in (r.args for r in requests):
            until = kwargs.get("until", [])
            until = [until] if isinstance(until, str) else list(until)
            n_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            keep = self.model.cfg.max_seq_len - n_new
            if keep < 1:
                raise ConfigError(
                    f"max_gen_toks={n_new} leaves no room for a context in the model's "
                    f"max_seq_len={self.model.cfg.max_seq_len}: ask for fewer new tokens"
                )
            ids = generate_tokens(
                self.model, (self._enc(ctx) or [self.eos])[-keep:], n_new, temperature=0.0, stop_id=self.eos
            )
            text = self.tok.decode([i for i in ids if i != self.eos])
            cuts = [text.index(s) for s in until if s and s in text]
            out.append(text[: min(cuts)] if cuts else text)
        return out


def task_yaml(name: str, path: Path) -> str:
    """An lm-eval task over a local JSONL file in flopwise's task format (read by `datasets`, offline)."""
    _, examples = load_task(str(path))
    head = (
        f"task: {TASK_PREFIX}{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {path.resolve()}\ntest_split: test\ndoc_to_text: context\ntarget_delimiter: ''\n"
    )
    if examples[0].choices:
        return head + (
            "output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: gold\n"
            "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
        )
    return head + (
        "output_type: loglikelihood\ndoc_to_target: target\nmetric_list:\n  - metric: acc\n  - metric: perplexity\n"
    )


def write_task_yamls(out: Path, tasks: dict[str, Path] | None = None) -> list[str]:
    """One YAML per task (default: the built-in ones) into `out`; returns the lm-eval task names."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for name, path in (tasks or builtin_tasks()).items():
        (out / f"{TASK_PREFIX}{name}.yaml").write_text(task_yaml(name, path))
        names.append(TASK_PREFIX + name)
    return names


def _split_include_paths(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the user's --include_path values, in order; the other arguments). lm-eval's CLI keeps only
    the last --include_path, so ours appended after the user's would hide theirs."""
    paths, rest, args = [], [], iter(argv)
    for a in args:
        if a == "--include_path":
            paths.append(next(args, ""))
        elif a.startswith("--include_path="):
            paths.append(a.split("=", 1)[1])
        else:
            rest.append(a)
    return [p for p in paths if p], rest


@contextlib.contextmanager
def _include_paths(paths: list[str]):
    """Every TaskManager built inside scans all of `paths` (lm-eval's TaskManager takes a list of
    include paths; its CLI passes one)."""
    from lm_eval.tasks import TaskManager

    init = TaskManager.__init__

    def with_paths(self, *args, include_path=None, **kwargs):
        init(self, *args, include_path=list(paths), **kwargs)

    TaskManager.__init__ = with_paths
    try:
        yield
    finally:
        TaskManager.__init__ = init


def run_lm_eval(argv: list[str]) -> None:
    """lm-eval's CLI with the flopwise model registered and the built-in tasks on its include path,
    beside the user's own --include_path folders."""
    from lm_eval.__main__ import cli_evaluate

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    user, rest = _split_include_paths(argv)
    with tempfile.TemporaryDirectory(prefix="flopwise-tasks-") as tmp, _include_paths([tmp, *user]):
        write_task_yamls(Path(tmp))
        sys.argv = ["lm_eval", *rest, "--include_path", tmp]
        cli_evaluate()


if __name__ == "__main__":
    run_lm_eval(sys.argv[1:])
