"""The pattern zoo: everyday training loops under horovodrun -np 2, each against a plain-torch
single-process reference on the concatenated data (workers/pattern_zoo.py). After every
optimizer step every rank's parameters, buffers and optimizer state must be within 1e-6
(relative, float32) of the reference's, or every rank must raise the case's clear error.
The cases run in a few jobs, each case bounded by the worker's watchdog (a hang is reported
with the case's name, never waited out)."""
import sys

import pytest

from support.launch import WORKERS, run_ranks

pytestmark = pytest.mark.distributed

CASE_LIMIT_S = 120

# The numbered patterns of issue 32 (each failed on main before the ledger), then the loops
# popular projects write.
JOBS = {
    "issue-32-patterns": [
        "checkpoint_shared_layer", "checkpoint_shared_layer_unused",      # 1
        "checkpoint_shared_layer_also_outside",                           # 1
        "parameter_order_per_rank", "different_parameters_per_rank",      # 2
        "pcgrad", "assigned_grad", "grad_surgery_after_backward",         # 3
        "hand_accumulation_alternating_heads", "two_backwards_per_step",  # 4
        "loader_accumulation_two_backwards",                              # 5
        "loader_accumulation_model_zero_grad", "loader_split_model_zero_grad",  # 6
        "loader_accumulation_zero_in_place",                              # 6, refused
        "set_to_none_false_unused_branch",                                # 7
        "different_seeds_per_rank",                                       # 8
        "duplicate_parameter",                                            # 9
        "complex_parameter", "bfloat16_parameters",                       # 11
    ],
    "research-loops": [
        "sam", "wgan_gp", "maml_inner_loop", "distillation", "lora", "ema",
        "tied_embeddings", "moe_expert_per_rank", "skip_layer_some_steps",
        "branch_on_one_rank", "gradient_penalty_in_loss", "gan_two_optimizers",
        "dino_teacher_student", "contrastive_local_negatives", "tied_embeddings_lora",
        "lightning_toggle_optimizer", "per_task_optimizers_shared_trunk", "compiled_model",
    ],
    "training-recipes": [
        "plain_sgd", "adamw", "hand_accumulation", "loader_accumulation", "model_zero_grad",
        "loader_accumulation_create_graph",
        "schedulers", "onecycle", "clip_grad_norm", "synchronize_clip_skip", "grad_scaler",
        "unfreeze_mid_training", "retain_graph_twice",
        "checkpoint_non_reentrant_shared", "fairseq_update_freq", "backwards_per_rank_differ",
        "zero_grad_between_forward_and_backward", "freeze_by_epoch",
        "clip_error_if_nonfinite_one_rank", "grad_scaler_inf_one_rank",
    ],
}


def zoo_cases():
    sys.path.insert(0, WORKERS)
    try:
        import pattern_zoo
    finally:
        sys.path.remove(WORKERS)
    return pattern_zoo.CASES


# One replica takes other paths: the loader splits a step in four into two half batches
# to measure the noise (pattern 6 needs no accumulation there), and nothing is averaged.
ONE_REPLICA = ["loader_split_model_zero_grad", "loader_accumulation_model_zero_grad",
               "loader_accumulation_two_backwards", "two_backwards_per_step",
               "hand_accumulation_alternating_heads", "set_to_none_false_unused_branch",
               "grad_scaler", "checkpoint_shared_layer_also_outside"]


def test_the_jobs_run_every_case_of_the_zoo():
    listed = [name for names in JOBS.values() for name in names]
    assert sorted(listed) == sorted(zoo_cases())
    assert len(listed) >= 30


@pytest.mark.parametrize("job", sorted(JOBS) + ["one-replica"])
def test_every_loop_matches_the_reference_or_every_rank_refuses_it(job):
    names, np = (ONE_REPLICA, 1) if job == "one-replica" else (JOBS[job], 2)
    result = run_ranks("pattern_zoo.py", np=np, launcher="python" if np == 1 else "gloo",
                       args=["--cases", ",".join(names), "--timeout", CASE_LIMIT_S],
                       timeout=CASE_LIMIT_S * len(names) + 60)
    failures = []
    for name in names:
        for rank in range(np):
            outcome = result.reports.get(rank, {}).get(name)
            if outcome is None:
                failures.append(f"{name} on rank {rank}: not run (the job ended first)")
            elif not outcome["ok"]:
                failures.append(f"{name} on rank {rank}: {outcome}")
    assert not failures, "\n".join(failures) + "\n" + result.output[-3000:]
    assert result.returncode == 0, result.output[-3000:]
