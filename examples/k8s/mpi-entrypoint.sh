#!/bin/sh
# PID 1 of the MPIJob's pods (examples/k8s/mpijob.yaml; in the image as
# ptrain-mpi-entrypoint): runs COMMAND and turns the kubelet's SIGTERM into a
# checkpoint of every rank before the pod goes.
#
#   ptrain-mpi-entrypoint worker   /usr/sbin/sshd -De -f /home/ptrain/.sshd_config
#   ptrain-mpi-entrypoint launcher mpirun -np 4 ... fashion_mnist --checkpoint-dir ...
#
# Without it PID 1 is sshd on a worker: on eviction sshd exits, the kernel
# kills every other process of the container with SIGKILL, and the ranks
# (children of sshd's sessions, under orted) never see a signal. Here:
#
#   worker    SIGTERM goes to every rank of this container (a process whose
#             environment has OMPI_COMM_WORLD_RANK, which orted sets); ptrain's
#             preemption handler makes all ranks agree at the next step, save a
#             checkpoint and exit. Once they are gone, and orted has reported
#             their exit to mpirun and ended, sshd gets SIGTERM.
#   launcher  SIGTERM becomes SIGUSR1 to mpirun, which forwards it to every rank
#             (Open MPI forwards SIGUSR1/SIGUSR2; on SIGTERM it would kill the
#             ranks a few seconds later); ptrain handles SIGUSR1 like SIGTERM.
#
# The exit status is COMMAND's. The pod's terminationGracePeriodSeconds must
# cover one step and one checkpoint write.
set -u

usage() {
  echo "usage: ptrain-mpi-entrypoint worker|launcher COMMAND [ARG...]" >&2
  exit 2
}
[ $# -ge 2 ] || usage
role=$1
shift
case "$role" in worker | launcher) ;; *) usage ;; esac

# Process ids of the MPI ranks in this container (this PID namespace).
ranks() {
  for env in /proc/[0-9]*/environ; do
    if { tr '\0' '\n' < "$env" | grep -q '^OMPI_COMM_WORLD_RANK='; } 2>/dev/null; then
      pid=${env#/proc/}
      echo "${pid%/environ}"
    fi
  done
}

# Whether Open MPI's daemon still runs here.
orted_running() {
  for comm in /proc/[0-9]*/comm; do
    [ "$(cat "$comm" 2>/dev/null)" = orted ] && return 0
  done
  return 1
}

on_term() {
  [ -n "$child" ] || exit 143         # SIGTERM before COMMAND started: nothing to save
  if [ "$role" = launcher ]; then
    echo "ptrain-mpi-entrypoint: SIGTERM: SIGUSR1 to mpirun (pid $child): the ranks checkpoint and exit" >&2
    kill -USR1 "$child" 2>/dev/null
    return
  fi
  # One pid per line; the word splitting below is what is wanted.
  pids=$(ranks)
  # shellcheck disable=SC2086
  echo "ptrain-mpi-entrypoint: SIGTERM: to rank process(es)" $pids "; waiting for their checkpoint" >&2
  # shellcheck disable=SC2086
  [ -z "$pids" ] || kill -TERM $pids 2>/dev/null
  while [ -n "$(ranks)" ]; do sleep 0.2; done
  while orted_running; do sleep 0.2; done
  kill -TERM "$child" 2>/dev/null
}

child=""
trap on_term TERM
trap '[ -z "$child" ] || kill -INT "$child" 2>/dev/null' INT
"$@" &
child=$!
# wait returns early when a trapped signal arrives; wait again until COMMAND has ended.
wait "$child"
status=$?
while kill -0 "$child" 2>/dev/null; do
  wait "$child"
  status=$?
done
exit "$status"
