#!/usr/bin/env bash
# Private CA and one certificate per node for dreamp2p's (mutual) TLS, with openssl.
#
#   deploy/tls/make-certs.sh [--out DIR] [--days N] [--ca-days N] [--force] [ID=]NAME[,EXTRA...] ...
#
#   ID       the node id (node_id in its TOML) the certificate vouches for, as its common name. With
#            mutual TLS a peer may only claim a node id its certificate names (CN or a SAN), so give
#            each node its own: eu-west=eu-west.example.org. Without ID the common name is NAME.
#   NAME     the host name (or IP address) other nodes dial this node by: the host part of its ring
#            address. Files are named after it (an IPv6 address's colons become _).
#            EXTRA: more names or IPs for the same certificate, comma-separated
#            (e.g. eu-west.example.org,203.0.113.10).
#            Each name that looks like an IP address becomes an IP SAN, every other one a DNS SAN.
#   --out    output directory (default ./dreamp2p-tls)
#   --days   node certificate lifetime in days (default 825)
#   --ca-days CA lifetime in days (default 3650)
#   --force  replace an existing CA and existing node files
#
# Writes DIR/ca.pem + DIR/ca.key (keep ca.key offline; it signs new nodes) and, per node,
# DIR/NAME.pem + DIR/NAME.key. Install NAME.pem, NAME.key and ca.pem on node NAME under these names
# in /etc/dreamp2p/tls/, as nodes/*.toml expect. Certificates carry serverAuth and clientAuth, so
# they serve both ends of mutual TLS.
#
# An existing CA in DIR is reused to sign further nodes (add a region later); without --force it
# is never overwritten, and neither are existing node files. To renew one node, delete its two
# files and run again.
set -euo pipefail

out=./dreamp2p-tls
days=825
ca_days=3650
force=0
names=()

usage() { sed -n '2,/^[^#]/{/^#/p;}' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || usage; out=$2; shift 2 ;;
    --days) [ $# -ge 2 ] || usage; days=$2; shift 2 ;;
    --ca-days) [ $# -ge 2 ] || usage; ca_days=$2; shift 2 ;;
    --force) force=1; shift ;;
    -h|--help) usage ;;
    --) shift; names+=("$@"); break ;;
    -*) echo "make-certs.sh: unknown option $1" >&2; usage ;;
    *) names+=("$1"); shift ;;
  esac
done

die() { echo "make-certs.sh: $*" >&2; exit 1; }

[ ${#names[@]} -gt 0 ] || usage
command -v openssl >/dev/null || die "openssl not found"
[[ $days =~ ^[1-9][0-9]*$ ]] || die "--days must be a positive integer, got '$days'"
[[ $ca_days =~ ^[1-9][0-9]*$ ]] || die "--ca-days must be a positive integer, got '$ca_days'"

is_ip() {
  [[ $1 =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}$ ]] || [[ $1 =~ ^[0-9A-Fa-f:.]+$ && $1 == *:* ]]
}

# Check every argument before writing anything.
node_id() { [[ $1 == *=* ]] && echo "${1%%=*}" || true; }
hosts() { echo "${1#*=}"; }

for spec in "${names[@]}"; do
  id=$(node_id "$spec")
  if [[ $spec == *=* ]]; then
    [[ $id =~ ^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$ ]] || die "node id '$id' must be letters, digits, '.', '_' or '-'"
  fi
  IFS=, read -r -a parts <<< "$(hosts "$spec")"
  [ ${#parts[@]} -gt 0 ] || die "empty node name"
  for n in "${parts[@]}"; do
    is_ip "$n" || [[ $n =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]] \
      || die "'$n' is neither a DNS name nor an IP address"
  done
  first=${parts[0]//:/_}
  if [ "$force" = 0 ] && { [ -e "$out/$first.pem" ] || [ -e "$out/$first.key" ]; }; then
    die "$out/$first.pem or .key exists; delete it to renew, or pass --force"
  fi
done

mkdir -p "$out"
chmod 0700 "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
umask 077

if [ -e "$out/ca.pem" ] || [ -e "$out/ca.key" ]; then
  if [ "$force" = 1 ]; then
    echo "replacing the CA in $out (certificates it signed will no longer verify)" >&2
    rm -f "$out/ca.pem" "$out/ca.key"
  elif [ -e "$out/ca.pem" ] && [ -e "$out/ca.key" ]; then
    echo "reusing the existing CA in $out (pass --force to replace it)" >&2
  else
    die "$out holds only one of ca.pem and ca.key; restore the other, or pass --force for a new CA"
  fi
fi

if [ ! -e "$out/ca.pem" ]; then
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tmp/ca.key"
  openssl req -x509 -new -key "$tmp/ca.key" -sha256 -days "$ca_days" \
    -subj "/CN=dreamp2p CA" \
    -addext "basicConstraints=critical,CA:TRUE,pathlen:0" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -addext "subjectKeyIdentifier=hash" \
    -out "$tmp/ca.pem"
  mv "$tmp/ca.key" "$out/ca.key"
  chmod 0644 "$tmp/ca.pem"
  mv "$tmp/ca.pem" "$out/ca.pem"
  echo "wrote $out/ca.pem and $out/ca.key" >&2
fi

for spec in "${names[@]}"; do
  id=$(node_id "$spec")
  IFS=, read -r -a parts <<< "$(hosts "$spec")"
  first=${parts[0]//:/_}      # file name; an IPv6 address's colons become underscores
  cn=${id:-${parts[0]}}
  san=""
  for n in "${parts[@]}"; do
    if is_ip "$n"; then san+="${san:+,}IP:$n"; else san+="${san:+,}DNS:$n"; fi
  done
  cat > "$tmp/ext.cnf" <<EOF
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth,clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid,issuer
subjectAltName = $san
EOF
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tmp/node.key"
  openssl req -new -key "$tmp/node.key" -subj "/CN=$cn" -out "$tmp/node.csr"
  openssl x509 -req -in "$tmp/node.csr" -CA "$out/ca.pem" -CAkey "$out/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 \
    -extfile "$tmp/ext.cnf" -out "$tmp/node.pem" 2>"$tmp/x509.err" \
    || { cat "$tmp/x509.err" >&2; die "could not sign the certificate for $first"; }
  chmod 0644 "$tmp/node.pem"
  mv "$tmp/node.key" "$out/$first.key"
  mv "$tmp/node.pem" "$out/$first.pem"
  echo "wrote $out/$first.pem and $out/$first.key (CN $cn; $san)" >&2
done
