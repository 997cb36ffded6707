# Sourced by the test command's vLLM parts (tools/test/vllm.sh). vllm_venv VENV PIN [BASE] makes
# VENV hold the vLLM release PIN (vllm==X.Y.Z) and pytest, or fails saying why.
#
# A vLLM release with its torch and CUDA libraries takes about 9 GB. With BASE (a venv made by
# this function for another release), VENV is layered on it: a .pth file appends BASE's
# site-packages to VENV's sys.path, so pip, resolving PIN, finds every package of the version it
# wants already there and installs only the others (torch, vLLM and a few more: about 4.5 GB)
# into VENV, whose own site-packages come first. A layered VENV records BASE's package list and
# is rebuilt when that list changes. Nothing is kept in pip's cache (the wheels would take as
# much again). (Installing without byte-compiling, --no-compile, made the whole run slower: the
# modules were compiled on first import in the suites and the model-cache warm-up instead.)
vllm_venv() {
  local venv=$1 pin=$2 base=${3:-} stamp
  if [ -n "$base" ] && ! "$base/bin/python" -c "import vllm" 2>/dev/null; then
    base=""
  fi
  # pip takes a package whose path starts with the venv's own path, as a string, for one of
  # the venv's own and uninstalls it: layering .venv-vllm on .venv-vllm33 would empty the base.
  case "$(cd "$base" 2>/dev/null && pwd)" in
    "$(pwd)/${venv#./}"*) [ -n "$base" ] && echo "test: $venv cannot be layered on $base (its path starts with $venv's); installing it whole" >&2; base="" ;;
  esac
  stamp="$pin"
  if [ -n "$base" ]; then
    stamp="$pin on $(cd "$base"/lib/python3*/site-packages && ls -d ./*.dist-info | grep -v "^./kvlink-" | sha256sum | cut -c1-16)"
  fi
  if [ "$(cat "$venv/kvlink-venv" 2>/dev/null)" = "$stamp" ] \
      && "$venv/bin/python" -c "import sys, vllm; sys.exit(vllm.__version__ != '${pin#vllm==}')" 2>/dev/null; then
    vllm_own_cache "$venv"
    return 0
  fi
  rm -rf "$venv"
  local need_gb=12 free_gb
  [ -n "$base" ] && need_gb=7
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "test: $pin needs about $need_gb GB and $free_gb GB are free here: its vLLM connector tests cannot run" >&2
    return 1
  fi
  python3 -m venv "$venv" || return 1
  if [ -n "$base" ]; then
    local own below
    own=$(echo "$venv"/lib/python3*/site-packages)
    below=$(cd "$base"/lib/python3*/site-packages && pwd)
    # Named to sort last: VENV's own .pth files run first; BASE's run inside addsitedir.
    echo "import site; site.addsitedir('$below')" > "$own/zz-kvlink-base.pth"
  fi
  if ! PIP_NO_CACHE_DIR=1 "$venv/bin/pip" install -q --disable-pip-version-check "$pin" pytest; then
    echo "test: installing $pin from the package registry failed (output above): its vLLM connector tests cannot run" >&2
    rm -rf "$venv"
    return 1
  fi
  echo "$stamp" > "$venv/kvlink-venv"
  vllm_own_cache "$venv"
}

# vllm_own_cache VENV: VENV's interpreters keep vLLM's cache in VENV/vllm-cache
# (VLLM_CACHE_ROOT, unless set): both releases name their model-info cache files alike, each
# with its own module hash inside, so with one cache the two suites would empty each other's.
# A .pth file sets it; its name sorts before the layering's, so a layered venv's own comes first.
vllm_own_cache() {
  local venv site
  venv=$(cd "$1" && pwd)
  site=$(echo "$venv"/lib/python3*/site-packages)
  echo "import os; os.environ.setdefault('VLLM_CACHE_ROOT', '$venv/vllm-cache')" >"$site/kvlink-vllm-cache.pth"
}
