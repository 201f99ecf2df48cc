#!/usr/bin/env bash
# One device call of tests/gpu/README.md, sized for the device's 10-minute call limit.
#   bash tests/gpu/device.sh bench   # benchmarks gpu + serve_gpu (~400 s), results under $OUT
#   bash tests/gpu/device.sh check   # tests/gpu, then the acceptance `raymill run` on the GPU (~300 s)
# Carry `.gpusite` (the xz Ray site folder that README.md says how to build). Each step has its own
# timeout, so one that hangs leaves the others their time and its log still comes back.
set -uo pipefail
case "${1:-}" in bench|check) ;; *) echo "usage: bash tests/gpu/device.sh bench|check" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/s/site ] || { mkdir -p /tmp/s && tar -xJf .gpusite/site.tar.xz -C /tmp/s; }
export PYTHONPATH=/tmp/s/site:$PWD PATH=/tmp/s/site/bin:$PATH PYTHONUNBUFFERED=1 RAY_DATA_DISABLE_PROGRESS_BARS=1
SP=$(python3 -c 'import site;print(site.getsitepackages()[0])')
echo /tmp/s/site > "$SP/zz_raysite.pth"; echo "$PWD" > "$SP/zz_repo.pth"  # Ray's workers see both
nproc; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; uptime

step() {  # step NAME SECONDS CMD...: run one step under its timeout, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s, load $(cut -d' ' -f1-3 /proc/loadavg))"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"
  ray stop --force > /dev/null 2>&1
}

case "${1:-}" in
  bench)
    step bench_gpu 200 python3 -m benchmarks gpu --wait-for-quiet 20
    step serve_gpu 190 python3 -m benchmarks serve_gpu --wait-for-quiet 0 --levels 1,32 --rounds 1 \
      --requests 200 --batch-images 384 --infer-images 600
    grep "serve_gpu\]" "$OUT/serve_gpu.log" | tail -8
    cp benchmarks/out/gpu.json benchmarks/out/serve_gpu.json "$OUT/" 2>/dev/null ;;
  check)
    step pytest_gpu 330 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning
    tail -12 "$OUT/pytest_gpu.log"
    python3 -m workflow demo-data /tmp/demo > /dev/null 2>&1
    # the acceptance command as a user types it: no train.num_workers (one worker per GPU is planned)
    step run_gpu 200 python3 -m workflow run --config configs/default.yaml --set run.source=/tmp/demo \
      --set run.dir=/tmp/run --set train.use_gpu=true --set infer.use_gpu=true --set tracking.enabled=false
    grep -v "^\s*$" "$OUT/run_gpu.log" | tail -20; cp /tmp/run/manifest.json "$OUT/run_manifest.json" 2>/dev/null ;;
esac
