#!/usr/bin/env python3
"""Helper of k8s/validate.sh (run with the venv's python).

  validate_helper.py objects FILE
      one line per object: KIND NAME (to count what was validated)
  validate_helper.py checkov VARIANT JSON [VARIANT JSON ...]
      reads checkov's JSON reports, applies the skip list below, prints what
      ran, what passed, what failed and what was skipped (with the reason),
      exits 1 on a failure not on the list, or on a per-resource skip that
      no longer matches anything (a stale excuse).

THE SKIP LIST. Every check skipped, with a one-line reason.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import yaml

# Skipped everywhere.
SKIP_ALL = {
    "CKV_K8S_43": "image digest pinning: the image is built locally (k8s/image/) and loaded "
    "on each host; there is no registry to take a digest from (the tag is set with "
    "kustomize `images:`)",
    "CKV_K8S_15": "imagePullPolicy Always: there is no registry, so Always would fail to pull "
    "the locally loaded image; IfNotPresent is deliberate",
}

# Skipped for one resource of one variant: (variant or "*", check, resource) -> reason.
SKIP_ONE = {
    ("*", "CKV_K8S_8", "Deployment.pagewire.pagewire-admin"): "the admin pod runs only a "
    "waiting shell for `kubectl exec ... pwctl`; it serves nothing a liveness probe could check",
    ("*", "CKV_K8S_9", "Deployment.pagewire.pagewire-admin"): "the admin pod serves nothing; "
    "no Service routes to it, so readiness would mean nothing",
    # soft-roce: the rxe-setup init container (k8s/overlays/soft-roce/rxe-init.yaml)
    # and the node container (node-devices.yaml) are privileged; checkov judges
    # the DaemonSet as a whole, so one skip per check covers both; which
    # containers are privileged, and nothing else about the node container,
    # is pinned by k8s/check_drift.py (NODE_DIFFERENCES).
    ("soft-roce", "CKV_K8S_16", "DaemonSet.pagewire.pagewire-node"): "privileged: rxe-setup, to "
    "create the soft-RoCE device (`rdma link add`), and the node, to open that device's "
    "/dev/infiniband/uverbsN, which appears after the kubelet allocated the pod's devices so no "
    "device plugin can grant it (k8s/README.md, soft-RoCE); test clusters only, roce is the "
    "production path",
    ("soft-roce", "CKV_K8S_20", "DaemonSet.pagewire.pagewire-node"): "a privileged container "
    "cannot set allowPrivilegeEscalation: false (the API refuses the pair): rxe-setup and the "
    "node (whose process still runs as uid 10001, non-root)",
    ("soft-roce", "CKV_K8S_37", "DaemonSet.pagewire.pagewire-node"): "rxe-setup is privileged "
    "and drops no capabilities; the node drops ALL, but runtimes ignore the drop in a "
    "privileged container (privileged is what the node needs; k8s/README.md, The cost)",
    ("soft-roce", "CKV_K8S_28", "DaemonSet.pagewire.pagewire-node"): "rxe-setup is privileged "
    "(NET_RAW included); the node drops ALL, which runtimes ignore under privileged (a "
    "known cost of the soft-RoCE node; k8s/README.md, The cost)",
}


def objects(path: str) -> int:
    """Lists the objects; fails on one outside the pagewire namespace, a
    container image without a tag (what an overlay's additions miss when
    the base's transformers do not reach them), or a container both
    privileged and with allowPrivilegeEscalation: false (the API server
    refuses the pair; the offline schemas do not see it)."""
    bad = []
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    for d in docs:
        kind, meta = d["kind"], d["metadata"]
        print(kind, meta["name"])
        if kind != "Namespace" and meta.get("namespace") != "pagewire":
            bad.append(f"{kind} {meta['name']} is in namespace {meta.get('namespace')!r}")
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        for c in pod.get("initContainers", []) + pod.get("containers", []):
            image = c.get("image", "")
            if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
                bad.append(f"{kind} {meta['name']} container {c['name']}: image {image!r} has no fixed tag")
            sc = c.get("securityContext") or {}
            if sc.get("privileged") is True and sc.get("allowPrivilegeEscalation") is False:
                bad.append(
                    f"{kind} {meta['name']} container {c['name']}: privileged with "
                    "allowPrivilegeEscalation: false, which the API server refuses"
                )
    for b in bad:
        print(f"validate_helper: {b}", file=sys.stderr)
    return 1 if bad else 0


def checkov(args: list[str]) -> int:
    if len(args) % 2:
        sys.exit("usage: validate_helper.py checkov VARIANT JSON [VARIANT JSON ...]")
    bad = 0
    ran: set[str] = set()
    used: set[tuple[str, str, str]] = set()
    skipped_all: dict[str, set[str]] = defaultdict(set)
    skipped_one: list[tuple[str, str, str, str]] = []
    for variant, path in zip(args[::2], args[1::2]):
        with open(path) as f:
            rep = json.load(f)
        if isinstance(rep, list):  # several frameworks: keep kubernetes
            rep = next(r for r in rep if r.get("check_type") == "kubernetes")
        res = rep.get("results", {})
        summ = rep.get("summary", {})
        if summ.get("parsing_errors"):
            print(f"  {variant}: checkov could not parse {summ['parsing_errors']} file(s)")
            bad += 1
        passed = res.get("passed_checks", [])
        failed = res.get("failed_checks", [])
        ran |= {c["check_id"] for c in passed + failed}
        real = []
        for c in failed:
            cid, rsrc = c["check_id"], c["resource"]
            key = next(
                (k for k in ((variant, cid, rsrc), ("*", cid, rsrc)) if k in SKIP_ONE), None
            )
            if cid in SKIP_ALL:
                skipped_all[cid].add(f"{variant}:{rsrc}")
            elif key:
                used.add(key)
                skipped_one.append((variant, cid, rsrc, SKIP_ONE[key]))
            else:
                real.append(c)
        print(
            f"  {variant}: {summ.get('resource_count', '?')} resources, "
            f"{len(passed)} passed, {len(failed) - len(real)} failed but skipped, "
            f"{len(real)} failed"
        )
        for c in real:
            print(f"    FAIL {c['check_id']} {c['check_name']}: {c['resource']}")
        bad += len(real)
    print(f"  checkov ran {len(ran)} distinct Kubernetes checks")
    if skipped_all:
        print("  skipped everywhere:")
        for cid, where in sorted(skipped_all.items()):
            print(f"    {cid} ({len(where)} resources): {SKIP_ALL[cid]}")
    if skipped_one:
        print("  skipped for one resource:")
        for variant, cid, rsrc, why in skipped_one:
            print(f"    {variant} {cid} {rsrc}: {why}")
    variants = set(args[::2])
    stale = [k for k in SKIP_ONE if k not in used and (k[0] == "*" or k[0] in variants)]
    for k in stale:
        print(f"    STALE skip {k}: nothing fails it any more; remove it from validate_helper.py")
    bad += len(stale)
    return 1 if bad else 0


def main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "objects":
        return objects(sys.argv[2])
    if len(sys.argv) >= 2 and sys.argv[1] == "checkov":
        return checkov(sys.argv[2:])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
