#!/usr/bin/env bash
# The GPU checks of ntkgp as one short command for a machine with a CUDA GPU (docs/scaling.md, "The GPU checks").
#
#     bash scripts/gpu_checks.sh            # in the repository root; results in $OUT (default /tmp/ntkgp-gpu)
#
# It needs a Python with torch (CUDA), gpytorch, linear_operator, tqdm, psutil and pytest; ntkgp is taken from
# this checkout (PYTHONPATH), nothing is installed. Every step has its own time limit (about 9 minutes in all),
# so that a slow step leaves the others their time; summary.txt lists each step's exit status. With the image step
# (only when the Fashion-MNIST files are at hand) it is about 11.5 minutes.
set -u
OUT=${OUT:-/tmp/ntkgp-gpu}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, output to $OUT/NAME.txt, status to summary.txt
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    echo "$name: exit $? after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}
: > "$OUT/summary.txt"
step machine 30 bash -c "nvidia-smi; $PY -c 'import torch, gpytorch, linear_operator; print(torch.__version__, gpytorch.__version__, linear_operator.__version__, torch.cuda.get_device_name())'"
step cuda_tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/fsvi/test_cuda.py
step gpu_scale 240 "$PY" benchmarks/gpu_scale.py --device cuda --json "$OUT/gpu_scale.json"
step fsvi_cuda 90 "$PY" benchmarks/fsvi.py --device cuda --steps 10 --repeats 3 --naive-steps 2
step distributed_1gpu 60 "$PY" benchmarks/distributed.py --backend nccl --worlds 1 --n 60000 --repeats 1
# The image-scale rows (benchmarks/image_scale.py) on the Fashion-MNIST CNN, when the four idx files are at hand
# ($FMNIST_DIR, default data/fashion-mnist in this checkout: about 30 MB, carried with the working tree).
FMNIST_DIR=${FMNIST_DIR:-data/fashion-mnist}
if [ -f "$FMNIST_DIR/train-images-idx3-ubyte.gz" ]; then
    step image_scale 150 "$PY" benchmarks/image_scale.py --device cuda --data-dir "$FMNIST_DIR" --n 20000 \
        --n-test 10000 --rows sfr_build:512 sfr_predict:512 kfac_predict --json "$OUT/image_scale.json"
else
    echo "image_scale: skipped (no Fashion-MNIST idx files in $FMNIST_DIR)" | tee -a "$OUT/summary.txt"
fi
