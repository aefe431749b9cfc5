"""Cost of `flopwise data prepare`: the datatrove pipeline on N workers against plain
`tokenizers` encode_batch in one process, on the same generated text; then a run killed half-way
and resumed must be byte-identical to the clean run.

    python benchmarks/throughput/prepare.py --mb 1000 --workers 2     # the 1 GB run
    python benchmarks/throughput/prepare.py --mb 200 --workers 2      # what prepare.md records
    python benchmarks/throughput/prepare.py --interleaved 30          # 1 worker vs a bare loop, same process

The corpus is generated, deterministically, from the shipped corpora (Shakespeare, Alice, the
Wikipedia articles): paragraphs grouped into ~3 KB documents, reshuffled (seeded) on every pass
until the target size, written as JSONL under --tmp. Nothing is downloaded.
Writes benchmarks/throughput/results/prepare-MBmb.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).parent / "results"
SRC = ROOT / "src"


def generate(path: Path, target: int, seed: int = 0) -> tuple[int, int]:
    """JSONL of ~3 KB documents until `target` bytes of text; (documents, text bytes)."""
    sys.path.insert(0, str(SRC))
    from flopwise.data.shards import iter_documents

    paragraphs = [
        p.strip()
        for spec in ("builtin:shakespeare", "builtin:alice", "builtin:enwiki")
        for _, text in iter_documents([spec])
        for p in text.split("\n\n")
        if p.strip()
    ]
    rng = np.random.default_rng(seed)
    docs = written = 0
    with open(path, "w") as f:
        while written < target:
            order = rng.permutation(len(paragraphs))
            doc: list[str] = []
            size = 0
            for i in order:
                doc.append(paragraphs[i])
                size += len(paragraphs[i].encode()) + 2
                if size >= 3000:
                    text = "\n\n".join(doc)
                    f.write(json.dumps({"text": text}) + "\n")
                    docs, written = docs + 1, written + len(text.encode())
                    doc, size = [], 0
                    if written >= target:
                        break
    return docs, written


def digest(d: Path) -> dict[str, str]:
    """sha256 of every output file but report.json (it holds the run's timings)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.iterdir())
        if p.is_file() and p.name != "report.json"
    }


def run_prepare(
    corpus: Path, out: Path, workers: int, kill_at: float | None = None, tokenizer: str = "bpe:4096"
) -> dict:
    """One prepare in a child process (so its RSS and its workers' are the children's): seconds,
    peak RSS of the process tree; with kill_at, SIGKILL once that share of tokenize tasks finished."""
    code = (
        f"import sys, json; from flopwise.data.prepare import prepare_data\n"
        f"if __name__ == '__main__':\n"
        f"    s = prepare_data([{str(corpus)!r}], {str(out)!r}, tokenizer={tokenizer!r}, workers={workers})\n"
        f"    print(json.dumps({{'documents': s.documents, 'tokens': s.tokens, 'bytes': s.bytes}}))\n"
    )
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    first_token = None
    killed = False
    while proc.poll() is None:
        time.sleep(0.2)
        work = out / "work"
        if first_token is None and (work / "progress").is_dir() and any((work / "progress").glob("tokens-*")):
            first_token = time.perf_counter() - t0
        if kill_at is not None and (work / "plan.json").is_file():
            n_tasks = len(json.loads((work / "plan.json").read_text())["tasks"])
            done = work / "logs" / "tokenize" / "completions"
            if done.is_dir() and len(list(done.iterdir())) >= kill_at * n_tasks:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
    stdout = proc.communicate()[0]
    seconds = time.perf_counter() - t0
    if killed:
        return {"killed_after_s": round(seconds, 1)}
    if proc.returncode:
        raise SystemExit(f"prepare failed ({proc.returncode})")
    stats = json.loads(stdout.strip().splitlines()[-1])
    return stats | {"seconds": round(seconds, 1), "tokenize_started_s": round(first_token or 0, 1)}


def run_encode_batch(corpus: Path, tokenizer: Path, threads: int | None) -> dict:
    """Plain tokenizers in one process: encode_batch over 256-document batches of the same JSONL
    (rayon threads: tokenizers' default, or RAYON_NUM_THREADS=1)."""
    code = (
        f"import json, time\nfrom tokenizers import Tokenizer\n"
        f"tok = Tokenizer.from_file({str(tokenizer)!r})\n"
        f"t0 = time.perf_counter(); n = 0; batch = []\n"
        f"def flush(batch):\n"
        f"    return sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))\n"
        f"for line in open({str(corpus)!r}):\n"
        f"    batch.append(json.loads(line)['text'])\n"
        f"    if len(batch) == 256: n += flush(batch); batch = []\n"
        f"n += flush(batch)\n"
        f"print(json.dumps({{'tokens': n, 'seconds': time.perf_counter() - t0}}))\n"
    )
    env = {**os.environ} | ({"RAYON_NUM_THREADS": str(threads)} if threads else {})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleaved(corpus: Path, tokenizer: Path, mb: int, rounds: int = 2) -> list[dict]:
    """Per-core overhead without the machine's load drifting between measurements: on the first
    `mb` MB of the corpus, alternate a bare serial encode_batch loop and `prepare --workers 1`
    in this process."""
    sys.path.insert(0, str(SRC))
    from tokenizers import Tokenizer

    from flopwise.data.prepare import prepare_data

    part = corpus.with_name(f"first-{mb}mb.jsonl")
    with open(corpus) as src, open(part, "w") as dst:
        size = 0
        for line in src:
            if size >= mb * 10**6:
                break
            dst.write(line)
            size += len(line.encode())
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_file(str(tokenizer))
    rows = []
    for _ in range(rounds):
        t0, n, batch = time.perf_counter(), 0, []
        for line in open(part):
            batch.append(json.loads(line)["text"])
            if len(batch) == 256:
                n += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
                batch = []
        n += sum(len(e.ids) + 1 for e in tok.encode_batch(batch, add_special_tokens=False))
        loop = n / (time.perf_counter() - t0)
        out = corpus.with_name("interleaved-out")
        subprocess.run(["rm", "-rf", str(out)], check=True)
        t0 = time.perf_counter()
        stats = prepare_data([str(part)], out, tokenizer=str(tokenizer), workers=1)
        rows.append(
            {
                "encode_batch_serial_tokens_per_s": round(loop),
                "prepare_1_worker_tokens_per_s": round(stats.tokens / (time.perf_counter() - t0)),
            }
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200, help="text to generate, in MB (1000 for the 1 GB run)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tmp", type=Path, default=Path("/tmp/flopwise-prepare-bench"))
    ap.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the encode_batch and one-worker comparisons (per-core ratios; 200 MB suffices)",
    )
    ap.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="MB",
        help="only compare 1 worker with a bare loop on the first MB of an earlier run's corpus",
    )
    args = ap.parse_args()
    args.tmp.mkdir(parents=True, exist_ok=True)
    corpus = args.tmp / "corpus.jsonl"
    if args.interleaved:
        rows = interleaved(corpus, args.tmp / "clean" / "tokenizer.json", args.interleaved)
        (RESULTS / "prepare_interleaved.json").write_text(json.dumps(rows, indent=1))
        return
    t0 = time.perf_counter()
    docs, text_bytes = generate(corpus, args.mb * 10**6)
    print(f"generated {docs:,} documents, {text_bytes / 1e6:.0f} MB in {time.perf_counter() - t0:.0f} s", flush=True)

    clean, killed = args.tmp / "clean", args.tmp / "killed"
    for d in (clean, killed):
        subprocess.run(["rm", "-rf", str(d)], check=True)
    res = run_prepare(corpus, clean, args.workers)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    tokenize_s = res["seconds"] - res["tokenize_started_s"]
    res |= {
        "tokens_per_s": round(res["tokens"] / res["seconds"]),
        "tokenize_stage_tokens_per_s": round(res["tokens"] / tokenize_s),
        "tokenize_stage_tokens_per_s_per_core": round(res["tokens"] / tokenize_s / args.workers),
        "peak_rss_mb_largest_process": round(rss),
    }
    print("prepare", res, flush=True)
    base, single = {}, {}
    if not args.no_baselines:
        base = {
            f"encode_batch_rayon_{k or 'default'}": run_encode_batch(corpus, clean / "tokenizer.json", k)
            for k in (1, None)
        }
        for v in base.values():
            v["tokens_per_s"] = round(v["tokens"] / v["seconds"])
        print("baseline", base, flush=True)
        one = args.tmp / "one-worker"
        subprocess.run(["rm", "-rf", str(one)], check=True)
        single = run_prepare(corpus, one, 1, tokenizer=str(clean / "tokenizer.json"))
        single["tokenize_stage_tokens_per_s"] = round(
            single["tokens"] / (single["seconds"] - single["tokenize_started_s"])
        )
        print("one worker, given tokenizer", single, flush=True)
    kill = run_prepare(corpus, killed, args.workers, kill_at=0.5)
    resume = run_prepare(corpus, killed, args.workers)
    identical = digest(clean) == digest(killed)
    print("killed", kill, "resumed", resume, "identical", identical, flush=True)
    result = {
        "mb": args.mb,
        "text_bytes": text_bytes,
        "documents": docs,
        "workers": args.workers,
        "cores": os.cpu_count(),
        "prepare": res,
        "prepare_1_worker_given_tokenizer": single,
        "baseline": base,
        "killed": kill,
        "resumed": resume,
        "byte_identical_after_resume": identical,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"prepare-{args.mb}mb.json").write_text(json.dumps(result, indent=1))
    if not identical:
        raise SystemExit("resumed output differs from the clean run")


if __name__ == "__main__":
    main()
