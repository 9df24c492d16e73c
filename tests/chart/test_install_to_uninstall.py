"""The user's whole path on the emulated API server, with the real `helm` and `kubectl` (issue #14):

`helm install` -> `kubectl apply -f mammothpipeline.yaml` -> `kubectl get mmp` shows the printer
columns -> `helm uninstall` (the operator stops) -> `kubectl delete mmp --all` and
`kubectl delete ns` finish, with the children garbage-collected.

The operator runs as a process started the way the chart's Deployment starts it, authorized by the
rendered RBAC (owner-reference enforcement included); `helm uninstall` deleting its Deployment is
followed by SIGTERM to that process, as the kubelet would send. `--disable-openapi-validation`: the
emulator serves permissive built-in OpenAPI documents only (the manifests' schemas are checked by
kubernetes-validate in test_chart_manifests.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

import chart_tools
from chart_tools import CHART_DIR, REPO_ROOT, by_kind, helm_template, load_documents

sys.path.insert(0, str(REPO_ROOT / "tests" / "operator"))
import test_chart_on_emulator as base  # noqa: E402  (the chart emulator and its helpers)

NAMESPACE = "team-a"
PIPELINES = f"/apis/mammoth.dev/v1alpha1/namespaces/{NAMESPACE}/mammothpipelines"


def test_helm_install_apply_get_uninstall_delete(helm, kubectl, tmp_path: Path):
    server = base.EmulatorServer()
    operator = None
    try:
        admin = base.write_kubeconfig(tmp_path / "admin.kubeconfig", server.url, base.ADMIN_TOKEN)
        operator_cfg = base.write_kubeconfig(tmp_path / "operator.kubeconfig", server.url, base.OPERATOR_TOKEN,
                                             chart_tools.RELEASE_NAMESPACE)
        env = dict(os.environ, KUBECONFIG=str(admin), HOME=str(tmp_path))

        def run(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
            proc = subprocess.run([str(a) for a in args], input=input, capture_output=True, text=True, env=env,
                                  timeout=120)
            assert not check or proc.returncode == 0, f"{' '.join(map(str, args))}:\n{proc.stdout}\n{proc.stderr}"
            return proc

        port, metrics = base.free_port(), base.free_port()
        values = [f"livenessPort={port}", f"metricsPort={metrics}"]
        rendered = load_documents(helm_template(helm, include_crds=True, set_values=values).stdout)
        cluster, namespaced = base.granted(rendered)
        server.emulator.authorizer = lambda p: p[:3] in cluster or (p[3] and (*p[:3], p[3]) in namespaced)
        run(kubectl, "apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}}
            for n in (chart_tools.RELEASE_NAMESPACE, NAMESPACE)]))

        installed = run(helm, "install", "mammoth", CHART_DIR, "-n", chart_tools.RELEASE_NAMESPACE,
                        "--disable-openapi-validation", *(f"--set={v}" for v in values))
        assert "STATUS: deployed" in installed.stdout, installed.stdout
        [deployment] = by_kind(rendered, "Deployment")
        argv, operator_env = base.operator_command(deployment)
        environment = dict(os.environ, **operator_env, KUBECONFIG=str(operator_cfg), HOME=str(tmp_path))
        environment.pop("KUBERNETES_SERVICE_HOST", None)
        log = tmp_path / "operator.log"
        operator = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=environment,
                                    cwd=tmp_path, start_new_session=True)

        run(kubectl, "apply", "-n", NAMESPACE, "-f", REPO_ROOT / "mammothpipeline.yaml")
        name = yaml.safe_load((REPO_ROOT / "mammothpipeline.yaml").read_text())["metadata"]["name"]

        def listed() -> list[str] | None:
            lines = run(kubectl, "get", "mmp", "-n", NAMESPACE).stdout.splitlines()
            return lines if len(lines) == 2 and "svc.cluster.local" in lines[1] else None

        try:
            lines = base.wait_for(listed, 60, "kubectl get mmp with the operator's status")
        except AssertionError:
            raise AssertionError(log.read_text()[-4000:])
        assert lines[0].split() == ["NAME", "READY", "AR", "DIT", "ENDPOINT", "AGE"], lines
        row = lines[1].split()
        assert row[:4] == [name, "False", "0/1", "0/1"], lines
        assert row[4] == f"http://{name}-gateway.{NAMESPACE}.svc.cluster.local", lines
        assert server.get_json(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}-ar") is not None

        run(helm, "uninstall", "mammoth", "-n", chart_tools.RELEASE_NAMESPACE, "--timeout=60s")
        assert server.get_json(f"/apis/apps/v1/namespaces/{chart_tools.RELEASE_NAMESPACE}/deployments/"
                               f"{deployment['metadata']['name']}") is None
        operator.send_signal(signal.SIGTERM)  # the kubelet stops the deleted Deployment's pod
        assert operator.wait(timeout=30) == 0, log.read_text()[-3000:]
        assert server.get_json("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/mammothpipelines.mammoth.dev")

        run(kubectl, "delete", "mmp", "--all", "-n", NAMESPACE, "--timeout=30s")
        assert server.get_json(f"{PIPELINES}/{name}") is None
        assert server.get_json(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}-ar") is None  # collected
        run(kubectl, "delete", "ns", NAMESPACE, "--timeout=30s")
        assert server.get_json(f"/api/v1/namespaces/{NAMESPACE}") is None
    finally:
        if operator is not None and operator.poll() is None:
            operator.kill()
            operator.wait()
        server.close()
