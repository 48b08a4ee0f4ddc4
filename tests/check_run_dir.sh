#!/bin/bash
# fashion_mnist with --run-dir on 2 ranks: the folder holds the run's config (every
# flag), metrics, TensorBoard events and checkpoints, and --resume with the same
# --run-dir continues from them. Then a metrics file that rank 0 cannot open: both
# ranks end with the reason (the timeout catches a hang).  usage: check_run_dir.sh MPIRUN FASHION_MNIST DIR
set -eu
mpirun=$1 program=$2 dir=$3
rm -rf "$dir"
run() { "$mpirun" --oversubscribe -np 2 "$program" --parallel ddp --train-limit 2000 --test-limit 500 \
          --batch 50 --log-every 5 --checkpoint-every 10 --run-dir "$dir" "$@"; }
run --epochs 1 >"$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
fail() { echo "check_run_dir: $*"; ls -R "$dir"; exit 1; }
grep -q '^epochs *= *1' "$dir/config.toml" || fail "config.toml lacks epochs = 1"
grep -q '"loss"' "$dir/metrics.jsonl" || fail "metrics.jsonl has no loss record"
ls "$dir"/tensorboard/events.out.tfevents.* >/dev/null 2>&1 || fail "no TensorBoard event file"
ls "$dir/checkpoints" | grep -q . || fail "no checkpoint"
# A second run of 2 epochs resumes from the folder's newest checkpoint.
run --epochs 2 --resume >"$dir.log" 2>&1 || { cat "$dir.log"; exit 1; }
grep -qi 'resum' "$dir.log" || { cat "$dir.log"; fail "the second run did not resume"; }
grep -q '^epochs *= *2' "$dir/config.toml" || fail "config.toml was not rewritten"
# A metrics file rank 0 cannot open ends every rank with the reason, not a hang.
rc=0
timeout 120 "$mpirun" --oversubscribe -np 2 "$program" --parallel ddp --train-limit 200 --test-limit 100 \
  --epochs 1 --metrics /proc/ptrain-no-such-dir/metrics.jsonl >"$dir.log" 2>&1 || rc=$?
((rc != 0)) || fail "an unwritable --metrics path did not fail"
((rc != 124)) || { cat "$dir.log"; fail "an unwritable --metrics path hung the ranks"; }
grep -q 'ptrain.metrics.open' "$dir.log" || { cat "$dir.log"; fail "no [ptrain.metrics.open] message"; }
echo "check_run_dir: ok"
