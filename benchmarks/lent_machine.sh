#!/usr/bin/env bash
# The pipeline benchmark on a machine with 16 free cores (a lent GPU machine's CPU), as measured for
# docs/benchmarks.md: the GPT table in four runs side by side, each pinned with taskset to 4 cores of its own
# (4 ranks, one thread each), then the 3F1B recycling table. Schedules whose torch peer can break the process
# group for the rows after it (torch's ZB-V hung and DualPipeV failed on gloo with torch 2.11) run in runs of
# their own; the 1f1b / zbv / vhalf comparison of issue 38 also runs without torch's peers, and again with the V
# memory limit counted in saved bytes (beside the 3F1B table). About 4 minutes.
# Usage: benchmarks/lent_machine.sh [ROUNDS]    (default 3)
set -uo pipefail
rounds=${1:-3}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpt="python3 benchmarks/pipeline.py --only gpt --rounds $rounds"
echo "$(nproc --all) cores, rounds $rounds, $(date -u +%H:%M:%S)"
taskset -c 0-3 timeout 300 $gpt --schedules 1f1b,interleaved > pipeline_a.log 2>&1 &
taskset -c 4-7 timeout 300 $gpt --schedules vhalf,gpipe,zb1 > pipeline_b.log 2>&1 &
taskset -c 8-11 timeout 300 $gpt --schedules zbv,dualpipev > pipeline_c.log 2>&1 &
taskset -c 12-15 timeout 300 $gpt --schedules 1f1b,zbv,vhalf --without-torch > pipeline_d.log 2>&1 &
wait
taskset -c 0-3 timeout 150 python3 benchmarks/pipeline.py --only recycling > pipeline_recycling.log 2>&1 &
taskset -c 4-7 timeout 300 $gpt --schedules 1f1b,zbv,vhalf --without-torch --activation-limit bytes > pipeline_e.log 2>&1 &
wait
for log in pipeline_a pipeline_b pipeline_c pipeline_d pipeline_e pipeline_recycling; do
    echo "== $log"
    grep -v '^rank\|^  \|^Traceback\|^Process' "$log.log"
done
echo "done $(date -u +%H:%M:%S)"
