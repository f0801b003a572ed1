"""A notebook's parameters, checked in the cell after its `parameters` cell, before any work:
each rule refused by name, with the value and the rule (zero_lab.course.parameters).

Each test names the mutant of `check_parameters` it catches."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_lab.course import parameters
from zero_lab.course.parameters import TooFewRanks, check_parameters, mlp_rank_bytes
from zero_lab.launch import TooFewGPUs
from zero_lab.launch.capacity import RANK_BASE_BYTES

GiB = 2**30


@pytest.fixture(autouse=True)
def big_machine(monkeypatch):
    """A machine with room for the ranks below unless a test says otherwise (the check reads
    cores and memory through zero_lab.launch.capacity)."""
    monkeypatch.setattr("zero_lab.launch.capacity.available_cores", lambda: 16)
    monkeypatch.setattr("zero_lab.launch.capacity.available_memory", lambda: 64 * GiB)


def test_the_defaults_pass_and_return_the_backend():
    assert check_parameters(2, "auto", "cpu", width=512, depth=6) == "gloo"
    assert check_parameters(2, "gloo", "auto") == "gloo"


@pytest.mark.parametrize("value", ["2", 2.0, True, None])
def test_nproc_of_another_type_is_refused_by_name(value):
    # mutant: no type check (a string reaches torch code: "'>=' not supported between ...")
    with pytest.raises(TypeError) as info:
        check_parameters(value, "auto", "cpu")
    text = str(info.value)
    assert text.startswith(f"parameter nproc={value!r}") and "an int >= 1" in text, text


@pytest.mark.parametrize("value", [0, -2])
def test_nproc_below_one_is_refused(value):
    # mutant: `nproc < 0` instead of `nproc < 1`, or no bound at all
    with pytest.raises(ValueError, match=rf"parameter nproc={value}: .*an int >= 1"):
        check_parameters(value, "auto", "cpu")


def test_a_notebook_about_communication_refuses_one_rank_by_name():
    # mutant: min_nproc ignored (notebook 02 then failed 30 s in: "no timings with
    # world_size > 1"; 04, 06 and 07 at an assertion about what ranks send)
    with pytest.raises(TooFewRanks, match=r"parameter nproc=1: must be at least 2: "):
        check_parameters(1, "auto", "cpu", min_nproc=2)
    assert check_parameters(2, "auto", "cpu", min_nproc=2) == "gloo"


def test_nproc_must_divide_the_batch_it_shards():
    # mutant: divisibility not checked (the launch fails 35 s in, inside a rank)
    with pytest.raises(ValueError) as info:
        check_parameters(3, "auto", "cpu", divides={"batch": 16}, batch=16)
    text = str(info.value)
    assert text.startswith("parameter batch=16: ") and "nproc=3" in text, text
    assert "1, 2, 4, 8, 16" in text, text  # the nproc that work
    assert check_parameters(4, "auto", "cpu", divides={"batch": 16}, batch=16) == "gloo"


def test_a_batch_split_into_more_parts_names_them():
    # notebook 08: each rank's rows are cut into k micro-batches, so nproc x lcm(ks) divides
    # mutant: the parts ignored, nproc alone checked
    with pytest.raises(ValueError, match=r"parameter mlp\['batch'\]=32: .*nproc x lcm\(ks\)=48"):
        check_parameters(2, "auto", "cpu", divides={"mlp['batch']": (32, 48, "nproc x lcm(ks)")})
    check_parameters(2, "auto", "cpu", divides={"mlp['batch']": (32, 16, "nproc x lcm(ks)")})


@pytest.mark.parametrize("name, value", [("width", "512"), ("depth", 6.0), ("steps", 0),
                                         ("worlds", [1, "2"]), ("worlds", []),
                                         ("gpt", {"width": 64, "seq": -1}), ("rows", False)])
def test_sizes_must_be_positive_ints(name, value):
    # mutant: sizes not checked, or only their sign (a string from `-r width 512` passes)
    with pytest.raises((TypeError, ValueError)) as info:
        check_parameters(2, "auto", "cpu", **{name: value})
    assert str(info.value).startswith(f"parameter {name}={value!r}: "), info.value
    assert "positive int" in str(info.value)


def test_numbers_may_be_fractional_but_not_strings():
    # mutant: numbers held to ints (bucket_kb = 0.5 refused) or not checked ("16" passes)
    check_parameters(2, "auto", "cpu", numbers={"bucket_kb": 0.5, "buckets": [0.5, 1, 2]})
    with pytest.raises(TypeError, match=r"parameter bucket_kb='16': .*positive number"):
        check_parameters(2, "auto", "cpu", numbers={"bucket_kb": "16"})


def test_rules_computed_from_the_parameters_wait_for_their_check():
    # notebook 08 computes nproc x lcm(ks) and the memory from its parameters; a string from
    # `-r` must be refused by name, not crash in that arithmetic.
    # mutant: the functions called before the sizes are checked
    import math

    ks, width = ["4"], "64"
    with pytest.raises(TypeError, match=r"parameter ks=\['4'\]: "):
        check_parameters(2, "auto", "cpu", ks=ks, width=width,
                         divides=lambda: {"batch": (32, 2 * math.lcm(*ks), "nproc x lcm(ks)")},
                         rank_bytes=lambda: mlp_rank_bytes(width, 4, 32),
                         ranks=lambda: {"math.prod(ks)": math.prod(ks) * 2})
    with pytest.raises(ValueError, match=r"nproc x lcm\(ks\)=16"):
        check_parameters(2, "auto", "cpu", ks=[8],
                         divides=lambda: {"batch": (8, 2 * math.lcm(*[8]), "nproc x lcm(ks)")})


def test_choices_are_named():
    # mutant: choices not checked
    check_parameters(2, "auto", "cpu", choices={"sweep": ("long", ("short", "long"))})
    with pytest.raises(ValueError, match=r"parameter sweep='fast': must be one of 'short', "
                                         r"'long'"):
        check_parameters(2, "auto", "cpu", choices={"sweep": ("fast", ("short", "long"))})


@pytest.mark.parametrize("name, backend, device", [("backend", "mpi", "auto"),
                                                   ("device", "auto", "gpu"),
                                                   ("backend", 2, "auto")])
def test_backend_and_device_values(name, backend, device):
    # mutant: values passed on unchecked (refused later, or never)
    with pytest.raises((TypeError, ValueError)) as info:
        check_parameters(2, backend, device)
    value = {"backend": backend, "device": device}[name]
    assert str(info.value).startswith(f"parameter {name}={value!r}: must be one of"), info.value


def test_device_decides_the_backend(monkeypatch):
    # device="cpu" runs gloo even where there are GPUs; device="cuda" without enough GPUs is
    # refused naming device. mutant: device dropped before resolve_backend
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert check_parameters(2, "auto", "auto") == "nccl"
    assert check_parameters(2, "auto", "cpu") == "gloo"
    assert check_parameters(2, "auto", "cuda") == "nccl"
    with pytest.raises(ValueError, match=r"parameter device='cuda' .*nproc=8 but this machine "
                                         r"has 4"):
        check_parameters(8, "auto", "cuda")
    with pytest.raises(ValueError, match=r"parameter device='cpu' .*backend='nccl' cannot run"):
        check_parameters(2, "nccl", "cpu")


def test_device_cuda_without_a_gpu_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"parameter device='cuda' .*has 0"):
        check_parameters(1, "auto", "cuda")


def test_nproc_checked_against_the_cores(monkeypatch):
    # mutant: no capacity check (64 ranks on 2 cores: the out-of-memory killer, 26 s in)
    monkeypatch.setattr("zero_lab.launch.capacity.available_cores", lambda: 2)
    with pytest.raises(ValueError, match=r"nproc=64 ranks on 2 cores: refused"):
        check_parameters(64, "auto", "cpu")


def test_nproc_checked_against_the_memory_a_rank_needs(monkeypatch):
    # mutant: rank_bytes not passed on (the base alone fits, the model does not)
    monkeypatch.setattr("zero_lab.launch.capacity.available_memory", lambda: 4 * GiB)
    check_parameters(4, "auto", "cpu", rank_bytes=RANK_BASE_BYTES)
    with pytest.raises(ValueError, match=r"nproc=4 ranks need about 8,192 MiB"):
        check_parameters(4, "auto", "cpu", rank_bytes=2 * GiB)


def test_no_capacity_check_where_nothing_is_launched(monkeypatch):
    # notebook 01 runs in one process: its nproc is only type-checked
    monkeypatch.setattr("zero_lab.launch.capacity.available_cores", lambda: 1)
    assert check_parameters(64, "auto", "cpu", rank_bytes=None) == "gloo"


def test_other_launch_sizes_are_checked_by_their_name(monkeypatch):
    # notebook 07's measured_worlds and 08's HSDP mesh launch ranks too
    # mutant: `ranks` ignored
    monkeypatch.setattr("zero_lab.launch.capacity.available_cores", lambda: 2)
    with pytest.raises(ValueError, match=r"max\(measured_worlds\)=16 ranks on 2 cores"):
        check_parameters(2, "auto", "cpu", ranks={"max(measured_worlds)": 16})


def test_other_launch_sizes_on_nccl_need_their_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # a TooFewGPUs (make gpu-check's skip: notebook 08's HSDP on one GPU), naming the launch
    # mutant: _resolve re-raising a plain ValueError
    with pytest.raises(TooFewGPUs, match=r"parameter math.prod\(hsdp_mesh\)=4 .*has 2"):
        check_parameters(2, "auto", "cuda", ranks={"math.prod(hsdp_mesh)": 4})
    # on gloo they need no GPU
    assert check_parameters(2, "auto", "cpu", ranks={"math.prod(hsdp_mesh)": 4}) == "gloo"


def test_mlp_rank_bytes_grows_with_the_model_and_the_batch():
    # 16 bytes a parameter (weight, gradient, Adam's m and v) per model alive, + activations
    base = mlp_rank_bytes(1, 1, 1, models=0)
    assert base >= RANK_BASE_BYTES
    psi = 6 * (512 * 512 + 512)
    assert mlp_rank_bytes(512, 6, 0, models=1) - mlp_rank_bytes(1, 1, 0, models=0) >= 16 * psi
    assert mlp_rank_bytes(512, 6, 64) > mlp_rank_bytes(512, 6, 16) > mlp_rank_bytes(256, 6, 16)
    assert parameters.mlp_rank_bytes(4096, 6, 64) > 3 * GiB  # 2 x 100.7M parameters x 16 B


# ---- notebook 00 under papermill: the validation cell is where bad parameters stop ----------

NOTEBOOK_00 = Path(__file__).resolve().parent.parent / "notebooks" / "00_setup.ipynb"


def _run_00(tmp_path, parameters: dict):
    """Notebook 00 up to its first launch's checks, executed by papermill with `parameters`
    (in tmp_path, where %%rank_script saves its worker); returns (executed notebook, error)."""
    import nbformat
    import papermill

    from zero_lab.course.runner import kernel_config

    nb = nbformat.read(NOTEBOOK_00, as_version=4)
    last = next(i for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and "every rank holds" in c.source)
    nb.cells = nb.cells[:last + 1]
    source, out = tmp_path / "00_setup.ipynb", tmp_path / "00_setup.out.ipynb"
    nbformat.write(nb, source)
    try:
        papermill.execute_notebook(str(source), str(out), parameters=parameters,
                                   cwd=str(tmp_path), kernel_name="python3", progress_bar=False,
                                   config=kernel_config())
    except papermill.PapermillExecutionError as err:
        return nbformat.read(out, as_version=4), err
    return nbformat.read(out, as_version=4), None


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def test_notebook_00_runs_on_the_backend_its_device_says(tmp_path, temp_dir):
    # device="cpu" runs gloo, even on a machine with GPUs (failed before: the parameter was
    # ignored, and "auto" picked NCCL where there was a GPU per rank)
    executed, error = _run_00(tmp_path, {"device": "cpu"})
    assert error is None, error
    said = "".join(_stdout(c) for c in executed.cells)
    assert "2 ranks, backend=gloo, device=cpu" in said, said
    assert "rank 0/2 on gloo: 1 -> 3" in said, said  # what the ranks themselves ran on


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("parameters, error, message", [
    ({"device": "cuda"}, "TooFewGPUs", "parameter device='cuda'"),  # failed before: device=cuda
    ({"nproc": "2"}, "TypeError", "parameter nproc='2'"),  # failed before: deep in torch code
])
def test_notebook_00_refuses_in_its_validation_cell(tmp_path, parameters, error, message):
    executed, err = _run_00(tmp_path, parameters)
    assert err is not None and err.ename == error and message in err.evalue, err
    [failed] = [i for i, c in enumerate(executed.cells)
                if any(o.output_type == "error" for o in c.get("outputs", []))]
    assert "check_parameters(" in executed.cells[failed].source
    tags = [c.metadata.get("tags", []) for c in executed.cells[:failed]
            if "papermill-error-cell-tag" not in c.metadata.get("tags", [])]
    assert "injected-parameters" in tags[-1] and "parameters" in tags[-2]  # right after them
    assert not any(c.get("execution_count") for c in executed.cells[failed + 1:])  # nothing ran
