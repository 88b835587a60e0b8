#!/usr/bin/env bash
# Source on the GPU machine: install the carried wheels into /tmp/site and keep NVLink multicast off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/trl ]; then
  whls=$(ls .whl/*.whl .whl-bnb/*.whl .whl-tf/*.whl 2>/dev/null || true)  # .whl-tf: the pinned transformers
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $whls
  if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
      .whl/deepspeed-*.tar.gz || echo "deepspeed install failed"
  fi
fi
if [ -d .whl/aio/usr/include ]; then  # carried libaio for DeepSpeed's async_io (NVMe offload)
  aio_lib=$(dirname "$(find "$PWD/.whl/aio" -name 'libaio.so*' | head -1)")
  export CPATH=$PWD/.whl/aio/usr/include${CPATH:+:$CPATH}
  export LIBRARY_PATH=$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
python3 - <<'PY'
import importlib
for m in ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "deepspeed", "bitsandbytes", "liger_kernel"):
    try:
        mod = importlib.import_module(m); print(f"{m}=={getattr(mod, '__version__', '?')}", end="  ")
    except Exception as exc:
        print(f"{m}: missing ({type(exc).__name__})", end="  ")
print()
PY
