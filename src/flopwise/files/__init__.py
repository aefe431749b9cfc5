"""What flopwise may write and replace: ownership proven by content, output writers that refuse
foreign files, and the run folder's record. Torch-free."""

from flopwise import public_api

HOMES = {
    "outputs": [
        "cache_dir",
        "check_folder",
        "check_space",
        "check_writable",
        "is_ours",
        "json_record",
        "png_bytes",
        "pyplot",
        "read_records",
        "save_figure",
        "TOML_HEADER",
        "write_csv",
        "write_json",
        "write_text",
    ],
    "ownership": [
        "add_to_manifest",
        "file_record",
        "files_under",
        "folder_id",
        "folder_lock",
        "hold_reading",
        "LOCK",
        "lock_lost",
        "ManifestKind",
        "real_path",
        "remove_all_but",
        "unread",
        "UNWRITABLE",
        "why_not_ours",
        "write_manifest",
        "written_for",
    ],
    "rundir": ["append", "Appender", "check_claim", "claim", "claimed", "remove", "replace"],
}
__all__ = [name for names in HOMES.values() for name in names]
__getattr__, __dir__ = public_api(__name__, HOMES)
