# shellcheck shell=bash disable=SC2015  # `test && test || die` is meant: die when either fails
# Shared by scripts/install-agent.sh and scripts/install-coordinator.sh (sourced, not run). Each script sets
# PROG (its name in messages) and SRC (the FedFit source tree) before sourcing this file.
#
# Test hooks (not for production): FEDFIT_PYTHON names a Python that can import FedFit (used for `fedfit broker`
# and to validate the written configuration instead of the venv's); with --skip-pip it lets a staging install
# check its files without a venv.

# ----------------------------------------------------------------------------------------------- messages
die() { printf '%s: error: %s\n' "$PROG" "$*" >&2; exit 1; }
warn() { printf '%s: warning: %s\n' "$PROG" "$*" >&2; }
say() { printf '%s: %s\n' "$PROG" "$*"; }

# ------------------------------------------------------------------------------------------------ options
# The script's opening comment, up to its shellcheck line.
usage() { awk 'NR > 1 { if (/^# shellcheck/ || !/^#/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0; }
# need_value OPTION "$#" VALUE: an option's value must be there and (but for pip's) not look like another option.
need_value() {
  [ "$2" -ge 2 ] || die "$1 needs a value"
  case $1 in --pip-args | --torch-spec) return 0 ;; esac
  case $3 in --*) die "$1 needs a value, got the option $3" ;; esac
}
# common_option OPT VALUE: the options both install scripts take (--torch-spec, --pip-args, --prefix, --python,
# --root), into the variables of the same names; returns 1 for any other option.
common_option() {
  local more
  case $1 in
    --torch-spec) TORCH_SPEC=$2 ;;
    --pip-args) read -r -a more <<<"$2"; PIP_ARGS+=("${more[@]}") ;;
    --prefix) PREFIX=$2 ;;
    --python) PYTHON=$2 ;;
    --root) ROOT=$2 ;;
    *) return 1 ;;
  esac
}
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
check_port() { is_uint "$2" && [ "$2" -ge 1 ] && [ "$2" -le 65535 ] || die "$1 must be a port in 1..65535, got '$2'"; }
# FedFit's names (agent ids, federations): one MQTT topic level, as protocol.validate_name checks them.
check_name() {
  [[ $2 =~ ^[A-Za-z0-9_.-]{1,64}$ ]] && [ "$2" != . ] && [ "$2" != .. ] ||
    die "$1 must be 1 to 64 characters of letters, digits, '_', '.' or '-' (not '.' or '..'), got '$2'"
}
# A YAML single-quoted scalar.
yq() { local s=${1//\'/\'\'}; printf "'%s'" "$s"; }

# ---------------------------------------------------------------------------------------------- the tree
check_source() {
  [ -f "$SRC/pyproject.toml" ] && grep -q '^name = "fedfit"' "$SRC/pyproject.toml" ||
    die "$SRC is not a FedFit source tree (no pyproject.toml naming fedfit); run the script from a checkout"
}

# ROOT (--root, "" for the live system) and PREFIX set: paths on the target, and where they are written.
set_paths() {
  if [ -n "$ROOT" ]; then  # made when the first file is written
    [ ! -e "$ROOT" ] || [ -d "$ROOT" ] || die "--root $ROOT is not a directory"
    ROOT=$(realpath -m -- "$ROOT")
    [ "$ROOT" != / ] || ROOT=""
  fi
  case $PREFIX in /*) ;; *) die "--prefix must be an absolute path, got '$PREFIX'" ;; esac
  PREFIX=${PREFIX%/}
  VENV=$PREFIX/.venv
  # shellcheck disable=SC2034  # used by the scripts
  ETC=/etc/fedfit
  UNIT_DIR=/etc/systemd/system
}

systemd_running() { [ -z "$ROOT" ] && [ -d /run/systemd/system ]; }

check_root() {
  [ -n "$ROOT" ] || [ "$(id -u)" -eq 0 ] || die "run it as root (sudo $0 ...), or with --root DIR to stage an image"
}

# ------------------------------------------------------------------------------------------------ python
check_python() {
  local want major minor
  command -v "$PYTHON" >/dev/null 2>&1 || die "no '$PYTHON' here: install Python 3 (apt-get install python3 python3-venv) or pass --python"
  want=$(sed -n 's/^requires-python *= *">= *\([0-9.]*\)".*/\1/p' "$SRC/pyproject.toml")
  want=${want:-3.10}
  major=${want%%.*} minor=${want#*.}; minor=${minor%%.*}
  "$PYTHON" -c "import sys; sys.exit(sys.version_info < ($major, $minor))" 2>/dev/null ||
    die "FedFit needs Python >= $want, $PYTHON is $("$PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo unknown) (pass --python python3.X)"
}

# PyTorch's index of CPU-only wheels (x86-64 and aarch64).
CPU_TORCH_INDEX=${CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# Where that index cannot be reached on aarch64: PyPI's CPU-only build there that runs on a Raspberry Pi 4 (from
# torch 2.11 on, PyPI's aarch64 wheels require the CUDA packages; its 2.10 builds need ARMv8.1 atomics at import).
AARCH64_PYPI_TORCH=${AARCH64_PYPI_TORCH:-"torch==2.9.1 torchvision==0.24.1"}
# shellcheck source=scripts/torch-import-check.sh
. "$SRC/scripts/torch-import-check.sh"

# The torch requirement (TORCH_ARGS, an array) for this machine, and what stands in where it cannot be installed
# (TORCH_FALLBACK, an array; empty: nothing); JETSON and TORCH_WHEELS/TORCH_SPEC from flags.
torch_plan() {
  TORCH_ARGS=()
  TORCH_FALLBACK=()
  if [ ${#TORCH_WHEELS[@]} -gt 0 ]; then
    TORCH_ARGS=("${TORCH_WHEELS[@]}")
    return
  fi
  if [ -n "$TORCH_SPEC" ]; then
    read -r -a TORCH_ARGS <<<"$TORCH_SPEC"
    return
  fi
  if [ "${JETSON:-0}" = 1 ]; then
    die "--jetson needs --torch-wheel PATH_OR_URL: PyPI has no CUDA torch for Jetson, use NVIDIA's JetPack wheel (https://docs.nvidia.com/deeplearning/frameworks/install-pytorch-jetson-platform/) or give --torch-spec with --pip-args naming its index"
  fi
  case $(uname -m) in
    # Plain `torch` from PyPI is a CUDA build on both: on aarch64 too it pulls cuda-toolkit, the nvidia-* packages
    # and triton (about 3 GB, a 5.7 GB venv; about 190 MB of CUDA libraries resident after `import torch` on a
    # board without a GPU). PyTorch's CPU index has the CPU builds for both.
    x86_64 | amd64)
      TORCH_ARGS=(torch torchvision --index-url "$CPU_TORCH_INDEX") ;;
    aarch64 | arm64)
      TORCH_ARGS=(torch torchvision --index-url "$CPU_TORCH_INDEX")
      read -r -a TORCH_FALLBACK <<<"$AARCH64_PYPI_TORCH" ;;
    *) die "there is no torch wheel for $(uname -m) on PyPI (32-bit Raspberry Pi OS?): use a 64-bit OS, or give --torch-spec/--torch-wheel" ;;
  esac
}

# pip in the venv with --pip-args (PIP_ARGS, an array).
vpip() { "$ROOT$VENV/bin/python" -m pip "$@" "${PIP_ARGS[@]}"; }

make_venv() {
  local venv=$ROOT$VENV
  if [ -x "$venv/bin/python" ] && ! "$venv/bin/python" -c 'import pip' >/dev/null 2>&1; then
    warn "$VENV is broken (its Python is gone?): making it again"
    rm -rf -- "$venv"
  fi
  if [ ! -x "$venv/bin/python" ]; then
    say "making the virtual environment $VENV with $PYTHON"
    mkdir -p -- "$(dirname -- "$venv")"
    local venv_log
    venv_log=$(mktemp)
    if ! "$PYTHON" -m venv "$venv" >"$venv_log" 2>&1; then
      rm -rf -- "$venv"
      rm -f "$venv_log"
      die "$PYTHON -m venv failed (on Debian, Ubuntu and Raspberry Pi OS: apt-get install python3-venv)"
    fi
    rm -f "$venv_log"
  else
    say "upgrading FedFit in the existing virtual environment $VENV"
  fi
}

# torch (TORCH_ARGS), or where pip cannot install it, what stands in (TORCH_FALLBACK), said in one sentence.
install_torch() {
  say "installing torch: ${TORCH_ARGS[*]}${PIP_ARGS[*]:+ (pip args: ${PIP_ARGS[*]})}"
  vpip install "${TORCH_ARGS[@]}" && return 0
  [ ${#TORCH_FALLBACK[@]} -gt 0 ] || die "pip could not install torch (${TORCH_ARGS[*]}); see pip's output above"
  warn "pip could not install torch from $CPU_TORCH_INDEX (unreachable?): installing ${TORCH_FALLBACK[*]} from PyPI, its CPU-only build for aarch64 that a Raspberry Pi 4 runs"
  vpip install "${TORCH_FALLBACK[@]}" ||
    die "pip could not install torch (${TORCH_FALLBACK[*]}) either; see pip's output above"
}

# The torch installed imports here, or the install stops with one sentence saying why. Staged into --root (an
# image for another machine) it is not imported: this machine's core is not the device's.
check_torch_imports() {
  local problem hint="give one that runs here with --torch-spec or --torch-wheel"
  if [ -n "${ROOT:-}" ]; then
    say "torch not imported to check it: staged into $ROOT, for the machine that boots it"
    return 0
  fi
  case $(uname -m) in aarch64 | arm64) hint="$hint (e.g. --torch-spec \"$AARCH64_PYPI_TORCH\")" ;; esac
  problem=$(cd / && torch_import_problem "$VENV/bin/python") || die "$problem; $hint"
}

# torch first (TORCH_ARGS), then FedFit without its torch requirements, then FedFit's other requirements under a
# constraint that keeps the torch just installed (a JetPack wheel, a CPU build) from being replaced.
install_packages() {
  local py=$ROOT$VENV/bin/python constraints reqs
  install_torch
  constraints=$(mktemp)
  "$py" - >"$constraints" <<'PY' || { rm -f "$constraints"; die "torch did not install into $VENV"; }
from importlib import metadata
for name in ("torch", "torchvision"):
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        if name == "torch":
            raise SystemExit(1)
PY
  check_torch_imports
  say "installing FedFit from $SRC (with $(tr '\n' ' ' <"$constraints"| sed 's/ $//'))"
  vpip install --no-deps --force-reinstall "$SRC" || { rm -f "$constraints"; die "pip could not install FedFit from $SRC; see pip's output above"; }
  reqs=$(cd / && "$py" - "${JETSON:-0}" <<'PY'
import re
import sys
from importlib import metadata


def installed(name):
    try:
        return metadata.version(name) is not None
    except metadata.PackageNotFoundError:
        return False


for requirement in metadata.requires("fedfit") or []:
    spec, _, marker = requirement.partition(";")
    if "extra" in marker:
        continue  # dev, embedded-broker: not for a device
    key = re.split(r"[\s<>=!~\[(]", spec.strip(), maxsplit=1)[0].lower()
    if key == "torch" or (key == "torchvision" and (installed(key) or sys.argv[1] == "1")):
        continue  # installed above (on a Jetson torchvision comes with --torch-wheel, or not at all)
    print(spec.strip())
PY
  ) || { rm -f "$constraints"; die "cannot read FedFit's requirements from $VENV"; }
  # shellcheck disable=SC2086  # one requirement a line, none with spaces
  vpip install -c "$constraints" $reqs || { rm -f "$constraints"; die "pip could not install FedFit's requirements; see pip's output above"; }
  rm -f "$constraints"
  if [ "${JETSON:-0}" = 1 ] && ! "$py" -c 'import importlib.metadata as m; m.version("torchvision")' >/dev/null 2>&1; then
    say "note: torchvision is not installed (FedFit does not import it; pass its JetPack wheel as a second --torch-wheel to have it)"
  fi
  if [ -n "$ROOT" ]; then  # the scripts' #! lines name the staging path: make them name the target's
    grep -rlI -- "$ROOT$VENV" "$ROOT$VENV/bin" | while IFS= read -r file; do
      sed -i "s#$ROOT$VENV#$VENV#g" "$file"
    done
  fi
}

# The Python that runs FedFit's own checks: FEDFIT_PYTHON (tests), else the venv's.
fedfit_python() {
  if [ -n "${FEDFIT_PYTHON:-}" ]; then printf '%s\n' "$FEDFIT_PYTHON"
  elif [ -x "$ROOT$VENV/bin/python" ]; then printf '%s\n' "$ROOT$VENV/bin/python"
  fi
}

# ------------------------------------------------------------------------------------------------- files
# put_file SOURCE TARGET MODE: TARGET (a path on the target) gets SOURCE's bytes with MODE, owned by root.
put_file() {
  local target=$ROOT$2 tmp
  mkdir -p -- "$(dirname -- "$target")"
  tmp=$(mktemp "$(dirname -- "$target")/.fedfit-install.XXXXXX")
  cat -- "$1" >"$tmp" || { rm -f -- "$tmp"; die "cannot read $1"; }
  chmod "$3" "$tmp"
  [ "$(id -u)" -ne 0 ] || chown root:root "$tmp"
  mv -f -- "$tmp" "$target"
}

# write_config FILE TARGET: put FILE at TARGET (0644: the daemons run as systemd's dynamic users and hold no secret
# here), keeping a different earlier one as TARGET.old.
write_config() {
  if [ -f "$ROOT$2" ] && ! cmp -s -- "$1" "$ROOT$2"; then
    cp -p -- "$ROOT$2" "$ROOT$2.old"
    say "kept the previous $2 as $2.old"
  fi
  put_file "$1" "$2" 0644
}

# validate_config FILE MODULE CLASS WHAT [EXTRA_PYTHON]: load FILE as the daemon does (common.config) and validate
# it; EXTRA_PYTHON runs with `config` bound (further checks raising ValueError).
validate_config() {
  local py errors
  py=$(fedfit_python)
  if [ -z "$py" ]; then
    say "note: $4 not validated (no FedFit Python: --skip-pip without FEDFIT_PYTHON)"
    return 0
  fi
  errors=$(mktemp)
  (cd / && "$py" - "$1" "$2" "$3" "${5:-}" <<'PY'
import importlib
import sys

from common.config import ConfigError, from_mapping, load_yaml

path, module, name, extra = sys.argv[1:5]
try:
    config = from_mapping(getattr(importlib.import_module(module), name), load_yaml(path), where="")
    config.validate()
    if extra:
        exec(extra, {"config": config})
except (ConfigError, ValueError) as exc:
    print(exc, file=sys.stderr)
    sys.exit(1)
PY
  ) 2>"$errors" || {
    local why
    why=$(tr '\n' ' ' <"$errors" | sed 's/ *$//')
    rm -f "$errors"
    die "the written $4 is not valid: $why"
  }
  rm -f "$errors"
}

# ------------------------------------------------------------------------------------------------- units
# install_unit NAME: systemd/NAME to /etc/systemd/system/NAME (its ExecStart moved to --prefix).
install_unit() {
  local tmp
  tmp=$(mktemp)
  sed "s#/opt/fedfit/.venv/#$VENV/#g" "$SRC/systemd/$1" >"$tmp"
  put_file "$tmp" "$UNIT_DIR/$1" 0644
  rm -f "$tmp"
}

# enable_unit NAME: what `systemctl enable` does for a unit's WantedBy=/RequiredBy= (used where systemd is not
# running: a chroot, an image, --root).
enable_unit() {
  local line target kind dir
  while IFS= read -r line; do
    kind=${line%%=*}
    for target in ${line#*=}; do
      [ "$kind" = WantedBy ] && dir=$ROOT$UNIT_DIR/$target.wants || dir=$ROOT$UNIT_DIR/$target.requires
      mkdir -p -- "$dir"
      ln -sfn -- "$UNIT_DIR/$1" "$dir/$1"
    done
  done < <(grep -E '^(WantedBy|RequiredBy)=' "$ROOT$UNIT_DIR/$1" || true)
}

check_systemd_version() {
  local version
  version=$(systemctl --version 2>/dev/null | sed -n '1s/^systemd \([0-9]*\).*/\1/p')
  [ -z "$version" ] || [ "$version" -ge 247 ] ||
    die "systemd $version is too old for the units' LoadCredential= (needs 247: Debian 11, Ubuntu 22.04, JetPack 6 or later)"
}

# start_unit NAME: enable it, and (unless --no-start) restart it so that an upgrade takes effect.
start_unit() {
  if systemd_running; then
    systemctl daemon-reload
    systemctl enable "$1" >/dev/null 2>&1 || die "systemctl enable $1 failed"
    if [ "$NO_START" = 1 ]; then
      say "$1 is enabled (not started: --no-start); start it with: systemctl start $1"
    elif systemctl restart "$1"; then
      say "$1 is running: journalctl -u $1 -f"
    else
      die "$1 did not start: see systemctl status $1 and journalctl -u $1 -n 50"
    fi
  else
    enable_unit "$1"
    if [ -n "$ROOT" ]; then
      say "$1 is enabled in $ROOT (systemctl not called: --root); it starts when that system boots"
    else
      say "$1 is enabled; systemd is not running here, so nothing was started: on the booted system run systemctl daemon-reload && systemctl start $1"
    fi
  fi
}

apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  say "installing $* with apt-get"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null 2>&1 && return 0
  apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# The training heap's page pool (edge_agent.page_pool) is compiled on the device; without a C compiler the
# agent falls back to the compact heap (the same peaks, slower steps).
want_compiler() {
  [ -z "$ROOT" ] || return 0
  command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 && return 0
  apt_install gcc libc6-dev || warn "no C compiler and apt-get could not install gcc: the agent trains with the compact heap (slower steps)"
}

want_fashion_mnist() {
  [ "$1" = fashion-mnist ] && [ -z "$ROOT" ] && [ ! -d /usr/share/datasets/fashion-mnist ] || return 0
  apt_install dataset-fashion-mnist || warn "apt-get could not install dataset-fashion-mnist: the fashion-mnist dataset is missing here"
}
