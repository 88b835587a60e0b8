#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the Python packages the GPU machine lacks, for its Python 3.12.
# That machine has torch, transformers, accelerate and peft but no network; the device tool carries
# .whl/ along (64 MiB limit). bitsandbytes goes into .whl-bnb/ with only its CUDA 13 and CPU libraries (the
# machine's torch is built for CUDA 13.0; the wheel's other CUDA and ROCm builds are 35 of its 41 MB:
# scripts/slim_wheel.py), and transformers into .whl-tf/: the machine's own transformers is 5.17, older than the
# 5.24 finetune pins, and its MoE experts run passes 5.24 does not (docs/validation.md, fifteenth session).
set -euo pipefail
cd "$(dirname "$0")/.."
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          "${plat[@]}" -d "$1" "${@:2}"; }
mkdir -p .whl .whl-bnb .whl-tf
get .whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 trl==1.16.0 datasets==5.2.0 "dill==0.4.1" "multiprocess==0.70.19" liger-kernel==0.8.5 hjson==3.1.0
# DeepSpeed is an sdist; it installs offline with --no-build-isolation against the machine's torch.
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl deepspeed==0.19.8
get .whl-bnb bitsandbytes==0.50.2
python3 scripts/slim_wheel.py .whl-bnb/bitsandbytes-0.50.2-*.whl 'cuda13[0-9]|cpu'
get .whl-tf transformers==5.24.0
# libaio (headers + library) for DeepSpeed's async_io op, which ZeRO-Infinity's NVMe offload compiles on
# first use; the GPU machine has neither. Debian packages, unpacked into .whl/aio (gpu_env.sh points gcc
# and the loader at it).
if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q libaio1 libaio-dev >/dev/null 2>&1) || echo "libaio: apt-get download failed"
  for deb in "$tmp"/*.deb; do [ -e "$deb" ] && dpkg-deb -x "$deb" .whl/aio; done
  rm -rf "$tmp"
fi
grep -qx '/.whl-bnb/' .git/info/exclude || echo '/.whl-bnb/' >> .git/info/exclude
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.whl-tf/' .git/info/exclude || echo '/.whl-tf/' >> .git/info/exclude
du -sh .whl .whl-bnb .whl-tf
