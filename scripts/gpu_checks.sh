#!/usr/bin/env bash
# The GPU checks still owed by issues 33 and 34, as one command for a session that is lent a GPU (the device
# tool's `run`; estimated 9-11 minutes on one H100 with torch 2.11, never yet timed: one device call may run at
# most 10, so run it in two calls, `bash scripts/gpu_checks.sh gpu-tests fused-quantize offload-memory` and
# `bash scripts/gpu_checks.sh link offload-step`). Arguments name the steps to run (default: all five).
# Everything it writes goes to $OUT (default ./gpu-out): each step's log and its benchmark JSON. A step that
# fails does not stop the others; the exit status is the first failure's.
#
# Before the call, here (the GPU image has torch 2.11, triton, transformers, rich, PyYAML and peft, but not
# pydantic or torchao: carry them as wheels; /.whl/ is ignored by git; pydantic-core must be the version
# the pydantic wheel names, see /work/.library/device/README.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
# then run (carry [".whl"], timeout_s 600):
#   bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
status=0
wanted=" $* "
step() {  # step NAME COMMAND...: run it (if asked for), log to $out/NAME.log, remember the first failure
  local name=$1
  shift
  [ "$wanted" = "  " ] || [[ "$wanted" == *" $name "* ]] || return 0
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  local code=${PIPESTATUS[0]}
  echo "== $name: exit $code"
  [ "$code" -eq 0 ] || [ "$status" -ne 0 ] || status=$code
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/env.txt" 2>&1
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >>"$out/env.txt" 2>&1
# 1. the gpu-marked tests: pinned buffers registered at their exact size, the gradient pool (one buffer per group
#    kept, one for all under step_in_backward, its host steps overlapped with backward and not), accumulated
#    gradients read after their copy lands, the host-to-device copy on the copy-in stream at world size 1
#    (issue 33), and every earlier gpu test
step gpu-tests "$python" -m pytest -q -m gpu tests -p no:cacheprovider
#    the fused quantize kernels bit-identical to the eager ops on CUDA (issue 34, item 3)
step fused-quantize "$python" -m pytest -q tests/test_fused_quantize.py -p no:cacheprovider
# 2. pinned host bytes against torch's CPUOffloadPolicy on a 1.3B GPT at fake world 8, fsdp2lite with gradients kept
#    and stepped in backward (issue 33, item 3)
step offload-memory "$python" benchmarks/bench_offload_memory.py --device cuda --out-dir "$out"
# 3. step time at each emulated link, fsdp2lite's policies against torch's fully_shard (issue 34, item 2)
step link "$python" benchmarks/bench_link.py --device cuda --links pcie4,nvlink4 --json --out-dir "$out"
# 4. host step and whole step against torch's CPUOffloadPolicy + foreach AdamW, 340M GPT at fake world 8, and
#    step_in_backward with its host steps overlapping the device's backward and not, traced (issue 33, item 2;
#    about 1 minute)
step offload-step "$python" benchmarks/bench_offload.py --device cuda --steps 8 --out-dir "$out"
exit "$status"
