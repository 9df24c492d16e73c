"""The operator's liveness endpoint (kopf's ``/healthz``) answers the kubelet on the pod's own address
family. The kubelet probes the pod's primary IP; kopf binds the one host of its ``--liveness`` URL,
and the chart's ``http://0.0.0.0:<port>/healthz`` is IPv4 only, so on an IPv6 cluster every probe
failed and the kubelet restarted a healthy operator forever. `mammoth operator` runs here as the
real console command against the emulated API server, with ``POD_IP`` as the chart's downward API
sets it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from emulator_harness import free_port, wait_for

from pipeline_harness import has_ipv6_loopback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _healthz(url: str, proc: subprocess.Popen, timeout: float = 20.0) -> int:
    """The status of ``url`` once it answers (`wait_for`), or fails with the operator's output."""
    def answer() -> int | None:
        assert proc.poll() is None, "the operator exited"
        try:
            return httpx.get(url, timeout=2).status_code
        except httpx.TransportError:
            return None

    try:
        return wait_for(answer, timeout=timeout, what=f"{url} to answer")
    except AssertionError:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
        pytest.fail(f"{url} never answered; the operator said:\n{out[-3000:]}")


@pytest.mark.parametrize("pod_ip, probed", [
    pytest.param("fd00:10:244::7", "[::1]", marks=pytest.mark.skipif(
        not has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)"), id="ipv6-pod"),
    pytest.param("10.244.0.7", "127.0.0.1", id="ipv4-pod"),
])
def test_liveness_answers_on_the_pods_address_family(api, crd_installed, pod_ip, probed):
    port = free_port()
    path = os.pathsep.join([ROOT, os.path.join(ROOT, "operator"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "POD_IP": pod_ip, "PYTHONPATH": path}
    proc = subprocess.Popen(  # the chart's arguments
        [sys.executable, "-m", "mammoth_app.cli", "operator", "--namespace", "default",
         f"--liveness=http://0.0.0.0:{port}/healthz"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _healthz(f"http://{probed}:{port}/healthz", proc) == 200
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
