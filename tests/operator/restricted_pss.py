"""The Kubernetes Pod Security Standards "restricted" profile (latest), as a checker over pod specs.

Written from the profile's published rules (kubernetes.io/docs/concepts/security/pod-security-standards,
"Baseline" and "Restricted" tables); the admission controller is not available offline. `violations`
returns one message per broken rule, naming the field, so a test can assert ``== []``.
"""

from __future__ import annotations

from typing import Any, Iterable

#: Restricted: the only volume types allowed.
ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                        "projected", "secret"}
#: Baseline: sysctls considered safe.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
#: Restricted: the only capability that may be added (after dropping ALL).
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}


def _containers(pod: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in pod.get(kind) or []:
            yield f"{kind}[{c.get('name')}]", c


def violations(pod: dict[str, Any]) -> list[str]:
    """Every rule of the restricted profile that ``pod`` (a PodSpec as a dict) breaks."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    # --- baseline ---
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"spec.{key} must be false")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("spec.securityContext.windowsOptions.hostProcess must be false")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"spec.securityContext.sysctls: {s.get('name')} is not a safe sysctl")
    for where, sc in [("spec.securityContext", psc)] + [(f"{n}.securityContext", c.get("securityContext") or {})
                                                        for n, c in _containers(pod)]:
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}.seLinuxOptions is not allowed")
        app = (sc.get("appArmorProfile") or {}).get("type")
        if app not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{where}.appArmorProfile.type {app} is not allowed")
    # --- restricted: volumes ---
    for v in pod.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= ALLOWED_VOLUME_TYPES:
            out.append(f"volume {v.get('name')}: type {sorted(kinds - ALLOWED_VOLUME_TYPES)} is not allowed")
    # --- per container ---
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ("RuntimeDefault", "Localhost"):
        out.append(f"spec.securityContext.seccompProfile.type {pod_seccomp} is not allowed")
    if psc.get("runAsUser") == 0:
        out.append("spec.securityContext.runAsUser must not be 0")
    for name, c in _containers(pod):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged must be false")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess must be false")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{name}: hostPort {port['hostPort']} is not allowed")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount must be Default")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{name}: runAsNonRoot must be true (container or pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is not None and seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile.type {seccomp} is not allowed")
        if seccomp is None and pod_seccomp is None:
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost (container or pod)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities.drop must include ALL")
        added = set(caps.get("add") or []) - ADDABLE_CAPABILITIES
        if added:
            out.append(f"{name}: capabilities.add {sorted(added)} is not allowed")
    return out


def pod_specs(manifests: Iterable[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(``Kind/name``, PodSpec) of every workload among ``manifests``."""
    found = []
    for m in manifests:
        kind, name = m.get("kind"), (m.get("metadata") or {}).get("name")
        if kind == "Pod":
            found.append((f"{kind}/{name}", m["spec"]))
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            found.append((f"{kind}/{name}", m["spec"]["template"]["spec"]))
        elif kind == "CronJob":
            found.append((f"{kind}/{name}", m["spec"]["jobTemplate"]["spec"]["template"]["spec"]))
    return found
