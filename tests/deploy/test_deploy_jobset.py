"""deploy/kubernetes/rlsup-jobset.yaml held to rlsup's own code: no cluster runs it (docs/deploy.md says it is
untested on a live cluster), so what can drift is checked here, in process.

The container's args go through rlsup's CLI parser and config loader with the manifest's ConfigMap and
environment, once per node rank (the completion index Kubernetes would put in RLSUP_NODE_RANK): the peers
must be JobSet's pod hostnames in rank order, the ports the container's named ports, the memory tier the
Memory emptyDir, the token a Secret only its owner can read. The pod failure policy must send exactly rlsup's
own exit codes (supervisor.exit_codes) to the actions docs/deploy.md names; the grace period must cover
stop_grace and kill_grace; the PodMonitor must scrape the metrics port under the job the alerts read.
Each check is then shown to fail on one drift of the manifest (test_each_check_catches_its_drift).
"""

from __future__ import annotations

import copy
import re
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from support.env import ROOT
from supervisor import exit_codes
from supervisor.cli.main import build_parser
from supervisor.config import ConfigError, EffectiveConfig, load_config, node_membership
from supervisor.membership import Membership
from supervisor.run.settings import signal_named

MANIFEST = ROOT / "deploy" / "kubernetes" / "rlsup-jobset.yaml"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DEPLOY_DOC = ROOT / "docs" / "deploy.md"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
GRACE_MARGIN = 30  # seconds beyond stop_grace + kill_grace: the final copy, the exit, the kubelet's own delay
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # JobSet's failure policy rule names
#: What each of rlsup's own exit codes must do (docs/deploy.md's table): first matching rule wins.
EXPECTED_ACTIONS = {exit_codes.CONFIG_ERROR: "FailJob", exit_codes.NO_PROGRESS: "FailJob",
                    exit_codes.REQUEUE: "Ignore", exit_codes.UNHEALTHY: "Count"}
UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(text: str | int) -> int:
    """A Kubernetes memory quantity (64Gi, 500M, 1024) in bytes."""
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(text))
    assert m, f"not a quantity this test reads: {text!r}"
    return int(m.group(1)) * UNITS[m.group(2) or ""]


@dataclass
class Manifest:
    """The manifest's documents by kind, and the parts every check reads."""

    docs: dict[str, dict[str, Any]]

    @property
    def jobset(self) -> dict[str, Any]:
        return self.docs["JobSet"]

    @property
    def rjob(self) -> dict[str, Any]:
        (rjob,) = self.jobset["spec"]["replicatedJobs"]
        return rjob

    @property
    def job(self) -> dict[str, Any]:
        return self.rjob["template"]["spec"]

    @property
    def pod(self) -> dict[str, Any]:
        return self.job["template"]

    @property
    def container(self) -> dict[str, Any]:
        (container,) = self.pod["spec"]["containers"]
        return container

    def volume(self, path: str) -> tuple[dict[str, Any], str]:
        """The volume holding ``path`` in the container, and ``path`` relative to its mount."""
        for mount in self.container["volumeMounts"]:
            root = mount["mountPath"].rstrip("/")
            if path == root or path.startswith(root + "/"):
                (vol,) = [v for v in self.pod["spec"]["volumes"] if v["name"] == mount["name"]]
                return vol, path[len(root):].lstrip("/")
        raise AssertionError(f"{path} is on no volume of the container (it would live in the image's file system)")

    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.container["ports"]}


@dataclass
class Node:
    """What rlsup and torchrun would run with on one pod."""

    eff: EffectiveConfig
    membership: Membership
    job_argv: list[str]

    def flag(self, name: str) -> str:
        values = [a.split("=", 1)[1] for a in self.job_argv if a.startswith(f"--{name}=")]
        assert len(values) == 1, f"torchrun --{name}= given {len(values)} times in {self.job_argv}"
        return values[0]


def load(text: str | None = None) -> Manifest:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text() if text is None else text) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one document per kind"
    return Manifest(by_kind)


def environment(m: Manifest, rank: int) -> dict[str, str]:
    """The container's environment on the pod with completion index ``rank``."""
    env = {}
    for var in m.container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == COMPLETION_INDEX, f"env {var['name']}: a field this test cannot resolve: {path}"
            env[var["name"]] = str(rank)
    return env


def node(m: Manifest, rank: int) -> Node:
    """rlsup's own parser and loader on the container's args, ConfigMap and environment for ``rank``."""
    env = environment(m, rank)
    assert m.container["command"] == ["rlsup"], "exec form: rlsup itself must receive the kubelet's SIGTERM"
    argv = [re.sub(r"\$\((\w+)\)", lambda v: env[v.group(1)], a) for a in m.container["args"]]
    assert "--" in argv, "rlsup run [options] -- COMMAND"
    own, job = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    with tempfile.TemporaryDirectory() as tmp:
        for i, arg in enumerate(own):
            if arg.startswith("--config="):
                vol, key = m.volume(arg.split("=", 1)[1])
                cm = m.docs["ConfigMap"]
                assert vol.get("configMap", {}).get("name") == cm["metadata"]["name"], "config is the ConfigMap"
                (Path(tmp) / key).write_text(cm["data"][key])
                own[i] = f"--config={Path(tmp) / key}"
        args = build_parser().parse_args(own)
        assert args.cmd == "run"
        try:
            eff = load_config(args, environ=env)
            membership = node_membership(eff, env)
        except ConfigError as e:
            raise AssertionError(f"rlsup refuses the manifest's config: {e}") from e
    assert membership is not None, "several nodes: rlsup must see peers"
    return Node(eff, membership, job)


def nodes(m: Manifest) -> list[Node]:
    return [node(m, rank) for rank in range(m.job["completions"])]


# ---------------------------------------------------------------- the checks


def check_exit_codes(m: Manifest) -> None:
    """podFailurePolicy sends rlsup's own codes, and only them, to their actions; the JobSet fails on FailJob."""
    assert m.pod["spec"]["restartPolicy"] == "Never", "podFailurePolicy needs restartPolicy: Never"
    actions: dict[int, str] = {}
    disruption = None
    for rule in m.job["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            codes = rule["onExitCodes"]
            assert codes["containerName"] == m.container["name"] and codes["operator"] == "In", codes
            assert codes["values"] == sorted(set(codes["values"])) and 0 not in codes["values"], "the API's rule"
            for code in codes["values"]:
                actions.setdefault(code, rule["action"])  # the first matching rule wins
        else:
            (cond,) = rule["onPodConditions"]
            if cond["type"] == "DisruptionTarget" and disruption is None:
                assert cond["status"] == "True", "older JobSet CRDs require a status"
                disruption = rule["action"]
    assert set(actions) == exit_codes.RESERVED, f"codes in the policy {sorted(actions)} != rlsup's own"
    assert actions == EXPECTED_ACTIONS, actions
    assert disruption == "Ignore", "an eviction or preemption must not count against backoffLimit"
    rules = m.jobset["spec"]["failurePolicy"]["rules"]
    assert all(RULE_NAME.match(r["name"]) for r in rules), [r["name"] for r in rules]
    assert any(r["action"] == "FailJobSet" and r["onJobFailureReasons"] == ["PodFailurePolicy"] for r in rules)


def check_peers_and_rank(m: Manifest) -> None:
    """Every pod's rlsup loads the config; node rank = completion index, peers = JobSet's hostnames."""
    name, sub = m.jobset["metadata"]["name"], m.jobset["spec"]["network"]["subdomain"]
    assert m.rjob["replicas"] == 1 and m.job["completionMode"] == "Indexed"
    for rank, n in enumerate(nodes(m)):
        hosts = [f"{name}-{m.rjob['name']}-0-{i}.{sub}" for i in range(m.job["completions"])]
        assert n.membership.node_rank == rank
        assert list(n.membership.peers) == [f"{h}:{n.eff.config.replication_port}" for h in hosts]


def check_ports(m: Manifest) -> None:
    """The container's named ports are rlsup's ports and torchrun's."""
    cfg, ports = node(m, 0).eff.config, m.ports()
    assert ports["metrics"] == cfg.metrics_port and cfg.metrics_port > 0
    assert ports["replication"] == cfg.replication_port
    assert ports["coordinator"] == cfg.coordinator_port
    assert ports["torchrun"] == int(node(m, 0).flag("master-port"))
    assert len(set(ports.values())) == len(ports), ports


def check_torchrun(m: Manifest) -> None:
    """torchrun: one node per pod, this pod's rank, rendezvous on node 0's hostname."""
    assert m.job["completions"] == m.job["parallelism"]
    for rank, n in enumerate(nodes(m)):
        assert int(n.flag("nnodes")) == m.job["completions"] == len(n.membership.peers)
        assert int(n.flag("node-rank")) == rank
        assert n.flag("master-addr") == n.membership.peers[0].rpartition(":")[0]


def check_memory_tier(m: Manifest) -> None:
    """memory_dir is a Memory emptyDir with room above memory_limit_bytes, inside the pod's memory limit."""
    cfg = node(m, 0).eff.config
    vol, rest = m.volume(cfg.memory_dir)
    assert rest == "" and vol.get("emptyDir", {}).get("medium") == "Memory", vol
    size = quantity(vol["emptyDir"]["sizeLimit"])
    assert 0 < cfg.memory_limit_bytes < size, "the tier must stop before the emptyDir's sizeLimit evicts the pod"
    tmpfs = sum(quantity(v["emptyDir"]["sizeLimit"]) for v in m.pod["spec"]["volumes"]
                if v.get("emptyDir", {}).get("medium") == "Memory")
    assert quantity(m.container["resources"]["limits"]["memory"]) > tmpfs, "tmpfs counts against the pod's memory"


def check_grace(m: Manifest) -> None:
    """The kubelet's SIGTERM is the preemption signal, and SIGKILL waits for rlsup's own graces."""
    cfg = node(m, 0).eff.config
    assert signal_named(cfg.preempt_signal) == signal.SIGTERM, "Kubernetes sends SIGTERM only; else rlsup exits 143"
    grace = m.pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= cfg.stop_grace + cfg.kill_grace + GRACE_MARGIN, (grace, cfg.stop_grace, cfg.kill_grace)


def check_node_loss(m: Manifest) -> None:
    """A pod on a lost node is evicted while the other nodes still wait for its replacement."""
    cfg = node(m, 0).eff.config
    waits = {t["key"]: t["tolerationSeconds"] for t in m.pod["spec"]["tolerations"] if t["effect"] == "NoExecute"}
    assert set(waits) == {"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"}, waits
    assert max(waits.values()) + GRACE_MARGIN < cfg.rendezvous_timeout, (waits, cfg.rendezvous_timeout)


def check_token(m: Manifest) -> None:
    """token_file is a Secret's key, only its owner can read it (rlsup refuses anything else)."""
    cfg = node(m, 0).eff.config
    vol, rest = m.volume(cfg.token_file)
    secret = vol["secret"]
    assert rest in [item["path"] for item in secret["items"]], (rest, secret)
    assert secret["defaultMode"] & 0o077 == 0 and secret["defaultMode"] & 0o400, oct(secret["defaultMode"])


def check_dirs(m: Manifest) -> None:
    """Every directory rlsup writes is on a volume; the persistent tier outlives the pod."""
    cfg = node(m, 0).eff.config
    for path in (cfg.checkpoint_dir, cfg.replica_dir, cfg.state_dir):
        assert "emptyDir" in m.volume(path)[0]
    if cfg.persistent_dir and "://" not in cfg.persistent_dir:
        assert "persistentVolumeClaim" in m.volume(cfg.persistent_dir)[0]
    assert m.job["podReplacementPolicy"] == "Failed", "never two pods with one hostname (one node rank)"
    network = m.jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True and network["publishNotReadyAddresses"] is True


def check_podmonitor(m: Manifest) -> None:
    """The PodMonitor scrapes the metrics port's /metrics under the job name the alerts and dashboard read."""
    cfg, pm = node(m, 0).eff.config, m.docs["PodMonitor"]["spec"]
    (endpoint,) = pm["podMetricsEndpoints"]
    assert m.ports().get(endpoint["port"]) == cfg.metrics_port, endpoint
    assert endpoint["path"] == "/metrics"
    labels = m.pod["metadata"]["labels"]
    assert pm["selector"]["matchLabels"].items() <= labels.items(), (pm["selector"], labels)
    (scrape,) = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    assert {"targetLabel": "job", "replacement": scrape["job_name"]} in endpoint["relabelings"]


CHECKS: list[Callable[[Manifest], None]] = [check_exit_codes, check_peers_and_rank, check_ports, check_torchrun,
                                            check_memory_tier, check_grace, check_node_loss, check_token, check_dirs, check_podmonitor]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_manifest_holds_to_rlsup(check: Callable[[Manifest], None]) -> None:
    check(load())


# ---------------------------------------------------------------- each check bites

def text_drift(old: str, new: str) -> Callable[[], Manifest]:
    def drift() -> Manifest:
        text = MANIFEST.read_text()
        assert text.count(old) == 1, f"the drift's anchor {old!r} is not once in the manifest"
        return load(text.replace(old, new))
    return drift


def doc_drift(change: Callable[[Manifest], None]) -> Callable[[], Manifest]:
    def drift() -> Manifest:
        m = Manifest(copy.deepcopy(load().docs))
        change(m)
        return m
    return drift


DRIFTS = [
    (check_exit_codes, text_drift("values: [75]", "values: [75, 77]")),  # 77 ignored: an unhealthy node forever
    (check_exit_codes, text_drift("values: [2, 76]", "values: [2]")),  # 76 no longer fails the job
    (check_exit_codes, text_drift("values: [77]", "values: [77, 78]")),
    (check_exit_codes, text_drift("values: [2, 76]", "values: [76, 2]")),  # the API wants them ordered
    (check_exit_codes, doc_drift(lambda m: m.jobset["spec"]["failurePolicy"]["rules"][0].update(name="do-not"))),
    (check_peers_and_rank, text_drift("rlsup-train-node-0-3.rlsup-train:9779", "rlsup-train-node-0-4.rlsup-train:9779")),
    (check_peers_and_rank, text_drift("fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']",
                                      "fieldPath: metadata.annotations['jobset.sigs.k8s.io/job-index']")),
    (check_peers_and_rank, text_drift("    kill_grace: 10\n", "    kill_grace: 10\n    kil_grace: 5\n")),
    (check_ports, text_drift("containerPort: 9779", "containerPort: 9781")),
    (check_ports, text_drift("metrics_port: 9778", "metrics_port: 9100")),
    (check_torchrun, text_drift("- --nnodes=4", "- --nnodes=3")),
    (check_torchrun, text_drift("--master-addr=rlsup-train-node-0-0", "--master-addr=rlsup-train-node-0-1")),
    (check_memory_tier, text_drift("memory_dir: /rlsup/memory", "memory_dir: /dev/shm")),
    (check_memory_tier, text_drift("sizeLimit: 64Gi", "sizeLimit: 32Gi")),
    (check_grace, text_drift("terminationGracePeriodSeconds: 180", "terminationGracePeriodSeconds: 30")),
    (check_grace, text_drift("preempt_signal: SIGTERM", "preempt_signal: SIGUSR1")),
    (check_node_loss, text_drift("rendezvous_timeout: 600", "rendezvous_timeout: 60")),
    (check_token, text_drift("defaultMode: 0400", "defaultMode: 0444")),
    (check_dirs, text_drift("state_dir: /rlsup/local/state", "state_dir: /var/lib/rlsup")),
    (check_dirs, text_drift("podReplacementPolicy: Failed", "podReplacementPolicy: TerminatingOrFailed")),
    (check_podmonitor, text_drift("- port: metrics", "- port: replication")),
    (check_podmonitor, text_drift("replacement: rlsup", "replacement: rlsup-train")),
]


@pytest.mark.parametrize("check, drift", DRIFTS, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(DRIFTS)])
def test_each_check_catches_its_drift(check: Callable[[Manifest], None], drift: Callable[[], Manifest]) -> None:
    drifted = drift()  # outside the raises: a drift that no longer applies must fail, not pass
    with pytest.raises(AssertionError):
        check(drifted)


def test_docs_give_the_mapping_and_say_it_is_untested() -> None:
    """docs/deploy.md names the manifest, every exit code's action, and that no cluster ran it."""
    text = DEPLOY_DOC.read_text()
    assert "deploy/kubernetes/rlsup-jobset.yaml" in text and "untested on a live cluster" in text.lower()
    for code, action in EXPECTED_ACTIONS.items():
        assert re.search(rf"\|\s*`?{code}`?\b[^\n]*`{action}`", text), f"docs/deploy.md: no table row {code} -> {action}"
    assert "`FailJobSet`" in text and "`DisruptionTarget`" in text
