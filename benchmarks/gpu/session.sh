#!/usr/bin/env bash
# Everything the time model's ±5% check and float8 still need from one H200, in one pass sized for a lent machine's
# 15 minutes (about 10 of commands once it has started), most valuable first; each step is bounded
# and a failed one does not stop the next. From the repository root on the GPU machine:
#
#     WHEELS=wheels OUT=$OUT bash benchmarks/gpu/session.sh
#
# WHEELS: a folder of wheels for what the machine's image lacks (it had torch, not pydantic,
# tomli-w, typer, rich, datatrove, torchao: `pip download` them here and carry the folder).
# OUT: where the results go (default benchmarks/gpu/results). Record the figures in the reports
# beside the scripts (llama1b.md, float8.md) and their rows in benchmarks/RESULTS.md.
set -uo pipefail
out=${OUT:-benchmarks/gpu/results}
mkdir -p "$out"
if [ -n "${WHEELS:-}" ]; then
  pip install -q --no-index --find-links "$WHEELS" pydantic tomli-w typer rich datatrove torchao safetensors tokenizers
fi
pip install -q --no-deps --no-build-isolation -e .

step() {  # step SECONDS COMMAND...: run it bounded, say how it ended
  local limit=$1
  shift
  echo "== $(date +%T) $*"
  timeout "$limit" "$@"
  echo "== exit $? after at most ${limit}s: $*"
}

# time model: this GPU's own tables (GEMMs at the 1.1B's shapes, attention, element-wise, AdamW)
step 150 flopwise hardware calibrate model.n_layers=16 model.d_model=2048 model.n_heads=32 model.n_kv_heads=8 \
  model.ffn_dim=8192 model.vocab_size=32000 model.max_seq_len=2048 data.seq_len=2048 --device cuda --nproc 1 \
  --out "$out/gpu_calibration.toml"
# time model: the ±5% check, on runs the built-in tables were not taken from (batch 12; eager)
step 120 python benchmarks/gpu/llama1b.py --zero 0 --batch 12 --hardware-file "$out/gpu_calibration.toml" \
  --out "$out/gpu_llama1b_z0_b12.json"
step 90 python benchmarks/gpu/llama1b.py --zero 0 --batch 12 --eager --hardware-file "$out/gpu_calibration.toml" \
  --out "$out/gpu_llama1b_z0_b12_eager.json"
# float8 vs bf16, Llama 3 8B's block shape first (the larger predicted gain), then 3B's
step 240 python benchmarks/gpu/float8.py --shapes b --steps 200 --out "$out/gpu_float8_b.json"
step 240 python benchmarks/gpu/float8.py --shapes a --steps 200 --out "$out/gpu_float8_a.json"
