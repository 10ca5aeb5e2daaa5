"""Every command in README.md's shell blocks works on a fresh clone, checked cheaply on the CPU.

Each command must match one rule below, which says how it is checked; a command no rule covers fails the test
(so a new README command gets a check). Commands that train, measure the machine or need GPUs are not run in full
here; their rule says which test runs them or what is checked instead:

- `make TARGET`: the target has a recipe (`make -n -B`); the training `make demo` starts is
  tests/test_train.py::test_example_config_trains_on_two_processes[dlrm_criteo.yaml], the suite is `make test`.
- `source .venv/bin/activate`: the file exists (where `make install` made .venv) and puts embshard, torchrun and
  torchx on PATH.
- `embshard train CONFIG ...`: the config and its overrides load (`load_config`, the check `embshard train` makes
  before it starts any process) and the arguments parse; tests/test_train.py trains every config in configs/.
- `embshard plan ...`: run for real (dry runs, no GPU), its output files written to a scratch folder; called as
  `.venv/bin/embshard plan ...` the same, and the program must be where `make install` puts it.
- `embshard calibrate`, `embshard checkpoint inspect/export`: `--help` (calibrate measures the machine for
  minutes; tests/checkpoint/test_checkpoint.py::test_inspect_and_export runs inspect and export on checkpoints).
- `embshard export serving`, `embshard predict`, `embshard serve`: `--help` (tests/serving exports checkpoints, scores
  data with `embshard predict` and posts requests to `embshard serve`).
- `launch/torchrun.sh ...`: run with DRY_RUN=1 and a PATH without the environment (as in a shell where .venv is
  not active): it must find a torchrun and print the command; the config and overrides load.
- `torchx run ...`: the torchx command and the component exist; tests/test_train.py::test_torchx_component_runs_on_cpu
  runs it.
- `pip install -e .[gpu]`: the extra exists (tests/test_imports.py checks what it holds).
- `EMBSHARD_TEST_DEVICE=cuda pytest tests`: needs GPUs; the CPU suite is the same files.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import paths

ROOT = paths.ROOT
BIN = Path(sys.executable).parent

# One subprocess (one start-up of Python) runs every in-process check: `embshard ...` argument lists through the
# `embshard` command's own entry point, and configs with overrides through load_config.
DRIVER = r"""
import contextlib, io, json, sys
from embshard.cli import main
from embshard.config import load_config

results = []
for kind, args in json.loads(sys.argv[1]):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if kind == "cli":
                main(args)
            else:
                load_config(args[0], args[1:])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except Exception as e:  # reported with the command
        code, out = 1, io.StringIO(out.getvalue() + f"{type(e).__name__}: {e}")
    results.append({"args": args, "code": code, "output": out.getvalue()[-1500:]})
print("RESULTS " + json.dumps(results))
"""


def readme_commands() -> list[str]:
    """Every command line of README.md's ```bash blocks (comments removed, continuation lines joined), and every
    `make TARGET` its text names."""
    text = (ROOT / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            if line:
                out.append(line)
    return out + sorted(set(re.findall(r"`(make [a-z-]+)`", text)))


def train_args(tokens: list[str]) -> list[str]:
    """`embshard train` arguments -> [config, overrides...], refusing options it does not have."""
    config, overrides, i = None, [], 0
    while i < len(tokens):
        t = tokens[i]
        if t == "--nproc":
            assert tokens[i + 1].isdigit(), tokens
            i += 2
            continue
        assert not t.startswith("-"), f"embshard train has no option {t!r}"
        if config is None:
            config = t
        else:
            assert "=" in t, f"{t!r} is neither the config nor a key=value override"
            overrides.append(t)
        i += 1
    assert config is not None, tokens
    return [config, *overrides]


def test_every_readme_command_works(tmp_path):
    commands = readme_commands()
    assert any(c.startswith("make demo") for c in commands) and any(c.startswith("embshard plan") for c in commands)
    for name in ("configs", "data"):  # relative paths as in the repository; outputs land in the scratch folder
        (tmp_path / name).symlink_to(ROOT / name)
    in_process: list[tuple[str, list[str]]] = []
    # the environment off PATH, as in a shell where .venv is not active; where no `make install` made .venv (an
    # environment of the machine's own, as on a GPU host) the script finds torchrun on PATH as is
    venv = (ROOT / ".venv").exists()
    no_venv_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != BIN or not venv)
    for cmd in commands:
        tokens = shlex.split(cmd)
        env_vars = {}
        while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
            key, _, value = tokens.pop(0).partition("=")
            env_vars[key] = value
        if tokens[0] == ".venv/bin/embshard":  # the program make install put in .venv, called by its path
            assert (ROOT / tokens[0]).exists() or not (ROOT / ".venv").exists(), (
                f"{cmd}: make install did not install it"
            )
            tokens[0] = "embshard"
        head = tokens[:2]
        if tokens[0] == "make":
            assert not env_vars, cmd
            # -B: the recipe even where it is up to date (make install has run wherever the suite runs)
            res = subprocess.run(["make", "-n", "-B", *tokens[1:]], cwd=ROOT, capture_output=True, text=True)
            assert res.returncode == 0 and res.stdout.strip(), f"{cmd}: {res.stderr}"
            assert "Nothing to be done" not in res.stdout, f"{cmd}: the Makefile has no recipe for it"
        elif tokens == ["source", ".venv/bin/activate"]:
            if (ROOT / ".venv").exists():
                assert (ROOT / ".venv/bin/activate").is_file()
                for program in ("embshard", "torchrun", "torchx"):
                    assert (ROOT / ".venv/bin" / program).exists(), f"make install did not install {program}"
        elif head == ["embshard", "train"] and tokens[2] == "CONFIG":  # the usage line
            in_process.append(("cli", ["train", "--help"]))
        elif head == ["embshard", "train"]:
            assert not env_vars, cmd
            in_process.append(("config", train_args(tokens[2:])))
        elif head == ["embshard", "plan"]:
            in_process.append(("cli", tokens[1:]))
        elif head in (["embshard", "export"], ["embshard", "predict"], ["embshard", "serve"]):
            in_process.append(("cli", [*tokens[1 : 3 if tokens[1] == "export" else 2], "--help"]))
        elif head in (["embshard", "calibrate"], ["embshard", "checkpoint"]):
            in_process.append(("cli", [*tokens[1 : 3 if tokens[1] == "checkpoint" else 2], "--help"]))
        elif tokens[0] == "launch/torchrun.sh":
            assert set(env_vars) <= {"MAX_RESTARTS", "NPROC_PER_NODE"}, cmd
            env = {**paths.cpu_subprocess_env(), **env_vars, "PATH": no_venv_path, "DRY_RUN": "1"}
            env.pop("VIRTUAL_ENV", None)
            res = subprocess.run(["bash", *tokens], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, f"{cmd}: {res.stderr}"
            printed = shlex.split(res.stdout)
            assert Path(printed[0]).name == "torchrun" and os.access(printed[0], os.X_OK), res.stdout
            assert printed[printed.index("-m") + 1 : printed.index("-m") + 3] == ["embshard.cli", "train"], printed
            assert f"--max-restarts={env_vars.get('MAX_RESTARTS', 0)}" in printed, printed
            in_process.append(("config", train_args(tokens[1:])))
        elif head == ["torchx", "run"]:
            assert (ROOT / tokens[tokens.index("-s") + 2].split(":")[0]).is_file(), cmd
            assert (BIN / "torchx").exists() or not (ROOT / ".venv").exists(), "torchx is not installed"
            in_process.append(("config", train_args(tokens[tokens.index("--") + 1 :])))
        elif tokens == ["pip", "install", "-e", ".[gpu]"]:
            assert "gpu = [" in (ROOT / "pyproject.toml").read_text()
        elif tokens == ["pytest", "tests"] and env_vars == {"EMBSHARD_TEST_DEVICE": "cuda"}:
            assert (ROOT / "tests" / "conftest.py").is_file()
        else:
            raise AssertionError(f"README.md command {cmd!r} has no check in tests/test_quickstart.py: add a rule")
    env = paths.cpu_subprocess_env()
    res = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(in_process)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0 and "RESULTS " in res.stdout, res.stderr[-3000:]
    results = json.loads(res.stdout.split("RESULTS ", 1)[1])
    failed = [r for r in results if r["code"] != 0]
    assert not failed, "\n\n".join(f"{r['args']}: exit {r['code']}\n{r['output']}" for r in failed)
    plans = [r for r in results if r["args"][0] == "plan"]
    reports = [r for r in plans if "torchrec" not in r["args"]]  # --format torchrec writes the file, no report
    assert reports and all("predicted step" in r["output"] for r in reports), reports  # the end of each report
    out = tmp_path / "runs" / "plan"  # the default output folder of `embshard plan --out --plot`
    assert (out / "plan.yaml").is_file() and (out / "plan.png").is_file()
    assert json.loads((out / "plan.torchrec.json").read_text())  # the TorchRec plan file, readable JSON
    assert not [p.name for p in tmp_path.iterdir() if p.name not in ("configs", "data", "runs")]  # nothing else
