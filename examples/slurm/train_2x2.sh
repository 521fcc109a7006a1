#!/bin/bash
# Rendered by `lightning-sync sbatch`; submit with `sbatch <this file>`.
#SBATCH --job-name=lightning-sync
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=60
#SBATCH --signal=USR1@90
#SBATCH --output=slurm-%j.out
#SBATCH --requeue

# One task per rank: Lightning's SLURMEnvironment reads the ranks from srun; the train app sets
# a MASTER_ADDR that resolves and MASTER_PORT from the job id.
srun python -m lightning_sync train launch=slurm launch.nodes=2 trainer.devices=2 strategy=bucketed_ddp launch.python=python
