#!/usr/bin/env bash
# Sets up everything `make demo` and `make test` need on a fresh Debian-like machine:
# system packages (mosquitto, openssl, dataset-fashion-mnist) when apt-get is available, and the .venv.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEFAULT_TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
TORCH_SPEC=${TORCH_SPEC:-$DEFAULT_TORCH_SPEC}
# On aarch64 (a Raspberry Pi) PyPI's torch is a CUDA build that pulls about 3 GB of CUDA packages: the CPU build
# comes from PyTorch's CPU index instead (TORCH_INDEX= empty keeps PyPI). Where that index cannot be reached,
# PyPI's CPU-only build for aarch64 that a Raspberry Pi 4 runs stands in (AARCH64_PYPI_TORCH: from torch 2.11 on,
# PyPI's aarch64 wheels require the CUDA packages; its 2.10 builds need ARMv8.1 atomics at import).
AARCH64_PYPI_TORCH=${AARCH64_PYPI_TORCH:-"torch==2.9.1 torchvision==0.24.1"}
TORCH_FALLBACK=""
if [ -z "${TORCH_INDEX+set}" ]; then
  case $(uname -m) in
    aarch64 | arm64)
      TORCH_INDEX=https://download.pytorch.org/whl/cpu
      # only for the default torch: a TORCH_SPEC of one's own is installed as given or not at all
      [ "$TORCH_SPEC" != "$DEFAULT_TORCH_SPEC" ] || TORCH_FALLBACK=$AARCH64_PYPI_TORCH ;;
    *) TORCH_INDEX= ;;
  esac
fi

want=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || want+=(mosquitto)
command -v openssl >/dev/null 2>&1 || want+=(openssl)  # makes the secured broker's TLS certificates
[ -d /usr/share/datasets/fashion-mnist ] || want+=(dataset-fashion-mnist)
# The training children's page pool (edge_agent/native/page_pool.c) is compiled once; without a compiler the
# agents fall back to the compact heap (same peaks, slower steps).
command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || want+=(gcc libc6-dev)
if [ ${#want[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    echo "setup: installing ${want[*]} with apt-get"
    if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${want[@]}"; }; then
      echo "setup: apt-get could not install ${want[*]}; continuing (the embedded broker, the digits" \
           "dataset and the compact heap stand in)" >&2
    fi
  else
    echo "setup: no apt-get here; install mosquitto, openssl and dataset-fashion-mnist yourself for the full demo" >&2
  fi
fi
# The init script may start a system-wide mosquitto on port 1883; FedFit starts its own on a free port.

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# shellcheck disable=SC2086
if ! .venv/bin/python -m pip install -q $TORCH_SPEC ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}; then
  [ -n "$TORCH_FALLBACK" ] || { echo "setup: pip could not install $TORCH_SPEC (see its output above)" >&2; exit 1; }
  echo "setup: $TORCH_INDEX did not give $TORCH_SPEC (unreachable?); installing $TORCH_FALLBACK from PyPI, its" \
       "CPU-only build for aarch64 that a Raspberry Pi 4 runs" >&2
  # shellcheck disable=SC2086
  .venv/bin/python -m pip install -q $TORCH_FALLBACK ||
    { echo "setup: pip could not install $TORCH_FALLBACK either (see its output above)" >&2; exit 1; }
fi
# shellcheck source=scripts/torch-import-check.sh
. scripts/torch-import-check.sh
problem=$(torch_import_problem .venv/bin/python) ||
  { echo "setup: $problem; give one that runs here with TORCH_SPEC=\"...\" (e.g. \"$AARCH64_PYPI_TORCH\")" >&2; exit 1; }
.venv/bin/python -m pip install -q -e '.[dev,embedded-broker]'
.venv/bin/python - <<'PY'
from edge_agent import page_pool
path = page_pool.library_path()
print(f"setup: page pool {path}" if path else
      "setup: the page pool could not be built (no C compiler?); agents train with the compact heap")
PY
echo "setup: .venv ready"
