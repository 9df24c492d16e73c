"""The emulator behaves like a real API server where the operator's faults live (with real kubectl)."""

from __future__ import annotations

import json

from emulator_harness import NAMESPACE, PIPELINES, child_path, example_pipeline, wait_for

DEPLOYMENTS = "/apis/apps/v1/namespaces/default/deployments"
CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


def _deployment(name: str, **spec) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "c", "image": "busybox:1"}]}}, **spec}}


def test_apps_v1_defaulting_turns_null_replicas_into_one(api):
    assert api.create(DEPLOYMENTS, _deployment("web", replicas=3)).status_code in (200, 201)
    stored = api.child("Deployment", "web")
    assert stored["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}}
    assert stored["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] == "/dev/termination-log"
    assert api.patch(child_path("Deployment", "web"), {"spec": {"replicas": None}}).status_code == 200
    assert api.child("Deployment", "web")["spec"]["replicas"] == 1


def test_stale_resource_version_is_a_conflict(api):
    assert api.create(CONFIGMAPS, {"metadata": {"name": "c"}, "data": {"a": "1"}}).status_code in (200, 201)
    first = api.get(f"{CONFIGMAPS}/c")
    assert api.patch(f"{CONFIGMAPS}/c", {"data": {"a": "2"}}).status_code == 200
    stale = dict(first, data={"a": "3"})
    r = api.http.put(f"{CONFIGMAPS}/c", json=stale)
    assert r.status_code == 409 and r.json()["reason"] == "Conflict", r.text
    fresh = api.get(f"{CONFIGMAPS}/c")
    r = api.http.put(f"{CONFIGMAPS}/c", json=dict(fresh, data={"b": "4"}))
    assert r.status_code == 200 and api.get(f"{CONFIGMAPS}/c")["data"] == {"b": "4"}


def test_kubectl_get_shows_the_printer_columns(api, crd_installed, kubectl):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    api.patch(f"{PIPELINES}/tiny/status", {"status": {"conditions": [{"type": "Ready", "status": "True"}],
                                                      "ar": {"ready": "1/1"}, "dit": {"ready": "0/1"},
                                                      "endpoint": "http://tiny-gateway"}})
    out = kubectl("get", "mmp").stdout.splitlines()
    assert out[0].split() == ["NAME", "READY", "AR", "DIT", "ENDPOINT", "AGE"], out
    assert out[1].split()[:5] == ["tiny", "True", "1/1", "0/1", "http://tiny-gateway"], out


def test_background_and_foreground_deletion_collect_dependents(api, crd_installed, kubectl):
    for name in ("bg", "fg"):
        assert api.create(PIPELINES, example_pipeline(name)).status_code in (200, 201)
        owner = api.pipeline(name)
        ref = {"apiVersion": "mammoth.dev/v1alpha1", "kind": "MammothPipeline", "name": name,
               "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        body = {"metadata": {"name": f"{name}-config", "ownerReferences": [ref], "finalizers": ["test/hold"]}}
        assert api.create(CONFIGMAPS, body).status_code in (200, 201)
    kubectl("delete", "mmp", "bg", "--wait=false")
    assert api.pipeline("bg") is None  # background: the owner goes at once
    wait_for(lambda: api.get(f"{CONFIGMAPS}/bg-config")["metadata"].get("deletionTimestamp"), what="dependent deleting")
    kubectl("delete", "mmp", "fg", "--cascade=foreground", "--wait=false")
    assert api.pipeline("fg")["metadata"]["finalizers"] == ["foregroundDeletion"]  # blocked by its dependent
    for name in ("bg", "fg"):
        api.patch(f"{CONFIGMAPS}/{name}-config", {"metadata": {"finalizers": None}})
    assert api.get(f"{CONFIGMAPS}/bg-config") is None and api.get(f"{CONFIGMAPS}/fg-config") is None
    assert api.pipeline("fg") is None


def test_finalizers_block_namespace_deletion_until_removed(api, crd_installed, kubectl):
    assert api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                             "metadata": {"name": "team-x"}}).status_code in (200, 201)
    base = "/apis/mammoth.dev/v1alpha1/namespaces/team-x/mammothpipelines"
    body = example_pipeline("held")
    body["metadata"] = {"name": "held", "namespace": "team-x", "finalizers": ["mammoth.dev/finalizer"]}
    assert api.create(base, body).status_code in (200, 201)
    result = kubectl("delete", "ns", "team-x", "--timeout=2s", check=False)
    assert result.returncode != 0  # a finalizer nobody removes holds the namespace
    assert api.get("/api/v1/namespaces/team-x")["status"]["phase"] == "Terminating"
    assert api.create("/api/v1/namespaces/team-x/configmaps", {"metadata": {"name": "x"}}).status_code == 403
    api.patch(f"{base}/held", {"metadata": {"finalizers": None}})
    wait_for(lambda: api.get("/api/v1/namespaces/team-x") is None, what="namespace gone")
    assert NAMESPACE == "default"


def test_block_owner_deletion_needs_update_on_the_owners_finalizers(api, crd_installed, emulator):
    assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
    owner = api.pipeline("tiny")
    emulator.authorizer = lambda p: p[1] != "mammothpipelines/finalizers"
    headers = {"Authorization": f"Bearer {emulator.subject_token}"}
    ref = {"apiVersion": "mammoth.dev/v1alpha1", "kind": "MammothPipeline", "name": "tiny",
           "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
    r = api.http.post(CONFIGMAPS, json={"metadata": {"name": "owned", "ownerReferences": [ref]}}, headers=headers)
    assert r.status_code == 403 and "blockOwnerDeletion" in r.json()["message"], r.text
    assert ("mammoth.dev", "mammothpipelines/finalizers", "update", "default") in emulator.denied
    r = api.http.post(CONFIGMAPS, json={"metadata": {"name": "owned", "ownerReferences": [dict(ref, blockOwnerDeletion=False)]}},
                      headers=headers)
    assert r.status_code in (200, 201), r.text
    r = api.http.post(CONFIGMAPS, json={"metadata": {"name": "by-admin", "ownerReferences": [ref]}})
    assert r.status_code in (200, 201), json.dumps(r.json())  # other identities are not restricted


def test_a_watch_delivers_a_write_made_while_it_sends_its_listing(api, emulator_thread):
    """A real API server's watch delivers every change after the state it lists. KMock's emulator
    released its lock after the listing's snapshot and subscribed to its event bus only once the
    listing was sent, so a write made meanwhile was never delivered: a watcher (kopf's index) kept
    the old object (the likeliest cause of the operator restart test's two patches to beta-ar)."""
    import socket
    import time
    from urllib.parse import urlparse

    for i in range(24):  # a listing of about 5 MB: the server blocks sending it while we read nothing
        assert api.create(CONFIGMAPS, {"metadata": {"name": f"big-{i}"}, "data": {"v": "x" * 200_000}}).status_code in (200, 201)
    url = urlparse(emulator_thread.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as s:
        s.sendall(f"GET {CONFIGMAPS}?watch=true HTTP/1.1\r\nHost: {url.hostname}\r\n"
                  "Authorization: Bearer test-token\r\n\r\n".encode())
        time.sleep(0.5)  # the listing is being sent, the reader idle
        assert api.patch(f"{CONFIGMAPS}/big-0", {"data": {"marker": "written-during-the-listing"}}).status_code == 200
        received = b""
        deadline = time.monotonic() + 10
        while b"written-during-the-listing" not in received and time.monotonic() < deadline:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    assert b"written-during-the-listing" in received, f"{len(received)} bytes, no event for the write"


def test_a_write_that_changes_nothing_keeps_the_resource_version_and_sends_no_event(api, emulator_thread):
    """The API server stores no update that leaves an object as it was: the resourceVersion stays and
    no watch event goes out (etcd3 storage's GuaranteedUpdate skips the write of identical bytes).
    The emulator bumped the version and sent MODIFIED for every patch, so a controller saw an event
    per redundant write of its own and ran again for it (redundant repairs of an unchanged child)."""
    import socket
    import time
    from urllib.parse import urlparse

    assert api.create(CONFIGMAPS, {"metadata": {"name": "steady"}, "data": {"v": "1"}}).status_code in (200, 201)
    before = api.http.get(f"{CONFIGMAPS}/steady").json()["metadata"]["resourceVersion"]
    url = urlparse(emulator_thread.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as s:
        s.sendall(f"GET {CONFIGMAPS}?watch=true&resourceVersion={before} HTTP/1.1\r\nHost: {url.hostname}\r\n"
                  "Authorization: Bearer test-token\r\n\r\n".encode())
        time.sleep(0.3)
        same = api.patch(f"{CONFIGMAPS}/steady", {"data": {"v": "1"}})
        assert same.status_code == 200, same.text
        assert same.json()["metadata"]["resourceVersion"] == before
        assert api.http.get(f"{CONFIGMAPS}/steady").json()["metadata"]["resourceVersion"] == before
        changed = api.patch(f"{CONFIGMAPS}/steady", {"data": {"v": "2"}})  # a real change: one event
        assert changed.status_code == 200 and changed.json()["metadata"]["resourceVersion"] != before
        received = b""
        deadline = time.monotonic() + 10
        while b'"v": "2"' not in received.replace(b'"v":"2"', b'"v": "2"') and time.monotonic() < deadline:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chunk = s.recv(1 << 20)
            except TimeoutError:
                break
            if not chunk:
                break
            received += chunk
    events = [line for line in received.split(b"\n") if b'"type"' in line and b"steady" in line]
    modified = [e for e in events if b"MODIFIED" in e]
    assert len(modified) == 1, [e[:200] for e in modified]


def _watch(api, query: str, until, timeout: float = 10.0) -> list[dict]:
    """The events of ``GET CONFIGMAPS?watch=true&<query>`` until ``until(events)`` holds or ``timeout``."""
    import time

    import httpx

    events: list[dict] = []
    deadline = time.monotonic() + timeout
    with api.http.stream("GET", f"{CONFIGMAPS}?watch=true&{query}", timeout=httpx.Timeout(timeout, read=1.0)) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        while not until(events) and time.monotonic() < deadline:
            try:
                line = next(lines)
            except (httpx.ReadTimeout, StopIteration):
                break
            if line.strip():
                events.append(json.loads(line))
    return events


def _summary(events: list[dict]) -> list[tuple[str, str, str | None]]:
    return [(e["type"], e["object"].get("metadata", {}).get("name"), (e["object"].get("data") or {}).get("v"))
            for e in events]


def test_a_watch_from_a_resource_version_sends_only_the_changes_after_it(api, emulator_thread):
    """kopf lists a kind, then watches it from the listing's ``resourceVersion``: a real API server
    sends only the changes after that version (from its watch cache), in order, and nothing of the
    state the listing already held; a version older than it keeps answers 410 Gone. The emulator
    ignored the version and began every watch (every restart and reconnect of kopf's watches) with
    the whole current state as ADDED events, each one a child event to the operator (a repair run)
    and, when the state was read before the operator's own write but delivered after it, one that
    patched the child a second time (the restart test's two or three patches to beta-ar)."""
    for name in ("a", "b"):
        assert api.create(CONFIGMAPS, {"metadata": {"name": name}, "data": {"v": "1"}}).status_code in (200, 201)
    listed = api.get(CONFIGMAPS)["metadata"]["resourceVersion"]
    assert api.patch(f"{CONFIGMAPS}/a", {"data": {"v": "2"}}).status_code == 200  # between list and watch
    assert api.http.delete(f"{CONFIGMAPS}/b").status_code == 200

    events = _watch(api, f"resourceVersion={listed}", until=lambda e: len(e) >= 2, timeout=3.0)
    assert _summary(events) == [("MODIFIED", "a", "2"), ("DELETED", "b", "1")], _summary(events)
    deleted_at = int(events[1]["object"]["metadata"]["resourceVersion"])
    assert deleted_at > int(events[0]["object"]["metadata"]["resourceVersion"]) > int(listed)

    # resourceVersion "0" or none: the state now, as ADDED events (the watch-cache's "any" semantics)
    for query in ("resourceVersion=0", "allowWatchBookmarks=true"):
        events = _watch(api, query, until=lambda e: len(e) >= 1, timeout=3.0)
        assert _summary(events) == [("ADDED", "a", "2")], (query, _summary(events))


def test_a_watch_from_a_version_older_than_the_watch_cache_is_gone(api):
    """A version the watch cache no longer reaches back to answers ``ERROR 410 Expired`` (kopf and
    client-go then list again), not a silent gap and not the whole state as new events."""
    api.emulator.watch_history = 2  # before the first write of the resource creates its cache
    listed = api.get(CONFIGMAPS)["metadata"]["resourceVersion"]
    for name in ("a", "b", "c"):
        assert api.create(CONFIGMAPS, {"metadata": {"name": name}, "data": {"v": "1"}}).status_code in (200, 201)
    events = _watch(api, f"resourceVersion={listed}", until=lambda e: len(e) >= 1, timeout=3.0)
    assert [(e["type"], e["object"].get("code"), e["object"].get("reason")) for e in events] == [("ERROR", 410, "Expired")]
    later = api.get(CONFIGMAPS)["metadata"]["resourceVersion"]
    assert api.patch(f"{CONFIGMAPS}/c", {"data": {"v": "2"}}).status_code == 200
    events = _watch(api, f"resourceVersion={later}", until=lambda e: len(e) >= 1, timeout=3.0)
    assert _summary(events) == [("MODIFIED", "c", "2")]


def test_configmaps_secrets_and_services_carry_no_generation(api):
    """A real API server sets ``metadata.generation`` only for kinds whose strategy keeps one
    (Deployments, PDBs, HPAs, NetworkPolicies, custom resources); a ConfigMap, a Secret or a Service
    has none. The emulator gave every kind one, so the operator's path for kinds without one (a
    late event it cannot order against its own write) never ran in the tests (break-it pass:
    ``{'ConfigMap': 1, 'Service': 1}``)."""
    bodies = {"ConfigMap": (CONFIGMAPS, {"metadata": {"name": "x"}, "data": {"a": "1"}}),
              "Secret": ("/api/v1/namespaces/default/secrets", {"metadata": {"name": "x"}, "data": {"a": "MQ=="}}),
              "Service": ("/api/v1/namespaces/default/services", {"metadata": {"name": "x"},
                                                                  "spec": {"ports": [{"port": 80}]}}),
              "Deployment": (DEPLOYMENTS, _deployment("x", replicas=1))}
    for kind, (path, body) in bodies.items():
        assert api.create(path, body).status_code in (200, 201), kind
    assert api.patch(f"{CONFIGMAPS}/x", {"data": {"a": "2"}}).status_code == 200
    assert api.patch(f"{DEPLOYMENTS}/x", {"spec": {"replicas": 2}}).status_code == 200
    found = {kind: api.get(f"{path}/x")["metadata"].get("generation") for kind, (path, _) in bodies.items()}
    assert found == {"ConfigMap": None, "Secret": None, "Service": None, "Deployment": 2}, found


def test_a_label_selector_filters_lists_and_watches_and_an_object_leaving_it_is_deleted_for_the_watch(api):
    """The API server filters lists and watches by ``labelSelector``, and a watch sees an object that
    stops matching as ``DELETED`` (its previous content, the new version) and one that starts matching
    as ``ADDED``: how the operator, watching its children by its ``managed-by`` label, sees a child
    whose label was removed by hand. KMock ignored the selector: the watch sent the edit as
    ``MODIFIED``, which the operator's client-side filter then dropped, so it saw nothing."""
    for name, team in (("a", "x"), ("b", "y")):
        assert api.create(CONFIGMAPS, {"metadata": {"name": name, "labels": {"team": team}},
                                       "data": {"v": "1"}}).status_code in (200, 201)
    listing = api.get(f"{CONFIGMAPS}?labelSelector=team%3Dx")
    assert [i["metadata"]["name"] for i in listing["items"]] == ["a"]
    assert [i["metadata"]["name"] for i in api.get(f"{CONFIGMAPS}?labelSelector=team%21%3Dx,team")["items"]] == ["b"]
    listed = listing["metadata"]["resourceVersion"]
    assert api.patch(f"{CONFIGMAPS}/b", {"data": {"v": "2"}}).status_code == 200  # not selected: no event
    assert api.patch(f"{CONFIGMAPS}/a", {"metadata": {"labels": {"team": None}}}).status_code == 200
    assert api.patch(f"{CONFIGMAPS}/b", {"metadata": {"labels": {"team": "x"}}}).status_code == 200
    events = _watch(api, f"resourceVersion={listed}&labelSelector=team%3Dx", until=lambda e: len(e) >= 2, timeout=3.0)
    seen = [(e["type"], e["object"]["metadata"]["name"], (e["object"]["metadata"].get("labels") or {}).get("team"))
            for e in events]
    assert seen == [("DELETED", "a", "x"), ("ADDED", "b", "x")], seen
