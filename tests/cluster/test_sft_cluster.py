"""An SFT job (configs/sft_toy.yaml, the trainer alone) on the Slurm test cluster, preempted: it
requeues, resumes at the step boundary and ends with the losses of the same job run uninterrupted on
this machine (tests/conftest.py's sft_run).

    bash tools/test.sh tests/cluster/test_sft_cluster.py
"""

import pytest
from helpers import (
    SFT, SFT_COMMON, SFT_STEPS, final_state, job_log, losses, losses_by_attempt, metrics, prl, submitted_job, tiny_model_dir,
    wait_for,
)

from prl.control import slurm


@pytest.mark.slurm
def test_an_sft_job_preempted_on_the_cluster_requeues_and_resumes_to_the_same_losses(sft_run, tmp_path, slurm_cluster):
    r = prl("submit", str(SFT), f"run.output_dir={tmp_path}", f"model.name={tiny_model_dir()}", *SFT_COMMON,
            "slurm.time=00:10:00", cwd=tmp_path)
    job_id, run = submitted_job(r), tmp_path / "sft-toy"
    wait_for(lambda: len(metrics(run, 0)) >= 2, 300, "two SFT steps")
    slurm.scancel([job_id], signal="USR1", batch=True)
    st = final_state(job_id)
    assert st.state == "COMPLETED", job_log(run, 1) if (run / "logs/attempt_1").exists() else job_log(run)
    assert "requeueing job" in job_log(run, 0)
    done = losses_by_attempt(run)
    assert set(done) == {0, 1} and min(done[1]) == max(done[0]) + 1, done  # resumed at the step boundary
    assert losses(run) == losses(sft_run)  # exact: the data order is a function of the step
    assert (run / f"weights/step_{SFT_STEPS}/COMPLETE").exists()
