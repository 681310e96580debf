#!/usr/bin/env bash
# Makes the cluster's internal PKI for the systemd units with openssl (run once, on one
# machine; then copy ca.pem and each node's role certificate and key to /etc/ferry/tls):
#   deploy/systemd/make-certs.sh DIR [SERVER_NAME] [DAYS]
# DIR gets ca.pem/ca.key (keep ca.key offline) and router, prefill and decode .pem/.key: each
# certificate names its role in its common name (ferry-<role>; workers serve each RPC to its
# role only) and SERVER_NAME (default ferry.internal, the units' FERRY_INTERNAL_TLS_SERVER_NAME)
# as its DNS name. Existing files are never overwritten.
set -euo pipefail
dir="${1:?usage: make-certs.sh DIR [SERVER_NAME] [DAYS]}"
name="${2:-ferry.internal}"
days="${3:-3650}"
mkdir -p "$dir"
umask 077
for f in ca.pem ca.key router.pem prefill.pem decode.pem; do
  [[ ! -e "$dir/$f" ]] || { echo "make-certs.sh: $dir/$f exists; not overwriting" >&2; exit 1; }
done
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -subj "/CN=ferry internal CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
for role in router prefill decode; do
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=ferry-$role" \
    -keyout "$dir/$role.key" -out "$dir/$role.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$role.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days "$days" -out "$dir/$role.pem" \
    -extfile <(printf 'subjectAltName=DNS:%s\nextendedKeyUsage=serverAuth,clientAuth\n' "$name") 2>/dev/null
  rm "$dir/$role.csr"
done
rm -f "$dir/ca.srl"
chmod 0644 "$dir"/*.pem
echo "made $dir: ca.pem, and router, prefill, decode .pem/.key for $name"
