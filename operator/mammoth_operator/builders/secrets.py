"""The generated Secret ``N-stage-tokens``: per-role stage tokens, immutable, rotated by deletion."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping

from mammoth_operator.builders.common import GROUP, Child, canonical_json, child_names, labels
from mammoth_operator.spec import ROLE_TOKEN_KEYS, PipelineSpec

#: Annotation on pod templates: the hash of the generated stage tokens, so a rotation rolls the pods.
TOKENS_HASH_ANNOTATION = f"{GROUP}/stage-tokens-hash"


def tokens_hash(tokens: Mapping[str, str]) -> str:
    """First 16 hex digits of the SHA-256 of the stage tokens (role -> token); rolls pods on rotation."""
    return hashlib.sha256(canonical_json(dict(tokens)).encode()).hexdigest()[:16]


def build_stage_tokens_secret(spec: PipelineSpec, tokens: Mapping[str, str]) -> Child:
    """The generated per-role token Secret (keys ``gateway`` and ``ar``). ``data`` is create-only and the
    Secret immutable: rotation is deleting it (the operator creates fresh tokens and the pods roll)."""
    data = {ROLE_TOKEN_KEYS[role]: base64.b64encode(tokens[role].encode()).decode() for role in ROLE_TOKEN_KEYS}
    return Child({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": child_names(spec.name).stage_tokens, "labels": labels(spec.name, "stage-tokens")},
        "type": "Opaque",
        "immutable": True,
        "data": data,
    }, create_only=(("data",),))


