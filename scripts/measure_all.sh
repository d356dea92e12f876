#!/usr/bin/env bash
# The full re-measurement (issue 23, item 12; docs/performance.md, docs/results.md): every bench and
# the replay, once each, in a fixed order, with the number of runs decided here, before running:
#
#   step           command                                           runs (inside the command)        ~time
#   restore-sweep  bench_restore.py --sweep                           3 passes per cell (+1 warm-up)   14 min
#   write          bench_write.py                                     3 passes (+1 warm-up)             1 min
#   write-floor    bench_write_floor.py (writes while restores never stop) 3 repeats of both modes      2 min
#   gil            bench_gil.py                                       3 repeats                         1 min
#   mas            bench_mas.py --qps 20 (the default 40 overloads 2 cores) 5 repeats                   3 min
#   cluster        bench_cluster.py (root, netns, etcd, Mooncake TE)  5 interleaved repeats             2 min
#   linker         bench_linker.py (the direct L3 linker, layer-wise)  3 repeats per cell                1 min
#   serve-bench-weka      serve_bench.py --traces weka (full: 5 systems, 2 and 4 req/s) 3 runs per point  28 min
#   serve-bench-mooncake  serve_bench.py --traces mooncake (the same)                 3 runs per point  24 min
#   results        results.py (full)                                  1 run (hit rates are              56 min
#                                                                     deterministic; TTFT one run)
#
# Every bench reports each run and the median, and its disk limit (fio) from the same window.
# Needs a quiet machine: nothing else running for the ~2.2 h (the script refuses to start when the
# 1-minute load average is above 0.5, unless FORCE=1). Writes runs/measure-<UTC date>/: log.txt
# (each command, start, end, exit status), <step>.out (its output) and the JSON files; the storage
# files of every step are removed by the step itself.
#
#   scripts/measure_all.sh [step ...]      # default: every step above, in that order
#   make measure                           # the same
set -u
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-runs/measure-$(date -u +%Y-%m-%d)}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(restore-sweep write write-floor gil mas cluster linker serve-bench-weka serve-bench-mooncake results)

load=$(cut -d' ' -f1 /proc/loadavg)
if [ "${FORCE:-0}" != 1 ] && awk -v l="$load" 'BEGIN{exit !(l > 0.5)}'; then
    echo "measure_all: the machine is not quiet (load average $load > 0.5); stop what runs or set FORCE=1" >&2
    exit 2
fi

cmd_of() {
    case "$1" in
        restore-sweep) echo "$PY scripts/bench_restore.py --sweep --json $OUT/restore-sweep.json" ;;
        write)         echo "$PY scripts/bench_write.py --json $OUT/write.json" ;;
        write-floor)   echo "$PY scripts/bench_write_floor.py --json $OUT/write-floor.json" ;;
        gil)           echo "$PY scripts/bench_gil.py --json $OUT/gil.json" ;;
        mas)           echo "$PY scripts/bench_mas.py --qps 20 --json $OUT/mas.json" ;;
        cluster)       echo "$PY scripts/bench_cluster.py --json $OUT/cluster.json" ;;
        linker)        echo "$PY scripts/bench_linker.py --repeat 3 --out $OUT/linker.json" ;;
        serve-bench-weka|serve-bench-mooncake)
                       t=${1#serve-bench-}
                       echo "$PY scripts/serve_bench.py --traces $t --out $OUT/serve-bench-$t --json $OUT/serve-bench-$t.json" ;;
        results)       echo "$PY scripts/results.py --out $OUT/results" ;;
        *) return 1 ;;
    esac
}

worst=0
for step in "${STEPS[@]}"; do
    cmd=$(cmd_of "$step") || { echo "measure_all: unknown step $step" >&2; exit 2; }
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
    t0=$(date -u +%s)
    echo "== $step: $cmd (start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$LOG"
    $cmd > "$OUT/$step.out" 2>&1
    rc=$?
    t1=$(date -u +%s)
    echo "rc=$rc $((t1 - t0)) s (end $(date -u +%H:%M:%S))" | tee -a "$LOG"
    [ $rc -gt $worst ] && worst=$rc
done
echo "ALL DONE (worst exit status $worst)" | tee -a "$LOG"
exit $worst
