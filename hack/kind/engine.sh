#!/usr/bin/env bash
# The container engine kind runs on: Debian's docker.io, installed when absent, dockerd started
# when it is not running, and a `docker` wrapper put first on PATH (in the tools cache's bin
# directory) that spells `--privileged` out without CAP_SYS_RESOURCE, which machines like this VM
# lack (Docker 20.10 turns `--privileged` into every capability it knows, and the container then
# fails with "unable to apply caps").
#
#   hack/kind/engine.sh             install/start what is missing; print the bin dir to put first on PATH
#   hack/kind/engine.sh stop        stop dockerd again if (and only if) this script started it
#   hack/kind/engine.sh status      say what runs and who started it
#   hack/kind/engine.sh --print-bin print the bin dir holding the wrapper
#
# Logs: dockerd's output goes to $AETHER_KIND_LOG_DIR (default /tmp)/aether-dockerd.log.
set -euo pipefail

tools_dir=${AETHER_TOOLS_DIR:-$HOME/.cache/aether-federation/tools}
bin_dir=$tools_dir/bin
log_dir=${AETHER_KIND_LOG_DIR:-/tmp}
# Who started dockerd is recorded where a reboot forgets it.
state_dir=${AETHER_KIND_STATE_DIR:-/run/aether-federation}
started_file=$state_dir/dockerd.started-by-engine-sh

die() { echo "engine: $*" >&2; exit 1; }
say() { echo "engine: $*" >&2; }

real_docker=/usr/bin/docker   # Debian's CLI; a docker found elsewhere on PATH is not relied on
dockerd_bin=/usr/sbin/dockerd

docker_up() { "$real_docker" info >/dev/null 2>&1; }

cmd=${1:-start}
case $cmd in
--print-bin) echo "$bin_dir"; exit 0 ;;
status)
  if docker_up; then say "dockerd answers ($("$real_docker" version -f '{{.Server.Version}}' 2>/dev/null))"; else say "dockerd does not answer"; fi
  if [[ -f $started_file ]]; then say "started by this script: $(cat "$started_file")"; else say "not started by this script"; fi
  exit 0 ;;
stop)
  if [[ ! -f $started_file ]]; then say "dockerd was not started by this script: leaving it alone"; exit 0; fi
  read -r how pid <"$started_file"
  case $how in
  systemd) systemctl stop docker.socket docker.service containerd.service 2>/dev/null || true ;;
  pid)
    if kill -0 "$pid" 2>/dev/null && [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$dockerd_bin"* ]]; then
      kill -TERM "$pid"
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && die "dockerd (pid $pid) did not stop within 30 s"
    fi ;;
  esac
  rm -f "$started_file"
  say "dockerd stopped"
  exit 0 ;;
start) ;;
*) die "unknown command '$cmd' (start, stop, status, --print-bin)" ;;
esac

# 1. The packages.
if [[ ! -x $dockerd_bin || ! -x $real_docker ]]; then
  command -v apt-get >/dev/null || die "missing Docker (dockerd at $dockerd_bin, docker at $real_docker) and no apt-get to install Debian's docker.io: install Docker 20.10+ with your package manager"
  [[ $(id -u) == 0 ]] || die "missing Docker (docker.io): run 'sudo apt-get install docker.io' or re-run as root"
  say "installing Debian's docker.io (apt-get update, apt-get install)"
  start=$SECONDS
  nice -n 19 apt-get update -qq >/dev/null || die "apt-get update failed: Debian's package mirror is needed to install docker.io"
  DEBIAN_FRONTEND=noninteractive nice -n 19 apt-get install -y -qq --no-install-recommends docker.io >/dev/null \
    || die "apt-get install docker.io failed"
  say "docker.io installed in $((SECONDS - start)) s"
fi
[[ -x $dockerd_bin ]] || die "docker.io is installed but $dockerd_bin is missing"

# 2. The daemon.
if docker_up; then
  say "dockerd already answers"
else
  [[ $(id -u) == 0 ]] || die "dockerd is not running and starting it needs root"
  mkdir -p "$state_dir"
  if [[ -d /run/systemd/system ]] && systemctl cat docker.service >/dev/null 2>&1; then
    say "starting docker.service"
    systemctl start docker.service || die "systemctl start docker.service failed (journalctl -u docker)"
    echo "systemd 0" >"$started_file"
  else
    say "starting dockerd (log: $log_dir/aether-dockerd.log)"
    # The daemon is a long-lived service: not niced, or the nodes' control planes starve.
    setsid "$dockerd_bin" >>"$log_dir/aether-dockerd.log" 2>&1 </dev/null &
    echo "pid $!" >"$started_file"
  fi
  for _ in $(seq 1 60); do docker_up && break; sleep 0.5; done
  docker_up || { tail -n 30 "$log_dir/aether-dockerd.log" >&2 2>/dev/null || true; die "dockerd did not answer within 30 s (log above: $log_dir/aether-dockerd.log)"; }
  say "dockerd answers ($("$real_docker" version -f '{{.Server.Version}}'))"
fi

# 3. The wrapper. Its cache key is a digest of its own text, so a change to it installs anew.
wrapper_text=$(cat <<'WRAPPER'
#!/usr/bin/env bash
# Installed by hack/kind/engine.sh: Docker's `--privileged` without CAP_SYS_RESOURCE.
# `run`/`create`: every capability but SYS_RESOURCE, no seccomp/AppArmor confinement, /proc and
# /sys paths unmasked, every device allowed by the device cgroup, /dev/kmsg for the kubelet.
# `exec`: the flag is dropped (the exec inherits the container's capabilities).
real=__REAL_DOCKER__
args=() sub=
for a in "$@"; do
  if [[ -z $sub && $a != -* ]]; then sub=$a; fi
  if [[ $a == --privileged || $a == --privileged=true ]]; then
    case $sub in
    run|create)
      args+=(--cap-add ALL --cap-drop SYS_RESOURCE
        --security-opt seccomp=unconfined --security-opt apparmor=unconfined
        --security-opt systempaths=unconfined
        --device-cgroup-rule 'a *:* rwm' --device /dev/kmsg) ;;
    exec) ;;
    *) args+=("$a") ;;
    esac
  else
    args+=("$a")
  fi
done
exec "$real" "${args[@]}"
WRAPPER
)
wrapper_text=${wrapper_text//__REAL_DOCKER__/$real_docker}
wrapper_dir=$tools_dir/docker-wrapper-$(printf '%s' "$wrapper_text" | sha256sum | cut -c1-12)
if [[ ! -x $wrapper_dir/docker ]]; then
  mkdir -p "$wrapper_dir"
  printf '%s\n' "$wrapper_text" >"$wrapper_dir/docker.tmp"
  chmod +x "$wrapper_dir/docker.tmp"
  mv "$wrapper_dir/docker.tmp" "$wrapper_dir/docker"
fi
mkdir -p "$bin_dir"
ln -sfn "$wrapper_dir/docker" "$bin_dir/docker"
echo "$bin_dir"
