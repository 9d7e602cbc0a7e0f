"""``python -m fsdp2lite.run SCRIPT ...``: an unchanged script sharded by fsdp2lite (issue 30 item 5).

The HF workflow: a Trainer script that asks for FSDP2 on its command line (``--fsdp full_shard
--fsdp_config cfg.json`` with ``fsdp_version: 2``), tests/integrations/trainer_script.py, run on 2 gloo
ranks under torchrun once plainly (torch's fully_shard, through Accelerate) and once as ``torchrun -m
fsdp2lite.run trainer_script.py ...``: the losses must be equal at every step, bit for bit (fp32, as in
tests/test_integrations.py), and the Trainer's model must be fsdp2lite's FSDPModule while Accelerate still
takes it for torch's. Full fine-tuning and peft's LoRA (get_peft_model before the Trainer) each. The oracle
trains both in one torchrun (the script's ``--configurations``: process start and imports are most of a
run's time); fsdp2lite's runs stay one per torchrun, as the exit report counts a process's sharding.

The launcher's own contract (``sys.argv``, ``sys.path[0]``, ``__main__``, exit codes, the script's
exceptions) is checked on small scripts in one process each.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cpu_env import cpu_env
from test_example_train import foreign_lines, together

from fsdp2lite import run as launcher

TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "integrations" / "trainer_script.py"
TRAINER_KEEPS_SHARDED_MODELS = "5.19"  # as in tests/test_integrations.py
TRAINER_ARGS = ["--fsdp", "full_shard", "--fsdp_config", "cfg.json", "--per_device_train_batch_size", "2",
                "--max_steps", "4", "--learning_rate", "5e-3", "--lr_scheduler_type", "constant", "--logging_steps",
                "1", "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--use_cpu",
                "--disable_tqdm", "true"]  # fmt: skip
README_REPORT = "python -m fsdp2lite.run: fsdp2lite sharded 6 modules in 5 fully_shard calls on rank 0"
FSDP_CONFIG = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}


def _needs_trainer() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[dev]'")
    pytest.importorskip("accelerate", reason="accelerate is not installed: pip install -e '.[dev]'")
    from packaging.version import Version  # a dependency of transformers

    if Version(transformers.__version__) < Version(TRAINER_KEEPS_SHARDED_MODELS):
        pytest.skip(
            f"transformers {transformers.__version__}: the Trainer needs >= {TRAINER_KEEPS_SHARDED_MODELS} on CPU"
        )


def _train(root: Path, launch: list[str], runs: dict[str, list[str]]) -> tuple[dict[str, list[dict[str, Any]]], str]:
    """One torchrun of the script on 2 ranks, each of ``runs`` (name: its arguments) trained in turn:
    each run's rank records, and what the torchrun printed on stderr."""
    configurations = [
        ["--out", str(root / name), "--output_dir", str(root / name / "trainer"), *extra]
        for name, extra in runs.items()
    ]
    listed = root / f"{'-'.join(runs)}.json"
    listed.write_text(json.dumps(configurations))
    command = [*TORCHRUN_2, *launch, str(SCRIPT), "--configurations", str(listed), *TRAINER_ARGS]
    env = cpu_env(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{list(runs)} run failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    records = {name: [json.loads((root / name / f"rank{rank}.json").read_text()) for rank in range(2)] for name in runs}
    return records, done.stderr


FINETUNES = {"full": [], "lora": ["--lora"]}


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """The oracle, torch's fully_shard: every fine-tuning this machine can run, in one torchrun."""
    _needs_trainer()
    finetunes = [f for f in FINETUNES if f == "full" or importlib.util.find_spec("peft")]
    root = tmp_path_factory.mktemp("launcher")
    (root / "cfg.json").write_text(json.dumps(FSDP_CONFIG))
    records, _ = _train(root, [], {f"torch-{f}": FINETUNES[f] for f in finetunes})
    return root, records


@pytest.mark.parametrize("finetune", list(FINETUNES))
def test_trainer_script_under_the_launcher_equals_torch(
    torch_runs: tuple[Path, dict[str, list[dict[str, Any]]]], finetune: str
) -> None:
    if finetune == "lora":
        pytest.importorskip("peft", reason="peft is not installed: pip install -e '.[finetune]'")
    root, oracle = torch_runs
    mine_by_name, printed = _train(root, ["-m", "fsdp2lite.run"], {f"fsdp2lite-{finetune}": FINETUNES[finetune]})
    ref_runs, fl_runs = oracle[f"torch-{finetune}"], mine_by_name[f"fsdp2lite-{finetune}"]
    for rank, (ref, mine) in enumerate(zip(ref_runs, fl_runs, strict=True)):
        assert mine["losses"] == ref["losses"] and len(mine["losses"]) == 4, (rank, mine["losses"], ref["losses"])
        assert mine["fsdp_enabled"] and ref["fsdp_enabled"]
        assert mine["fsdp_enabled_on_cpu"] and ref["fsdp_enabled_on_cpu"], "Accelerate's state carried over"
        assert "fsdp2lite.module" in mine["model"]["mro_modules"], mine["model"]  # fsdp2lite's runtime ran
        assert not any(m.startswith("fsdp2lite") for m in ref["model"]["mro_modules"]), ref["model"]
        assert mine["model"]["torch_fsdp_module"], "Accelerate must still see a torch FSDPModule"
        assert mine["model"]["groups"] == ref["model"]["groups"] > 1  # Accelerate's own plan, per decoder layer
        assert mine["model"]["trainable"] == ref["model"]["trainable"]
        assert (mine["argv0"], mine["path0"], mine["name"]) == (str(SCRIPT), str(SCRIPT.parent), "__main__")
    assert fl_runs[0]["losses"] == fl_runs[1]["losses"], "ranks disagree on the logged loss"
    if finetune == "lora":  # the base frozen: only the adapters train
        assert 0 < fl_runs[0]["model"]["trainable"] < 10_000
    # the exit report, rank 0's only: each FSDPModule counted (Accelerate shards some in one call, as a list)
    [report] = [line for line in printed.splitlines() if line.startswith("python -m fsdp2lite.run:")]
    modules = report.removeprefix("python -m fsdp2lite.run: fsdp2lite sharded ").split(" modules in ")[0]
    assert int(modules) == fl_runs[0]["model"]["groups"] and report.endswith(" fully_shard calls on rank 0"), report
    if finetune == "full":  # the line README quotes (Accelerate's plan: the 2 layers, the root, 2 modules as one)
        assert report == README_REPORT and README_REPORT in " ".join((HERE.parent / "README.md").read_text().split())
    assert foreign_lines(printed) == [], "other packages' import-time lines are left out"


PROBE = """\
import json, logging, sys, warnings
logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: as torchao says on import")
logging.getLogger("probe").warning("the script's own log line")
warnings.warn("`is_gradient_checkpointing` is deprecated: the script's own warning", FutureWarning)
import torch.distributed.fsdp as torch_fsdp
import helper  # found through sys.path[0], the script's directory
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__,
                  "fully_shard": torch_fsdp.fully_shard.__module__}))
if "raise" in sys.argv:
    raise KeyError("from the script")
if "exit" in sys.argv:
    raise SystemExit(5)
"""


def _launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fsdp2lite.run", *args]
    return subprocess.run(command, cwd=cwd, env=cpu_env(), capture_output=True, text=True, timeout=300)


def test_launcher_runs_a_script_as_python_would(tmp_path: Path) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    (scripts / "helper.py").write_text("")
    launch = [sys.executable, "-m", "fsdp2lite.run", "scripts/probe.py"]
    plain = [sys.executable, "scripts/probe.py", "raise"]  # the same script without the launcher
    commands = [[*launch, "--lr", "1", "-m", "x"], plain, [*launch, "raise"], [*launch, "exit"]]
    # one process each, independent: started at once (two share 2 cores where one after the other leaves one idle)
    done, plain_run, raised, exited = together([(command, cpu_env()) for command in commands], tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["argv"] == ["scripts/probe.py", "--lr", "1", "-m", "x"]  # the script's own options, untouched
    assert (seen["path0"], seen["name"]) == (str(scripts.resolve()), "__main__")
    assert seen["file"] == "scripts/probe.py"
    assert seen["fully_shard"] == "fsdp2lite.api", "torch's name must resolve to fsdp2lite's"
    assert "_C_mxfp8.so" not in done.stderr, "torchao's import noise is filtered before the script runs"
    assert "the script's own log line" in done.stderr and "the script's own warning" in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"python -m fsdp2lite.run: {launcher.NOTHING_SHARDED}"

    assert raised.returncode == plain_run.returncode == 1
    last_line = "KeyError: 'from the script'"
    assert raised.stderr.strip().splitlines()[-1] == plain_run.stderr.strip().splitlines()[-1] == last_line
    assert exited.returncode == 5 and "fsdp2lite.run:" not in raised.stderr + exited.stderr, "no report on failure"


def test_launcher_runs_a_module_with_dash_m(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "helper.py").write_text("")
    done = _launch(["--verbose", "-m", "probe", "--steps", "3"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "fsdp2lite.patch():" in done.stderr and "torch.distributed.fsdp.fully_shard" in done.stderr  # the report
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["argv"] == [str(tmp_path / "probe.py"), "--steps", "3"]
    assert (seen["path0"], seen["name"], seen["fully_shard"]) == (str(tmp_path), "__main__", "fsdp2lite.api")


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["missing.py", "--x"], "can't open file"),
        ([], "no script given"),
        (["-m"], "-m needs a module name"),
        (["-m", "no_such_module_xyz"], "no module named 'no_such_module_xyz'"),
        (["--nproc", "2", "train.py"], "unknown option '--nproc'"),
    ],
)
def test_launcher_usage_errors_exit_2_with_one_line(
    argv: list[str], says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert launcher.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and says in err, err
    assert err.startswith("python -m fsdp2lite.run: error: ")


def test_launcher_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert launcher.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m fsdp2lite.run")
    assert "torchrun --nproc-per-node 4 -m fsdp2lite.run run_clm.py" in out and "-m MODULE" in out
