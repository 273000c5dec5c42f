"""Small faults a new user meets first: a checkout whose Rust extension was not built in place, config warnings
printed several times, ``grpo validate`` asking for what only the run's own hosts need, and docs that cite a file
the repository does not hold."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flow_helpers import grpo_train_command

import packer_rs
from grpo_core.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
#: The Sample schema's columns (DESIGN.md §6, the rollout-trainer contract), an independent list to check against.
SAMPLE_COLUMNS = {"sample_id", "group_id", "prompt_index", "input_ids", "completion_mask", "sampler_logprobs"}


def _checkout_without_extension(tmp_path: Path) -> Path:
    """A folder laid out as a checkout whose ``packer_rs/`` holds the package's source but no built extension."""
    checkout = tmp_path / "checkout"
    (checkout / "packer_rs").mkdir(parents=True)
    shutil.copy(ROOT / "packer_rs" / "__init__.py", checkout / "packer_rs" / "__init__.py")
    assert not list((checkout / "packer_rs").glob("_native*"))
    return checkout


def _installed_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A site folder holding packer_rs as a wheel installs it (the package and its built extension); returns the
    folder and the extension's path there."""
    built = Path(packer_rs._native.__file__)  # the extension this test process loaded
    site = tmp_path / "site"
    (site / "packer_rs").mkdir(parents=True)
    shutil.copy(ROOT / "packer_rs" / "__init__.py", site / "packer_rs" / "__init__.py")
    shutil.copy(built, site / "packer_rs" / built.name)
    return site, site / "packer_rs" / built.name


def _run(args: list[str], cwd: Path, drop: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess:
    """``args`` run in ``cwd`` with this checkout's packages on the path (not another copy an editable install or
    a .pth file names), ``env`` set and the variables ``drop`` unset."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    env = {k: v for k, v in {**os.environ, **env}.items() if k not in drop}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_a_checkout_without_a_built_extension_takes_the_installed_one(tmp_path):
    checkout = _checkout_without_extension(tmp_path)
    site, extension = _installed_copy(tmp_path)
    code = (
        "import packer_rs, packer_rs._native as n; print(packer_rs.__file__); print(n.__file__); "
        "print(','.join(packer_rs.sample_schema().names))"
    )
    # python -c puts the working folder (the checkout) first, as every grpo process does; the wheel's folder after
    done = _run([sys.executable, "-c", code], cwd=checkout, PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    assert done.returncode == 0, done.stderr
    package, native, columns = done.stdout.split()
    assert Path(package) == checkout / "packer_rs" / "__init__.py"  # the checkout's source folder did shadow it
    assert Path(native) == extension  # and the installed wheel's extension was found
    assert set(columns.split(",")) >= SAMPLE_COLUMNS  # the extension works


def test_no_extension_anywhere_names_the_command_that_builds_it(tmp_path):
    checkout = _checkout_without_extension(tmp_path)
    # -S: no site-packages, so no installed (or editable) packer_rs is on the path
    done = _run([sys.executable, "-S", "-c", "import packer_rs"], cwd=checkout, PYTHONPATH="")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: packer_rs: the Rust extension packer_rs._native is not built in "), last
    assert str(checkout / "packer_rs") in last and "`make install`" in last and "pip install ." in last


def test_grpo_validate_runs_in_a_checkout_whose_extension_is_not_built_in_place(tmp_path):
    checkout = _checkout_without_extension(tmp_path)
    site, _ = _installed_copy(tmp_path)
    args = ["--set", f"train.output_dir={tmp_path / 'runs'}", "--set", f"tracking.dir={tmp_path / 'mlflow'}"]
    done = _run(
        [sys.executable, "-m", "flows.cli", "validate", "--config", str(TINY), *args],
        cwd=checkout,
        PYTHONPATH=f"{site}{os.pathsep}{ROOT}",
    )
    assert done.returncode == 0, done.stderr
    assert f"{TINY}: valid" in done.stderr.replace("\n", " ")
    assert "packer_rs" not in done.stderr


def test_the_docs_cite_no_file_outside_the_repository():
    """DESIGN.md and STYLE.md are the team's guides, kept outside the repository: a page citing them sends the
    reader nowhere (docs/algorithms.md and docs/metrics.md hold the same content)."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 10
    for name in ("DESIGN.md", "STYLE.md"):
        assert not (ROOT / name).exists()
        citing = [p.name for p in pages if name in p.read_text()]
        assert citing == [], f"{name} is cited by {citing}"


def test_the_configuration_reference_has_no_broken_inline_code():
    """Every RST ````code```` span of a field's docstring is one Markdown code span, even when the docstring breaks
    it across lines (``flow.concurrency_limit`` did: ````grpo\\n deploy````)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "``" not in text
    for line in text.splitlines():
        if line.startswith("| `"):
            assert line.replace("\\|", "").count("`") % 2 == 0, line  # every span closed on its row
    row = next(line for line in text.splitlines() if line.startswith("| `flow.concurrency_limit`"))
    assert "(`grpo deploy` creates `gpu` with one slot per GPU)" in row, row


def test_the_generator_joins_a_code_span_broken_across_lines():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_config_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    cell = gen_config_reference._rst_to_md("limit (``grpo\n    deploy`` creates ``gpu``); None = none.")
    assert cell == "limit (`grpo deploy` creates `gpu`); None = none."


def test_grpo_validate_notes_what_only_the_runs_own_hosts_need(tmp_path, monkeypatch):
    """vLLM where the flow starts vLLM replicas, and a multi-node run's shared token on trainer-0: ``grpo validate``
    (which may run ahead of deployment, elsewhere) notes their absence and passes; ``grpo train`` refuses."""
    import importlib.util

    from typer.testing import CliRunner

    from flows.cli import app

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: nothing to note")
    monkeypatch.delenv("GRPO_RUN_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)
    where = ["--set", f"train.output_dir={tmp_path / 'runs'}", "--set", f"tracking.dir={tmp_path / 'mlflow'}"]
    cases = {
        # vLLM on GPU 1 beside the trainer's GPU 0: a layout the NCCL weight transfer can use (preflight checks it)
        "vllm": ["--set", "server.backend=vllm", "--set", "server.gpu_ids=[1]"],
        "token": ["--set", "train.nnodes=2", "--set", "train.rdzv_endpoint=trainer-0:29400"],
    }
    for what, sets in cases.items():  # in this process (the command's own code path; a subprocess costs ~15 s each)
        done = CliRunner().invoke(app, ["validate", "--config", str(TINY), *where, *sets])
        output = " ".join(done.output.split())  # rich wraps long lines
        assert done.exit_code == 0, (what, done.output)
        notes = output.split("note: ")[1:]
        assert len(notes) == 1, (what, done.output)
        if what == "vllm":
            assert "vllm is not installed here" in notes[0] and "pip install vllm" in notes[0], notes
        else:
            assert "train.nnodes=2 needs GRPO_RUN_TOKEN" in notes[0] and "it is not set" in notes[0], notes
        assert "config error" not in output and "valid" in output
    # grpo train as a user runs it: its own process, refused before any flow or server starts
    train = grpo_train_command(tmp_path, *(s for s in cases["vllm"] if s != "--set"))
    done = _run(train, cwd=tmp_path, drop=("GRPO_RUN_TOKEN",))
    assert done.returncode == 2, done.stderr  # a config error: refused before any flow or server starts
    assert "config error: server.backend is 'vllm'" in done.stderr and "pip install vllm" in done.stderr
    assert "note: " not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_cuda_trainer_on_a_host_without_a_gpu_is_noted_by_validate_and_refused_by_train(tmp_path, monkeypatch, gpus):
    """``train.device: cuda`` where torch sees no GPU: ``grpo validate`` notes it (it may run ahead of deployment) and
    the run's own check refuses it, naming the field and the fix, before any server starts (it used to pass, and
    the trainer failed in ``torch.cuda.set_device`` once the servers were up); one GPU seen: nothing to say."""
    import torch
    from typer.testing import CliRunner

    from flows.cli import app
    from grpo_core.errors import ConfigError
    from grpo_core.run.preflight import check_run

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)  # the host's GPUs, whatever this box has
    monkeypatch.chdir(tmp_path)
    sets = [f"train.output_dir={tmp_path / 'runs'}", f"tracking.dir={tmp_path / 'mlflow'}", "train.device=cuda"]
    result = CliRunner().invoke(app, ["validate", "--config", str(TINY), *sum((["--set", w] for w in sets), [])])
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())  # rich wraps long lines
    notes = [n for n in output.split("note: ")[1:] if n.startswith("train.device")]
    cfg = load_config(TINY, [*sets[:2], "train.device=cuda"])
    if gpus:
        assert notes == [], output
        assert check_run(cfg, create=True) == []
        return
    assert len(notes) == 1, output
    assert "train.device is 'cuda' but torch sees no CUDA GPU on this host" in notes[0], notes
    assert "set train.device to 'auto'" in notes[0] and "not by `grpo validate`" in notes[0], notes
    with pytest.raises(ConfigError, match=r"train\.device is 'cuda'.*set train\.device to 'auto'") as refused:
        check_run(cfg, create=True)
    assert "grpo validate" not in str(refused.value)
    assert check_run(load_config(TINY, [*sets[:2], "train.device=auto"]), create=True) == []


WARNED = {
    "temperature": "rollout.temperature=0 makes the 4 rollouts of a group identical",
    "mixture": "rollout.mixture_epoch_size has no effect without rollout.datasets",
    "overlong": "rollout.overlong_penalty_factor has no effect without rollout.overlong_buffer_len",
    "unused": "server.max_num_seqs: no effect",
}


def _warned_config(tmp_path: Path) -> Path:
    """tiny.yaml with settings that each draw a config warning: three of the rollout section's validator and one of
    the run's unused settings (a launch setting of servers this host does not start)."""
    data = yaml.safe_load(TINY.read_text())
    data["rollout"].update(temperature=0, mixture_epoch_size=10, overlong_penalty_factor=0.5)
    data["server"] = {"urls": ["http://127.0.0.1:9"], "max_num_seqs": 8, "max_model_len": 256}
    data["train"]["output_dir"] = str(tmp_path / "runs")
    data["tracking"] = {"dir": str(tmp_path / "mlflow")}
    path = tmp_path / "warned.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_grpo_validate_prints_each_config_warning_once(tmp_path):
    config = _warned_config(tmp_path)
    done = _run([sys.executable, "-m", "flows.cli", "validate", "--config", str(config)], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for what, text in WARNED.items():
        assert done.stderr.count(text) == 1, (what, done.stderr)


def test_a_config_warning_is_logged_once_per_process_however_often_the_config_is_validated(tmp_path, caplog):
    from grpo_core.config import forget_shown
    from grpo_core.rollout.build import loop_class_and_config

    forget_shown()  # as in a fresh process
    config = _warned_config(tmp_path)
    with caplog.at_level(logging.WARNING, logger="grpo_core"):
        cfg = load_config(config)
        load_config(config)  # grpo resume loads a config twice
        RunConfig.model_validate(cfg.model_dump())  # a saved config read back
        loop_class_and_config(cfg.rollout)  # the preflight re-validates the rollout section as the loop's config
        cfg.rollout.max_completion_length = 16  # an assignment re-runs the section's validators
    messages = [r.getMessage() for r in caplog.records]
    for what, text in WARNED.items():
        assert sum(text in m for m in messages) == 1, (what, messages)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_core"):
        load_config(config, ["rollout.num_generations=2"])  # another message: shown
        load_config(config)  # the same messages as before: not shown again
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "rollouts of a group identical" in m] == [
        "rollout.temperature=0 makes the 2 rollouts of a group identical: every group has zero reward std and is "
        "dropped; raise rollout.temperature"
    ], messages
    forget_shown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpo_core"):
        load_config(config)
    assert sum(WARNED["mixture"] in r.getMessage() for r in caplog.records) == 1  # shown again after forget_shown
    forget_shown()  # leave nothing shown for the next test of this process
