#!/usr/bin/env bash
# tutti against Open MPI, side by side in one run: f32 sum all-reduce, time per call.
#
#   bash scripts/compare_mpi.sh [shm|tcp|mpi] [ranks] [sizes...]
#
# Needs Open MPI and mpi4py (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py
# numpy) and a release build of tutti (cargo build --release). Prints bytes, Open MPI's time,
# tutti's time and their ratio (Open MPI / tutti: above 1.0, tutti is faster). shm compares
# tutti's shared-memory transport with Open MPI's vader; tcp both over loopback TCP. More ranks
# than cores run Open MPI with --oversubscribe. Both run ROUNDS times in turn (default 3) and
# each side's best time per size is printed. SHARED=1 runs tutti on shared buffers
# (--shared-buffers, over shm: zero-copy between the processes). mpi runs tutti under mpirun
# over its MPI transport (tutti's algorithms on MPI's point-to-point, MPI's vader BTL beneath
# both sides); it builds tutti with `--features mpi`. ALGO=NAME passes `-a NAME` to tutti perf
# (ALGO=mpi with mpi: MPI's own all-reduce behind tutti's checks).
set -euo pipefail
cd "$(dirname "$0")/.."
transport=${1:-shm}
ranks=${2:-2}
shift 2 || true
sizes=("$@")
[ ${#sizes[@]} -gt 0 ] || sizes=(8 1024 4096 16384 65536 1048576 67108864)
tutti=target/release/tutti
if [ "$transport" = mpi ]; then
    cargo build --release -q -p tutti-cli --features mpi
else
    [ -x "$tutti" ] || cargo build --release -q -p tutti-cli
fi

case $transport in
shm | mpi) btl=self,vader ;;
tcp) btl=self,tcp ;;
*) echo "transport: shm, tcp or mpi" >&2; exit 2 ;;
esac
mpi_flags=(--allow-run-as-root --bind-to none --mca btl "$btl" -np "$ranks")
[ "$ranks" -le "$(nproc)" ] || mpi_flags+=(--oversubscribe)

# Both sides run in turn, ROUNDS times (default 3), and each keeps its best time per size: a
# side that ran right after the other (processes still exiting, caches cold) is not penalised.
rounds=${ROUNDS:-3}
shared=()
[ "${SHARED:-0}" = 1 ] && shared=(--shared-buffers)
algo=()
[ -n "${ALGO:-}" ] && algo=(-a "$ALGO")
declare -A mpi tut
keep_best() { # keep_best ARRAY BYTES US
    local -n arr=$1
    if [ -z "${arr[$2]:-}" ] || python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)" "$3" "${arr[$2]}"; then
        arr[$2]=$3
    fi
}
# One tutti run over every power of two from the smallest size to the largest; the rows asked
# for are taken from it.
lo=${sizes[0]} hi=${sizes[0]}
for b in "${sizes[@]}"; do ((b < lo)) && lo=$b; ((b > hi)) && hi=$b; done
for ((round = 0; round < rounds; round++)); do
    while read -r b us; do keep_best mpi "$b" "$us"; done < <(
        OMPI_MCA_btl_tcp_if_include=lo mpirun "${mpi_flags[@]}" python3 scripts/mpi_allreduce.py "${sizes[@]}")
    while read -r b us; do keep_best tut "$b" "$us"; done < <(
        if [ "$transport" = mpi ]; then
            mpirun "${mpi_flags[@]}" "$tutti" perf -b "$lo" -e "$hi" -f 2 --out-of-place --transport mpi "${algo[@]}" --json
        else
            "$tutti" launch -n "$ranks" -- "$tutti" perf -b "$lo" -e "$hi" -f 2 --out-of-place --transport "$transport" "${shared[@]}" "${algo[@]}" --json
        fi |
            python3 -c 'import sys, json
for l in sys.stdin:
    r = json.loads(l) if l.startswith("{") else {}
    if "bytes" in r:
        print(r["bytes"], r["time_us"])')
done
echo "# f32 all-reduce, $ranks ranks over $transport${shared:+ (tutti on shared buffers)}${algo:+ (tutti -a $ALGO)}, best of $rounds rounds each: Open MPI ($btl) against tutti; ratio = Open MPI time / tutti time (>1: tutti faster)"
printf "%12s %14s %12s %8s\n" bytes "openmpi(us)" "tutti(us)" ratio
for b in "${sizes[@]}"; do
    python3 -c "import sys; b, m, t = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]); print('%12s %14.2f %12.2f %8.2f' % (b, m, t, m / t))" "$b" "${mpi[$b]}" "${tut[$b]}"
done
