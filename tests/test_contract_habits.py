"""The loops people write in real training code, at every stage, against one process
(tests/workers/contract_habits.py, in the launch per world size of world_cases.py): each is
made right, or refused at the first moment it can be detected with a message that says what
to do instead.
"""

from __future__ import annotations

import pytest
from common import case_reports

from zero_lab.launch import LaunchError, torchrun
from zero_lab.launch.paths import REPO_ROOT

FP32_ATOL = 1e-6  # fp32 weights after a few Adam steps (the contract tests measure ~2e-7)


@pytest.fixture(params=[2, 3], scope="module", ids=lambda n: f"N={n}")
def ranks(request):
    return request.param, case_reports("contract_habits", request.param)


def runs(ranks, case: str) -> list[tuple[int, dict]]:
    _, reps = ranks
    out = []
    for rank, rep in enumerate(reps):
        found = rep[case]
        assert isinstance(found, list), (case, rank, found)  # the case itself did not crash
        out += [(rank, r) for r in found]
    return out


def test_training_goes_on_after_an_exception_caught_in_backward(ranks):
    """An OOM-skip loop: the second step's backward raises on every rank, the loop zeroes the
    gradients and goes on; three more steps train as in one process."""
    found = runs(ranks, "backward_raises")
    assert sorted({r["stage"] for _, r in found}) == [0, 1, 2, 3]
    for rank, r in found:
        assert "error" not in r, (rank, r)
        assert r["max_abs_diff"] <= FP32_ATOL, (rank, r)


def test_torch_clip_grad_norm_on_all_parameters_is_the_global_norm(ranks):
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c): each rank alone would see only
    its slices (stage 1: the norm of its slice, stage 2: 0.0, no gradients on the
    parameters; stage 3: its pieces); shard() routes it to opt.clip_grad_norm_, the global
    norm, at every stage."""
    found = runs(ranks, "torch_clip")
    assert sorted({r["stage"] for _, r in found}) == [0, 1, 2, 3]
    for rank, r in found:
        assert "error" not in r, (rank, r)
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=1e-5), (rank, r)
        assert min(r["ref_norms"]) > 0.05  # every step clipped
        assert r["max_abs_diff"] <= FP32_ATOL, (rank, r)


def test_torch_clip_grad_norm_on_some_parameters_is_refused(ranks):
    _, reps = ranks
    for rep in reps:
        for stage, message in rep["torch_clip_subset"].items():
            assert message.startswith(
                f"RuntimeError: torch.nn.utils.clip_grad_norm_ was given 2 of the 6 trainable "
                f"parameters of a model sharded at stage {stage}"), message
            assert "opt.clip_grad_norm_(max_norm)" in message


def test_load_state_dict_reaches_every_copy_of_the_weights(ranks):
    """model.load_state_dict(W) after shard(): full_state_dict is W at once (in mixed
    precision the fp32 masters took W, not only the 16-bit parameters; at stage 3 W has the
    model's own shapes and each rank keeps its piece), and training goes on as one process
    that loaded W. bf16: the ranks round in another order than one process, so two steps
    after the load they sit at bf16's rounding distance (measured 1.2e-3; a load that
    missed the masters is 0.65 off)."""
    found = runs(ranks, "load_weights")
    assert len(found) == 8 * len(ranks[1])
    for rank, r in found:
        assert "error" not in r, (rank, r)
        assert r["after_load"] == 0.0, (rank, r)
        bound = FP32_ATOL if r["precision"] == "fp32" else 1e-2
        assert r["max_abs_diff"] <= bound, (rank, r)


def test_stage3_state_dict_is_refused_and_wrong_shapes_are_named(ranks):
    _, reps = ranks
    for rank, rep in enumerate(reps):
        found = rep["stage3_state"]
        assert found["state_dict"].startswith(
            "RuntimeError: model.state_dict() at stage 3 would hold this rank's 1-D pieces of "
            "the parameters"), found
        assert "full_state_dict(model)" in found["state_dict"]
        assert "zero_lab.checkpoint" in found["state_dict"]
        assert found["wrong_shape"] == (
            "ValueError: load_state_dict: 2.weight has shape (9, 10) in the state dict, the "
            "model's is (9, 9)"), (rank, found)


def test_rank0_optimizer_state_loaded_everywhere_is_refused_where_ranks_differ(ranks):
    """Stage 0: every rank holds the whole state, rank 0's is everyone's (the DDP habit is
    right). Stages 1-3: each rank holds the state of its slices; rank 0's loaded elsewhere is
    refused, as torch's ZeroRedundancyOptimizer refuses it; each rank's own loads."""
    n, reps = ranks
    for rank, rep in enumerate(reps):
        for stage, found in rep["opt_state_rank0"].items():
            assert found["own"] == "no error", (rank, stage, found)
            if stage == "0" or rank == 0:
                assert found["rank0"] == "no error", (rank, stage, found)
                continue
            assert found["rank0"].startswith(
                f"ValueError: opt.load_state_dict: this state was saved by rank 0 of {n} "
                f"(stage {stage}), this is rank {rank} of {n}"), found
            assert "zero_lab.checkpoint" in found["rank0"]


def test_add_param_group_after_shard_is_refused(ranks):
    _, reps = ranks
    for rep in reps:
        for stage, message in rep["add_group"].items():
            assert message.startswith("RuntimeError: opt.add_param_group after shard()"), \
                (stage, message)
            assert "optimizer function given to shard()" in message


def test_a_parameter_unfrozen_after_shard_is_refused_at_the_next_backward(ranks):
    _, reps = ranks
    for rep in reps:
        for stage, message in rep["unfrozen"].items():
            assert message.startswith(
                "RuntimeError: 0.weight was frozen (requires_grad=False) when shard() ran and "
                "has been unfrozen since"), (stage, message)


def test_frozen_batchnorm_in_eval_mode_is_exact_and_training_mode_is_refused(ranks):
    _, reps = ranks
    for rank, rep in enumerate(reps):
        found = rep["batchnorm"]
        assert isinstance(found, dict) and "frozen" in found, found
        assert sorted(r["stage"] for r in found["frozen"]) == [0, 1, 2, 3]
        for r in found["frozen"]:
            assert "error" not in r, (rank, r)
            assert r["max_abs_diff"] <= FP32_ATOL, (rank, r)
        for stage, message in found["training"].items():
            assert message.startswith(
                "RuntimeError: 1 is a BatchNorm1d in training mode"), (stage, message)
            assert "GroupNorm" in message and ".eval()" in message


def test_small_ones(ranks):
    n, reps = ranks
    for rep in reps:
        found = rep["small"]
        assert found["full_state_dict_str"] == (
            "TypeError: full_state_dict takes the model shard() returned (an nn.Module), got str")
        assert found["zero_disagree"] == (
            "ValueError: the ranks called ZeroRedundancyOptimizer() differently: rank 1 has "
            "parameters[0] = ((4, 6), 'torch.float32', True) where rank 0 has ((6, 4), "
            "'torch.float32', True). Every rank must shard the same model (same parameter "
            "names and shapes) with the same settings")
        assert found["zero_outside"].startswith(
            "RuntimeError: this SGD steps parameters of a model sharded at stage 1"), found


def test_a_rank_that_never_calls_shard_is_named(temp_dir):
    """Rank 1 skips shard() and finishes; rank 0 fails waiting for it ("connection closed by
    peer"): the error names rank 1 and says why."""
    with pytest.raises(LaunchError) as info:
        torchrun(REPO_ROOT / "tests" / "workers" / "contract_skip_shard.py", nproc=2,
                 timeout=120, stream=False, backend="gloo")
    assert info.value.rank == 1
    assert info.value.cause.startswith(
        "rank 1 of 2 finished contract_skip_shard.py while rank(s) 0 still waited for it in a "
        "collective: every rank must make the same collective calls in the same order"), \
        info.value.cause


def test_buffers_follow_rank_0_before_every_training_forward_as_torch_ddp(ranks):
    """A buffer forward updates and reads (an EMA): with broadcast_buffers=True (the default,
    as torch's DDP) every rank starts each training forward from rank 0's buffers, and the
    weights and each rank's buffer end as DDP's; full_state_dict holds rank 0's buffer on every
    rank. broadcast_buffers=False: each rank keeps its own, as DDP with the same option. And
    when the buffer changes on some ranks only (rank 0 never updates it), the ranks still
    agree to broadcast, as DDP, which broadcasts every time (before: the ranks that saw no
    change sent nothing, and the others' broadcast met another collective)."""
    found = runs(ranks, "buffers")
    assert {(r["broadcast_buffers"], r["not_on_rank0"], r["stage"]) for _, r in found} == {
        (b, only, s) for b, only in ((True, False), (False, False), (True, True))
        for s in range(4)}
    for rank, r in found:
        assert "error" not in r, (rank, r)
        assert r["params_diff"] <= FP32_ATOL, (rank, r)
        assert r["own_ema_diff"] <= FP32_ATOL, (rank, r)
        if r["broadcast_buffers"]:
            assert r["full_ema_vs_rank0"] == 0.0, (rank, r)


def test_torch_compile_works_at_stages_0_to_2_and_is_refused_at_stage_3():
    reps = case_reports("contract_habits", 2)  # at N = 2 only (contract_habits.py says why)
    for rank, rep in enumerate(reps):
        found = rep["compiled"]
        assert isinstance(found, dict) and "stages" in found, found
        assert [r["stage"] for r in found["stages"]] == [0, 1, 2]
        for r in found["stages"]:
            assert "error" not in r, (rank, r)
            assert r["max_abs_diff"] <= FP32_ATOL, (rank, r)
        for backend, message in found["stage3"].items():
            assert message.startswith(
                "RuntimeError: torch.compile of a model sharded at stage 3 is not supported: "
                "stage 3 gathers and frees each unit's parameters in module hooks"), \
                (backend, message)


def test_a_rank_that_steps_once_more_is_named_on_every_rank(ranks):
    """The last rank calls opt.step() twice at step 2. Stages 1-2 used to hang (its all-gather
    met the others' reduce-scatter), stages 0 and 3 to train apart in silence. Now every rank
    raises at the first collective after the extra step, naming the rank; at the very end,
    full_state_dict() is where they meet."""
    n, _ = ranks
    found = runs(ranks, "lockstep_steps")
    assert sorted({(r["stage"], r["when"]) for _, r in found}) == [
        (s, w) for s in range(4) for w in ("end", "mid")]
    for rank, r in found:
        assert r["error"].startswith("the ranks left lockstep: "), (rank, r)
        assert "every rank must call forward, backward and opt.step() the same number" \
            in r["error"], (rank, r)
        if r["stage"] < 3:  # the extra step checks before it would send: the phases differ
            assert (f"rank {n - 1} is in an opt.step() with no backward since its last step "
                    "(3 optimizer steps taken)") in r["error"], (rank, r)
        else:  # stage 3's step sends nothing: the next check tells them apart by their count
            doing = "ended a forward" if r["when"] == "mid" else "is in full_state_dict()"
            assert f"rank {n - 1} {doing} (4 optimizer steps taken" in r["error"], (rank, r)
            assert f"rank 0 {doing} (3 optimizer steps taken" in r["error"], (rank, r)
        if r["when"] == "end":  # the extra step was the last: full_state_dict() meets it
            assert "rank 0 is in full_state_dict() (3 optimizer steps taken)" in r["error"]
        # Raised at the first collective after the extra step, never later.
        if rank == n - 1 and r["stage"] < 3:
            expected = "extra step 2"
        else:
            expected = "step 3" if r["when"] == "mid" else "full_state_dict"
        assert r["where"] == expected, (rank, r)


def test_a_rank_dependent_unit_order_at_stage_3_is_named_in_that_forward(ranks):
    """From step 2, the last rank runs unit b before unit a (two units of one size, so their
    all-gathers pair without an error). It used to compute with a mix of both and then
    hang; the check at the end of forward raises in that forward, with both orders."""
    n, _ = ranks
    found = runs(ranks, "lockstep_order")
    assert sorted(r["prefetch"] for _, r in found) == sorted([False, True] * n)
    for rank, r in found:
        assert r["where"] == "forward 2", (rank, r)
        assert "the ranks ran the units of this forward in different orders" in r["error"]
        assert "rank 0 ended a forward (2 optimizer steps taken; gathering a, b, head)" \
            in r["error"], (rank, r)
        assert (f"rank {n - 1} ended a forward (2 optimizer steps taken; gathering b, a, head)"
                in r["error"]), (rank, r)


def test_the_lockstep_check_is_one_control_record_a_step_apart_from_the_data(ranks):
    """24 bytes a rank, once a step, at every stage; the ledger's records (and so every
    volume the notebooks assert) hold the data collectives only."""
    n, _ = ranks
    found = runs(ranks, "lockstep_ledger")
    for rank, r in found:
        assert r["control"] == [["all_gather", 24 * n]], (rank, r)
        assert r["ops"] == (["all_reduce"] if r["stage"] == 0
                            else ["all_gather", "reduce_scatter"]), (rank, r)
        assert f"(and 1 control message(s) of {24 * n} bytes, not counted above)" in r["table"]
