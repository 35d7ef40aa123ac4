#!/usr/bin/env bash
# Serving throughput and latency, pagedserve against vLLM-CPU, measured by vLLM's own serving
# benchmark client (random 128 in / 64 out, 64 prompts, rate inf) on the same 120M GLM-4 model,
# one server after the other on 127.0.0.1.
#
#   benchmarks/serving_vs_vllm.sh [--quantization int4|none] [extra bench args]
#
# Needs ../shared/baselines/vllm_cpu.sh setup (for the client and the vLLM server). Results go to
# bench_out/serving-*.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM=../shared/baselines/vllm_cpu.sh
MODEL=${MODEL:-/tmp/pagedserve-bench-glm4-120m}
NAME=$(basename "$MODEL")
QUANT=int4
if [[ ${1:-} == --quantization ]]; then QUANT=$2; shift 2; fi
mkdir -p bench_out
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from offline_throughput import build_model; from pathlib import Path; build_model(Path('$MODEL'))"

wait_ready() {
  for _ in $(seq 600); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done
  echo "server at $1 did not start" >&2; return 1
}

port=8123
quant_flag=(); [[ $QUANT != none ]] && quant_flag=(--quantization "$QUANT")
pagedserve serve --model "$MODEL" --served-model-name "$NAME" --dtype bfloat16 "${quant_flag[@]}" \
  --max-model-len 2048 --host 127.0.0.1 --port $port --log-level warning &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
wait_ready "http://127.0.0.1:$port"
bash $VLLM bench "http://127.0.0.1:$port" "$NAME" "$MODEL" "$@" | tee "bench_out/serving-pagedserve-$QUANT.txt"
kill $pid; wait $pid 2>/dev/null || true

port=8765
bash $VLLM serve "$MODEL" $port > bench_out/vllm-server.log 2>&1 &
pid=$!
wait_ready "http://127.0.0.1:$port"
bash $VLLM bench "http://127.0.0.1:$port" "$NAME" "$MODEL" "$@" | tee bench_out/serving-vllm.txt
kill $pid; wait $pid 2>/dev/null || true
