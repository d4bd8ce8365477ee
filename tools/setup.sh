#!/usr/bin/env bash
# Installs what mok needs to build and test, only what is missing:
#   Debian: cmake, ninja, g++, GoogleTest, ccache;  PyPI: torch (CPU is enough), pytest.
# The CUDA toolkit (nvcc) is used when present; it is not installed here.
set -euo pipefail

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v ccache >/dev/null || need_apt+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "setup: apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "setup: missing ${need_apt[*]} and cannot apt-get install them" >&2
  fi
fi

if ! python3 -c "import torch" 2>/dev/null; then
  echo "setup: pip install torch (CPU use; a few minutes on a fresh machine)"
  python3 -m pip install -q torch
fi
python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q pytest

# nvcc lives outside PATH on some images.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: nvcc found at /usr/local/cuda/bin (add it to PATH)"
fi
