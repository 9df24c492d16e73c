"""The ConfigMap ``N-config``: ``pipeline.yaml``, the settings file every container reads, and the
per-component hash of what each component reads from it (the pod-template annotation that rolls
exactly the components an edit concerns)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import yaml

from mammoth_core.settings import ARSettings, DiTSettings, GatewaySettings
from mammoth_operator.builders.common import (API_KEYS_DIR, AUTH_DIR, CACHE_DIR, CONFIG_KEY, GATEWAY_PORT, GROUP,
                                              ROLE_TOKENS_DIR, ROLE_TOKENS_MOUNTED, STAGE_PORTS, backend_address,
                                              Child, canonical_json, child_names, drain_grace_seconds, labels)
from mammoth_operator.spec import PipelineSpec

#: Annotation on pod templates: the hash of the settings *that component reads*, so an edit rolls
#: exactly the components it concerns (``requestDefaults.steps`` rolls the gateway, not the GPUs).
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
#: Settings class of each component: the keys it reads from ``pipeline.yaml``.
SETTINGS_CLASSES = {"ar": ARSettings, "dit": DiTSettings, "gateway": GatewaySettings}


def pipeline_config(spec: PipelineSpec) -> dict[str, Any]:
    """The settings file (flat keys + ``ar``/``dit``/``gateway`` sections) every container reads.

    Both stages read the same flat ``chunk_rows`` and ``max_message_bytes``, so their transport
    limits cannot disagree.
    """
    rd = spec.request_defaults
    config: dict[str, Any] = {
        # every interface of both families (IPv4 and IPv6): a pod of an IPv6 or dual-stack cluster is
        # reached on its IPv6 address too ("0.0.0.0" is IPv4 alone; runtime.listen_sockets, add_port)
        "host": "",
        "device": spec.device,
        "dtype": spec.dtype,
        "chunk_rows": spec.transport.chunk_rows,
        "max_message_bytes": spec.transport.max_message_bytes,
        "drain_grace_seconds": drain_grace_seconds(spec),
        "cache_dir": CACHE_DIR,
        "log_format": spec.log_format,
        "log_level": spec.log_level,
        # request limits the DiT enforces as well as the gateway (flat: every component reads them)
        "max_pixels": rd.max_pixels,
        "min_pixels": rd.min_pixels,
    }
    if spec.transport.auth_token is not None:
        config["auth_token_file"] = f"{AUTH_DIR}/token"
    config["ar"] = {
        "port": STAGE_PORTS["ar"][0],
        "metrics_port": STAGE_PORTS["ar"][1],
        "max_running_sequences": spec.ar.capacity,
        "weights_dtype": spec.ar.weights_dtype,
        "tensor_parallel_size": spec.ar.ranks,
        # The AR pushes only to pods behind the DiT's headless Service (stage_ar/dit_targets.py).
        "dit_allow_list": [backend_address(spec, "dit")],
    }
    config["dit"] = {
        "port": STAGE_PORTS["dit"][0],
        "metrics_port": STAGE_PORTS["dit"][1],
        "slots": spec.dit.capacity,
        "dit_parallel": spec.dit.parallel,
    }
    if spec.dit.parallel != "none":
        config["dit"]["dit_parallel_size"] = spec.dit.ranks
    gateway: dict[str, Any] = {
        "port": GATEWAY_PORT,
        "default_steps": rd.steps,
        "default_guidance_scale": rd.guidance_scale,
        "default_cfg_range": list(rd.cfg_range),
        "default_ar_grid": rd.ar_grid,
        "default_ar_decoding": rd.ar_decoding,
        "default_jacobi_window": rd.jacobi_window,
        "max_prompt_chars": rd.max_prompt_chars,
        "request_timeout_seconds": rd.request_timeout_seconds,
        "queue_size": spec.gateway.queue_size,
    }
    if spec.gateway.api_keys is not None:
        gateway["api_keys_file"] = f"{API_KEYS_DIR}/keys"
    config["gateway"] = gateway
    if spec.transport.role_tokens is not None:
        for component, roles in ROLE_TOKENS_MOUNTED.items():
            for role in roles:
                config[component][f"{role}_token_file"] = f"{ROLE_TOKENS_DIR}/{role}"
    return config


def render_config(spec: PipelineSpec) -> str:
    """``pipeline.yaml`` as text (stable key order, so its hash only changes with its content)."""
    return yaml.safe_dump(pipeline_config(spec), sort_keys=True)


def component_settings(spec: PipelineSpec, component: str) -> dict[str, Any]:
    """The settings ``component`` reads from ``pipeline.yaml``: flat keys with its section merged on top
    (as ``mammoth_core.settings.read_config_file`` does), only the keys its settings class declares."""
    config = pipeline_config(spec)
    merged = {k: v for k, v in config.items() if k not in SETTINGS_CLASSES} | dict(config.get(component) or {})
    known = {f.name for f in dataclasses.fields(SETTINGS_CLASSES[component])}
    return {k: v for k, v in merged.items() if k in known}


def config_hash(spec: PipelineSpec, component: str) -> str:
    """First 16 hex digits of the SHA-256 of the settings ``component`` reads (:func:`component_settings`)."""
    return hashlib.sha256(canonical_json(component_settings(spec, component)).encode()).hexdigest()[:16]



def build_config_map(spec: PipelineSpec) -> Child:
    """The ConfigMap holding ``pipeline.yaml`` (mounted at ``/etc/mammoth`` in every pod)."""
    return Child({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": child_names(spec.name).config, "labels": labels(spec.name, "config")},
        "data": {CONFIG_KEY: render_config(spec)},
    })

