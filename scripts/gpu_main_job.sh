#!/bin/bash
# The main job on an offline GPU host (this workplace's H200s), from the repository root:
#   bash scripts/gpu_main_job.sh STEP [STEP ...]
# Steps, in the order a device session needs them:
#   collect        copy the parts carried by this call (.vllm/partN/*, .gpu/wheelhouse/partN/*) to /tmp/parts;
#                  every call that carries a part starts with it (the machine keeps /tmp while it stays warm)
#   setup          reassemble and verify the vLLM 0.25.1 bundle (shared/vllm-h200/stage_vllm.sh) into /tmp/site
#                  and the wheelhouse (scripts/wheelhouse.py) into /tmp/grpo-site, link packer_rs's extension
#                  into the checkout, convert SmolLM2 once, and check that everything imports
#   setup-vllm     only the vLLM bundle of setup (no wheelhouse): enough for the engine calibration, whose model
#                  is built on the box (random weights in a registry shape) from the tokenizer carried in .gpu/calib
#   calib[=ARGS]   benchmarks/engine_calibration.py (decode-step time against running sequences, seeded and n = G
#                  variants, K engines on GPU 0); ARGS: its arguments, e.g. "--model random-qwen3-0.6b --engines 1"
#   probe          benchmarks/rollout.py on configs/gpu-1xh200.yaml's vLLM without a trainer, 30 s per variant: as
#                  configured, with a group's first requests as one (rollout.batch_group_prompts), and with top-8
#                  sampler log-probs (score centering); where the rollout's time goes
#                  (CPU seconds of the rollout, vLLM's API server and engine core; running requests)
#   probe2         the same with two vLLM replicas on GPU 0 (gpu_ids [0, 0], 15% of its memory each, eager): prefix
#                  affinity routing as configured vs route_imbalance 0 (every imbalance spills: least-loaded routing),
#                  vLLM's own prefix-cache hit rate per replica
#   long           benchmarks/long_generation_sync.py: a 1500-token generation across a weight sync (real vLLM)
#   sync           benchmarks/gpu_sync_timing.py on configs/gpu-1xh200.yaml: perf/weight_sync_* of 8 full-weight syncs
#                  (gather before the pause, packed CUDA IPC) to every vLLM replica while 32 generations each run,
#                  and a greedy check on every replica that the weights arrived (sync_timing.json)
#   e2e=RUNS       benchmarks/gpu_e2e.py --runs RUNS (comma-separated: 1xh200,1xh200-lora,2xh200,qwen3-0.6b-random)
#   trl[=GPUS]     benchmarks/trl_async_grpo.py on the gpu-1xh200 config (GPUS 1 or 2) against e2e's summary
#   benches        start, detached (it outlives the call while the machine stays warm), the trainer benchmarks that
#                  need only torch, pydantic (.gpu/mini wheels, carried by the same call) and packer_rs's extension:
#                  python -m benchmarks.trainer sweep, then python -m benchmarks.trainer.hybrid --check --gradient-checkpointing
#                  (without checkpointing, Qwen3.5-2B's shape at 16384 tokens with transformers' PyTorch Gated
#                  DeltaNet kernel ran out of the H200's 139 GiB); they use the GPU
#                  while later calls only copy parts and unpack, so their timings are not shared
#   benches-wait   wait (at most 420 s) until the detached benchmarks have ended, then print their tables
#   parity         benchmarks/logprob_parity.py on the rollout dump of the last e2e run made with DUMP=1 (trainer path,
#                  Hugging Face fp32/bf16 and the sampler's log-probs of the same tokens; then again with --stale-masks)
#   qwen35         scripts/gpu_qwen35.sh vllm: a tiny Qwen3.5 served by real vLLM, log-probs across an IPC sync
# STEPS (default 30) sets the steps of every run; E2E_ARGS adds gpu_e2e.py arguments (e.g. "--set train.compile=false"). Results accumulate in /tmp/grpo-results across the calls
# of one warm machine ($OUT is emptied before each call) and are copied to OUT (at most 8 files) at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}; STEPS=${STEPS:-30}; PY=${PYTHON:-python3}; RES=/tmp/grpo-results
mkdir -p "$OUT" /tmp/parts "$RES"
export PYTHONPATH=$PWD:/tmp/grpo-site:/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 \
       GRPO_FLOW_CACHE_DIR=/tmp/grpo-cache TRL_EXPERIMENTAL_SILENCE=1 TOKENIZERS_PARALLELISM=false

collect() {
    local n=0
    for f in .vllm/part*/* .gpu/wheelhouse/part*/*; do [ -f "$f" ] && cp "$f" /tmp/parts/ && n=$((n + 1)); done
    echo "collect: $n files; /tmp/parts now holds:"; ls -l /tmp/parts
}

setup_vllm() {
    if [ ! -d /tmp/site/vllm ]; then
        cat /tmp/parts/bundle.tar.xz.* > /tmp/bundle.tar.xz
        (cd /tmp && sed 's#/tmp/bundle.tar.xz#bundle.tar.xz#' /tmp/parts/bundle.sha256 | sha256sum -c --quiet) \
            || { echo "vLLM bundle incomplete (a .vllm part is missing)"; return 3; }
        rm -rf /tmp/site && "$PY" -c "import tarfile; tarfile.open('/tmp/bundle.tar.xz').extractall('/tmp/site', filter='data')" || return 4
    fi
    mkdir -p "$GRPO_FLOW_CACHE_DIR/models"
    [ -d .gpu/calib ] && cp -rn .gpu/calib/* "$GRPO_FLOW_CACHE_DIR/models/"
    return 0
}

setup() {
    setup_vllm || return $?
    [ -d /tmp/grpo-site/prefect ] || bash scripts/install_wheelhouse.sh /tmp/parts /tmp/grpo-site || return 5
    ln -sf /tmp/grpo-site/packer_rs/_native.abi3.so packer_rs/_native.abi3.so
    "$PY" - <<'PYEOF' || return 6
import importlib, torch
for m in ("vllm", "prefect", "mlflow", "reasoning_gym", "packer_rs", "grpo_core.train", "flows.grpo_train", "trl"):
    try:
        importlib.import_module(m)
    except Exception as e:  # report every missing piece at once
        print("IMPORT FAILED", m, repr(e)[:300])
from grpo_core.config import ModelConfig
from grpo_core.models import resolve_model_dir
print("GPUs:", torch.cuda.device_count(), "model:", resolve_model_dir(ModelConfig()))
PYEOF
    "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|pyarrow|peft|accelerate|numpy|pydantic|fastapi|vllm|prefect|mlflow) " \
        | tee "$RES/versions.txt"
}

benches() {
    mkdir -p /tmp/mini && "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/mini .gpu/mini/*.whl \
        || return 7
    PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/mini setsid nohup bash -c "
        $PY -m benchmarks.trainer sweep --time-budget-s 200 --out $RES > $RES/sweep.txt 2>&1
        $PY -m benchmarks.trainer.hybrid --check --json --gradient-checkpointing > $RES/hybrid.txt 2>&1
        echo done > $RES/benches.done" > /dev/null 2>&1 < /dev/null &
    echo "benchmarks started in the background (pid $!)"
}

benches_wait() {
    for _ in $(seq 420); do [ -f "$RES/benches.done" ] && break; sleep 1; done
    [ -f "$RES/benches.done" ] || echo "benchmarks still running after 420 s"
    tail -40 "$RES/sweep.txt"; tail -20 "$RES/hybrid.txt"
}

rc=0
for step in "$@"; do
    echo "=== $step ($(date +%T))"
    case $step in
        collect) collect ;;
        setup) setup || { rc=$?; echo "setup failed ($rc)"; exit $rc; } ;;
        setup-vllm) setup_vllm || { rc=$?; echo "setup-vllm failed ($rc)"; exit $rc; } ;;
        calib|calib=*) a=${step#calib}; a=${a#=}; n=$(ls "$RES"/calib*.json 2>/dev/null | wc -l)
                       timeout -k 30 560 "$PY" benchmarks/engine_calibration.py $a --log-dir /tmp/calib-logs \
                           --out "$RES/calib$n.json" || { rc=1; tail -30 /tmp/calib-logs/*/*.log; } ;;
        probe) timeout 400 "$PY" benchmarks/rollout.py --config configs/gpu-1xh200.yaml --seconds 30 --variant "" \
                   --variant rollout.batch_group_prompts=true \
                   --variant rollout.num_sampler_logprobs=8,train.score_centering=true \
                   --out "$RES/rollout_probe.json" || rc=1 ;;
        probe2) timeout 480 "$PY" benchmarks/rollout.py --config configs/gpu-1xh200.yaml --seconds 30 \
                    --set server.num_replicas=2 --set "server.gpu_ids=[0, 0]" --set server.gpu_memory_utilization=0.15 \
                    --set server.enforce_eager=true --variant "" --variant server.route_imbalance=0 \
                    --out "$RES/rollout_probe_2replicas.json" || rc=1 ;;
        sync) timeout 500 "$PY" benchmarks/gpu_sync_timing.py --config configs/gpu-1xh200.yaml --out "$RES" || rc=1 ;;
        long) timeout 300 "$PY" benchmarks/long_generation_sync.py --config configs/gpu-1xh200.yaml --out "$RES" || rc=1 ;;
        e2e=*) [ "${DUMP:-0}" = 1 ] && export GRPO_DEBUG_ROLLOUT_DUMP=$RES/rollout_dump.jsonl
               timeout -k 45 550 "$PY" benchmarks/gpu_e2e.py --runs "${step#e2e=}" --steps "$STEPS" --out "$RES" \
                   ${E2E_ARGS:-} || rc=1 ;;
        trl|trl=*) g=${step#trl}; g=${g#=}; timeout 560 "$PY" benchmarks/trl_async_grpo.py --gpus "${g:-1}" \
                       --steps "$STEPS" --out "$RES" --compare "$RES/summary.json" || rc=1 ;;
        parity) model=$("$PY" -c "from grpo_core.config import ModelConfig; from grpo_core.models import resolve_model_dir; print(resolve_model_dir(ModelConfig()))")
                timeout 240 "$PY" benchmarks/logprob_parity.py --dump "$RES/rollout_dump.jsonl" --model-dir "$model" \
                    --config configs/gpu-1xh200.yaml --out "$RES/parity.json" || rc=1
                timeout 200 "$PY" benchmarks/logprob_parity.py --dump "$RES/rollout_dump.jsonl" --model-dir "$model" \
                    --config configs/gpu-1xh200.yaml --stale-masks --skip-bf16 --out "$RES/parity_stale_masks.json" || rc=1 ;;
        benches) benches || rc=1 ;;
        benches-wait) benches_wait ;;
        qwen35) OUT=$RES timeout 400 bash scripts/gpu_qwen35.sh vllm || rc=1 ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done
cp "$RES"/*.json "$RES"/*.png "$RES"/*.txt "$OUT"/ 2>/dev/null
ls -l "$OUT"
exit $rc
