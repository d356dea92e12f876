#!/usr/bin/env bash
# GPU proof of FC-CIO (paper §3.3) on a lent GPU machine (H200), in under 8 minutes:
#   kvikio reads into HBM (GDS or compat mode), HBM window + Triton scatter into device paged KV
#   for every layout (bit-exact vs torch), SSD -> HBM restore bandwidth vs the same bytes read
#   sequentially, scatter/read overlap, scatter kernel throughput vs index_copy_, and the direct
#   linker's layer-wise load (FlatCakeLinker) into CUDA stand-in device pools: bit-exact per layout,
#   time to layer 0 usable vs the whole restore.
# Writes gpu_results.json + gpu_results.md to $OUT (else runs/gpu/). See scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh             # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run   # anywhere: the parts that need no GPU (part of the tests)
#
# Packages the GPU image lacks travel as wheels in .whl/ (git-ignored; see the device README).
# Prepare them on the dev machine, in the repo root (Python 3.12 there, CUDA 13):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 \
#     rapids-logger==0.3.0 pydantic pydantic-core annotated-types typing-inspection
# and name .whl in the device run's `carry`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=1; done

missing=$($PY - <<'PYEOF'
import importlib
print(" ".join(m for m in ("kvikio", "pydantic", "xxhash", "yaml") if importlib.util.find_spec(m) is None))
PYEOF
)
if [ -n "$missing" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing carried wheels for: $missing"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "warning: missing Python packages ($missing) and no .whl/ wheels to install" >&2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ "$DRY" = 0 ]; then
  # GDS probe in AUTO mode, in a subprocess under a timeout: libcufile 1.20 can spin forever in
  # cuFileDriverOpen on VMs without /proc/modules (docs: io-stack-facts §2). If it fails or hangs,
  # the check runs in kvikio's compatibility mode (POSIX reads + bounce buffer into HBM).
  probe=$(timeout 90 env KVIKIO_COMPAT_MODE=AUTO $PY - <<'PYEOF' 2>&1 | tail -1
import os, tempfile, torch, kvikio, kvikio.defaults
fd, p = tempfile.mkstemp(dir="/tmp"); os.write(fd, os.urandom(16 << 20)); os.close(fd)
t = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
f = kvikio.CuFile(p, "r"); n = f.pread(t, 16 << 20, 0).get(); f.close(); os.unlink(p)
print(f"GDS_PROBE auto-mode read {n} B, compat_mode_preferred={kvikio.defaults.is_compat_mode_preferred()}")
PYEOF
  )
  rc=$?
  if [ $rc -eq 0 ] && [[ "$probe" == GDS_PROBE* ]]; then
    export FC_GDS_PROBE="${probe#GDS_PROBE }"
  else
    export KVIKIO_COMPAT_MODE=ON
    export FC_GDS_PROBE="AUTO mode failed (rc $rc: ${probe:0:200}); running in compat mode ON"
  fi
  echo "GDS probe: $FC_GDS_PROBE"
fi
timeout 450 $PY scripts/gpu_check.py "$@"
