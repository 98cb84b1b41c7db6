#!/usr/bin/env bash
# Run ON the GPU machine (an H200 with no network, python3 with torch 2.11+cu130).
#   scripts/gpu_run.sh [JOB ...]     JOB: install (default), check, kernels, pytest [ARGS ;] (VLLM_BI_PYTEST_TIMEOUT=S
#                                    stops it after S seconds; its servers' logs -> $OUT/server-logs.tar.gz), serve-parity [ARGS ;],
#                                    suite [ARGS ;] (scripts/gpu_suite.py), gate [ARGS ;] (scripts/gpu_gate.py), bench [ARGS ;] (benchmarks/gdn_layer.py ARGS: forward, layer, train; bi_gemm.py),
#                                    gemm-tune [ARGS ;] (benchmarks/bi_gemm_tune.py: Triton GEMM tiles -> $OUT/bi_gemm_tiles.json),
#                                    moe [ARGS ;] (benchmarks/moe_layer.py: MoE experts, BI loop / triton vs stock),
#                                    e2e [ARGS ;] (benchmarks/generate_throughput.py ARGS), save-caches,
#                                    py SCRIPT [ARGS] ; (any benchmarks/ script, e.g. py profile_gdn.py --shapes train:1x4096 ;),
#                                    checkpoint NAME DIR [ARGS] ; (vllm-bi make-checkpoint on the GPU: full-size random weights)
# Installs every bundle part present in $VLLM_BI_BUNDLE (default: <repo>/.gpu_bundle, made by
# scripts/gpu_prepare.sh) into $VLLM_BI_SITE (default /tmp/vllm_bi_site). Idempotent: a part already
# installed (same MANIFEST) is skipped, so a bundle can arrive over several back-to-back calls to a
# warm machine. vllm_bi itself is used from this checkout (PYTHONPATH) and made visible to vLLM's
# plugin loader by a hand-written vllm_bi.dist-info with the `vllm.general_plugins` entry point.
# Logs go to $OUT when set (the output folder that comes back from the GPU machine). VLLM_BI_NO_INSTALL=1 skips
# the install step (for a second gpu_run.sh started beside a first one on a machine already installed).
# Compile caches: tilelang compiles fla-core's Hopper backward kernels (~17 s each, per process). `save-caches`
# writes ~/.tilelang to $OUT/tilelang_cache.tar.gz; a tilelang_cache.tar.gz in the bundle folder is unpacked at
# install, so a fresh machine skips those compiles.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SITE="${VLLM_BI_SITE:-/tmp/vllm_bi_site}"
BUNDLE="${VLLM_BI_BUNDLE:-$REPO/.gpu_bundle}"
LOG="${OUT:-/tmp}"
mkdir -p "$SITE/bin"
export PYTHONUNBUFFERED=1

install_part() {
  local p="$1" stamp
  [ -f "$p/MANIFEST" ] || { echo "skip $p (no MANIFEST)"; return 0; }
  stamp="$SITE/.installed.$(basename "$p").$(sha256sum "$p/MANIFEST" | cut -c1-16)"
  [ -f "$stamp" ] && { echo "already installed: $p"; return 0; }
  ( cd "$p" && grep -v '^#' MANIFEST | sha256sum -c --quiet ) || { echo "ERROR: $p fails its MANIFEST" >&2; return 1; }
  if ls "$p"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$p"/*.whl
  fi
  [ -f "$p/vllm_py.tar.xz" ] && tar -xJf "$p/vllm_py.tar.xz" -C "$SITE"
  local f
  for f in "$p"/*.so.xz; do
    [ -e "$f" ] || continue
    case "$(basename "$f")" in
      _vllm_fa3_C*) dst="$SITE/vllm/vllm_flash_attn" ;;
      *) dst="$SITE/vllm" ;;
    esac
    mkdir -p "$dst"; xz -dc "$f" > "$dst/$(basename "$f" .xz)"
  done
  touch "$stamp"; echo "installed $p"
}

install_all() {
  local p
  for p in "$BUNDLE"/part*; do [ -d "$p" ] && install_part "$p"; done
  # vllm_bi from this checkout, with distribution metadata so vLLM finds the plugin.
  local di="$SITE/vllm_bi-0.0.0+checkout.dist-info"
  rm -rf "$SITE"/vllm_bi-*.dist-info; mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: vllm_bi\nVersion: 0.0.0+checkout\n' > "$di/METADATA"
  printf '[vllm.general_plugins]\nvllm_bi = vllm_bi.plugin:register\n\n[console_scripts]\nvllm-bi = vllm_bi.cli:main\n' > "$di/entry_points.txt"
  : > "$di/RECORD"
  # vLLM starts its engine with multiprocessing "spawn", which re-imports __main__: keep the guard.
  printf '#!/usr/bin/env python3\nimport sys\nfrom vllm.entrypoints.cli.main import main\nif __name__ == "__main__":\n    sys.exit(main())\n' > "$SITE/bin/vllm"
  chmod +x "$SITE/bin/vllm"
}

env_setup() {
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
  export VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
}

job_check() {
  python3 - <<'PY'
import importlib.metadata as md, torch, triton
import vllm, fla
def ver(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return getattr(vllm, "__version__", "?") if dist == "vllm" else "?"
print("torch", torch.__version__, "triton", triton.__version__, "vllm", ver("vllm"), "fla", ver("fla-core"))
print("device", torch.cuda.get_device_name(), "cc", torch.cuda.get_device_capability())
eps = [e for e in md.entry_points(group="vllm.general_plugins")]
print("vllm.general_plugins:", [(e.name, e.value) for e in eps])
PY
}

restore_caches() {
  local t="$BUNDLE/tilelang_cache.tar.gz"
  [ -f "$t" ] && [ ! -d "$HOME/.tilelang" ] && tar -xzf "$t" -C "$HOME" && echo "restored tilelang cache from $t"
  return 0
}

# part4's tilelang without part5's z3 imports half-way ("Failed to import z3, consider to reinstall tilelang") and
# every vLLM engine started then died at its first request (docs/results/2026-12-01-h200-chunk-decode-targets.md): run
# nothing but installs until part5 is in too.
half_tilelang() {
  ls "$SITE"/.installed.part4.* >/dev/null 2>&1 && ! ls "$SITE"/.installed.part5.* >/dev/null 2>&1
}

if [ "${VLLM_BI_NO_INSTALL:-0}" = 1 ]; then
  if ! ls "$SITE"/.installed.part* >/dev/null 2>&1 && [ "$*" != install ]; then
    echo "ERROR: VLLM_BI_NO_INSTALL=1 but nothing is installed in $SITE (a fresh machine): run without" \
         "VLLM_BI_NO_INSTALL, carrying .gpu_bundle" >&2
    exit 2
  fi
else
  install_all; restore_caches
fi
env_setup
[ $# -eq 0 ] && set -- install
if half_tilelang && [ "$*" != install ]; then
  echo "ERROR: part4 (tilelang) is installed without part5 (z3), which breaks vLLM's engine: install part5 first" \
       "(carry .gpu_bundle/part5 in the next call), then run jobs" >&2
  exit 2
fi
# vLLM servers a test started run in sessions of their own, so a stopped pytest (or a device call cut off at its
# limit) leaves them holding the GPU for the next job on a warm machine: stop_servers ends them, before a test run
# and after it. end_servers also brings back the server logs written since the stamp file, as
# $OUT/server-logs.tar.gz.
stop_servers() {
  pkill -9 -f "$SITE/bin/vllm serve" 2>/dev/null || true
  pkill -9 -f "VLLM::EngineCore" 2>/dev/null || true
}
end_servers() {
  stop_servers
  # servers started by VllmServer log to /tmp; tests that start their own write under pytest's tmp folders
  local logs; logs=$( { find /tmp -maxdepth 1 -name 'vllm_bi_server_*.log' -newer "$1";
    find /tmp -path '/tmp/pytest-of-*' -name '*.log' -newer "$1"; } 2>/dev/null || true)
  [ -n "$logs" ] && tar -czf "$LOG/server-logs.tar.gz" $logs 2>/dev/null || true
  rm -f "$1"
}

while [ $# -gt 0 ]; do
  job="$1"; shift
  case "$job" in
    install) ;;
    check) job_check 2>&1 | tee "$LOG/check.log" ;;
    kernels) python3 -m pytest -p no:cacheprovider -m gpu "$REPO/tests/gpu" -v -rs 2>&1 | tee "$LOG/kernels.log" ;;
    pytest)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      stop_servers; stamp=$(mktemp)
      ( cd "$REPO" && timeout -k 10 "${VLLM_BI_PYTEST_TIMEOUT:-0}" python3 -m pytest -p no:cacheprovider -m gpu -v -rs -s \
        "${args[@]}" ) 2>&1 | tee "$LOG/pytest.log" || true
      end_servers "$stamp" ;;
    serve-parity)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      python3 "$REPO/scripts/gpu_serve_parity.py" --out "$LOG" "${args[@]}" 2>&1 | tee "$LOG/serve-parity.log" ;;
    gate)  # the GPU gate (scripts/gpu_gate.py): gpu-gate.json and gpu-gate.md to $OUT
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      python3 "$REPO/scripts/gpu_gate.py" --out "$LOG" "${args[@]}" 2>&1 | tee "$LOG/gate.log" ;;
    suite)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      python3 "$REPO/scripts/gpu_suite.py" --out "$LOG" "${args[@]}" 2>&1 | tee "$LOG/suite.log" ;;
    bench)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      # forward and train rows in separate processes (stock runs before the chunk mode pins fla-core's kernels)
      ( cd "$REPO/benchmarks" && python3 gdn_layer.py --part forward --out "$LOG/bench_gdn_forward.md" "${args[@]}" \
        && python3 gdn_layer.py --part layer --out "$LOG/bench_gdn_layer.md" "${args[@]}" \
        && python3 gdn_layer.py --part train --out "$LOG/bench_gdn_train.md" "${args[@]}" \
        && python3 bi_gemm.py --out "$LOG/bench_bi_gemm.md" ) 2>&1 | tee "$LOG/bench.log" ;;
    gemm-tune)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      ( cd "$REPO/benchmarks" && python3 bi_gemm_tune.py --out "$LOG/bench_gemm_tune.md" \
        --out-json "$LOG/bi_gemm_tiles.json" "${args[@]}" ) 2>&1 | tee "$LOG/gemm-tune.log" ;;
    checkpoint)  # a full-size random-weight checkpoint on this machine: checkpoint qwen3.5-9b /tmp/ckpt/9b [ARGS] ;
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      ( cd "$REPO" && python3 -m vllm_bi.cli make-checkpoint --device cuda "${args[@]}" ) 2>&1 | tee "$LOG/checkpoint.log" ;;
    py)  # any script of benchmarks/ alone: py gdn_layer.py --part forward --rows decode ;  (log: $OUT/py-<script>.log)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      ( cd "$REPO/benchmarks" && python3 "${args[@]}" ) 2>&1 | tee "$LOG/py-$(basename "${args[0]}" .py).log" ;;
    moe)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      ( cd "$REPO/benchmarks" && python3 moe_layer.py --out "$LOG/bench_moe.md" "${args[@]}" ) 2>&1 \
        | tee "$LOG/moe.log" ;;
    e2e)
      args=(); while [ $# -gt 0 ] && [ "$1" != ";" ]; do args+=("$1"); shift; done; [ $# -gt 0 ] && shift
      ( cd "$REPO/benchmarks" && python3 generate_throughput.py --stock-args "--gdn-prefill-backend triton" \
        --out "$LOG/bench_e2e.md" "${args[@]}" ) 2>&1 | tee "$LOG/e2e.log" ;;
    save-caches)
      if [ -d "$HOME/.tilelang" ]; then tar -czf "$LOG/tilelang_cache.tar.gz" -C "$HOME" .tilelang; ls -la "$LOG/tilelang_cache.tar.gz"; else echo "no ~/.tilelang"; fi ;;
    *) echo "unknown job $job" >&2; exit 2 ;;
  esac
done
