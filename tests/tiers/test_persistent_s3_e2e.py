"""The persistent tier against a real S3-compatible server (issue #8).

moto's S3 server runs as a separate process (``python -m moto.server``) and speaks the S3 HTTP API;
the tier reaches it through s3fs/aiobotocore exactly as it would reach AWS or MinIO. Endpoint and
credentials come from the process environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``), which is how a user of ``rlsup run`` configures it. Corruption and
interrupted uploads are made with an independent boto3 client, as another process would.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import torch

pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[test]' or rlsup[s3])")
pytest.importorskip("moto", reason="moto[server] is not installed (pip install -e '.[test]')")
pytest.importorskip("flask", reason="moto's server needs its [server] extra (pip install 'moto[server]')")
boto3 = pytest.importorskip("boto3", reason="boto3 (a moto dependency) is not installed")

from support.env import ROOT, clean_env  # noqa: E402
from support.incidents import incidents  # noqa: E402
from support.ports import free_ports  # noqa: E402
from support.procs import start_rlsup  # noqa: E402
from support.waits import wait_for  # noqa: E402
from supervisor.tiers.persistent import PersistentTier, PersistentTierError  # noqa: E402
from supervisor.tiers.selection import choose_across_tiers  # noqa: E402
from trainer_hooks import CheckpointManager  # noqa: E402
from rlsup_format.manifest import MANIFEST_RE, manifest_name, step_dir_name, verify_step_dir  # noqa: E402

KEY, SECRET, REGION = "rlsup-test-key", "rlsup-test-secret", "us-east-1"


def _answers(url: str) -> bool:
    try:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2).close()
    except urllib.error.HTTPError:
        return True  # an HTTP answer of any status: the server is up
    except OSError:
        return False
    return True


def _start_moto(log_path: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free port; returns (process, endpoint) once it answers HTTP."""
    for _ in range(3):  # the free port may be taken between the probe and the bind: try another
        port = free_ports(1)[0]
        log = open(log_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RLSUP_"))}
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        endpoint = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: proc.poll() is not None or _answers(endpoint), 90, "moto's S3 server to answer",
                     interval=0.2)
        except AssertionError:
            proc.kill()
            proc.wait()
            raise AssertionError(f"moto server did not start: {log_path.read_text()[-3000:]}") from None
        if proc.poll() is None:
            return proc, endpoint
    raise AssertionError(f"moto server exited: {log_path.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def s3_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A running moto S3 server and the environment that points botocore (s3fs, boto3) at it."""
    proc, endpoint = _start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,  # set too, so a service-specific one in the outer env loses
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,  # no ~/.aws profile or credentials leak in
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
        "NO_PROXY": "127.0.0.1,localhost",  # the server is local, whatever proxy the machine has
        "no_proxy": "127.0.0.1,localhost",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
            mp.delenv(k, raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            yield env
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def bucket(s3_env: dict[str, str], request: pytest.FixtureRequest) -> str:
    name = ("rlsup-" + request.node.name.removeprefix("test_").replace("_", "-")[:40].lower()).rstrip("-")
    client().create_bucket(Bucket=name)
    return name


def client():
    """An independent S3 client (not s3fs): what another process or an operator would use."""
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], aws_access_key_id=KEY,
                        aws_secret_access_key=SECRET, region_name=REGION)


def keys(bucket: str, prefix: str) -> set[str]:
    out = set()
    for page in client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update(o["Key"] for o in page.get("Contents", []))
    return out


def save_steps(ckpt: Path, steps: list[int], size: int = 50_000, backend: str = "torch") -> None:
    mgr = CheckpointManager(ckpt, backend=backend)
    for s in steps:
        mgr.save(s, {"w": torch.arange(size, dtype=torch.float32) * s, "step": s})


def step_files(step_dir: Path) -> dict[str, bytes]:
    """Every file of a step (relative path -> bytes), markers (``.hold-*``) left out."""
    return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in sorted(step_dir.rglob("*"))
            if p.is_file() and not p.name.startswith(".hold")}


def test_copy_latest_valid_and_fetch_bit_for_bit(bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    save_steps(local, [10], backend="dcp")  # nested objects (dcp/.metadata, dcp/__0_0.distcp)
    url = f"s3://{bucket}/run42/ckpt"
    tier = PersistentTier(url, source=local)
    assert tier.steps() == [] and tier.latest_valid() is None  # the prefix does not exist yet
    assert tier.poll() == 10
    src = step_files(local / step_dir_name(10))
    assert any("/" in rel for rel in src)  # the nested layout really is exercised
    prefix = f"run42/ckpt/{step_dir_name(10)}/"
    assert keys(bucket, "") == {prefix + rel for rel in src}  # exactly the step's objects, no markers
    copy = PersistentTier(url).latest_valid()  # a fresh tier (a new rlsup): only what S3 says
    assert copy.step == 10 and copy.size_bytes == verify_step_dir(local / step_dir_name(10)).size_bytes
    got = tier.fetch(10, tmp_path / "back")
    assert got == tmp_path / "back" / step_dir_name(10) and verify_step_dir(got).valid
    assert step_files(got) == src  # bit for bit
    assert [p.name for p in (tmp_path / "back").iterdir()] == [step_dir_name(10)]  # no temp dirs left
    shutil.rmtree(local)
    point = choose_across_tiers(local, tier)
    assert (point.step, point.tier) == (10, "persistent") and step_files(point.path) == src


def test_corrupted_object_is_never_offered(bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    tier = PersistentTier(f"s3://{bucket}/ckpt", source=local)
    for s in (10, 20):
        save_steps(local, [s])
        assert tier.poll() == s
    assert tier.latest_valid().step == 20  # the tier has read (and could cache) step 20's metadata
    key = f"ckpt/{step_dir_name(20)}/rank_00000.pt"
    data = bytearray(client().get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # same size, different content (and ETag)
    client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    assert not tier.verify(20) and tier.verify(20, full=False)  # only the checksum tells
    assert tier.latest_valid().step == 10
    with pytest.raises(PersistentTierError):
        tier.fetch(20, tmp_path / "back")
    assert not (tmp_path / "back" / step_dir_name(20)).exists()  # never renamed into place
    shutil.rmtree(local)
    point = choose_across_tiers(local, tier)  # the older valid copy is used
    assert (point.step, point.tier) == (10, "persistent")
    assert torch.load(point.path / "rank_00000.pt", weights_only=True)["w"][1].item() == 10.0
    # A missing object (deleted by someone) is as invalid as a corrupted one.
    client().delete_object(Bucket=bucket, Key=f"ckpt/{step_dir_name(10)}/rank_00000.pt")
    assert not tier.verify(10, full=False) and tier.latest_valid() is None


def test_copy_interrupted_before_the_manifests_is_never_valid(bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    save_steps(local, [10, 20])
    tier = PersistentTier(f"s3://{bucket}/ckpt", source=local)
    assert tier.poll() == 20
    # An upload of step 30 that died after its data objects, before the manifests (the commit).
    save_steps(local, [30])
    src = local / step_dir_name(30)
    for rel in step_files(src):
        if not MANIFEST_RE.match(rel):
            client().put_object(Bucket=bucket, Key=f"ckpt/{step_dir_name(30)}/{rel}", Body=(src / rel).read_bytes())
    assert tier.steps() == [20, 30]
    assert not tier.verify(30, full=False) and tier.latest_valid().step == 20
    with pytest.raises(PersistentTierError):
        tier.fetch(30, tmp_path / "back")
    # A copy whose manifests were removed (a deletion interrupted after its first stage) is invalid too.
    client().delete_object(Bucket=bucket, Key=f"ckpt/{step_dir_name(20)}/{manifest_name(0)}")
    assert not tier.verify(20, full=False) and tier.latest_valid() is None
    shutil.rmtree(tmp_path / "back", ignore_errors=True)
    assert choose_across_tiers(tmp_path / "back", tier) is None
    # A new copy over the partial one completes it (objects checked, the manifest last).
    from supervisor.tiers.part_protocol import copy_part
    from supervisor.tiers.part_stores.local import LocalStore

    copy_part(LocalStore(local), tier.store, 30, 0)  # the one rank's part: data objects, then the manifest
    assert tier.latest_valid().step == 30
    assert keys(bucket, f"ckpt/{step_dir_name(30)}/") == {
        f"ckpt/{step_dir_name(30)}/{rel}" for rel in step_files(src)}


def test_retention_keep_last(bucket: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    tier = PersistentTier(f"s3://{bucket}/ckpt", keep_last=2, source=local)
    for s in (10, 20, 30, 40):
        save_steps(local, [s])
        assert tier.poll() == s
    assert tier.steps() == [30, 40]
    assert {k.split("/")[1] for k in keys(bucket, "ckpt/")} == {step_dir_name(30), step_dir_name(40)}
    # An invalid copy older than the newest valid one does not count and is removed as well.
    client().put_object(Bucket=bucket, Key=f"ckpt/{step_dir_name(30)}/rank_00000.pt", Body=b"garbage")
    save_steps(local, [50])
    assert tier.poll() == 50
    assert tier.steps() == [40, 50] and all(tier.verify(s) for s in (40, 50))
    assert {k.split("/")[1] for k in keys(bucket, "ckpt/")} == {step_dir_name(40), step_dir_name(50)}


PY = sys.executable
TRAIN = str(ROOT / "examples" / "train_tiny.py")


def test_rlsup_run_resumes_from_s3_bit_identical(s3_env: dict[str, str], bucket: str, tmp_path: Path) -> None:
    """``rlsup run --persistent-dir s3://...``: rlsup SIGKILLed, the local checkpoints wiped; a new
    rlsup resumes from S3 and the run ends bit-identical to an uninterrupted one."""
    train = ["--steps", "30", "--checkpoint-every", "3", "--step-time", "0.15", "--ballast-mb", "4", "--keep-last", "2"]
    ref_out = tmp_path / "reference.pt"
    reference = subprocess.Popen([PY, TRAIN, *train, "--step-time", "0", "--checkpoint-dir", str(tmp_path / "ref"),
                                  "--out", str(ref_out)], env=clean_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    url = f"s3://{bucket}/job/ckpt"
    out, ckpt = tmp_path / "final.pt", tmp_path / "checkpoints"
    args = ["run", "--backoff-initial", "0.05", "--persistent-dir", url, "--replication-scan-interval", "0.2",
            "--", PY, TRAIN, *train, "--out", str(out)]
    from supervisor.job_identity import job_identity

    # rlsup keeps each job's copies under <persistent_dir>/<job>/ (the job: its absolute checkpoint_dir here)
    probe = PersistentTier(f"{url}/{job_identity('', 'checkpoints', False, environ={}, cwd=str(tmp_path)).id}")

    def persisted() -> int:
        return max((s for s in probe.steps() if probe.verify(s, full=False)), default=0)

    proc = start_rlsup(args, tmp_path, **s3_env)
    try:
        wait_for(lambda: proc.poll() is not None or persisted() >= 6, 120, "a step >= 6 copied to S3", interval=0.2)
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = persisted()
    shutil.rmtree(ckpt)  # the node is gone; only S3 holds checkpoints
    proc = start_rlsup(args, tmp_path, **s3_env)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert incidents(tmp_path / ".rlsup")[-1]["reason"] == "supervisor_lost"
    state = json.loads((tmp_path / ".rlsup" / "state.json").read_text())
    assert state["resume_tier"] == "persistent" and state["resume_step"] >= saved, (saved, state)
    ref_log, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_log[-3000:]
    ref, final = torch.load(ref_out, weights_only=True), torch.load(out, weights_only=True)
    assert final.keys() == ref.keys()
    for name in ref:
        assert torch.equal(final[name], ref[name]), f"{name} differs from the uninterrupted run"
