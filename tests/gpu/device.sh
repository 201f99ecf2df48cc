#!/usr/bin/env bash
# One device call of tests/gpu/README.md, sized for the device's 10-minute call limit.
#   bash tests/gpu/device.sh bench   # benchmarks gpu + serve_gpu (~370 s), results under $OUT
#   bash tests/gpu/device.sh check   # tests/gpu, then the acceptance `raymill run` on the GPU (~300 s)
#   bash tests/gpu/device.sh one     # where the device time allows one call: serve_gpu, the acceptance
#                                    # run, then tests/gpu (~500 s; benchmarks gpu is left out)
#   bash tests/gpu/device.sh serve   # serve_gpu alone (~230 s)
#   bash tests/gpu/device.sh feed    # benchmarks gpu, then tests/gpu (~300 s): after a change to the input path
#   bash tests/gpu/device.sh user    # benchmarks gpu_user: the demo `raymill run` on the GPU, then whole epochs
#                                    # of `raymill train` by ingest path and the fine-tune (~420 s; 16k JPEGs'
#                                    # generation + ETL alone took ~110 s on 2026-11-27)
#   bash tests/gpu/device.sh rd      # the demo run and gpu_user's ray_data row, then the infer CLI test (~330 s)
#   bash tests/gpu/device.sh all     # where one call must do it: why, gpu_user's ray_data row (no demo), tests/gpu (~480 s)
#   bash tests/gpu/device.sh whyrd   # why, then gpu_user's ray_data row (no demo) (~300 s)
#   bash tests/gpu/device.sh lone    # benchmarks serve_user, resnet18: a CPU replica's lone request on 16 cores (~300 s)
#   bash tests/gpu/device.sh why     # the demo run on the GPU with -v, every line timestamped from the start,
#                                    # and Ray Train's own JSON logs: where the GPU run's fixed cost goes (~120 s)
# Carry `.gpusite` (the xz Ray site folder that README.md says how to build). Each step has its own
# timeout, so one that hangs leaves the others their time and its log still comes back.
set -uo pipefail
case "${1:-}" in bench|check|one|serve|feed|user|rd|why|all|whyrd|lone) ;; *) echo "usage: bash tests/gpu/device.sh bench|check|one|serve|feed|user|rd|why|all|whyrd|lone" >&2; exit 2 ;; esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/s/site ]; then
  mkdir -p /tmp/s && tar -xJf .gpusite/site.tar.xz -C /tmp/s
  # What `pip install` does (it byte-compiles what it installs): the carry has no __pycache__, and
  # without this the first run compiles Ray's modules in every process that first imports them
  # (ray.init took 12 s of the demo's 47 s on 2026-11-27's first run).
  t=$(date +%s); python3 -m compileall -q -j 0 /tmp/s/site "$PWD" > /dev/null 2>&1
  echo "byte-compiled the Ray site and the repo in $(( $(date +%s) - t )) s"
fi
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

serve_gpu() {  # $1: seconds; the quiet machine's first step
  step serve_gpu "$1" python3 -m benchmarks serve_gpu --wait-for-quiet 10 --levels 1,32 --rounds 1 \
    --requests 200 --batch-images 384 --infer-images 600
  grep "serve_gpu\]" "$OUT/serve_gpu.log" | tail -10; cp benchmarks/out/serve_gpu.json "$OUT/" 2>/dev/null
}
pytest_gpu() {  # $1: seconds
  step pytest_gpu "$1" python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -W ignore::DeprecationWarning
  tail -12 "$OUT/pytest_gpu.log"
}
run_gpu() {  # $1: seconds; the acceptance command as a user types it (no train.num_workers: planned)
  python3 -m workflow demo-data /tmp/demo > /dev/null 2>&1
  step run_gpu "$1" python3 -m workflow run --config configs/default.yaml --set run.source=/tmp/demo \
    --set run.dir=/tmp/run --set train.use_gpu=true --set infer.use_gpu=true --set tracking.enabled=false
  grep -v "^\s*$" "$OUT/run_gpu.log" | tail -20; cp /tmp/run/report.json "$OUT/run_report.json" 2>/dev/null
}

case "${1:-}" in
  bench)
    step bench_gpu 200 python3 -m benchmarks gpu --wait-for-quiet 20
    cp benchmarks/out/gpu.json "$OUT/" 2>/dev/null
    serve_gpu 260 ;;
  check) pytest_gpu 330; run_gpu 200 ;;
  one) serve_gpu 240; run_gpu 120; pytest_gpu 200 ;;
  serve) serve_gpu 300 ;;
  feed)
    step bench_gpu 170 python3 -m benchmarks gpu --wait-for-quiet 10
    cp benchmarks/out/gpu.json "$OUT/" 2>/dev/null; tail -15 "$OUT/bench_gpu.log"
    pytest_gpu 150 ;;
  user)
    step gpu_user 540 python3 -m benchmarks gpu_user --wait-for-quiet 10
    cp benchmarks/out/gpu_user.json "$OUT/" 2>/dev/null; grep -v "^\s*$" "$OUT/gpu_user.log" | tail -25 ;;
  lone)  # a CPU replica's lone request on 16 cores, onnxruntime and torch: does serve.torch_threads pay there? (2 cores: no)
    step serve_user 330 python3 -m benchmarks serve_user --archs resnet18 --rounds 2 --requests 200 --every-core --quiet-s 10 --settle-s 2
    cp benchmarks/out/serve_user.json "$OUT/" 2>/dev/null; grep "serve_user resnet18" "$OUT/serve_user.log" ;;
  rd)
    step gpu_user 255 python3 -m benchmarks gpu_user --wait-for-quiet 10 --paths ray_data
    cp benchmarks/out/gpu_user.json "$OUT/" 2>/dev/null; grep -v "^\s*$" "$OUT/gpu_user.log" | tail -12
    step pytest_gpu 60 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -k infer_cli
    tail -4 "$OUT/pytest_gpu.log" ;;
  all|whyrd)
    bash "$0" why
    step gpu_user 250 python3 -m benchmarks gpu_user --wait-for-quiet 5 --paths ray_data --skip-demo
    cp benchmarks/out/gpu_user.json "$OUT/" 2>/dev/null; grep -v "^\s*$" "$OUT/gpu_user.log" | tail -12
    [ "$1" = all ] && pytest_gpu 170 ;;
  why)
    python3 -m workflow demo-data /tmp/demo > /dev/null 2>&1
    echo "== why (limit 240s, load $(cut -d' ' -f1-3 /proc/loadavg))"
    timeout 240 python3 -m workflow run -v --config configs/default.yaml --set run.source=/tmp/demo --set run.dir=/tmp/run \
      --set train.use_gpu=true --set infer.use_gpu=true 2>&1 \
      | python3 -u -c 'import sys, time; t = time.time(); [print(f"{time.time() - t:7.2f} {l}", end="") for l in sys.stdin]' \
      > "$OUT/why.log"; echo "why rc=${PIPESTATUS[0]}"
    cp -r /tmp/ray/session_latest/logs/train "$OUT/train_logs" 2>/dev/null; cp /tmp/run/report.json "$OUT/run_report.json" 2>/dev/null
    ray stop --force > /dev/null 2>&1
    python3 -c 'import json; [print(f"{v:8.2f}  {k}") for k, v in (json.load(open("/tmp/run/report.json")).get("train_seconds_split") or {}).items()]' 2>/dev/null
    grep -v "^ *[0-9.]* *$" "$OUT/why.log" | grep -v "Checkpoint successfully\|Reporting training" | cut -c1-160 | tail -40 ;;
esac
