. /tmp/prl-gpu-site/env.sh; export PYTHONPATH=$PYTHONPATH:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PRL_SLURM_DEBS=.gpu-slurm/debs PRL_SLURM_GPUS=real PRL_SLURM_CPU_NODES=0 PRL_SLURM_NODES=2 PRL_SLURM_CPUS=16 PRL_SLURM_MEM_MB=120000
PRL_SLURM_EXTRA_CONF="KillWait=120" bash tools/slurm_cluster.sh up > /tmp/g2/cluster.log 2>&1
grep -h KillWait /etc/slurm/slurm.conf >> /tmp/g2/cluster.log
python3 benchmarks/bench_model.py --preset qwen2-1.5b --out /tmp/m15 > /tmp/g2/model.log 2>&1
python3 benchmarks/gpu_slurm_preemption.py --model /tmp/m15 --work /tmp/preempt --json /tmp/g2/preemption_1.5b_killwait120.json --skip-local > /tmp/g2/preemption_1.5b_killwait120.log 2>&1
tar -czf /tmp/g2/logs.tgz -C /tmp/preempt/slurm/toy logs
touch /tmp/g2/DONE
