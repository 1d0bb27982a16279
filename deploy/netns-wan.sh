#!/usr/bin/env bash
# WAN emulation on one machine: two network namespaces joined by a veth pair, each direction shaped by
# tbf to a given rate. Needs root and iproute2. netem is not assumed (this kernel lacks it), so latency
# is emulated elsewhere (dreamp2p's in-process delay) if needed.
#
#   deploy/netns-wan.sh up   [--prefix dp2p] [--rate 100mbit] [--burst 64kb] [--subnet 10.199.7]
#   deploy/netns-wan.sh down [--prefix dp2p]
#   deploy/netns-wan.sh show [--prefix dp2p]
#
# `up` creates namespaces ${prefix}-a (${subnet}.1) and ${prefix}-b (${subnet}.2); on any failure it
# removes what it created. `down` always succeeds, whether or not the namespaces exist.
set -euo pipefail

cmd=${1:-}
shift || true
prefix=dp2p
rate=100mbit
burst=""
subnet=10.199.7
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --burst) burst=$2; shift 2 ;;
    --subnet) subnet=$2; shift 2 ;;
    *) echo "netns-wan.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
a="${prefix}-a"
b="${prefix}-b"
va="${prefix}-va"
vb="${prefix}-vb"

down() {
  ip netns del "$a" 2>/dev/null || true
  ip netns del "$b" 2>/dev/null || true
  ip link del "$va" 2>/dev/null || true
}

shape() {  # shape <netns> <dev>
  # tbf needs a bucket of at least rate/HZ; 4 ms worth of bytes, never under 32 KiB, is safe.
  # The veth's GSO size is then capped under the bucket: tbf cuts any TSO super-packet larger than its
  # bucket into MTU-sized packets in software, which on one host charges the trainers' own cores for work
  # a real NIC does in hardware (11-15 ms of CPU per 6.6 MB int4 round at 100 Mbit/s). The rate and
  # the bucket, i.e. what the link does, stay the same.
  local sizes b gso
  sizes=$(python3 - "$rate" "$burst" <<'PY'
import sys
rate, burst = sys.argv[1].lower(), sys.argv[2].lower()
bits = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}
for u, m in bits.items():
    if rate.endswith(u):
        bps = float(rate[: -len(u)]) * m
        break
else:
    bps = float(rate)
if burst:
    # tc's size units: the *bit ones count bits, the others bytes (k = 1024)
    size = {"kbit": 128, "mbit": 1 << 17, "gbit": 1 << 27, "bit": 1 / 8,
            "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}
    for u, m in size.items():
        if burst.endswith(u):
            b = int(float(burst[: -len(u)]) * m)
            break
    else:
        b = int(burst)
else:
    b = max(32768, int(bps / 8 / 1000 * 4))
# a GSO packet's length at tbf counts every segment's headers (~5% at MSS 1448): leave an eighth
print(b, min(65536, b * 7 // 8))
PY
)
  read -r b gso <<<"$sizes"
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$rate" burst "$b" latency 100ms
  ip -n "$1" link set dev "$2" gso_max_size "$gso" 2>/dev/null \
    || echo "netns-wan.sh: could not cap $2's GSO size (old kernel?); tbf will segment in software" >&2
}

case "$cmd" in
  up)
    [ "$(id -u)" = 0 ] || { echo "netns-wan.sh: needs root" >&2; exit 1; }
    down
    trap 'down' ERR
    ip netns add "$a"
    ip netns add "$b"
    ip link add "$va" type veth peer name "$vb"
    ip link set "$va" netns "$a"
    ip link set "$vb" netns "$b"
    ip -n "$a" addr add "${subnet}.1/24" dev "$va"
    ip -n "$b" addr add "${subnet}.2/24" dev "$vb"
    for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
    ip -n "$a" link set "$va" up
    ip -n "$b" link set "$vb" up
    shape "$a" "$va"
    shape "$b" "$vb"
    trap - ERR
    echo "$a ${subnet}.1"
    echo "$b ${subnet}.2"
    ;;
  down)
    down
    ;;
  show)
    for ns in "$a" "$b"; do
      echo "== $ns"
      ip -n "$ns" -br addr 2>/dev/null || echo "(absent)"
      ip netns exec "$ns" tc -s qdisc show 2>/dev/null | sed -n '1,4p' || true
    done
    ;;
  *)
    echo "usage: netns-wan.sh up|down|show [--prefix P] [--rate R] [--burst B] [--subnet A.B.C]" >&2
    exit 2
    ;;
esac
