#!/usr/bin/env bash
# guidellm against TokenFleet's gateway, offline (no model hub), on loopback only.
#
# Starts two emulated vLLM instances and the gateway from this clone, runs two short
# guidellm benchmarks through the gateway (streamed chat completions, then streamed text
# completions), and stops both. Put your own servers in a fleet file to do the same in
# front of real instances.
#
# Needs the repository's virtual environment (./dev setup). Creates, when missing:
#   $GL_VENV   guidellm 0.8.1 in a virtual environment of its own (about 100 s and 6 GB:
#              it pulls torch with its CUDA wheels);
#   $TOK_DIR   a local tokenizer that counts 4 bytes a token, as the gateway does
#              (make_tokenizer.py beside this script).
# Settings (environment): GL_VENV, TOK_DIR, OUT, EMU_PORT (two ports from it), GW_PORT,
# RATE, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
tokenfleet=$repo/.venv/bin/tokenfleet
GL_VENV=${GL_VENV:-$HOME/.cache/tokenfleet/guidellm-venv}
TOK_DIR=${TOK_DIR:-$HOME/.cache/tokenfleet/guidellm-tokenizer}
OUT=${OUT:-$PWD/guidellm-results}
EMU_PORT=${EMU_PORT:-18100}
GW_PORT=${GW_PORT:-18080}
RATE=${RATE:-2} REQUESTS=${REQUESTS:-20}
PROMPT_TOKENS=${PROMPT_TOKENS:-128} OUTPUT_TOKENS=${OUTPUT_TOKENS:-16}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
[ -x "$tokenfleet" ] || { echo "run ./dev setup first" >&2; exit 1; }
mkdir -p "$OUT"
pids=()
stop() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT

if [ ! -x "$GL_VENV/bin/guidellm" ]; then
  "$repo/.venv/bin/python" -c 'import sys; print(sys._base_executable)' |
    xargs -I{} {} -m venv "$GL_VENV"
  "$GL_VENV/bin/pip" install -q guidellm==0.8.1
fi
[ -f "$TOK_DIR/tokenizer.json" ] || "$GL_VENV/bin/python" "$here/make_tokenizer.py" "$TOK_DIR"

sed -e "s#127.0.0.1:8100#127.0.0.1:$EMU_PORT#; s#127.0.0.1:8101#127.0.0.1:$((EMU_PORT + 1))#" \
  "$repo/examples/fleet.toml" > "$OUT/fleet.toml"   # model "emulated", key sk-demo
"$tokenfleet" emulate --instances 2 --base-port "$EMU_PORT" > "$OUT/emulate.log" 2>&1 &
pids+=($!)
"$tokenfleet" gateway --fleet "$OUT/fleet.toml" --host 127.0.0.1 --port "$GW_PORT" \
  > "$OUT/gateway.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do
  curl -sf "http://127.0.0.1:$GW_PORT/ready" >/dev/null && break
  sleep 0.5
done
curl -sf "http://127.0.0.1:$GW_PORT/ready" >/dev/null || { echo "the gateway is not ready" >&2; exit 1; }

for endpoint in chat/completions completions; do
  name=${endpoint//\//_}
  timeout 300 "$GL_VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$GW_PORT,model=emulated,api_key=sk-demo,request_format=/v1/$endpoint,stream=true" \
    --tokenizer "kind=hf_auto,model=$TOK_DIR" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --profile "kind=constant,rate=$RATE" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --output kind=console --output "kind=json,path=$OUT/$name.json" \
    --disable-progress 2>&1 | tee "$OUT/$name.out"
done
echo "results: $OUT/chat_completions.{out,json} $OUT/completions.{out,json}"
