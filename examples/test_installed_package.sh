#!/usr/bin/env bash
# Installs the built project into a temporary prefix, builds examples/consumer against it with
# find_package(epmoe) and with pkg-config, and runs both builds. Usage: test_installed_package.sh BUILD_DIR
set -euo pipefail
source_dir="$(cd "$(dirname "$0")/.." && pwd)"
build_dir="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" > "$work/install.log"
cmake -S "$source_dir/examples/consumer" -B "$work/consumer" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" > "$work/configure.log"
cmake --build "$work/consumer" > "$work/build.log"
expected="5 6 5 7 8 4 3 4 10 9 10 2 0 1 11 1 
7 10 6 8 6 11 8 9 2 4 5 1 5 0 3 1 "
out="$("$work/consumer/place_experts")"
[ "$out" = "$expected" ] || { echo "find_package build printed: $out"; exit 1; }
pc_dir="$(dirname "$(find "$work/prefix" -name epmoe.pc)")"
export PKG_CONFIG_PATH="$pc_dir"
c++ -std=c++20 -O1 "$source_dir/examples/consumer/place_experts.cc" -o "$work/place_experts_pc" \
  $(pkg-config --cflags --libs epmoe) -Wl,-rpath,"$(pkg-config --variable=libdir epmoe)"
out="$("$work/place_experts_pc")"
[ "$out" = "$expected" ] || { echo "pkg-config build printed: $out"; exit 1; }
echo "installed package: find_package and pkg-config builds print DeepSeek's published placement"
