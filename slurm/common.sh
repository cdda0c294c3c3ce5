# Sourced by the sbatch scripts in this folder: the rendezvous, the srun launch, and preemption.
#
# Preemption protocol. `sbatch --signal=B:USR1@<seconds>` sends USR1 to this batch shell
# <seconds> before the time limit. The trap forwards it to srun, which hands it to every training
# process; they finish the step, save a checkpoint and exit with PREEMPTED_EXIT_CODE. The shell
# then requeues the job (`scontrol requeue`), keeping its job id, and the next run resumes from
# the newest complete checkpoint in train.run_dir. SIGTERM (scancel, or Slurm's own preemption,
# which requeues by itself when the cluster is configured so) is forwarded as well so the run
# saves, but never triggers a self-requeue: a cancelled job stays cancelled. A run that exits
# 0 (all steps done) or with any other failure is not requeued.

# Equal to ttt_lm.train.preempt.PREEMPTED_EXIT_CODE; tests/slurm holds the two equal.
PREEMPTED_EXIT_CODE=75
PYTHON=${PYTHON:-python}
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# MASTER_ADDR: the first host of the allocation, as Slurm names it (no ssh, no hostfile).
# MASTER_PORT: derived from the job id, so two jobs sharing a node do not collide, and a
# requeued job (same id) uses the same port again.
ttt_rendezvous() {
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    export MASTER_ADDR MASTER_PORT
}

ttt_banner() {
    echo "[$(date -Is)] job ${SLURM_JOB_ID}${SLURM_ARRAY_TASK_ID:+ (array ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID})}" \
         "restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}:" \
         "${SLURM_NTASKS:-1} tasks, rendezvous ${MASTER_ADDR:-?}:${MASTER_PORT:-?}"
}

_ttt_on_usr1() {
    TTT_GOT_USR1=1; TTT_INTERRUPTED=1
    echo "[$(date -Is)] USR1: asking the training processes to checkpoint and stop"
    [ -n "${TTT_SRUN_PID:-}" ] && kill -USR1 "$TTT_SRUN_PID" 2>/dev/null
}

_ttt_on_term() {
    TTT_GOT_TERM=1; TTT_INTERRUPTED=1
    echo "[$(date -Is)] TERM: forwarding to the training processes (no requeue)"
    [ -n "${TTT_SRUN_PID:-}" ] && kill -TERM "$TTT_SRUN_PID" 2>/dev/null
}

# ttt_launch CMD...: run CMD as one srun step (one task per GPU, as allocated), forward USR1/TERM
# to it, and requeue the job when it stopped for preemption. Returns CMD's exit status.
ttt_launch() {
    TTT_GOT_USR1=0; TTT_GOT_TERM=0; TTT_SRUN_PID=
    trap _ttt_on_usr1 USR1
    trap _ttt_on_term TERM
    # No --kill-on-bad-exit: a preempted rank exits with a non-zero status (75) and Slurm would
    # kill the ranks still leaving the final barrier, turning 75 into 143. Instead --wait gives
    # the others TTT_SRUN_WAIT seconds after the first one ends (a crashed rank's peers stop
    # then at the latest). Since Slurm 22.05 srun no longer inherits --cpus-per-task.
    srun --kill-on-bad-exit=0 --wait="${TTT_SRUN_WAIT:-120}" \
        ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} "$@" &
    TTT_SRUN_PID=$!
    # A trapped signal interrupts `wait` (status > 128) while srun is still running: wait again.
    # bash keeps a reaped child's status, so a repeated wait returns the real one.
    while :; do
        TTT_INTERRUPTED=0
        wait "$TTT_SRUN_PID"; TTT_RC=$?
        [ "$TTT_INTERRUPTED" = 1 ] || break
    done
    trap - USR1 TERM
    echo "[$(date -Is)] step exited with status $TTT_RC"
    if [ "$TTT_RC" -eq "$PREEMPTED_EXIT_CODE" ] && [ "$TTT_GOT_TERM" = 0 ]; then
        if [ -n "${TTT_MAX_RESTARTS:-}" ] && [ "${SLURM_RESTART_COUNT:-0}" -ge "$TTT_MAX_RESTARTS" ]; then
            echo "[$(date -Is)] preempted, but TTT_MAX_RESTARTS=$TTT_MAX_RESTARTS restarts are used up"
        else
            echo "[$(date -Is)] checkpoint saved; requeueing job ${SLURM_JOB_ID}"
            scontrol requeue "$SLURM_JOB_ID"
        fi
    fi
    return "$TTT_RC"
}
