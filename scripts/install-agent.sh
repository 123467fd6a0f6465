#!/usr/bin/env bash
# Installs a FedFit edge agent on this device (Raspberry Pi 4/5 with a 64-bit OS, Jetson with JetPack 6, any
# Debian-like Linux), as root, from a FedFit checkout or unpacked source tree:
#
#   sudo scripts/install-agent.sh --agent-id pi-kitchen-01 --federation lab --broker-host broker.lan \
#        --ca bundle/ca.crt --password-file bundle/pi-kitchen-01.password --data-path /srv/fedfit/data.npz
#
# (scripts/install-coordinator.sh --agents ... prints this line for each device, and makes the bundle.)
# It makes the venv /opt/fedfit/.venv (torch, then FedFit), writes /etc/fedfit/agent.yaml, puts the CA at
# /etc/fedfit/ca.crt and the broker password at /etc/fedfit/agent.password (0600), installs
# fedfit-agent.service (and, with --jetson, its Jetson drop-in), enables it and (re)starts it. Re-running it
# upgrades in place; the password is kept unless a new one is given.
#
# Options:
#   --agent-id ID          this device's agent id = its broker username (required)
#   --federation NAME      the federation (required)
#   --broker-host HOST     the broker's host name or address, as named in its certificate (required)
#   --broker-port PORT     default 8883
#   --ca FILE              the fleet's CA certificate (ca.crt; required on the first install)
#   --password-file FILE   this device's password file from `fedfit broker add-device` (required on the first
#                          install; later the installed one is kept unless this is given)
#   --data-path PATH       the device's data: an .npz with x and y, or a folder of 0/ 1/ ... image folders
#   --data-dataset NAME    or a shard of a known dataset (demos): with --shard I --num-shards N
#                          [--partition iid|dirichlet:A|shards:K] [--seed S]
#   --budget BYTES         memory training may use at most (default: what the device has)
#   --device cpu|cuda|auto default cpu (cuda with --jetson)
#   --jetson               install the Jetson drop-in (GPU groups); needs --torch-wheel (or --torch-spec)
#   --torch-wheel PATH_OR_URL   a torch wheel to install (NVIDIA's JetPack wheel); repeatable (torchvision's)
#   --torch-spec "SPEC"    pip requirement(s) for torch, installed with --pip-args only (default: torch
#                          torchvision, from https://download.pytorch.org/whl/cpu: CPU builds; on aarch64, where
#                          that index cannot be reached, PyPI's torch 2.9.1, which a Raspberry Pi 4 runs)
#   --pip-args "ARGS"      extra pip arguments for every install, e.g. "--no-index --find-links /media/wheels"
#   --prefix DIR           default /opt/fedfit (the venv is DIR/.venv)
#   --python PYTHON        default python3 (FedFit needs the version pyproject.toml's requires-python names)
#   --root DIR             stage into DIR (an image's root): every path is under DIR, systemctl is not called
#   --skip-pip             no venv and no pip (a staging image whose venv is made otherwise; tests)
#   --no-start             install and enable, but do not (re)start the agent
# shellcheck disable=SC2015  # `test && test || die` is meant: die when either fails
set -euo pipefail

PROG=install-agent
SRC=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/install-common.sh
. "$SRC/scripts/install-common.sh"

AGENT_ID="" FEDERATION="" BROKER_HOST="" BROKER_PORT=8883 CA="" PASSWORD_FILE=""
DATA_PATH="" DATASET="" SHARD="" NUM_SHARDS="" PARTITION="" SEED="" BUDGET="" DEVICE="" JETSON=0
TORCH_SPEC="" TORCH_WHEELS=() PIP_ARGS=() PREFIX=/opt/fedfit PYTHON=python3 ROOT="" SKIP_PIP=0 NO_START=0

while [ $# -gt 0 ]; do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    -h | --help) usage ;;
    --jetson) JETSON=1; shift; continue ;;
    --skip-pip) SKIP_PIP=1; shift; continue ;;
    --no-start) NO_START=1; shift; continue ;;
    --agent-id | --federation | --broker-host | --broker-port | --ca | --password-file | --data-path | \
      --data-dataset | --shard | --num-shards | --partition | --seed | --budget | --device | --torch-wheel | \
      --torch-spec | --pip-args | --prefix | --python | --root) need_value "$opt" $# "${2-}" ;;
    *) die "unknown option '$opt' (see $0 --help)" ;;
  esac
  value=$2
  case $opt in
    --agent-id) AGENT_ID=$value ;;
    --federation) FEDERATION=$value ;;
    --broker-host) BROKER_HOST=$value ;;
    --broker-port) BROKER_PORT=$value ;;
    --ca) CA=$value ;;
    --password-file) PASSWORD_FILE=$value ;;
    --data-path) DATA_PATH=$value ;;
    --data-dataset) DATASET=$value ;;
    --shard) SHARD=$value ;;
    --num-shards) NUM_SHARDS=$value ;;
    --partition) PARTITION=$value ;;
    --seed) SEED=$value ;;
    --budget) BUDGET=$value ;;
    --device) DEVICE=$value ;;
    --torch-wheel) TORCH_WHEELS+=("$value") ;;
    *) common_option "$opt" "$value" ;;
  esac
  shift 2
done

# ------------------------------------------------------------------- check everything before touching anything
check_source
set_paths
[ -n "$AGENT_ID" ] || die "--agent-id is required (this device's agent id, its broker username)"
check_name --agent-id "$AGENT_ID"
[ -n "$FEDERATION" ] || die "--federation is required (the coordinator's federation)"
check_name --federation "$FEDERATION"
[ -n "$BROKER_HOST" ] || die "--broker-host is required (the broker's name or address, as in its certificate)"
[[ $BROKER_HOST =~ ^[A-Za-z0-9_.:-]+$ ]] || die "--broker-host must be one host name or address, got '$BROKER_HOST'"
check_port --broker-port "$BROKER_PORT"
BROKER_PORT=$((10#$BROKER_PORT))  # decimal, as checked (YAML reads a leading 0 as octal)
if [ -n "$DATA_PATH" ] && [ -n "$DATASET" ]; then die "give either --data-path or --data-dataset, not both"; fi
if [ -n "$DATA_PATH" ]; then
  for flag in shard:"$SHARD" num-shards:"$NUM_SHARDS" partition:"$PARTITION" seed:"$SEED"; do
    [ -z "${flag#*:}" ] || die "--${flag%%:*} is for --data-dataset, not --data-path"
  done
  case $DATA_PATH in /*) ;; *) DATA_PATH=$(realpath -m -- "$DATA_PATH") ;; esac
  [ -e "$ROOT$DATA_PATH" ] || die "--data-path $DATA_PATH does not exist${ROOT:+ under $ROOT}"
  [ -r "$ROOT$DATA_PATH" ] || die "--data-path $DATA_PATH is not readable"
elif [ -n "$DATASET" ]; then
  [[ $DATASET =~ ^[A-Za-z0-9_.-]+$ ]] || die "--data-dataset must be a dataset name (fashion-mnist, digits, auto), got '$DATASET'"
  [ -n "$SHARD" ] && [ -n "$NUM_SHARDS" ] || die "--data-dataset needs --shard I and --num-shards N (this device's shard)"
  is_uint "$NUM_SHARDS" && [ "$NUM_SHARDS" -ge 1 ] || die "--num-shards must be a positive integer, got '$NUM_SHARDS'"
  is_uint "$SHARD" || die "--shard must be an integer in 0..$((NUM_SHARDS - 1)), got '$SHARD'"
  [ "$SHARD" -lt "$NUM_SHARDS" ] || die "--shard must be in 0..$((NUM_SHARDS - 1)) (--num-shards $NUM_SHARDS), got $SHARD"
  [ -z "$SEED" ] || is_uint "$SEED" || die "--seed must be a non-negative integer, got '$SEED'"
  [[ ${PARTITION:-iid} =~ ^(iid|dirichlet:[0-9.eE+-]+|shards:[0-9]+)$ ]] || die "--partition must be iid, dirichlet:ALPHA or shards:K, got '$PARTITION'"
  # Decimal, as bash compared them (YAML would read a leading 0 as octal).
  SHARD=$((10#$SHARD)) NUM_SHARDS=$((10#$NUM_SHARDS))
  [ -z "$SEED" ] || SEED=$((10#$SEED))
else
  die "give the device's data: --data-path FILE_OR_DIR, or --data-dataset NAME --shard I --num-shards N"
fi
if [ -n "$BUDGET" ]; then
  is_uint "$BUDGET" && [ "$BUDGET" -gt 0 ] || die "--budget must be a positive number of bytes, got '$BUDGET'"
  BUDGET=$((10#$BUDGET))
fi
if [ -z "$DEVICE" ]; then [ "$JETSON" = 1 ] && DEVICE=cuda || DEVICE=cpu; fi
case $DEVICE in cpu | cuda | auto) ;; *) die "--device must be cpu, cuda or auto, got '$DEVICE'" ;; esac
if [ -n "$CA" ]; then
  [ -f "$CA" ] || die "--ca $CA does not exist"
  grep -q -- '-----BEGIN CERTIFICATE-----' "$CA" 2>/dev/null || die "--ca $CA is not a PEM certificate (the broker directory's ca.crt)"
fi
if [ -n "$PASSWORD_FILE" ]; then
  [ -f "$PASSWORD_FILE" ] && [ -r "$PASSWORD_FILE" ] || die "--password-file $PASSWORD_FILE does not exist or is not readable"
  [ -n "$(head -n 1 -- "$PASSWORD_FILE" | tr -d '\r\n')" ] || die "--password-file $PASSWORD_FILE has no password on its first line"
fi
for wheel in "${TORCH_WHEELS[@]}"; do
  case $wheel in http://* | https://*) ;; *) [ -f "$wheel" ] || die "--torch-wheel $wheel does not exist" ;; esac
done
[ "$SKIP_PIP" = 1 ] || torch_plan
[ -n "$CA" ] || [ -f "$ROOT$ETC/ca.crt" ] || die "--ca is required on the first install (the broker's ca.crt)"
[ -n "$PASSWORD_FILE" ] || [ -f "$ROOT$ETC/agent.password" ] ||
  die "--password-file is required on the first install (the device's file from fedfit broker add-device)"
[ -f "$SRC/systemd/fedfit-agent.service" ] || die "$SRC/systemd/fedfit-agent.service is missing"
JETSON_DROPIN=systemd/fedfit-agent.service.d/jetson.conf
[ "$JETSON" = 0 ] || [ -f "$SRC/$JETSON_DROPIN" ] || die "--jetson: $SRC/$JETSON_DROPIN is missing from this source tree"
check_root
[ "$SKIP_PIP" = 1 ] || check_python
if systemd_running; then check_systemd_version; fi

# --------------------------------------------------------------------------------------------- the machine
if [ -z "$ROOT" ]; then
  model=$( { tr -d '\0' </proc/device-tree/model; } 2>/dev/null || true)
  if [ -f /sys/fs/cgroup/cgroup.controllers ] && ! grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
    case $model in
      *"Raspberry Pi"*) warn "the memory cgroup is off, so the unit's MemoryMax= is not enforced: add cgroup_enable=memory to /boot/firmware/cmdline.txt (older systems: /boot/cmdline.txt) and reboot" ;;
      *) warn "the memory cgroup is off, so the unit's MemoryMax= is not enforced: enable it (cgroup_enable=memory on the kernel command line)" ;;
    esac
  fi
  if [ "$JETSON" = 0 ] && [ -f /etc/nv_tegra_release ]; then
    warn "this looks like a Jetson: pass --jetson (and --torch-wheel) for its GPU"
  fi
  case $DATA_PATH in
    /home/* | /root/* | /tmp/* | /var/tmp/* | /run/user/*)
      warn "the agent cannot read --data-path $DATA_PATH under systemd (ProtectHome=, PrivateTmp=): move it, e.g. to /srv/fedfit/" ;;
  esac
fi
if [ -n "$DATA_PATH" ] && [ "$(find "$ROOT$DATA_PATH" -maxdepth 0 -perm -o=r 2>/dev/null)" = "" ]; then
  warn "--data-path $DATA_PATH is not readable by others, and the agent runs as a dynamic user: chmod -R o+rX it"
fi
[ "$SKIP_PIP" = 1 ] || want_compiler
[ -z "$DATASET" ] || want_fashion_mnist "$DATASET"

# ------------------------------------------------------------------------------------------------ packages
if [ "$SKIP_PIP" = 1 ]; then
  say "not installing packages (--skip-pip): $VENV must hold FedFit when the agent starts"
else
  make_venv
  install_packages
fi

# ----------------------------------------------------------------------------------------- secrets and config
mkdir -p -- "$ROOT$ETC"
chmod 0755 "$ROOT$ETC"
if [ -n "$CA" ]; then
  put_file "$CA" "$ETC/ca.crt" 0644
  say "CA certificate: $ETC/ca.crt"
else
  say "keeping the CA certificate $ETC/ca.crt"
fi
if [ -n "$PASSWORD_FILE" ]; then
  put_file "$PASSWORD_FILE" "$ETC/agent.password" 0600
  say "broker password: $ETC/agent.password (0600, root; the unit hands it to the agent)"
else
  chmod 0600 "$ROOT$ETC/agent.password"
  say "keeping the broker password in $ETC/agent.password"
fi

config=$(mktemp)
trap 'rm -f "$config"' EXIT
{
  echo "# Written by scripts/install-agent.sh: re-run it to change this file (a changed file is kept as"
  echo "# agent.yaml.old); every key: examples/agent.yaml."
  echo "agent_id: $(yq "$AGENT_ID")"
  echo "federation: $(yq "$FEDERATION")"
  echo "broker:"
  echo "  host: $(yq "$BROKER_HOST")"
  echo "  port: $BROKER_PORT"
  echo "  tls: true"
  echo "  ca_file: $ETC/ca.crt"
  echo "  username: $(yq "$AGENT_ID")"
  echo "  password_file: /run/credentials/fedfit-agent.service/broker-password   # systemd's copy of $ETC/agent.password"
  echo "data:"
  if [ -n "$DATA_PATH" ]; then
    echo "  path: $(yq "$DATA_PATH")"
  else
    echo "  dataset: $(yq "$DATASET")"
    echo "  partition: $(yq "${PARTITION:-iid}")"
    echo "  num_shards: $NUM_SHARDS"
    echo "  shard: $SHARD"
    echo "  seed: ${SEED:-0}"
  fi
  echo "device: $DEVICE"
  [ -z "$BUDGET" ] || echo "budget_bytes: $BUDGET"
  echo "state_dir: null                 # systemd's StateDirectory (/var/lib/fedfit-agent)"
} >"$config"
validate_config "$config" edge_agent.config AgentConfig agent.yaml "
from common.data import DATASET_NAMES, parse_partition
if config.data.dataset is not None:
    if config.data.dataset.lower() not in (*DATASET_NAMES, 'auto'):
        raise ValueError(f'--data-dataset must be one of {\", \".join((*DATASET_NAMES, \"auto\"))}, got {config.data.dataset!r}')
    parse_partition(config.data.partition)
"
write_config "$config" "$ETC/agent.yaml"
say "configuration: $ETC/agent.yaml"

# ---------------------------------------------------------------------------------------------------- units
install_unit fedfit-agent.service
grep -Eq "^LoadCredential=[^:]*:$ETC/agent.password\$" "$ROOT$UNIT_DIR/fedfit-agent.service" ||
  warn "fedfit-agent.service does not load $ETC/agent.password (LoadCredential=): the agent will not find its password"
if [ "$JETSON" = 1 ]; then
  put_file "$SRC/$JETSON_DROPIN" "$UNIT_DIR/fedfit-agent.service.d/jetson.conf" 0644
  say "Jetson drop-in: $UNIT_DIR/fedfit-agent.service.d/jetson.conf"
elif [ -f "$ROOT$UNIT_DIR/fedfit-agent.service.d/jetson.conf" ]; then
  rm -f -- "$ROOT$UNIT_DIR/fedfit-agent.service.d/jetson.conf"
  rmdir -- "$ROOT$UNIT_DIR/fedfit-agent.service.d" 2>/dev/null || true
  say "removed the Jetson drop-in (no --jetson)"
fi
start_unit fedfit-agent.service
say "done: agent $AGENT_ID of federation $FEDERATION, broker $BROKER_HOST:$BROKER_PORT"
