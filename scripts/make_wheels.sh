#!/usr/bin/env bash
# Builds .whl/ in the current folder: wheels (CPython 3.12, x86_64 Linux) of the Python packages that the
# GPU machine's image lacks, so a GPU run can install them offline:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl && export PYTHONPATH="$SITE"
#   (SITE: any empty folder outside the working tree, e.g. SITE=$(mktemp -d))
# Usage: bash scripts/make_wheels.sh [EXTRA_SPEC ...]   (from the repo root; .whl/ is in .gitignore)
# The scripts/h200_*.sh device calls install .whl/ through scripts/h200_env.sh (carry .whl with the call).
# PyAV (av, 35 MB) is left out unless named: a GPU run carries 64 MiB at most, wheels included.
# Packages the GPU image already has (torch, triton, transformers, accelerate, einops, numpy, ...) are left out,
# so the image's own builds stay in charge.
set -euo pipefail
out=.whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# resolved with their dependencies
python3 -m pip download -q "${plat[@]}" -d "$tmp/dl" diffusers webdataset wandb "$@"
# hydra's parser runtime ships as source only: build its wheel here, pin the pair by hand
python3 -m pip download -q "${plat[@]}" --no-deps -d "$tmp/dl" "hydra-core==1.3.2" "omegaconf==2.3.0"
python3 -m pip wheel -q --no-deps -w "$tmp/dl" "antlr4-python3-runtime==4.9.3"
# what the GPU machine's image already holds
have="anyio certifi charset_normalizer click filelock fsspec h11 hf_xet httpcore httpx huggingface_hub idna
numpy packaging pillow protobuf pyyaml regex requests safetensors six tqdm typing_extensions urllib3 xxhash zipp
torch triton transformers accelerate einops sympy networkx jinja2 markupsafe mpmath setuptools"
mkdir -p "$out"
for w in "$tmp"/dl/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  if grep -qw "$name" <<<"$have"; then continue; fi
  cp "$w" "$out/"
done
du -sh "$out"
ls "$out"
