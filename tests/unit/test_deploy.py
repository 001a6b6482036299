"""The deployment scripts and manifests: every script parses (`bash -n`), the KubeRay
RayJob is one (kind, apiVersion, entrypoint, a head and a worker group, the job TOML and
the runs volume mounted where the config says), and the `rlhf-async run ...
placement.launcher=ray` command each one runs is a config the loader accepts. The driver
script itself runs against stand-in `python` and `ray` commands: it pins the run directory
the dry run names, waits for every Ray node and turns a run directory into a resume."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

from rlhf_async.config import ConfigError, load_config

DEPLOY = Path(__file__).parents[2] / "deploy"
SCRIPTS = ["launch.sh", "ray/job.sh", "slurm/ray.sbatch"]
EXAMPLE = DEPLOY / "examples" / "multihost-separation.toml"


def _accepted(config: str | None, overrides: list[str], text: str | None = None) -> None:
    """load_config accepts it; without the [ray] extra, its one complaint is that."""
    try:
        load_config(config, overrides, text=text)
    except ConfigError as e:
        if importlib.util.find_spec("ray") is not None:
            raise
        assert all(p.startswith("placement.launcher: ray is not installed")
                   for p in e.problems), e.problems


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses(script):
    done = subprocess.run(["bash", "-n", str(DEPLOY / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_bare_metal_and_slurm_start_a_ray_cluster_then_the_same_driver():
    launch, sbatch = ((DEPLOY / p).read_text() for p in ("launch.sh", "slurm/ray.sbatch"))
    assert "start --head" in launch and "start --address=$HEAD:$PORT" in launch
    assert "start --head --block" in sbatch and 'start --block --address="$RAY_ADDRESS"' in sbatch
    for text in (launch, sbatch):  # every Ray process presents the same token
        assert "RAY_AUTH_MODE=token" in text and "RAY_AUTH_TOKEN_PATH=" in text
    assert '"$HERE/ray/job.sh" "${#ROWS[@]}" "$@"' in launch
    assert '-w "$HEAD"' in sbatch and '"$JOB_SH" "${#NODES[@]}" "$@"' in sbatch
    assert "trap stop_ray EXIT" in launch


def test_the_driver_runs_a_command_the_config_loader_accepts():
    line = next(x for x in (DEPLOY / "ray/job.sh").read_text().splitlines()
                if x.strip().startswith("ARGS=("))
    fixed = [w for w in shlex.split(line.strip()[len("ARGS=("):-1]) if not w.startswith("$")]
    assert fixed == ["placement.launcher=ray", "ray.address=auto"]
    _accepted(str(EXAMPLE), [*fixed, "run.name=job1"])


def _stand_ins(tmp_path: Path) -> dict[str, str]:
    """`python` that logs its arguments (a dry run names runs/<run.name or a timestamp>)
    and `ray` whose status shows two live nodes."""
    py, ray = tmp_path / "python", tmp_path / "ray"
    py.write_text('#!/bin/bash\necho "$*" >> "$LOG"\n'
                  'if [[ " $* " == *" --dry-run "* ]]; then echo "run directory: runs/20260101-000000"; fi\n'
                  'if [[ -n $DOCTOR_FAILS && " $* " == *" doctor "* ]]; then echo "FAIL  x"; exit 1; fi\n')
    ray.write_text('#!/bin/bash\nprintf "Active:\\n 1 node_a\\n 1 node_b\\nPending:\\n"\n')
    for f in (py, ray):
        f.chmod(0o755)
    return {**os.environ, "RLHF_PYTHON": str(py), "RLHF_RAY": str(ray),
            "RAY_ADDRESS": "10.0.0.1:6379", "LOG": str(tmp_path / "log")}


def test_the_driver_pins_the_dry_runs_run_directory_then_resumes_it(tmp_path):
    env = _stand_ins(tmp_path)
    job = [str(DEPLOY / "ray/job.sh"), "2"]
    done = subprocess.run([*job, str(EXAMPLE), "train.steps=3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    dry, doctor, run = (tmp_path / "log").read_text().splitlines()
    assert dry == f"-m rlhf_async run {EXAMPLE} train.steps=3 placement.launcher=ray " \
                  "ray.address=auto --dry-run"
    assert doctor == f"-m rlhf_async doctor {EXAMPLE} train.steps=3 placement.launcher=ray " \
                     "ray.address=auto"
    assert run == f"-m rlhf_async run {EXAMPLE} train.steps=3 placement.launcher=ray " \
                  "ray.address=auto run.name=20260101-000000"
    assert f"2 Ray nodes up at 10.0.0.1:6379; run directory {tmp_path}/runs/20260101-000000" \
        in done.stdout
    run_dir = tmp_path / "runs" / "20260101-000000"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    done = subprocess.run([*job, str(run_dir)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "log").read_text().splitlines()[-2:] == [
        f"-m rlhf_async doctor {run_dir}", f"-m rlhf_async resume {run_dir}"]


def _failed_driver(tmp_path: Path, nodes: int, **env: str) -> str:
    """job.sh for EXAMPLE on NODES nodes with the stand-ins; it fails: its stderr."""
    done = subprocess.run([str(DEPLOY / "ray/job.sh"), str(nodes), str(EXAMPLE)], cwd=tmp_path,
                          env={**_stand_ins(tmp_path), **env}, capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 1
    return done.stderr


def test_the_driver_stops_when_the_cluster_lacks_nodes(tmp_path):
    assert "2 of 3 Ray nodes up after 0 s" in _failed_driver(tmp_path, 3, RLHF_RAY_WAIT_S="0")


def test_the_driver_runs_no_job_on_a_cluster_the_doctor_fails(tmp_path):
    err = _failed_driver(tmp_path, 2, DOCTOR_FAILS="1")
    assert "job.sh: the Ray cluster is not ready for the job" in err
    assert [x.split()[2] for x in (tmp_path / "log").read_text().splitlines()] == \
        ["run", "doctor"]  # the dry run and the doctor; no job


def test_the_rayjob_runs_the_job_toml_it_mounts_with_its_runs_volume():
    yaml = pytest.importorskip("yaml")
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s/rayjob.yaml").read_text())}
    assert sorted(docs) == ["ConfigMap", "PersistentVolumeClaim", "RayJob"]
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv == ["rlhf-async", "run", "/config/job.toml", "placement.launcher=ray"]
    toml = docs["ConfigMap"]["data"]["job.toml"]
    _accepted(argv[2], argv[3:], text=toml)
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    workers = [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    assert workers
    cfg_volume = next(v for v in head["volumes"] if v.get("configMap"))
    assert cfg_volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    assert {"name": cfg_volume["name"], "mountPath": "/config"} in \
        head["containers"][0]["volumeMounts"]
    run = tomllib.loads(toml)["run"]
    out = run["output_dir"]
    assert run["cache_dir"].startswith(out + "/")  # the artefacts on the shared volume too
    claim = docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert "ReadWriteMany" in docs["PersistentVolumeClaim"]["spec"]["accessModes"]
    for pod in (head, *workers):  # every Ray node sees the run directories at one path
        runs = next(v["name"] for v in pod["volumes"]
                    if v.get("persistentVolumeClaim", {}).get("claimName") == claim)
        assert {"name": runs, "mountPath": out} in pod["containers"][0]["volumeMounts"]
