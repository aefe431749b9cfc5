"""A trained model evaluated: perplexity, multiple-choice tasks' scoring, generation with a KV
cache, and lm-eval's harness."""

from flopwise import public_api

HOMES = {
    "report": ["Evaluation", "evaluate_checkpoint"],
    "generate": ["generate_tokens", "complete"],
    "harness": ["FlopwiseLM", "run_lm_eval", "TASK_PREFIX", "task_yaml", "write_task_yamls"],
    "load": ["load_for_inference"],
    "perplexity": ["text_loss"],
    "tasks": ["evaluate_task", "score", "with_shots"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
