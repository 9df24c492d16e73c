"""Issue 21: stages over several GPUs in the CRD and the operator (``ar.tensorParallelSize``,
``dit.parallel`` / ``dit.parallelSize``).

Pure builders: the pod of a replica requests one ``nvidia.com/gpu`` per rank, all ranks in that one
pod (one container: the stage starts its ranks itself), a memory-backed ``/dev/shm`` for NCCL only
when there are several ranks, and the stage reads its rank count from the rendered config file.
Against the emulated API server: out-of-bounds and unknown values are refused at admission, and,
when admission did not run, reported as ``Degraded/InvalidSpec`` naming the field, with no child
written; fixing the spec creates the GPU-sized Deployments.
"""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from emulator_harness import PIPELINES, Api, child_writes, condition, example_pipeline, wait_for
from mammoth_core.settings import ARSettings, DiTSettings, resolve_settings
from mammoth_operator import builders
from mammoth_operator.config import OperatorConfig
from mammoth_operator.spec import InvalidSpec, parse_spec

IMAGES = OperatorConfig.from_env({}).images


def _pipeline(**spec: Any):
    return parse_spec("p", "ns1", {"model": {"source": "builtin://tiny"}, **spec}, IMAGES)


def _deployment(spec, component: str) -> dict[str, Any]:
    return next(c.manifest for c in builders.build_children(spec)
                if c.kind == "Deployment" and c.name == f"{spec.name}-{component}")


def _shm(pod: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    volumes = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    mounts = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    return volumes, mounts


def _settings(spec, cls, tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(builders.render_config(spec))
    return resolve_settings(cls, config_file=str(path), env={})


@pytest.mark.parametrize("component,stage_spec,ranks", [
    ("ar", {"tensorParallelSize": 2}, 2),
    ("ar", {"tensorParallelSize": 4, "gpus": 1}, 4),
    ("dit", {"parallel": "cfg"}, 2),
    ("dit", {"parallel": "ulysses", "parallelSize": 4}, 4),
])
def test_several_ranks_get_one_gpu_each_and_shared_memory_in_one_pod(component, stage_spec, ranks, tmp_path):
    spec = _pipeline(**{component: stage_spec})
    manifest = _deployment(spec, component)
    kubernetes_validate.validate(dict(manifest, metadata=dict(manifest["metadata"], namespace="ns1")), "1.35",
                                 strict=True)
    pod = manifest["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1  # the ranks are processes of the one stage container
    resources = pod["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == str(ranks)
    # each rank holds the weights in host memory while loading and runs its own host loop
    assert (resources["requests"]["cpu"], resources["requests"]["memory"]) == (str(4 * ranks), f"{32 * ranks}Gi")
    volumes, mounts = _shm(pod)
    assert [v["emptyDir"] for v in volumes] == [{"medium": "Memory", "sizeLimit": "1Gi"}]
    assert [m["name"] for m in mounts] == [volumes[0]["name"]]
    if component == "ar":
        assert _settings(spec, ARSettings, tmp_path).tensor_parallel_size == ranks
    else:
        settings = _settings(spec, DiTSettings, tmp_path)
        assert (settings.dit_parallel, settings.parallel_ranks()) == (stage_spec["parallel"], ranks)


def test_one_rank_is_unchanged_one_gpu_and_no_shared_memory(tmp_path):
    spec = _pipeline()
    for component, cls in (("ar", ARSettings), ("dit", DiTSettings)):
        pod = _deployment(spec, component)["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert pod["containers"][0]["resources"]["requests"]["memory"] == "32Gi"
        assert _shm(pod) == ([], [])
    mine = _deployment(_pipeline(ar={"tensorParallelSize": 2, "resources": {"requests": {"memory": "40Gi"}}}), "ar")
    assert mine["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] == "40Gi"
    assert _settings(spec, ARSettings, tmp_path).tensor_parallel_size == 1
    assert _settings(spec, DiTSettings, tmp_path).parallel_ranks() == 1
    cpu = _deployment(_pipeline(ar={"gpus": 0, "tensorParallelSize": 2}), "ar")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"].get("limits", {})  # gloo ranks on the CPU


@pytest.mark.parametrize("stage_spec,field", [
    ({"ar": {"tensorParallelSize": 0}}, "spec.ar.tensorParallelSize"),
    ({"ar": {"tensorParallelSize": 9}}, "spec.ar.tensorParallelSize"),
    ({"dit": {"parallel": "ring"}}, "spec.dit.parallel"),
    ({"dit": {"parallel": "cfg", "parallelSize": 1}}, "spec.dit.parallelSize"),
])
def test_bad_parallel_values_are_invalid_specs(stage_spec, field):
    with pytest.raises(InvalidSpec) as info:
        _pipeline(**stage_spec)
    assert info.value.field == field


def test_bad_parallel_size_is_refused_or_reported_and_fixing_it_creates_gpu_pods(api: Api, running_operator,
                                                                                 emulator):
    base = example_pipeline()
    bad = copy.deepcopy(base)
    bad["spec"]["ar"]["tensorParallelSize"] = 16
    refused = api.create(PIPELINES, bad)
    assert refused.status_code == 422 and "tensorParallelSize" in refused.text

    emulator.admission = False  # as if admission had not checked the schema (older CRD, other server)
    assert api.create(PIPELINES, bad).status_code in (200, 201)
    degraded = wait_for(lambda: (condition(api.pipeline("tiny"), "Degraded") or {}).get("reason") == "InvalidSpec"
                        and api.pipeline("tiny"), what="Degraded/InvalidSpec")
    assert "spec.ar.tensorParallelSize" in condition(degraded, "Degraded")["message"]
    assert child_writes(emulator) == []

    r = api.patch(f"{PIPELINES}/tiny", {"spec": {"ar": {"tensorParallelSize": 2}, "dit": {"parallel": "cfg"}}})
    assert r.status_code == 200, r.text
    for component in ("ar", "dit"):
        deployment = wait_for(lambda: api.child("Deployment", f"tiny-{component}"), what=f"tiny-{component}")
        pod = deployment["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
