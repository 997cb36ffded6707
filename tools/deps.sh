#!/usr/bin/env bash
# Installs what building kvlink needs beyond a Rust toolchain, when missing: cmake and libclang
# (the RDMA verbs bindings build a small C shim and generate bindings at build time). The verbs
# library itself is loaded at run time and is optional. Debian/Ubuntu; needs root for apt.
set -euo pipefail

missing=()
command -v cmake >/dev/null || missing+=(cmake)
if ! compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null && ! compgen -G '/usr/lib/*-linux-gnu/libclang*.so*' >/dev/null; then
  missing+=(libclang-dev)
fi
command -v cc >/dev/null || missing+=(gcc)
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
  echo "deps: cargo not found; install Rust 1.89 or newer (https://rustup.rs)" >&2
  exit 1
fi
