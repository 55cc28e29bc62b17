# Sourced by the scripts/h200_*.sh device calls: $OUT (default $1), the .whl/ wheels the GPU image lacks (diffusers,
# hydra, omegaconf, wandb; bash scripts/make_wheels.sh fills .whl/), quiet logging, and the GPU and
# versions in $OUT/gpu.txt.
OUT=${OUT:-$1}; mkdir -p "$OUT"
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then  # once a machine: a later script (or call) on it reuses them
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
