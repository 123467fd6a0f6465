#!/usr/bin/env bash
# Installs the FedFit coordinator and its secured broker on this machine (Debian-like, systemd), as root, from a
# FedFit checkout or unpacked source tree:
#
#   sudo scripts/install-coordinator.sh --federation lab --broker-host broker.lan,10.0.0.2 \
#        --agents pi-kitchen-01,jetson-01 --algorithm heterofl --model cnn --dataset fashion-mnist --rounds 50
#
# It installs mosquitto and openssl (apt-get) when missing, makes the venv /opt/fedfit/.venv (torch, then FedFit),
# makes the broker with `fedfit broker init /etc/fedfit/broker` (an existing one there is kept), points Debian's
# mosquitto.service at it (a drop-in: mosquitto -c /etc/fedfit/broker/mosquitto.conf), gives each --agents
# device a login (`fedfit broker add-device`; existing logins are kept) and a bundle /etc/fedfit/devices/ID/
# (ca.crt, ID.password) to copy to it, writes /etc/fedfit/coordinator.yaml, puts the CA at /etc/fedfit/ca.crt
# and the coordinator's password at /etc/fedfit/coordinator.password (0600), installs fedfit-coordinator.service,
# enables and (re)starts mosquitto and the coordinator, and prints the install-agent.sh line for each device.
# Re-running it upgrades in place and adds devices.
#
# Options:
#   --federation NAME      the federation (required; an existing broker must be for the same one)
#   --broker-host HOST     a name or address the devices reach the broker at, named in its certificate
#                          (required; repeatable or comma-separated; the first is the one devices are told)
#   --broker-port PORT     the broker's TLS port (default 8883)
#   --agents ID,...        devices to give a login and a bundle (repeatable or comma-separated)
#   --algorithm NAME       default heterofl
#   --model FAMILY         default cnn
#   --dataset NAME         the coordinator's test set: fashion-mnist, digits or auto (default auto)
#   --rounds N             default 10
#   --min-agents N         agents to wait for before a round (default: the number of --agents, else 1)
#   --torch-spec "SPEC"    pip requirement(s) for torch, installed with --pip-args only (default: torch
#                          torchvision, from https://download.pytorch.org/whl/cpu: CPU builds; on aarch64, where
#                          that index cannot be reached, PyPI's torch 2.9.1, which a Raspberry Pi 4 runs)
#   --pip-args "ARGS"      extra pip arguments for every install, e.g. "--no-index --find-links /media/wheels"
#   --prefix DIR           default /opt/fedfit (the venv is DIR/.venv)
#   --python PYTHON        default python3
#   --root DIR             stage into DIR (an image's root): every path is under DIR, neither systemctl nor
#                          apt-get is called (install mosquitto and openssl in the image yourself)
#   --skip-pip             no venv and no pip (a staging image whose venv is made otherwise; tests)
#   --no-start             install and enable, but do not (re)start mosquitto and the coordinator
# shellcheck disable=SC2015  # `test && test || die` is meant: die when either fails
set -euo pipefail

PROG=install-coordinator
SRC=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/install-common.sh
. "$SRC/scripts/install-common.sh"

FEDERATION="" HOSTS=() BROKER_PORT=8883 AGENTS=() ALGORITHM="" MODEL="" DATASET="" ROUNDS="" MIN_AGENTS=""
TORCH_SPEC="" TORCH_WHEELS=() PIP_ARGS=() PREFIX=/opt/fedfit PYTHON=python3 ROOT="" SKIP_PIP=0 NO_START=0

while [ $# -gt 0 ]; do
  opt=$1
  if [[ $opt == --*=* ]]; then set -- "${opt%%=*}" "${opt#*=}" "${@:2}"; opt=$1; fi
  case $opt in
    -h | --help) usage ;;
    --skip-pip) SKIP_PIP=1; shift; continue ;;
    --no-start) NO_START=1; shift; continue ;;
    --federation | --broker-host | --broker-port | --agents | --algorithm | --model | --dataset | --rounds | \
      --min-agents | --torch-spec | --pip-args | --prefix | --python | --root) need_value "$opt" $# "${2-}" ;;
    *) die "unknown option '$opt' (see $0 --help)" ;;
  esac
  value=$2
  case $opt in
    --federation) FEDERATION=$value ;;
    --broker-host) IFS=, read -r -a more <<<"$value"; HOSTS+=("${more[@]}") ;;
    --broker-port) BROKER_PORT=$value ;;
    --agents) IFS=, read -r -a more <<<"$value"; AGENTS+=("${more[@]}") ;;
    --algorithm) ALGORITHM=$value ;;
    --model) MODEL=$value ;;
    --dataset) DATASET=$value ;;
    --rounds) ROUNDS=$value ;;
    --min-agents) MIN_AGENTS=$value ;;
    *) common_option "$opt" "$value" ;;
  esac
  shift 2
done

# ------------------------------------------------------------------- check everything before touching anything
check_source
set_paths
[ -n "$FEDERATION" ] || die "--federation is required"
check_name --federation "$FEDERATION"
[ ${#HOSTS[@]} -gt 0 ] || die "--broker-host is required (the names or addresses devices reach the broker at)"
for host in "${HOSTS[@]}"; do
  [[ $host =~ ^[A-Za-z0-9_.:-]+$ ]] || die "--broker-host must be host names or addresses, got '$host'"
done
check_port --broker-port "$BROKER_PORT"
BROKER_PORT=$((10#$BROKER_PORT))  # decimal, as checked (YAML reads a leading 0 as octal)
declare -A seen=()
for agent in "${AGENTS[@]}"; do
  check_name "--agents" "$agent"
  [ -z "${seen[$agent]:-}" ] || die "--agents names $agent twice"
  seen[$agent]=1
done
# Settings not given keep what an existing coordinator.yaml says (a re-run that adds devices changes nothing
# else), else these defaults; both are filled in once FedFit's Python is there to read the YAML.
[ -z "$ALGORITHM" ] || [[ $ALGORITHM =~ ^[a-z0-9_-]+$ ]] || die "--algorithm must be an algorithm name (e.g. heterofl), got '$ALGORITHM'"
[ -z "$MODEL" ] || [[ $MODEL =~ ^[a-z0-9_-]+$ ]] || die "--model must be a model family (e.g. cnn), got '$MODEL'"
[ -z "$DATASET" ] || [[ $DATASET =~ ^[A-Za-z0-9_.-]+$ ]] || die "--dataset must be a dataset name (fashion-mnist, digits, auto), got '$DATASET'"
[ -z "$ROUNDS" ] || { is_uint "$ROUNDS" && [ "$ROUNDS" -ge 1 ]; } || die "--rounds must be a positive integer, got '$ROUNDS'"
[ -z "$MIN_AGENTS" ] || { is_uint "$MIN_AGENTS" && [ "$MIN_AGENTS" -ge 1 ]; } ||
  die "--min-agents must be a positive integer, got '$MIN_AGENTS'"
[ "$SKIP_PIP" = 1 ] || torch_plan
[ -f "$SRC/systemd/fedfit-coordinator.service" ] || die "$SRC/systemd/fedfit-coordinator.service is missing"
[ "$SKIP_PIP" = 0 ] || [ -n "$(fedfit_python)" ] ||
  die "--skip-pip needs FedFit already in $VENV (or FEDFIT_PYTHON) to make the broker"
check_root
[ "$SKIP_PIP" = 1 ] || check_python
if systemd_running; then check_systemd_version; fi
BROKER_DIR=$ETC/broker
# The coordinator's login is no device's: refused here, before anything is touched (the broker's own name for it
# when there is one, else fedfit broker init's default).
coordinator_login=coordinator
if [ -f "$ROOT$BROKER_DIR/broker.yaml" ]; then
  coordinator_login=$(sed -n 's/^coordinator: *//p' "$ROOT$BROKER_DIR/broker.yaml" | tr -d "'\"")
fi
for agent in "${AGENTS[@]}"; do
  [ "$agent" != "$coordinator_login" ] || die "--agents names $agent, the coordinator's own login: give the device another id"
done

# --------------------------------------------------------------------------------------------- the machine
if [ -n "$ROOT" ]; then
  say "note: not installing mosquitto and openssl (--root): the image needs both"
else
  want=()
  command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || want+=(mosquitto)
  command -v openssl >/dev/null 2>&1 || want+=(openssl)
  if [ ${#want[@]} -gt 0 ]; then
    apt_install "${want[@]}" || die "cannot install ${want[*]} with apt-get: install them, then run this again"
  fi
  want_fashion_mnist "$DATASET"
fi
command -v openssl >/dev/null 2>&1 || die "the openssl command is missing (apt-get install openssl): it makes the broker's certificates"

# ------------------------------------------------------------------------------------------------ packages
if [ "$SKIP_PIP" = 1 ]; then
  say "not installing packages (--skip-pip): $VENV must hold FedFit when the coordinator starts"
else
  make_venv
  install_packages
fi
FPY=$(fedfit_python)
fedfit() { (cd / && "$FPY" -m fedfit.cli "$@"); }

# ----------------------------------------------------------------------------------- settings of a re-run
if [ -f "$ROOT$ETC/coordinator.yaml" ]; then
  kept=$(cd / && "$FPY" - "$ROOT$ETC/coordinator.yaml" <<'PY'
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1], encoding="utf-8")) or {}
print(config.get("algorithm", ""), (config.get("model") or {}).get("family", ""),
      (config.get("data") or {}).get("dataset", ""), config.get("rounds", ""), config.get("min_agents", ""))
PY
  ) || die "cannot read $ETC/coordinator.yaml: fix or move it away, then run this again"
  read -r k_algorithm k_model k_dataset k_rounds k_min <<<"$kept"
  ALGORITHM=${ALGORITHM:-$k_algorithm} MODEL=${MODEL:-$k_model} DATASET=${DATASET:-$k_dataset}
  ROUNDS=${ROUNDS:-$k_rounds} MIN_AGENTS=${MIN_AGENTS:-$k_min}
  say "keeping the settings of $ETC/coordinator.yaml that no flag changes"
fi
ALGORITHM=${ALGORITHM:-heterofl} MODEL=${MODEL:-cnn} DATASET=${DATASET:-auto} ROUNDS=${ROUNDS:-10}
MIN_AGENTS=${MIN_AGENTS:-$((${#AGENTS[@]} > 0 ? ${#AGENTS[@]} : 1))}
ROUNDS=$((10#$ROUNDS)) MIN_AGENTS=$((10#$MIN_AGENTS))  # decimal, as checked (YAML reads a leading 0 as octal)
if [ "$DATASET" = auto ] && [ -z "$ROOT" ]; then
  # Resolved once, here: the devices' shards must be of the coordinator's dataset, whatever each machine has.
  DATASET=$(cd / && "$FPY" -c 'from common.data.datasets import find_fashion_mnist
print("fashion-mnist" if find_fashion_mnist() is not None else "digits")') || die "cannot tell which dataset 'auto' is here"
  say "dataset auto is $DATASET on this machine: written as such"
fi

# -------------------------------------------------------------------------------------------------- broker
mkdir -p -- "$ROOT$ETC"
chmod 0755 "$ROOT$ETC"
if [ -f "$ROOT$BROKER_DIR/broker.yaml" ]; then
  say "keeping the broker in $BROKER_DIR"
else
  init_hosts=("${HOSTS[@]}")
  # the coordinator's own way in (an address: a minimal system may not resolve localhost)
  [[ " ${HOSTS[*]} " == *" 127.0.0.1 "* ]] || init_hosts+=(127.0.0.1)
  host_args=()
  for host in "${init_hosts[@]}"; do host_args+=(--host "$host"); done
  say "making the broker: fedfit broker init $BROKER_DIR --federation $FEDERATION ${host_args[*]} --port $BROKER_PORT"
  fedfit broker init "$ROOT$BROKER_DIR" --federation "$FEDERATION" "${host_args[@]}" --port "$BROKER_PORT" >/dev/null ||
    die "fedfit broker init could not make $BROKER_DIR (its message is above)"
  if [ -n "$ROOT" ]; then  # its paths name the staging root: make them the target's
    sed -i "s#$ROOT$BROKER_DIR#$BROKER_DIR#g" "$ROOT$BROKER_DIR/mosquitto.conf"
  fi
fi
# What the broker directory holds (an existing one may differ from the flags); the files the broker reads go to
# mosquitto's group (it may have been installed after the directory was made).
info=$(cd / && "$FPY" - "$ROOT$BROKER_DIR" "${ROOT:-}" <<'PY'
import sys
from pathlib import Path

from fedfit.secure_broker import BrokerDirectory

directory = BrokerDirectory.open(Path(sys.argv[1]))
if not sys.argv[2]:
    directory.share_with_broker()
s = directory.settings
print(s.federation, s.port, s.coordinator, *s.hosts)
PY
) || die "cannot read the broker in $BROKER_DIR"
read -r -a broker <<<"$info"
[ "${broker[0]}" = "$FEDERATION" ] ||
  die "$BROKER_DIR holds the broker of federation ${broker[0]}, not $FEDERATION: use --federation ${broker[0]}, or move that directory away to make a new broker"
BROKER_PORT=${broker[1]} COORDINATOR=${broker[2]} CERT_HOSTS=("${broker[@]:3}")
for host in "${HOSTS[@]}"; do
  [[ " ${CERT_HOSTS[*]} " == *" $host "* ]] ||
    warn "the broker's certificate does not name $host (it names ${CERT_HOSTS[*]}): devices must use one of those"
done
COORD_HOST=${CERT_HOSTS[0]}
for host in localhost 127.0.0.1; do
  [[ " ${CERT_HOSTS[*]} " != *" $host "* ]] || COORD_HOST=$host
done
DEVICE_HOST=${HOSTS[0]}
[[ " ${CERT_HOSTS[*]} " == *" $DEVICE_HOST "* ]] || DEVICE_HOST=${CERT_HOSTS[0]}

put_file "$ROOT$BROKER_DIR/ca.crt" "$ETC/ca.crt" 0644
put_file "$ROOT$BROKER_DIR/clients/$COORDINATOR.password" "$ETC/coordinator.password" 0600
say "CA certificate: $ETC/ca.crt; the coordinator's broker password: $ETC/coordinator.password (0600, root)"

logins=" $(fedfit broker list "$ROOT$BROKER_DIR" | cut -d' ' -f1 | tr '\n' ' ') "
earlier_devices=0
for login in $logins; do
  [ "$login" = "$COORDINATOR" ] || [[ " ${AGENTS[*]} " == *" $login "* ]] || earlier_devices=$((earlier_devices + 1))
done
for agent in "${AGENTS[@]}"; do
  [ "$agent" != "$COORDINATOR" ] || die "--agents names $agent, the coordinator's own login: give the device another id"
done
for agent in "${AGENTS[@]}"; do
  if [[ $logins == *" $agent "* ]]; then
    say "device $agent: keeping its login"
  else
    fedfit broker add-device "$ROOT$BROKER_DIR" "$agent" >/dev/null || die "fedfit broker add-device could not add $agent (its message is above)"
    say "device $agent: new login"
  fi
  mkdir -p -- "$ROOT$ETC/devices/$agent"
  chmod 0700 "$ROOT$ETC/devices" "$ROOT$ETC/devices/$agent"
  put_file "$ROOT$BROKER_DIR/ca.crt" "$ETC/devices/$agent/ca.crt" 0644
  put_file "$ROOT$BROKER_DIR/clients/$agent.password" "$ETC/devices/$agent/$agent.password" 0600
  rm -rf -- "$ROOT$BROKER_DIR/devices/$agent"  # add-device's own bundle: this one replaces it
done

# mosquitto.service (Debian's) runs the FedFit broker's configuration; it starts as root and mosquitto drops to
# its own user, whose group `fedfit broker init` gave the files it reads.
MOSQUITTO=/usr/sbin/mosquitto
if [ -z "$ROOT" ] && [ ! -x $MOSQUITTO ]; then MOSQUITTO=$(command -v mosquitto); fi
dropin=$(mktemp)
trap 'rm -f "$dropin" "${config:-}"' EXIT
cat >"$dropin" <<EOF
# Written by scripts/install-coordinator.sh: mosquitto.service runs the FedFit broker made by fedfit broker init.
[Service]
ExecStart=
ExecStart=$MOSQUITTO -c $BROKER_DIR/mosquitto.conf
EOF
dropin_changed=1
! cmp -s "$dropin" "$ROOT$UNIT_DIR/mosquitto.service.d/fedfit.conf" || dropin_changed=0
put_file "$dropin" "$UNIT_DIR/mosquitto.service.d/fedfit.conf" 0644
say "mosquitto.service runs $BROKER_DIR/mosquitto.conf: $UNIT_DIR/mosquitto.service.d/fedfit.conf"

# ------------------------------------------------------------------------------------------------- config
config=$(mktemp)
cat >"$config" <<EOF
# Written by scripts/install-coordinator.sh: re-run it to change this file (a changed file is kept as
# coordinator.yaml.old); every key: examples/coordinator.yaml.
federation: $(yq "$FEDERATION")
broker:
  host: $(yq "$COORD_HOST")
  port: $BROKER_PORT
  tls: true
  ca_file: $ETC/ca.crt
  username: $(yq "$COORDINATOR")
  password_file: /run/credentials/fedfit-coordinator.service/broker-password   # systemd's copy of $ETC/coordinator.password
algorithm: $(yq "$ALGORITHM")
model:
  family: $(yq "$MODEL")
data:
  dataset: $(yq "$DATASET")
rounds: $ROUNDS
min_agents: $MIN_AGENTS
state_dir: /var/lib/fedfit-coordinator   # systemd's StateDirectory: checkpoints, metrics
resume: true
EOF
validate_config "$config" coordinator.config CoordinatorConfig coordinator.yaml "
from common.data import DATASET_NAMES
from coordinator.strategies import check_algorithm
check_algorithm(config.algorithm)
if config.data.dataset.lower() not in (*DATASET_NAMES, 'auto'):
    raise ValueError(f'--dataset must be one of {\", \".join((*DATASET_NAMES, \"auto\"))}, got {config.data.dataset!r}')
"
write_config "$config" "$ETC/coordinator.yaml"
say "configuration: $ETC/coordinator.yaml"

# ---------------------------------------------------------------------------------------------------- units
install_unit fedfit-coordinator.service
grep -Eq "^LoadCredential=[^:]*:$ETC/coordinator.password\$" "$ROOT$UNIT_DIR/fedfit-coordinator.service" ||
  warn "fedfit-coordinator.service does not load $ETC/coordinator.password (LoadCredential=): the coordinator will not find its password"
if systemd_running; then
  systemctl daemon-reload
  systemctl enable mosquitto.service >/dev/null 2>&1 || die "systemctl enable mosquitto failed"
  if [ "$NO_START" = 1 ]; then
    say "mosquitto.service is enabled (not restarted: --no-start): systemctl restart mosquitto"
  else
    if [ "$dropin_changed" = 1 ] || ! systemctl is-active --quiet mosquitto.service; then
      systemctl restart mosquitto.service || die "mosquitto did not start: see journalctl -u mosquitto -n 50"
    else
      systemctl reload mosquitto.service || die "mosquitto did not reload: see journalctl -u mosquitto -n 50"
    fi
    say "mosquitto.service is running the FedFit broker on port $BROKER_PORT"
  fi
elif [ -z "$ROOT" ]; then
  say "systemd is not running here: start the broker by hand with $MOSQUITTO -c $BROKER_DIR/mosquitto.conf -d"
fi
start_unit fedfit-coordinator.service

# ------------------------------------------------------------------------------------------------ devices
if [ ${#AGENTS[@]} -gt 0 ]; then
  say "for each device: copy its bundle (only to it), e.g. scp -r root@THIS-HOST:$ETC/devices/ID fedfit-ID, then"
  say "run from a FedFit checkout there (replace --data-dataset ... by --data-path FILE_OR_DIR for its own data):"
  if [ "$earlier_devices" -gt 0 ]; then
    # Shards of a dataset divide the fleet the first install named: new devices would overlap them.
    say "the broker has $earlier_devices device(s) from an earlier install: give the new ones their own data"
    data_args() { echo "--data-path FILE_OR_DIR"; }
  else
    data_args() { echo "--data-dataset $DATASET --shard $1 --num-shards ${#AGENTS[@]}"; }
  fi
  index=0
  for agent in "${AGENTS[@]}"; do
    echo "  sudo scripts/install-agent.sh --agent-id $agent --federation $FEDERATION --broker-host $DEVICE_HOST" \
         "--broker-port $BROKER_PORT --ca fedfit-$agent/ca.crt --password-file fedfit-$agent/$agent.password" \
         "$(data_args "$index")"
    index=$((index + 1))
  done
fi
say "done: coordinator of federation $FEDERATION, broker $DEVICE_HOST:$BROKER_PORT"
