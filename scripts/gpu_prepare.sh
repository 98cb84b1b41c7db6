#!/usr/bin/env bash
# Prepare what the H200 (no network, torch 2.11+cu130 preinstalled) needs to run
# vLLM 0.32.0 (GPU wheel) with vllm_bi: run HERE (needs PyPI). Writes .gpu_bundle/partN/ (gitignored),
# each < 60 MiB so one transfer to the GPU machine can carry it, each with a MANIFEST listing what it holds.
#   scripts/gpu_prepare.sh [OUTDIR]          (default: .gpu_bundle)
#   VLLM_BI_TILELANG=1 scripts/gpu_prepare.sh     also part4/part5: tilelang for fla-core's gated chunk backward
#   VLLM_BI_TILELANG=only scripts/gpu_prepare.sh  only (re)make part4/part5, leave part1..3 as they are
# scripts/gpu_run.sh (on the device) installs whatever parts are present; see docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-.gpu_bundle}"
CACHE="${GPU_PREPARE_CACHE:-.gpu_cache}"   # downloaded wheels (gitignored), reused between runs
PY="${PYTHON:-python3}"
mkdir -p "$CACHE/wheels" "$CACHE/vllm"
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64)
dl() { "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$1" "${@:2}"; }
manifest() {  # manifest PARTDIR DESCRIPTION
  ( cd "$1" && { echo "# $(basename "$1") of the vllm_bi GPU bundle ($2)";
    echo "# made $(date -u +%FT%TZ) by scripts/gpu_prepare.sh; sha256 and file"; sha256sum * | grep -v MANIFEST; } > MANIFEST )
}
size_ok() { local p s; for p in "$@"; do
  s=$(du -sb "$p" | cut -f1); [ "$s" -lt $((60*1024*1024)) ] || { echo "ERROR: $p is $s bytes (>= 60 MiB)" >&2; exit 1; }; done; }
# Optional: tilelang, which fla-core 0.6.0 needs for the gated chunk backward (chunk_bwd_dqkwg) on Hopper
# with Triton < 3.7.1 (the device has 3.6.0). Versions are vLLM 0.32.0's own pins (tilelang==0.1.12,
# apache-tvm-ffi==0.1.11; part4's tvm-ffi replaces part3's 0.1.15.post2 files when installed after it) and
# tilelang 0.1.12's other requirements missing from the device image. libtvm_compiler.so links libz3, so
# z3-solver is needed; it does not fit next to tilelang (50 MB) under 60 MiB, hence part5.
# JIT-compiling the kernels needs nvcc (CUDA 13.0 is on the device image).
TL_PART4=(tilelang==0.1.12 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5)
TL_PART5=(z3-solver==4.15.4.0)
tilelang_parts() {
  local d n v
  mkdir -p "$CACHE/tilelang"
  for d in "${TL_PART4[@]}" "${TL_PART5[@]}"; do
    n="${d%%==*}"; v="${d##*==}"
    ls "$CACHE/tilelang/" | grep -qi "^$(echo "$n" | tr - _)-$v-" || dl "$CACHE/tilelang" "$d"
  done
  rm -rf "$OUT/part4" "$OUT/part5"; mkdir -p "$OUT/part4" "$OUT/part5"
  for d in "${TL_PART4[@]}"; do cp "$CACHE"/tilelang/"$(echo "${d%%==*}" | tr - _)"-"${d##*==}"-*.whl "$OUT/part4/"; done
  for d in "${TL_PART5[@]}"; do cp "$CACHE"/tilelang/"$(echo "${d%%==*}" | tr - _)"-"${d##*==}"-*.whl "$OUT/part5/"; done
  manifest "$OUT/part4" "tilelang 0.1.12 for fla-core's Hopper backward, cp312; needs part5"
  manifest "$OUT/part5" "z3-solver, needed by part4's tilelang"
  du -sh "$OUT/part4" "$OUT/part5"; size_ok "$OUT/part4" "$OUT/part5"
}
if [ "${VLLM_BI_TILELANG:-0}" = only ]; then tilelang_parts; echo "tilelang parts ready in $OUT"; exit 0; fi

# 1. vLLM's GPU wheel and fla-core (the CUDA GDN kernel vllm_bi uses).
[ -f "$CACHE"/vllm/vllm-0.32.0-*.whl ] 2>/dev/null || dl "$CACHE/vllm" vllm==0.32.0
# 2. Dependencies of vLLM 0.32 missing from the device image (torch 2.11, transformers 5.17, ...):
#    the list that ran there (shared/docs/gpu-measurements.md), pinned.
DEPS=(fla-core==0.6.0 annotated-doc==0.0.7 annotated-types==0.8.0 anthropic==2.14.0 apache-tvm-ffi==0.1.15.post2
  astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 cffi==2.1.1 compressed-tensors==0.17.0
  cryptography==50.0.2 depyf==0.20.0 dill==0.4.1 docstring-parser==0.18.0 fastapi==0.136.3 httpcore2==2.16.2
  httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 lm-format-enforcer==0.11.3 loguru==0.7.3
  mcp==2.3.0 mcp-types==2.3.0 mistral-common==1.13.1 model-hosting-container-standards==0.1.16 msgspec==0.23.0
  openai==3.57.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-semantic-conventions-ai==0.5.1 oss-harmony==0.0.11 outlines-core==0.2.14
  partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pycountry==26.2.16
  pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pyjwt==2.15.1
  python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1
  setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5
  typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.8)
need=()
for d in "${DEPS[@]}"; do
  n="${d%%==*}"; v="${d##*==}"; pat="$(echo "$n" | tr - _)-$v-"
  ls "$CACHE/wheels/" 2>/dev/null | grep -qi "^$pat" || need+=("$d")
done
[ ${#need[@]} -eq 0 ] || dl "$CACHE/wheels" "${need[@]}"

# 3. Split the vLLM wheel: Python files (minus what BI serving on an H200 never loads) and the three
#    extension modules it does load, each stripped and xz'd. FA2 (_vllm_fa2_C) is left out: FA3 serves sm_90.
W="$(ls "$CACHE"/vllm/vllm-0.32.0-*.whl)"
rm -rf "$CACHE/unz" "$OUT"; mkdir -p "$CACHE/unz" "$OUT"/part1 "$OUT"/part2 "$OUT"/part3
unzip -q "$W" -d "$CACHE/unz"
U="$CACHE/unz"
xz_so() { local src="$U/$1" dst="$2"; strip --strip-unneeded -o "$dst.tmp" "$src"; xz -T0 -9 -c "$dst.tmp" > "$dst"; rm "$dst.tmp"; }
xz_so vllm/_C_stable_libtorch.abi3.so "$OUT/part1/_C_stable_libtorch.abi3.so.xz"
xz_so vllm/_moe_C_stable_libtorch.abi3.so "$OUT/part2/_moe_C_stable_libtorch.abi3.so.xz"
xz_so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so "$OUT/part2/_vllm_fa3_C.abi3.so.xz"
( cd "$U" && find . -name '*.so' -delete && rm -rf vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 vllm/vllm-rs \
    && tar -cf - vllm vllm-0.32.0.dist-info | xz -T0 -9 > "$OLDPWD/$OUT/part2/vllm_py.tar.xz" )
# The wheel's dist-info RECORD lists the removed files; nothing on the device reads it.
cp "$CACHE"/wheels/*.whl "$OUT/part3/"
# fla-core is tiny and the kernel job needs it first: keep a copy in part1 too.
cp "$CACHE"/wheels/fla_core-0.6.0-*.whl "$OUT/part1/"
for p in "$OUT"/part*; do manifest "$p" "vLLM 0.32.0 GPU wheel, cp312, for torch 2.11+cu130"; done
du -sh "$OUT"/part*
size_ok "$OUT"/part*
[ "${VLLM_BI_TILELANG:-0}" = 0 ] || tilelang_parts
echo "bundle ready in $OUT"
