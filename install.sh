#!/usr/bin/env bash
# Creates .venv and installs the pinned dependencies. Safe to run again: when nothing changed since the
# last successful run (same pins, same Python), it checks the imports and exits in a second or two.
#
# Order matters: torch first (the CUDA build on a node where nvidia-smi lists a GPU, see install_torch), then deepspeed with --no-build-isolation so that its setup sees that torch
# instead of pulling another one into a throwaway build environment. DeepSpeed's ops compile just in time.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv

TORCH="torch==2.13.0"
DEEPSPEED="deepspeed==0.19.8"
# Runtime dependencies, pinned. Why each one is here:
RUNTIME=(
  "tokenizers==0.23.3"             # byte-level BPE (BLOOM's tokenizer recipe)
  "datasets==5.2.0"                # reading corpora saved with save_to_disk
  "textual==8.2.8"                 # the dashboard
  "psutil==7.2.2"                  # CPU cores, RAM, process memory
  "nvidia-ml-py==13.615.71"        # NVML (imported as pynvml): GPUs, power, energy counter
  "safetensors==0.8.0"             # checkpoints and the Hugging Face export
  "numpy==2.4.6"                   # indexed datasets
  "ftfy==6.3.1"                    # Unicode repair (mojibake) in corpus preparation
  "lingua-language-detector==2.1.1"  # offline language identification; its models ship inside the wheel
  "datasketch==2.0.0"              # MinHash LSH for near-duplicate removal
  "zstandard==0.25.0"              # reading .jsonl.zst corpora
  "pyarrow==26.0.1"                # reading .parquet corpora
  "regex==2026.11.15"              # Unicode properties (\p{Han}, \p{Extended_Pictographic}) that re lacks: filters, PII
  "PyYAML==6.0.3"                  # lm-evaluation-harness task files (imported as yaml)
  "Jinja2==3.1.6"                  # the prompt templates of those task files
  "rich==15.0.0"                   # styled text in the dashboard's widgets (Textual renders with it)
  "transformers==5.23.0"           # `bench`'s peer (BloomForCausalLM eager and compiled); the tests' reference
  "tensorboard==2.21.0"            # <run>/tensorboard/ event files (its own writer, no TensorFlow), under the scalar names Megatron-DeepSpeed users watch; its reader checks them in the tests
)
# Build tools for DeepSpeed's --no-build-isolation install and for installing this project (editable).
BUILD=("setuptools==84.2.1" "wheel==0.48.0")
# triton ships with CUDA builds of torch; on CPU we install it for the kernel interpreter (TRITON_INTERPRET=1).
TRITON="triton==3.7.1"
# Test and lint tools (and lm-evaluation-harness, which `eval --tasks` needs; the rest of the appliance does not).
DEV=(
  "pytest==8.4.2"
  "pytest-timeout==2.4.0"
  "pytest-textual-snapshot==1.1.0"  # dashboard snapshots at a fixed terminal size
  "ruff==0.17.5"
  "mypy==2.4.1"
  # lm-evaluation-harness: `eval --tasks` runs its tasks through the appliance's model (appliance/eval/lm_eval_*.py),
  # and the tests compare that with its hf backend on the export (its "hf" extra: accelerate and peft). Its own
  # dependencies are pinned at what it resolves to beside the pins above (datasets and transformers stay ours).
  "lm-eval==0.4.13"
  "accelerate==1.15.0"
  "peft==0.21.2"
  "evaluate==0.4.6"
  "rouge-score==0.1.2"
  "sacrebleu==2.6.0"
  "scikit-learn==1.9.1"
  "sqlitedict==2.1.0"
  "pytablewriter==1.2.1"
  "word2number==1.1"
  "more-itertools==11.2.1"
)

stamp_of() { { cat "$0" pyproject.toml; "$PYTHON" --version 2>&1; } | sha256sum | cut -d' ' -f1; }
STAMP="$VENV/.install-stamp"

# An NVIDIA GPU on this node: nvidia-smi lists "GPU 0: ..." lines (none, or no nvidia-smi, on a CPU box).
gpu_node() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
torch_has_cuda() { "$VENV/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null; }

# torch: the package index's default Linux wheel is the CUDA build, but a pip configured with a local wheel cache or
# a CPU-only index can hand a GPU node the CPU build, which then trains on gloo at CPU speed without a word. So on a
# GPU node the result is checked, and a CPU build is replaced by the pinned release from the package index alone
# (TORCH_INDEX_URL, default PyPI's simple index). Elsewhere the index's default stands: the CPU build where the
# index offers it, else the CUDA build, which runs on CPUs too.
install_torch() {
  "${PIP[@]}" "$TORCH"
  gpu_node || return 0
  torch_has_cuda && return 0
  echo "install.sh: nvidia-smi lists a GPU but the installed torch is a CPU-only build; installing the CUDA build"
  "$VENV/bin/python" -m pip uninstall --yes --disable-pip-version-check torch
  PIP_FIND_LINKS="" PIP_EXTRA_INDEX_URL="" "${PIP[@]}" --no-cache-dir \
    --index-url "${TORCH_INDEX_URL:-https://pypi.org/simple}" "$TORCH"
  if ! torch_has_cuda; then
    echo "install.sh: error: this node has an NVIDIA GPU, but $TORCH from ${TORCH_INDEX_URL:-https://pypi.org/simple}" \
      "is still a CPU-only build. Set TORCH_INDEX_URL to an index that serves the CUDA build of $TORCH" \
      "(for CUDA 12.x drivers, PyTorch's cu12x index) and run ./install.sh again." >&2
    exit 1
  fi
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" ]] \
   && "$VENV/bin/python" -c "import torch, deepspeed, tokenizers, textual, psutil, pynvml, safetensors, tensorboard" 2>/dev/null \
   && { ! gpu_node || torch_has_cuda; }; then
  echo "install.sh: .venv is up to date"
  exit 0
fi

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)

echo "install.sh: torch"
install_torch
echo "install.sh: triton"
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then "${PIP[@]}" "$TRITON"; fi
echo "install.sh: runtime dependencies"
"${PIP[@]}" "${RUNTIME[@]}" "${BUILD[@]}"
echo "install.sh: deepspeed (no build isolation, ops built just in time)"
DS_BUILD_OPS=0 "${PIP[@]}" --no-build-isolation "$DEEPSPEED"
echo "install.sh: test tools"
"${PIP[@]}" "${DEV[@]}"
# The project itself, editable (the appliance runs from this checkout: presets/, .venv, SLURM scripts that cd here),
# so that .venv/bin/bloom-appliance exists; its dependencies are the pins above, already in place.
echo "install.sh: bloom-appliance (editable)"
"${PIP[@]}" --no-deps --no-build-isolation --editable .

"$VENV/bin/python" -c "import torch, deepspeed, tokenizers, textual, psutil, pynvml, safetensors, transformers, tensorboard; \
print('install.sh: torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| cuda', torch.cuda.is_available())"
stamp_of > "$STAMP"
