#!/usr/bin/env bash
# tutti's all-to-all against Open MPI's MPI_Alltoall, in turn in one run: f32, time per call.
#
#   bash scripts/compare_mpi_alltoall.sh [shm|tcp] [ranks] [sizes...]
#
# Needs Open MPI (apt-get install openmpi-bin libopenmpi-dev: mpicc builds
# scripts/mpi_alltoall.c) and a release build of tutti (cargo build --release). A size is each
# rank's input in bytes, as `tutti perf -c all-to-all` counts it. Open MPI (vader or tcp BTL),
# tutti on heap buffers and (over shm) tutti on shared buffers (--shared-buffers: `auto` runs
# `direct` through them from 64 KiB per rank's block) run in turn, ROUNDS times (default 3);
# the median of each side per size is printed, with tutti's mem_ratio (medians too) and the
# ratio Open MPI time / tutti time (above 1.0, tutti is faster).
set -euo pipefail
cd "$(dirname "$0")/.."
transport=${1:-shm}
ranks=${2:-2}
shift 2 || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(65536 262144 1048576 4194304 16777216 67108864)
tutti=target/release/tutti
[ -x "$tutti" ] || cargo build --release -q -p tutti-cli
mkdir -p target
mpicc -O2 -o target/mpi_alltoall scripts/mpi_alltoall.c

case $transport in
shm) btl=self,vader ;;
tcp) btl=self,tcp ;;
*) echo "transport: shm or tcp" >&2; exit 2 ;;
esac
mpi_flags=(--allow-run-as-root --bind-to none --mca btl "$btl" -np "$ranks")
[ "$ranks" -le "$(nproc)" ] || mpi_flags+=(--oversubscribe)
variants=(heap)
[ "$transport" = shm ] && variants+=(shared)

lo=${sizes[0]} hi=${sizes[0]}
for b in "${sizes[@]}"; do ((b < lo)) && lo=$b; ((b > hi)) && hi=$b; done
rounds=${ROUNDS:-3}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((round = 0; round < rounds; round++)); do
    OMPI_MCA_btl_tcp_if_include=lo mpirun "${mpi_flags[@]}" target/mpi_alltoall "${sizes[@]}" |
        while read -r b us; do echo "mpi $b $us 0"; done >>"$log"
    for v in "${variants[@]}"; do
        shared=()
        [ "$v" = shared ] && shared=(--shared-buffers)
        "$tutti" launch -n "$ranks" -- "$tutti" perf -c all-to-all -b "$lo" -e "$hi" -f 2 \
            --transport "$transport" "${shared[@]}" --json |
            python3 -c 'import sys, json
for l in sys.stdin:
    r = json.loads(l) if l.startswith("{") else {}
    if "bytes" in r:
        assert r["errors"] == 0, r
        print(sys.argv[1], r["bytes"], r["time_us"], r["mem_ratio"])' "tutti-$v" >>"$log"
    done
done
python3 - "$log" "$rounds" "$ranks" "$transport" "${variants[*]}" "${sizes[@]}" <<'PY'
import sys, statistics
log, rounds, ranks, transport, variants, sizes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(), sys.argv[6:]
t, m = {}, {}
for line in open(log):
    who, b, us, ratio = line.split()
    t.setdefault((who, b), []).append(float(us))
    m.setdefault((who, b), []).append(float(ratio))
med = lambda d, k: statistics.median(d[k]) if k in d else float("nan")
print(f"# f32 all-to-all, {ranks} ranks over {transport}, medians of {rounds} rounds run in turn; ratio = Open MPI time / tutti time (>1: tutti faster)")
head = f"{'bytes':>10} {'openmpi(us)':>12}"
for v in variants:
    head += f" {v + '(us)':>12} {'mem_ratio':>9} {'ratio':>6}"
print(head)
for b in sizes:
    row = f"{b:>10} {med(t, ('mpi', b)):>12.1f}"
    for v in variants:
        k = ("tutti-" + v, b)
        row += f" {med(t, k):>12.1f} {med(m, k):>9.2f} {med(t, ('mpi', b)) / med(t, k):>6.2f}"
    print(row)
PY
