#!/usr/bin/env bash
# Installs Ferry's systemd units on this node (run as root from a Ferry checkout or release):
#   deploy/systemd/install.sh [BIN_DIR]
# BIN_DIR holds ferry-router, ferry-prefill and ferry-decode (default: target/release). It
# creates the `ferry` user, installs the binaries in /usr/local/bin, the units in
# /etc/systemd/system and example environment files in /etc/ferry (existing ones are kept),
# then reloads systemd. Enable what this node runs, e.g.:
#   systemctl enable --now ferry-router ferry-prefill@0 ferry-prefill@1 ferry.target
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${1:-$here/../../target/release}"
for b in ferry-router ferry-prefill ferry-decode; do
  [[ -x "$bin/$b" ]] || { echo "install.sh: $bin/$b missing (cargo build --release first)" >&2; exit 1; }
done
install -D -m 0644 "$here/ferry.sysusers" /usr/lib/sysusers.d/ferry.conf
systemd-sysusers /usr/lib/sysusers.d/ferry.conf
install -d -o ferry -g ferry -m 0750 /var/lib/ferry /var/lib/ferry/models
install -m 0755 "$bin/ferry-router" "$bin/ferry-prefill" "$bin/ferry-decode" /usr/local/bin/
install -m 0644 "$here"/ferry.target "$here"/*.service /etc/systemd/system/
install -d -m 0750 -g ferry /etc/ferry
for f in "$here"/env/*.env; do
  dest="/etc/ferry/$(basename "$f")"
  [[ -e "$dest" ]] || install -m 0640 -g ferry "$f" "$dest"
done
systemctl daemon-reload
[[ -e /etc/ferry/tls/ca.pem ]] ||
  echo "no /etc/ferry/tls/ca.pem: the daemons run mutual TLS; make the cluster's certificates once with $here/make-certs.sh DIR and copy them to /etc/ferry/tls on every node (the key readable by group ferry)"
echo "installed; edit /etc/ferry/*.env, then: systemctl enable --now ferry-router (and/or ferry-prefill, ferry-decode, ferry.target)"
