#!/usr/bin/env bash
# A simulated cluster on one machine: HOSTS network namespaces ("hosts"), each joined to a
# switch (a bridge in a namespace of its own) by a veth link shaped with `tc tbf` to RATE in
# both directions, and on each host RANKS processes started by `tutti launch`. Each host has
# its own TUTTI_HOST_ID, so tutti sees HOSTS hosts: shared memory among a host's ranks, TCP
# over the shaped links between hosts, the hierarchy across hosts where it pays.
#
#   scripts/sim_cluster.sh [--hosts H] [--ranks R] [--rate RATE] [--stats] -- PROGRAM [ARGS...]
#
#   --hosts H    simulated hosts (default 2)
#   --ranks R    ranks per host (default 2)
#   --rate RATE  each link's rate per direction, as tc spells it (default 1gbit; e.g. 100mbit,
#                10gbit)
#   --stats      after the run, print each host's bytes sent and received on its link
#                ("sim_cluster: host K sent N bytes, received M bytes")
#
# PROGRAM runs as `tutti launch --nnodes H --node-rank K -n R -- PROGRAM ARGS` on host K
# (`tutti` means the tutti binary itself, as for `tutti launch`); each line it prints is
# prefixed with `[hK] `. The job's secret is fresh (TUTTI_JOB_TOKEN), the rendezvous is on
# host 0. The binary is $TUTTI_BIN, else target/release/tutti, else `tutti` on PATH. The exit
# status is the first host's that failed, else 0. Everything is removed on exit.
#
# Needs root and iproute2 (`ip`, `tc`), with the veth, bridge and sch_tbf kernel modules.
# Examples (README, "A simulated cluster"):
#   scripts/sim_cluster.sh --hosts 2 --ranks 2 -- tutti check
#   scripts/sim_cluster.sh --hosts 4 --ranks 4 --rate 10gbit -- tutti perf -b 8 -e 64M
set -euo pipefail

hosts=2
ranks=2
rate=1gbit
stats=0
while [ $# -gt 0 ]; do
    case "$1" in
    --hosts) hosts=$2; shift 2 ;;
    --ranks) ranks=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --stats) stats=1; shift ;;
    --) shift; break ;;
    -h | --help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "sim_cluster: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "sim_cluster: no program given (... -- PROGRAM [ARGS])" >&2; exit 2; }
case "$hosts$ranks" in *[!0-9]*) echo "sim_cluster: --hosts and --ranks take numbers" >&2; exit 2 ;; esac
if [ "$hosts" -lt 1 ] || [ "$hosts" -gt 250 ] || [ "$ranks" -lt 1 ]; then
    echo "sim_cluster: --hosts must be 1 to 250 and --ranks at least 1" >&2
    exit 2
fi
[ "$(id -u)" = 0 ] || { echo "sim_cluster: needs root (network namespaces)" >&2; exit 2; }
for tool in ip tc; do
    command -v "$tool" >/dev/null || { echo "sim_cluster: needs $tool (iproute2)" >&2; exit 2; }
done

here=$(cd "$(dirname "$0")/.." && pwd)
bin=${TUTTI_BIN:-}
if [ -z "$bin" ]; then
    if [ -x "$here/target/release/tutti" ]; then
        bin="$here/target/release/tutti"
    else
        bin=$(command -v tutti) || { echo "sim_cluster: no tutti binary (build it, or set TUTTI_BIN)" >&2; exit 2; }
    fi
fi

# Names unique to this run, so that runs side by side do not meet.
tag="ts$$"
switch="${tag}sw"
host_ns() { echo "${tag}h$1"; }
address() { echo "10.213.$(($1 / 250)).$(($1 % 250 + 1))"; }

cleanup() {
    for k in $(seq 0 $((hosts - 1))); do
        ip netns del "$(host_ns "$k")" 2>/dev/null || true
    done
    ip netns del "$switch" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$switch"
ip -n "$switch" link add br0 type bridge
ip -n "$switch" link set br0 up
# RATE in bytes per second, from tc's units: bit (or none), kbit, mbit, gbit, tbit, the IEC
# kibit ... tibit, and the same with bps for bytes.
rate_bytes() {
    awk -v r="$1" 'BEGIN {
        if (!match(r, /^[0-9]*\.?[0-9]+/)) exit 1
        n = substr(r, 1, RLENGTH) + 0; u = tolower(substr(r, RLENGTH + 1))
        if (n <= 0 || u !~ /^([kmgt]i?)?(bit|bps)?$/) exit 1
        p = index("kmgt", substr(u, 1, 1)); k = 1
        if (p > 0) k = (substr(u, 2, 1) == "i") ? 1024 ^ p : 1000 ^ p
        b = (u ~ /bps$/) ? 1 : 1 / 8
        printf "%d", n * k * b
    }'
}
rate_b=$(rate_bytes "$rate") || { echo "sim_cluster: --rate $rate: expected tc's units (e.g. 100mbit, 4gbit)" >&2; exit 2; }
# tbf: a bucket of 250 us of the rate (at least 128 KiB, so the kernel's timers keep the link at
# its rate), and a queue of 50 ms. A larger bucket lets each burst after an idle gap cross at
# memory speed, and what `tutti tune` fits from calls of up to 1 MiB is then faster than the link.
burst=$((rate_b / 4000 > 131072 ? rate_b / 4000 : 131072))
shape() { # namespace device
    tc -n "$1" qdisc add dev "$2" root tbf rate "$rate" burst "$burst" latency 50ms
}
for k in $(seq 0 $((hosts - 1))); do
    ns=$(host_ns "$k")
    ip netns add "$ns"
    ip link add "${tag}e$k" type veth peer name "${tag}p$k"
    ip link set "${tag}e$k" netns "$ns"
    ip link set "${tag}p$k" netns "$switch"
    ip -n "$ns" link set "${tag}e$k" name eth0
    ip -n "$ns" addr add "$(address "$k")/16" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "$switch" link set "${tag}p$k" master br0
    ip -n "$switch" link set "${tag}p$k" up
    shape "$ns" eth0
    shape "$switch" "${tag}p$k"
done

token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
master=$(address 0)
pids=()
for k in $(seq 0 $((hosts - 1))); do
    (
        set +e
        ip netns exec "$(host_ns "$k")" env \
            TUTTI_JOB_TOKEN="$token" TUTTI_HOST_ID="sim-h$k" TUTTI_LISTEN_HOST="$(address "$k")" \
            "$bin" launch --nnodes "$hosts" --node-rank "$k" --master-addr "$master" \
            --master-port 29500 -n "$ranks" -- "$@" 2>&1 | sed -u "s/^/[h$k] /"
        exit "${PIPESTATUS[0]}"
    ) &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || { s=$?; [ "$status" != 0 ] || status=$s; }
done
if [ "$stats" = 1 ]; then
    for k in $(seq 0 $((hosts - 1))); do
        counters=$(ip netns exec "$(host_ns "$k")" cat /sys/class/net/eth0/statistics/tx_bytes \
            /sys/class/net/eth0/statistics/rx_bytes | tr '\n' ' ')
        read -r tx rx <<<"$counters"
        echo "sim_cluster: host $k sent $tx bytes, received $rx bytes"
    done
fi
exit "$status"
