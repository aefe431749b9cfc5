"""Text to batches: tokenizers, token shards (prepare), mixtures, the resumable loader, task files
and contamination."""

from flopwise import public_api

HOMES = {
    "contamination": ["DecontaminationFilter", "measure_contamination", "contamination_report"],
    "loader": ["eval_batches", "TokenLoader"],
    "mixture": [
        "check_tokenizers",
        "draws",
        "EPOCH_WARNING",
        "mixture_fingerprint",
        "parse_unique_tokens",
        "prepared_sources",
        "Source",
        "mixture_of",
        "SourceDraw",
    ],
    "prepare": ["prepare_data"],
    "prepare_steps": ["Whitespace"],
    "shards": [
        "DATA_MANIFEST",
        "input_digest",
        "iter_documents",
        "open_split",
        "read_index",
        "read_text",
        "resolve_input",
        "SHARDS_FORMAT",
        "skipped_note",
        "tokenizer_of",
        "tokenizer_path",
        "val_documents",
    ],
    "tasks": ["builtin_tasks", "Example", "heldout_plays", "load_task", "shipped_task_records"],
    "tokenizer": [
        "EOS",
        "eos_id",
        "guarded",
        "GuardedTokenizer",
        "load_tokenizer",
        "SIDE_FILES",
        "side_files",
        "special_ids",
        "tokenizer_difference",
        "train_bpe",
    ],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
