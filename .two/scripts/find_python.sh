#!/usr/bin/env sh
# Prints a Python >= 3.12 interpreter found on this machine (jax >= 0.11 needs it; the default python3 here is
# 3.11 and would silently get an old jax). Looks at PATH first, then pyenv's versions folder directly, because a
# pyenv shim for python3.12 fails unless PYENV_VERSION is set.
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for p in python3.14 python3.13 python3.12 python3; do
  if command -v "$p" >/dev/null 2>&1 && ok "$p"; then command -v "$p"; exit 0; fi
done
root="${PYENV_ROOT:-$HOME/.pyenv}"
for p in "$root"/versions/3.1[2-9]*/bin/python3; do
  if [ -x "$p" ] && ok "$p"; then echo "$p"; exit 0; fi
done
echo "no Python >= 3.12 found (looked on PATH and in $root/versions)" >&2
exit 1
