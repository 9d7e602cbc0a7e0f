#!/usr/bin/env bash
# What a session lent a GPU runs first (issues 51 and 53), as one command: the founding job measured, then the
# GPU tests and the GPU benchmarks. Estimated (never yet timed in this order) on one H200 with torch 2.11: the
# founding job at 4 and 2 ranks about 4 minutes, the gpu-marked tests 1, bench_gpu 2, the rest 4; one device
# call may run at most 10, so run it in two calls: `bash scripts/gpu_checks.sh founding-4 founding-2 gpu-tests
# fused-quantize` and `bash scripts/gpu_checks.sh gpu-bench offload-memory link offload-step`. Arguments name
# the steps to run (default: all). Everything it writes goes to $OUT (default ./gpu-out): each step's log and
# its benchmark JSON and Markdown. A step that fails does not stop the others; the exit status is the first
# failure's.
#
# Before the call, here (the GPU image has torch 2.11, triton, transformers, rich, PyYAML and peft, but not
# pydantic or torchao: carry them as wheels; /.whl/ is ignored by git; pydantic-core must be the version
# the pydantic wheel names, see /work/.library/device/README.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection torchao==0.18.0 peft==0.21.2
# then run (carry [".whl"], timeout_s 600):
#   bash scripts/gpu_checks.sh founding-4 founding-2 gpu-tests fused-quantize
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
# 0. the founding job (issue 51): Llama-3-70B QLoRA as rank 0 of a fake group of 4, then 2, under a 24 GiB card's
#    budget less the CUDA context measured here, with the config `fsdp2lite estimate --budget 24GiB` writes for
#    this GPU: peak allocated and reserved, forward and backward peaks, the microbatch time, beside the planner's
step founding-4 "$python" benchmarks/bench_founding.py --device cuda --world 4 --budget 24GiB --out-dir "$out"
step founding-2 "$python" benchmarks/bench_founding.py --device cuda --world 2 --budget 24GiB --out-dir "$out"
# 1. the gpu-marked tests: pinned buffers registered at their exact size, the gradient pool (one buffer per group
#    kept, one for all under step_in_backward, its host steps overlapped with backward and not), accumulated
#    gradients read after their copy lands, the host-to-device copy on the copy-in stream at world size 1
#    (issue 33), and every earlier gpu test
step gpu-tests "$python" -m pytest -q -m gpu tests -p no:cacheprovider
#    the fused quantize kernels bit-identical to the eager ops on CUDA (issue 34, item 3)
step fused-quantize "$python" -m pytest -q tests/test_fused_quantize.py -p no:cacheprovider
#    the step against torch's fully_shard at fake world 8, bf16, with the host time per phase (issue 53)
step gpu-bench "$python" benchmarks/bench_gpu.py --runs w8 --dtypes bf16 --profile --out-dir "$out"
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
