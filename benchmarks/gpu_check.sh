#!/usr/bin/env bash
# The GPU path measured in one command, on a machine with one CUDA GPU and nothing else
# prepared (Python 3.10+ and the NVIDIA driver):
#
#     bash benchmarks/gpu_check.sh            # JSON: ~/.cache/megacache-gpu-check/gpu-check.json
#
# Makes a venv, installs megacache[server], torch (PyPI's CUDA build, TORCH_VERSION, default
# 2.13.0) and transformers from the registries, then runs the compile benchmark on GPU 0:
# cold, warm-local and megacache (a new machine: empty Inductor, Triton and node caches),
# on the MLP and a third-party model (transformers' GPT-2, built from a config). One JSON
# holds the figures, the g++ builds and Triton compilations of each job (ptxas runs; the
# kernels in Triton's own cache dir too), the GPU's name, compute capability and driver.
#
# Exit codes: 0 measured; 69 no CUDA GPU here (stops at once, installs nothing); 70 the
# installed torch does not see the GPU; 71 no C compiler (Triton and Inductor need one);
# else the benchmark's own (1: a job failed, see the JSON).
#
# Settings: GPU_CHECK_DIR (venv and output, default ~/.cache/megacache-gpu-check),
# GPU_CHECK_OUT (the JSON), TORCH_VERSION, PYTHON (default python3), GPU_CHECK_MODELS
# (default mlp,gpt2), GPU_CHECK_TIMEOUT (seconds for the benchmark, default 480).
set -euo pipefail

NO_GPU=69
TORCH_SEES_NO_GPU=70
NO_COMPILER=71

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    echo "gpu_check: no CUDA GPU on this machine (nvidia-smi is missing or lists no GPU):" \
         "nothing to measure here; run it on a host with one NVIDIA GPU and its driver" >&2
    exit "$NO_GPU"
fi

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
work=${GPU_CHECK_DIR:-$HOME/.cache/megacache-gpu-check}
out=${GPU_CHECK_OUT:-$work/gpu-check.json}
torch_version=${TORCH_VERSION:-2.13.0}
python=${PYTHON:-python3}
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" >&2; }

say "GPU: $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -1)"
if ! command -v g++ >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing g++ (Triton builds its launcher with gcc; Inductor's CPU side with g++)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
    else
        echo "gpu_check: no gcc/g++ here; Triton and Inductor need them (apt-get install g++)" >&2
        exit "$NO_COMPILER"
    fi
fi

mkdir -p "$work"
if [ ! -x "$work/venv/bin/python" ]; then
    say "venv at $work/venv ($("$python" --version))"
    "$python" -m venv "$work/venv"
fi
say "installing megacache[server], torch==$torch_version (CUDA build), transformers"
"$work/venv/bin/pip" install -q --upgrade pip
"$work/venv/bin/pip" install -q -e "$repo[server]" "torch==$torch_version" "transformers>=4.45"

if ! "$work/venv/bin/python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch $torch_version sees no CUDA GPU although nvidia-smi lists one" \
         "(a driver older than its CUDA build?): see nvidia-smi and" \
         "'$work/venv/bin/python -c \"import torch; print(torch.version.cuda)\"'" >&2
    exit "$TORCH_SEES_NO_GPU"
fi

say "compile benchmark on GPU 0: ${GPU_CHECK_MODELS:-mlp,gpt2}; cold, warm-local, megacache"
timeout "${GPU_CHECK_TIMEOUT:-480}" "$work/venv/bin/python" "$here/compile_bench.py" \
    --device cuda --models "${GPU_CHECK_MODELS:-mlp,gpt2}" \
    --scenarios cold,warm-local,megacache --repeats 1 --steps 3 --out "$out"
say "wrote $out"
