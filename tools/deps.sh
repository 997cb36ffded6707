#!/usr/bin/env bash
# Installs what building kvlink needs beyond a Rust toolchain, when missing (Debian/Ubuntu; root
# or sudo for apt-get):
#   - cmake, make and a C compiler: the verbs bindings (rdma-mummy-sys) build a small C shim;
#   - libclang-dev: bindgen loads libclang (libclang.so or libclang-N.so, never libclang-cpp) and
#     needs clang's own headers (stddef.h) beside it.
# The verbs library itself is loaded at run time and is optional.
#
#   tools/deps.sh                 # the build dependencies
#   tools/deps.sh PKG...          # and these Debian packages too (installed when not installed)
#
# Quiet and quick when everything is present: no apt-get run at all.
set -euo pipefail

log() { echo "deps: $*" >&2; }

is_installed() {
  [ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" = installed ]
}

# True when bindgen (clang-sys, loaded at run time) will find a usable libclang: the shared
# library under one of the names clang-sys accepts, and clang's resource headers next to it.
# libclang-cpp.so.N (the C++ library, shipped with llvm on some images) does not count.
have_libclang() {
  local dirs=() d f lib=""
  [ -n "${LIBCLANG_PATH:-}" ] && dirs+=("$LIBCLANG_PATH")
  if command -v llvm-config >/dev/null; then
    d=$(llvm-config --libdir 2>/dev/null || true)
    [ -n "$d" ] && dirs+=("$d")
  fi
  dirs+=(/usr/lib/llvm-*/lib /usr/lib/*-linux-gnu /usr/lib64 /usr/lib /usr/local/lib)
  for d in "${dirs[@]}"; do
    [ -d "$d" ] || continue
    for f in "$d"/libclang.so "$d"/libclang.so.* "$d"/libclang-[0-9]*.so "$d"/libclang-[0-9]*.so.*; do
      if [ -e "$f" ]; then lib=$f; break 2; fi
    done
  done
  [ -n "$lib" ] || return 1
  # clang's builtin headers: <llvm>/lib/clang/<version>/include/stddef.h.
  compgen -G '/usr/lib/llvm-*/lib/clang/*/include/stddef.h' >/dev/null ||
    compgen -G '/usr/lib/clang/*/include/stddef.h' >/dev/null ||
    compgen -G "$(dirname "$lib")/clang/*/include/stddef.h" >/dev/null
}

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v make >/dev/null || missing+=(make)
command -v cc >/dev/null || missing+=(gcc)
have_libclang || missing+=(libclang-dev)
for pkg in "$@"; do
  is_installed "$pkg" || missing+=("$pkg")
done

if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  aptlog=$(mktemp)
  # Another apt-get (the VM's installs, in the test command's background) may hold the lock.
  if ! { $sudo apt-get update -q -o DPkg::Lock::Timeout=600 && DEBIAN_FRONTEND=noninteractive \
      $sudo apt-get install -y -q -o DPkg::Lock::Timeout=600 --no-install-recommends "${missing[@]}"; } \
      >"$aptlog" 2>&1; then
    tail -n 20 "$aptlog" >&2
    log "error: apt-get could not install ${missing[*]} (log: $aptlog)"
    exit 1
  fi
  rm -f "$aptlog"
  if printf '%s\n' "${missing[@]}" | grep -qx libclang-dev && ! have_libclang; then
    log "error: libclang-dev is installed but no libclang.so / libclang-N.so with clang's headers was found; set LIBCLANG_PATH"
    exit 1
  fi
fi
if ! command -v cargo >/dev/null; then
  log "error: cargo not found; install Rust 1.89 or newer (https://rustup.rs)"
  exit 1
fi
