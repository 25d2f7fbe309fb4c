"""check_drift.py's RDMA part: the soft-roce and roce overlays against the
tcp one (but for verbs), and the image build against the verbs feature."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import yaml


from drift_lib import *  # noqa: F403 (the checks share every helper)

# --- verbs: the RDMA overlays against the tcp one, and the image ------------------

VERBS_CONFIG = K8S / "components" / "verbs" / "node.toml"
VERBS_PACKAGES = ("libibverbs1", "ibverbs-providers")
VERBS_FEATURE = "pagewire-node/verbs"

# How each RDMA overlay's node container may differ from the tcp overlay's,
# beyond the verbs port (checked on its own). Anything else is drift.
#   securityContext: keys set to these values, and keys removed.
#   resources: extended resources added to requests and limits.
#   privileged: the containers of the pod that may be privileged.
# soft-roce: the rxe device's /dev/infiniband/uverbsN is created by the
# rxe-setup init container after the kubelet has allocated the pod's
# devices, so only a privileged container (whose /dev the runtime fills
# with the host's devices when it creates it, after the init containers)
# can open it; the API refuses allowPrivilegeEscalation: false beside
# privileged, so that key goes (k8s/overlays/soft-roce/node-devices.yaml,
# k8s/README.md "soft-RoCE"). Still uid 10001, non-root, read-only root,
# no added capability.
# roce: the RDMA shared device plugin grants the device; nothing else.
NODE_DIFFERENCES = {
    "soft-roce": {
        "securityContext": ({"privileged": True}, ("allowPrivilegeEscalation",)),
        "resources": {},
        "privileged": {"rxe-setup", "node"},
    },
    "roce": {
        "securityContext": ({}, ()),
        "resources": {"rdma/rdma_shared_device_a": "1"},
        "privileged": set(),
    },
}


def without_verbs(toml: dict) -> dict:
    """The node config but for [transports] verbs_* and verbs."""
    out = dict(toml)
    out["transports"] = {
        k: v for k, v in toml.get("transports", {}).items() if k != "verbs" and not k.startswith("verbs_")
    }
    return out


def policy_ports(objs, name, overlay) -> set[tuple[int, str]]:
    o = find(objs, "NetworkPolicy", name, overlay)
    return {(p["port"], p.get("protocol", "TCP")) for r in o["spec"].get("ingress", []) for p in r.get("ports", [])}


def check_verbs(tcp_objs, rdma: dict[str, list[dict]], base_toml: dict, node_ports: dict) -> None:
    print("verbs (tcp overlay and compose: off; soft-roce and roce: on, GID chosen at start):")
    t = base_toml.get("transports", {})
    check(
        "k8s/base/config/node.toml (tcp overlay, compose) has [transports] verbs off",
        t.get("verbs", False) is False,
        f"verbs = {t.get('verbs')!r}",
    )
    tcp_ds = find(tcp_objs, "DaemonSet", "pagewire-node")
    tcp_node = container(tcp_ds, "node")
    tcp_cm = config_map(tcp_objs)
    tcp_rendered = tomllib.loads(tcp_cm["data"]["node.toml"]) if tcp_cm else {}
    check(
        "the tcp rendering's node.toml has verbs off",
        tcp_cm is not None and tcp_rendered.get("transports", {}).get("verbs", False) is False,
    )
    check(
        "the tcp node container has no verbs port",
        all(p.get("name") != "verbs" for p in tcp_node.get("ports", [])),
    )
    if not VERBS_CONFIG.exists():
        check(f"{VERBS_CONFIG.relative_to(REPO)} exists", False)
        return
    verbs_text = VERBS_CONFIG.read_text()
    verbs_toml = tomllib.loads(verbs_text)
    vt = verbs_toml.get("transports", {})
    rel = VERBS_CONFIG.relative_to(REPO)
    check(
        f"{rel} is k8s/base/config/node.toml but for [transports] verbs*",
        without_verbs(verbs_toml) == without_verbs(base_toml),
        "differs beyond verbs_* (copy the base's change over)",
    )
    check(f"{rel}: verbs = true", vt.get("verbs") is True, f"verbs = {vt.get('verbs')!r}")
    check(
        f"{rel}: GID chosen at start (verbs_gid_index = -1, verbs_device empty)",
        vt.get("verbs_gid_index", -1) == -1 and vt.get("verbs_device", "") == "",
        f"verbs_gid_index = {vt.get('verbs_gid_index')!r}, verbs_device = {vt.get('verbs_device')!r}",
    )
    listen = vt.get("verbs_listen", "")
    verbs_port = port_of(listen) if re.search(r":\d+$", listen) else 0
    check(
        f"{rel}: verbs_listen has a fixed port (NetworkPolicy, hostNetwork)",
        verbs_port > 0,
        f"verbs_listen = {listen!r}",
    )
    check(
        f"{rel}: verbs port {verbs_port} is none of the other ports {sorted(node_ports.values())}",
        verbs_port not in node_ports.values(),
    )

    tcp_policy = policy_ports(tcp_objs, "pagewire-internal", "tcp")
    for name in RDMA_OVERLAYS:
        objs = rdma[name]
        print(f"  {name}:")
        cm = config_map(objs)
        check(f"{name}: one ConfigMap pagewire-config", cm is not None)
        if cm is None:
            continue
        data = cm.get("data", {})
        check(f"{name}: its node.toml is {rel} byte for byte", data.get("node.toml") == verbs_text)
        check(
            f"{name}: its coordinator.toml is the base's byte for byte",
            data.get("coordinator.toml") == (K8S / "base" / "config" / "coordinator.toml").read_text(),
        )
        rendered = tomllib.loads(data.get("node.toml", ""))
        rt = rendered.get("transports", {})
        check(
            f"{name}: rendered node.toml has verbs = true, verbs_gid_index = -1, verbs_device empty",
            rt.get("verbs") is True and rt.get("verbs_gid_index", -1) == -1 and rt.get("verbs_device", "") == "",
            f"verbs = {rt.get('verbs')!r}, verbs_gid_index = {rt.get('verbs_gid_index')!r}, verbs_device = {rt.get('verbs_device')!r}",
        )
        ds = find(objs, "DaemonSet", "pagewire-node", name)
        node = container(ds, "node")
        mounts = k8s_mounts(ds, node)
        m = mounts.get("/etc/pagewire/node.toml", {})
        check(
            f"{name}: the node mounts that ConfigMap's node.toml at /etc/pagewire/node.toml",
            m.get("kind") == "configMap"
            and m.get("subPath") == "node.toml"
            and m["volume"]["configMap"]["name"] == cm["metadata"]["name"],
        )
        vp = {p["containerPort"]: p for p in node.get("ports", []) if p.get("name") == "verbs"}
        check(
            f"{name}: node container port verbs = {verbs_port}/TCP",
            list(vp) == [verbs_port] and vp[verbs_port].get("protocol", "TCP") == "TCP",
            f"k8s {sorted(vp)}",
        )
        others = [p for p in node.get("ports", []) if p.get("name") != "verbs"]
        check(f"{name}: the other node ports are the tcp overlay's", others == tcp_node.get("ports", []))
        allowed = NODE_DIFFERENCES[name]
        rest = sorted(
            k
            for k in (set(node) | set(tcp_node)) - {"ports", "securityContext", "resources"}
            if node.get(k) != tcp_node.get(k)
        )
        check(
            f"{name}: node container is the tcp overlay's field for field (command, env, probes, "
            "lifecycle, image, mounts, ...) but for ports, securityContext and resources",
            not rest,
            "differs in " + ", ".join(f"{k}: {node.get(k)!r} vs {tcp_node.get(k)!r}" for k in rest),
        )
        set_sc, removed_sc = allowed["securityContext"]
        want_sc = {k: v for k, v in tcp_node.get("securityContext", {}).items() if k not in removed_sc}
        want_sc.update(set_sc)
        sc = node.get("securityContext", {})
        what = ", ".join([f"{k}: {json.dumps(v)}" for k, v in set_sc.items()] + [f"no {k}" for k in removed_sc])
        check(
            f"{name}: node securityContext is the tcp overlay's" + (f" but for {what}" if what else ""),
            sc == want_sc,
            f"{sc!r} vs the wanted {want_sc!r}",
        )
        added = (sc.get("capabilities") or {}).get("add") or []
        check(
            f"{name}: node runs as uid 10001, non-root, with no added capability (IPC_LOCK would not reach a non-root process)",
            sc.get("runAsUser") == 10001 and sc.get("runAsNonRoot") is True and not added,
            f"runAsUser {sc.get('runAsUser')}, runAsNonRoot {sc.get('runAsNonRoot')}, add {added}",
        )
        res, tcp_res = node.get("resources", {}), tcp_node.get("resources", {})
        want_res = dict(tcp_res)
        if allowed["resources"]:
            for part in ("requests", "limits"):
                want_res[part] = {**tcp_res.get(part, {}), **allowed["resources"]}
        check(
            f"{name}: node resources are the tcp overlay's"
            + (f" plus {allowed['resources']} (requests and limits)" if allowed["resources"] else ""),
            res == want_res,
            f"{res!r} vs the wanted {want_res!r}",
        )
        pod, tcp_pod = ds["spec"]["template"]["spec"], tcp_ds["spec"]["template"]["spec"]
        host = ("securityContext", "hostNetwork", "hostPID", "hostIPC", "serviceAccountName", "automountServiceAccountToken")
        check(
            f"{name}: the pod's securityContext and host namespaces are the tcp pod's",
            all(pod.get(k) == tcp_pod.get(k) for k in host),
            ", ".join(f"{k}: {pod.get(k)!r} vs {tcp_pod.get(k)!r}" for k in host if pod.get(k) != tcp_pod.get(k)),
        )
        priv = {
            c["name"]
            for c in pod.get("initContainers", []) + pod.get("containers", [])
            if (c.get("securityContext") or {}).get("privileged")
        }
        check(
            f"{name}: privileged containers are exactly {sorted(allowed['privileged']) or 'none'}",
            priv == allowed["privileged"],
            f"privileged: {sorted(priv)}",
        )
        if name == "soft-roce":
            inits = [c["name"] for c in pod.get("initContainers", [])]
            check(
                "soft-roce: rxe-setup is an init container (it makes the device before the node container is created)",
                "rxe-setup" in inits,
                f"init containers {inits}",
            )
        pol = policy_ports(objs, "pagewire-internal", name)
        want = tcp_policy | {(verbs_port, "TCP"), (4791, "UDP")}
        check(
            f"{name}: NetworkPolicy pagewire-internal opens the tcp ones plus {verbs_port}/TCP and 4791/UDP (RoCE v2)",
            pol == want,
            f"{sorted(pol)}",
        )
        if name == "roce":
            inits = {c["name"]: c for c in ds["spec"]["template"]["spec"].get("initContainers", [])}
            gc = inits.get("gid-check")
            check("roce: init container gid-check", gc is not None)
            if gc is None:
                continue
            gm = k8s_mounts(ds, gc).get("/etc/pagewire/node.toml", {})
            check(
                "roce: gid-check reads the node's node.toml (same ConfigMap key, same path)",
                gm.get("kind") == "configMap"
                and gm.get("subPath") == "node.toml"
                and gm["volume"]["configMap"]["name"] == cm["metadata"]["name"],
            )
            genv = {e["name"]: e for e in gc.get("env", [])}
            check(
                "roce: gid-check pins no device, port or GID of its own (node.toml is the one source)",
                not {"RDMA_DEVICE", "RDMA_PORT", "GID_INDEX"} & set(genv),
                f"env {sorted(genv)}",
            )
            check(
                "roce: gid-check's POD_IP is status.podIP (what an empty advertise makes the node advertise)",
                genv.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP",
            )
            check("roce: gid-check runs the node's image", gc.get("image") == node.get("image"))


def shell_text(path: Path) -> str:
    """A Dockerfile or shell script with its line continuations joined."""
    return re.sub(r"\\\n", " ", path.read_text())


def cargo_features(text: str) -> set[str] | None:
    m = re.search(r"cargo build[^\n]*?--features[ =]\"?([^\s\"]+)\"?", text)
    if not m:
        return None
    return {f for f in m.group(1).split(",") if f}


def check_image() -> None:
    print("image (the verbs transport built in, libibverbs in the runtime image):")
    df = REPO / "Dockerfile"
    build = K8S / "image" / "build.sh"
    base = K8S / "image" / "base.sh"
    dft = shell_text(df)
    stages = re.split(r"(?im)^FROM\s", dft)
    build_stage = next((st for st in stages if re.match(r"\S+\s+AS\s+build\b", st, re.I)), "")
    runtime_stage = next((st for st in stages if re.match(r"\S+\s+AS\s+runtime\b", st, re.I)), "")
    dff = cargo_features(build_stage)
    check(
        f"the Dockerfile's cargo build has --features {VERBS_FEATURE}",
        dff is not None and VERBS_FEATURE in dff,
        f"features {sorted(dff) if dff is not None else 'none'}",
    )
    bt = shell_text(build)
    m = re.search(r"(?m)^features=(\S+)", bt)
    bf = {f for f in m.group(1).split(",") if f} if m else None
    check(
        "k8s/image/build.sh builds with the Dockerfile's features",
        bf is not None and bf == dff and re.search(r'cargo build[^\n]*--features "\$features"', bt) is not None,
        f"build.sh {sorted(bf) if bf else bf} vs Dockerfile {sorted(dff) if dff else dff}",
    )
    runtime_apt = re.search(r"apt-get install[^\n]*", runtime_stage)
    check(
        f"the Dockerfile's runtime stage installs {' and '.join(VERBS_PACKAGES)}",
        runtime_apt is not None and all(re.search(rf"\b{re.escape(p)}\b", runtime_apt.group(0)) for p in VERBS_PACKAGES),
    )
    m = re.search(r"(?m)^include=(\S+)", base.read_text())
    inc = set(m.group(1).split(",")) if m else set()
    check(
        f"k8s/image/base.sh debootstraps with --include {','.join(VERBS_PACKAGES)}",
        set(VERBS_PACKAGES) <= inc and '--include="$include"' in base.read_text(),
        f"include {sorted(inc)}",
    )
