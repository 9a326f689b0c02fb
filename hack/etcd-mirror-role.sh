#!/usr/bin/env bash
# Creates, on a peer etcd, the least-privilege user an origin region's mirror needs: read-write on
# /aether/v1/regions/<origin>/ and /aether/v1/federation/<origin>/, nothing else.
#   hack/etcd-mirror-role.sh <origin-region> <peer-endpoint> [etcdctl flags, e.g. --user root:pw]
# The password of the new user comes from MIRROR_PASSWORD (prompted for if unset).
set -euo pipefail
origin=${1:?origin region}; endpoint=${2:?peer endpoint}; shift 2
user="mirror-$origin"
password=${MIRROR_PASSWORD:-}
[[ -n "$password" ]] || read -rsp "password for $user: " password
run() { echo "+ etcdctl $*" >&2; etcdctl --endpoints "$endpoint" "$@"; }
run "$@" role add "$user"
run "$@" role grant-permission "$user" --prefix=true readwrite "/aether/v1/regions/$origin/"
run "$@" role grant-permission "$user" --prefix=true readwrite "/aether/v1/federation/$origin/"
echo "$password" | run "$@" user add "$user" --interactive=false
run "$@" user grant-role "$user" "$user"
echo "Put username=$user and password into the peer's Secret (keys username, password)." >&2
