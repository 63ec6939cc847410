#!/usr/bin/env bash
# Build libaio.so from the shim beside this script into DIR (default: ./build here) and print the environment that
# lets DeepSpeed's async_io op find it (its op builder reads CFLAGS/LDFLAGS for the check, and the compiler and the
# loader read CPATH, LIBRARY_PATH and LD_LIBRARY_PATH). Usage: eval "$(bash build.sh [DIR])"
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="$(mkdir -p "${1:-$HERE/build}" && cd "${1:-$HERE/build}" && pwd)"
cp "$HERE/libaio.h" "$DIR/"
${CC:-cc} -O2 -Wall -Wextra -Werror -fPIC -shared -Wl,-soname,libaio.so.1 -o "$DIR/libaio.so.1" "$HERE/libaio.c"
ln -sf libaio.so.1 "$DIR/libaio.so"
cat <<ENV
export CPATH="$DIR\${CPATH:+:\$CPATH}"
export LIBRARY_PATH="$DIR\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$DIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export CFLAGS="-I$DIR\${CFLAGS:+ \$CFLAGS}"
export LDFLAGS="-L$DIR\${LDFLAGS:+ \$LDFLAGS}"
ENV
