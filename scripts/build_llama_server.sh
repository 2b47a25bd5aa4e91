#!/usr/bin/env bash
# llama.cpp's llama-server and llama-bench, built from the very source the installed
# llama-cpp-python was built from (its sdist vendors llama.cpp), so the peer in `fly-serve bench`
# and `python -m loadtest.load_sweep --peer llama-server` runs the same kernels as fly-serve's
# llama.cpp runtime. About 10 minutes on 2 cores the first time; run again, it reuses the build
# (seconds) where it suits this machine. Prints the llama-server path. CI (.ci/run) runs it
# before the tests, so the llama-server tests run there.
#
#   scripts/build_llama_server.sh            # into ~/.cache/fly-serve/llama.cpp-<version>
#   scripts/build_llama_server.sh DIR        # into DIR
#
# fly_bench/llama_server.py finds it there (or at $FLY_LLAMA_SERVER).
set -euo pipefail
VERSION=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
DEST=${1:-${FLY_SERVE_CACHE:-$HOME/.cache/fly-serve}/llama.cpp-$VERSION}
if [[ ! -d "$DEST/src" ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  mkdir -p "$DEST"
  mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST/src"
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# A build kept in the cache (CI keeps ~/.cache/fly-serve between runs) is reused only on the
# machine it suits: llama.cpp compiles for this CPU (GGML_NATIVE), so a build from a CPU with
# other instructions could die of SIGILL here; and cmake refuses another generator in the same
# build folder. Either differs: build afresh. Otherwise cmake only checks that it is up to date.
fingerprint="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr '\n' ' ') ${generator[*]:-make} $(c++ --version 2>/dev/null | head -n 1)"
built="$DEST/src/build/bin/llama-server"
if [[ -x "$built" && ! -f "$DEST/src/build/fly-fingerprint" ]] && "$built" --version >/dev/null 2>&1; then
  printf '%s' "$fingerprint" > "$DEST/src/build/fly-fingerprint"  # a build from before fingerprints, that runs here
fi
if [[ -d "$DEST/src/build" && "$(cat "$DEST/src/build/fly-fingerprint" 2>/dev/null)" != "$fingerprint" ]]; then
  rm -rf "$DEST/src/build"
fi
mkdir -p "$DEST/src/build"
cmake -S "$DEST/src" -B "$DEST/src/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$DEST/src/build" -j"$(nproc)" --target llama-server llama-bench >/dev/null
printf '%s' "$fingerprint" > "$DEST/src/build/fly-fingerprint"
echo "$built"
