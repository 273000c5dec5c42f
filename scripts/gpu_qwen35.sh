#!/bin/bash
# GPU checks of Gated DeltaNet hybrids (issue 15) on one H200, from the repository root. Steps, in order,
# across calls of one warm machine (each call carries at most 64 MiB, the vLLM bundle comes in two parts):
#   collect  copy the carried .vllm/part*/bundle.tar.xz.* to /tmp/vparts (run once per part)
#   site     check and unpack the vLLM 0.25.1 bundle to /tmp/site (pydantic etc. for grpo_core too)
#   bench    python -m benchmarks.trainer.hybrid --check --json --gradient-checkpointing: fp32 packed-vs-alone on CUDA, then tree vs plain
#            rows on the Qwen3.5-2B shape (bf16)
#   vllm     a random tiny Qwen3.5 (scripts/make_tiny_qwen35.py, the VLM checkpoint layout) served by real
#            vLLM (--language-model-only, IPC weight transfer), then benchmarks/vllm_weight_sync.py: the
#            trainer's log-probs vs vLLM's before a sync, with perturbed weights, and after the full sync
# Results go to $OUT (default /tmp). Example: bash scripts/gpu_qwen35.sh collect site bench vllm
set -uo pipefail
OUT=${OUT:-/tmp}
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       VLLM_SERVER_DEV_MODE=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1

collect() { mkdir -p /tmp/vparts; cp .vllm/part*/bundle.tar.xz.* /tmp/vparts/ 2>/dev/null; cp .vllm/part*/bundle.sha256 /tmp/vparts/ 2>/dev/null; ls -l /tmp/vparts; }

site() {
  [ -f /tmp/site/vllm/__init__.py ] && { echo "site already unpacked"; return 0; }
  cat /tmp/vparts/bundle.tar.xz.* > /tmp/bundle.tar.xz
  (cd /tmp/vparts && sha256sum -c bundle.sha256) || { echo "BUNDLE INCOMPLETE"; ls -l /tmp/vparts; return 3; }
  python3 -c "import tarfile; tarfile.open('/tmp/bundle.tar.xz').extractall('/tmp/site', filter='data')" || return 4
}

bench() {
  python3 -m benchmarks.trainer.hybrid --check --json --gradient-checkpointing 2>&1 | tee "$OUT/qwen35_trainer.log" | grep '^{' > "$OUT/qwen35_trainer.jsonl"
  cat "$OUT/qwen35_trainer.jsonl"
}

vllm() {
  python3 scripts/make_tiny_qwen35.py /tmp/tiny-qwen35 || return 5
  python3 -m vllm.entrypoints.cli.main serve /tmp/tiny-qwen35 --host 127.0.0.1 --port 8000 --served-model-name tiny \
    --max-model-len 512 --max-num-seqs 8 --gpu-memory-utilization 0.15 --enforce-eager --language-model-only \
    --logprobs-mode processed_logprobs --max-logprobs 20 --generation-config vllm \
    --weight-transfer-config '{"backend":"ipc"}' > "$OUT/vllm_qwen35.log" 2>&1 &
  local sp=$!
  python3 - "$sp" <<'E' || { tail -80 "$OUT/vllm_qwen35.log"; kill $sp; return 6; }
import os, sys, time, urllib.request
for i in range(300):
    if not os.path.exists(f"/proc/{sys.argv[1]}"): raise SystemExit("vLLM exited")
    try:
        if urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=2).status == 200: print("healthy after", i, "s"); break
    except OSError: pass
    time.sleep(1)
else: raise SystemExit("vLLM not healthy in 300 s")
E
  python3 benchmarks/vllm_weight_sync.py --model tiny --model-dir /tmp/tiny-qwen35 2>&1 | tee "$OUT/qwen35_vllm_sync.log" | tail -3
  kill $sp; wait $sp 2>/dev/null
  grep -E "Using .*backend|GDN|gated_delta|ERROR|Error" "$OUT/vllm_qwen35.log" | head -20
}

for step in "$@"; do
  echo "== $step"; "$step" || { echo "step $step failed ($?)"; exit 1; }
done
