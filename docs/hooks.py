"""mkdocs hooks: the pages that live outside docs/ (README, CHANGELOG, CONTRIBUTING, the benchmarks' index and
reports, and the figures docs link to) join the site under their repository paths, so one link works both on GitHub
and on the site. Each file exists once, where the repository keeps it."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = [
    "README.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "examples/train.sbatch",
    *[str(p.relative_to(ROOT)) for p in sorted((ROOT / "benchmarks").rglob("*.md"))],
    *[str(p.relative_to(ROOT)) for p in sorted((ROOT / "benchmarks").rglob("*.png"))],
]
ROOT_PAGES = {"index.md", "CHANGELOG.md", "CONTRIBUTING.md"}
# a link from a page in docs/ to ../X (X outside docs/) becomes X, where on_files put it
UP = re.compile(r"\]\(\.\./(?!docs/)")


def on_files(files: Files, config) -> Files:
    for rel in OUTSIDE:
        uri = "index.md" if rel == "README.md" else rel
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri in ROOT_PAGES:  # their links point into docs/ from the repository's root
        return re.sub(r"\]\(docs/", "](", markdown)
    return UP.sub("](", markdown)
