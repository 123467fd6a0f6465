# Sourced by scripts/setup.sh and scripts/install-common.sh: does the torch just installed import on this machine?
#
# torch_import_problem PYTHON: prints nothing and returns 0 where `import torch` works with PYTHON; otherwise prints
# one sentence saying why not (a torch built for a newer core than this one is named as such) and returns 1.
torch_import_problem() {
  local python=$1 out rc version
  out=$("$python" -c "import torch" 2>&1)
  rc=$?
  [ "$rc" -eq 0 ] && return 0
  version=$("$python" -c "from importlib.metadata import version; print(version('torch'))" 2>/dev/null || echo "?")
  if [ "$rc" -eq 132 ]; then  # 128 + SIGILL
    case $(uname -m) in
      aarch64 | arm64)
        echo "torch $version stops at import with an illegal instruction: it was built for a newer core than this" \
             "one (PyPI's aarch64 torch 2.10 needs the ARMv8.1 atomics a Raspberry Pi 4's Cortex-A72 lacks:" \
             "pytorch/pytorch#176993; PyPI's torch 2.9.1 runs there)" ;;
      *) echo "torch $version stops at import with an illegal instruction: it was built for a newer CPU than this one" ;;
    esac
  else
    echo "torch $version does not import (exit $rc): $(printf '%s\n' "$out" | tail -1)"
  fi
  return 1
}
