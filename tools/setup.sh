#!/usr/bin/env bash
# Installs what mok needs to build and test, only what is missing:
#   Debian: cmake, ninja, g++, GoogleTest (the C++ tests), ccache (optional: faster rebuilds);
#   PyPI:   torch (the CPU wheel is enough without a GPU), numpy (torch warns on import
#           without it), pytest, scikit-build-core (pip install . builds through it).
# On a fresh Debian/Ubuntu machine that is about 60 MB of Debian packages; the torch wheel and
# its NVIDIA libraries are the large part (a few GB, minutes), skipped when torch imports.
# The CUDA toolkit (nvcc) is used when present; it is not installed here.
# Nothing here is fatal: on a machine without network access a missing piece is reported, and
# the step that needs it fails with its own message.
set -uo pipefail

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
command -v ccache >/dev/null || need_apt+=(ccache)
if [ "${MOK_SETUP_TESTS:-1}" = 1 ] && [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  need_apt+=(libgtest-dev)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "setup: apt-get install ${need_apt[*]}"
    # Bounded: on a machine without network access apt-get would retry for minutes.
    { timeout 300 apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq "${need_apt[@]}"; } >/tmp/mok-setup-apt.log 2>&1 ||
      echo "setup: apt-get could not install ${need_apt[*]} (see /tmp/mok-setup-apt.log); going on without" >&2
  else
    echo "setup: missing ${need_apt[*]} and cannot apt-get install them; going on without" >&2
  fi
fi

pip_install() {  # name, import name
  python3 -c "import $2" 2>/dev/null && return 0
  echo "setup: pip install $1"
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --retries 2 --timeout 30 "$1" ||
    echo "setup: pip could not install $1; going on without" >&2
}
if ! python3 -c "import torch" 2>/dev/null; then
  echo "setup: torch is not installed: pip install torch (a few GB with its NVIDIA libraries; minutes)"
fi
pip_install torch torch
pip_install numpy numpy
pip_install pytest pytest
pip_install "scikit-build-core>=0.10" scikit_build_core
# The tests of the optional integrations and benchmarks (import mok needs none of them):
#   transformers (mok.integrations.hf; the version the suite is run against), matplotlib (the
#   benchmarks' PNGs), TorchTitan's MoE (mok.integrations.torchtitan) with only the five small
#   wheels its MoE imports need; its full dependency tree (datasets, wandb, ...) is ~100 packages.
if [ "${MOK_SETUP_INTEGRATIONS:-1}" = 1 ]; then
  pip_install "transformers==5.17.0" transformers
  pip_install matplotlib matplotlib
  python3 -c "import torchtitan" 2>/dev/null || {
    echo "setup: pip install --no-deps torchtitan==0.3.0 (and the four wheels its MoE imports)"
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --retries 2 --timeout 30 --no-deps \
      torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 ||
      echo "setup: pip could not install torchtitan; its tests skip" >&2
  }
fi

# nvcc lives outside PATH on some images; the scripts and CMake look in /usr/local/cuda/bin too.
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: no CUDA toolkit (nvcc): mok builds its CPU backend only"
fi
exit 0
