#!/bin/bash
# Rendered by `lightning-sync sbatch`; submit with `sbatch <this file>`.
#SBATCH --job-name=lightning-sync
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=60
#SBATCH --signal=USR1@90
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --requeue

# One intra-op thread per CPU of the task (Lightning's own launcher does the same; unset, every rank
# starts a thread per core of the node and they fight over them).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# One task per rank: Lightning's SLURMEnvironment reads the ranks from srun; the train app sets
# a MASTER_ADDR that resolves and MASTER_PORT from the job id.
srun python -m lightning_sync train launch=slurm launch.nodes=2 trainer.devices=2 strategy=bucketed_ddp launch.python=python &
pid=$!
# --signal sends SIGUSR1 to every task; `scancel --signal=USR1 --batch` reaches only this shell,
# which passes it on (srun forwards it to the tasks). The tasks save, requeue the job and exit.
trap 'kill -s USR1 "$pid" 2>/dev/null' USR1
wait "$pid"; status=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; status=$?; done  # a trapped signal ends `wait` early
exit "$status"
