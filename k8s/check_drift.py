#!/usr/bin/env python3
"""Fails when the Kubernetes manifests drift from what the compose test runs,
or the RDMA overlays from the tcp one, or the image from the verbs transport,
or the ha overlays from the compose HA cluster.

Compares k8s/compose/docker-compose.yml (the cluster the compose scenarios
test) with the rendered tcp overlay (`kubectl kustomize k8s/overlays/tcp`),
container by container:

  compose service            k8s object / container
  pagewire-coordinator   ->  StatefulSet pagewire-coordinator / coordinator
  node-1, node-2, node-3 ->  DaemonSet pagewire-node / node
  tools                  ->  Deployment pagewire-admin / pwctl (env only)

and checks, each printed as OK or FAIL:
  * the command line (entrypoint/command + args, the image's ENTRYPOINT/CMD
    from the Dockerfile where one side leaves them out);
  * the env names (PAGEWIRE_* and every other name);
  * the config files mounted (target paths and their source: the same
    k8s/base/config/*.toml, byte for byte in the rendered ConfigMap), the
    token, state, shm and data mount paths, and the shm size;
  * the ports: the TOML's listen addresses against the k8s containerPorts,
    the Service, the NetworkPolicies, the Dockerfile's EXPOSE and any compose
    ports/expose;
  * the probes: compose's healthcheck (path and port) against the k8s
    readinessProbe, liveness on /healthz on the same port;
  * the shutdown budget: grace periods above the node's drain timeout (plus
    the preStop drain wait in k8s);
  * the default image, the user id, the coordinator's address;
  * the NetworkPolicies' ports and that they select and admit the pods,
    and the Prometheus scrape annotations;
  * verbs: the tcp rendering's node.toml (the compose cluster's) has
    [transports] verbs off and the node no verbs port; the soft-roce and roce
    renderings mount k8s/components/verbs/node.toml, which is the base's
    node.toml but for the verbs_* keys, with verbs = true and the GID chosen
    at start (verbs_gid_index = -1, verbs_device empty), its verbs_listen
    port in the node container and the NetworkPolicy, the node container
    otherwise the tcp one's field for field but for what NODE_DIFFERENCES
    below allows (soft-roce: privileged, to open the rxe device; roce: the
    RDMA shared device plugin's resource), no added capability, the pod's
    securityContext and host namespaces the tcp pod's, no privileged
    container but the ones allowed; roce's gid-check reads that same
    node.toml and pins nothing of its own;
  * the image: the Dockerfile and k8s/image/build.sh build with the same
    cargo features, pagewire-node/verbs among them, and the runtime image
    gets libibverbs1 and ibverbs-providers (the Dockerfile's runtime stage
    and k8s/image/base.sh's debootstrap --include);
  * ha: the ha overlay against the compose HA cluster (docker-compose.yml
    with ha.yml merged over it, as `docker-compose -f A -f B` merges):
    three coordinators, each `pagewire-coordinator --config
    /etc/pagewire/coordinator.toml --advertise NAME:7400` (compose: its
    service name; k8s: $(POD_NAME) under the headless Service), both
    mounting k8s/components/ha/coordinator.toml, which is the base's
    coordinator.toml but for store, advertise, state_file, lease_ms and [etcd] and
    whose store names every etcd member; the nodes, tools and admin pod
    given all three coordinators (and the nodes' preStop drain); three etcd
    members of the image k8s/image/etcd.sh builds, named and found the same
    way (PAGEWIRE_ETCD_MEMBERS, PAGEWIRE_ETCD_DOMAIN, hostnames, the
    headless Service), their ports, probes, data volume and user; one
    coordinator and one member per host, the PDBs (2 of 3), the etcd
    NetworkPolicy; ha-external: the same coordinators and clients, no etcd,
    its coordinator.toml ha's but for store and [etcd]'s TLS and user keys,
    those files in the mounted Secret pagewire-etcd-tls.

Usage: check_drift.py [--rendered FILE] [--overlay NAME=FILE ...] [--compose FILE]
                      [--compose-ha FILE]
Without --rendered (the tcp overlay) or --overlay soft-roce=FILE,
roce=FILE, ha=FILE, ha-external=FILE it renders them itself (kubectl, with a
throwaway token and etcd TLS files in a temporary copy of k8s/). Needs PyYAML.
"""

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

K8S = Path(__file__).resolve().parent
REPO = K8S.parent

COORD_SVC = "pagewire-coordinator"
NODE_SVCS = ("node-1", "node-2", "node-3")
TOOLS_SVC = "tools"

failures: list[str] = []
passes = 0


def check(name: str, ok: bool, detail: str = "") -> None:
    global passes
    if ok:
        passes += 1
        print(f"  OK    {name}")
    else:
        failures.append(name)
        print(f"  FAIL  {name}" + (f": {detail}" if detail else ""))


# --- inputs -----------------------------------------------------------------


RDMA_OVERLAYS = ("soft-roce", "roce")


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        sys.exit(f"check_drift: kubectl not found (needed to render k8s/overlays/{overlay})")
    with tempfile.TemporaryDirectory(prefix="pagewire-drift-") as tmp:
        t = Path(tmp)
        for d in ("base", "overlays", "components"):
            shutil.copytree(K8S / d, t / d)
        (t / "base" / "cluster-token").write_text(os.urandom(16).hex())
        # ha-external's etcd TLS files: git-ignored, without placeholders;
        # kustomize only copies their bytes into a Secret.
        tls = t / "components" / "ha" / "external" / "tls"
        for f in ("ca.crt", "client.crt", "client.key"):
            if tls.is_dir() and not (tls / f).exists():
                (tls / f).write_text(f"throwaway {f} for check_drift.py\n")
        out = subprocess.run(
            [kubectl, "kustomize", str(t / "overlays" / overlay)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def load_rendered(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolate(v):
    """Compose variable substitution with the defaults (the environment is
    ignored, so the check is deterministic); `$$` is a literal `$`."""
    if isinstance(v, str):
        return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else (m.group(2) or ""), v)
    if isinstance(v, list):
        return [interpolate(x) for x in v]
    if isinstance(v, dict):
        return {k: interpolate(x) for k, x in v.items()}
    return v


def argv(v) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return shlex.split(v)
    return [str(x) for x in v]


def dockerfile_runtime() -> dict:
    """ENTRYPOINT, CMD, USER and EXPOSE of the Dockerfile's last stage."""
    info = {"entrypoint": None, "cmd": None, "user": None, "expose": set()}
    path = REPO / "Dockerfile"
    if not path.exists():
        return info
    text = re.sub(r"\\\n", " ", path.read_text())
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        rest = rest.strip()
        if word == "FROM":
            info = {"entrypoint": None, "cmd": None, "user": None, "expose": set()}
        elif word in ("ENTRYPOINT", "CMD"):
            try:
                val = json.loads(rest)
            except json.JSONDecodeError:
                val = ["/bin/sh", "-c", rest]
            info[word.lower()] = [str(x) for x in val]
        elif word == "USER":
            info["user"] = rest.split(":")[0]
        elif word == "EXPOSE":
            info["expose"] |= {int(p.split("/")[0]) for p in rest.split()}
    return info


def effective(entrypoint, command, image) -> list[str]:
    """The process's argv: Docker and Kubernetes combine them the same way
    (an explicit entrypoint/command drops the image's CMD)."""
    if entrypoint is not None:
        return entrypoint + (command or [])
    return (image["entrypoint"] or []) + (
        command if command is not None else (image["cmd"] or [])
    )


def port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def mib(size: str) -> float:
    """A size (Kubernetes quantity or a tmpfs size= option) in MiB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]i?|[kmg]|)", str(size).strip())
    if not m:
        raise ValueError(f"cannot read size {size!r}")
    n, unit = float(m.group(1)), m.group(2)
    factor = {
        "": 1 / 2**20,
        "k": 1 / 1024, "K": 1 / 1024, "Ki": 1 / 1024,
        "m": 1, "M": 1, "Mi": 1,
        "g": 1024, "G": 1024, "Gi": 1024,
    }[unit]
    # Kubernetes' k/M/G are powers of 1000; tmpfs' k/m/g are powers of 1024.
    return n * factor


def seconds(v) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", str(v))
    if not m or not any(m.groups()):
        raise ValueError(f"cannot read duration {v!r}")
    return int(m.group(1) or 0) * 60 + float(m.group(2) or 0)


# --- compose ------------------------------------------------------------------


def compose_mounts(svc: dict, volumes_top: dict) -> dict[str, dict]:
    """target -> {"kind": bind|volume|tmpfs, "source": ..., "size": ...}."""
    out: dict[str, dict] = {}
    for v in svc.get("volumes", []) or []:
        if isinstance(v, str):
            parts = v.split(":")
            src, tgt = parts[0], parts[1]
            kind = "bind" if src.startswith((".", "/")) else "volume"
            out[tgt] = {"kind": kind, "source": src}
        else:
            out[v["target"]] = {"kind": v.get("type", "volume"), "source": v.get("source")}
    tmpfs = svc.get("tmpfs") or []
    if isinstance(tmpfs, str):
        tmpfs = [tmpfs]
    for t in tmpfs:
        path, _, opts = t.partition(":")
        o = dict(x.partition("=")[::2] for x in opts.split(",") if x)
        out[path] = {"kind": "tmpfs", "source": None, "size": o.get("size")}
    return out


def compose_probe(svc: dict) -> tuple[str, int] | None:
    hc = svc.get("healthcheck") or {}
    test = hc.get("test")
    if not test:
        return None
    text = " ".join(test) if isinstance(test, list) else str(test)
    port = re.search(r"/dev/tcp/[^/\s]+/(\d+)", text) or re.search(
        r"https?://[^/\s:]+:(\d+)", text
    )
    path = re.search(r"GET (/\S*) HTTP", text) or re.search(
        r"https?://[^/\s]+(/[^\s'\"]*)", text
    )
    if not (port and path):
        return None
    return path.group(1), int(port.group(1))


def compose_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.partition("=")[::2] for e in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


# --- k8s ----------------------------------------------------------------------


def find(objs, kind, name, overlay="tcp") -> dict:
    for o in objs:
        if o.get("kind") == kind and o["metadata"]["name"] == name:
            return o
    sys.exit(f"check_drift: no {kind} {name} in the rendered {overlay} overlay")


def container(obj, name) -> dict:
    for c in obj["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return c
    sys.exit(f"check_drift: no container {name} in {obj['kind']} {obj['metadata']['name']}")


def k8s_mounts(obj, c) -> dict[str, dict]:
    vols = {v["name"]: v for v in obj["spec"]["template"]["spec"].get("volumes", [])}
    for t in obj["spec"].get("volumeClaimTemplates", []) or []:
        vols[t["metadata"]["name"]] = {"name": t["metadata"]["name"], "pvc": t}
    out = {}
    for m in c.get("volumeMounts", []):
        v = vols.get(m["name"], {})
        kind = next((k for k in v if k != "name"), "?")
        out[m["mountPath"]] = {
            "kind": kind,
            "subPath": m.get("subPath"),
            "volume": v,
            "readOnly": bool(m.get("readOnly")),
        }
    return out


def k8s_probe(c, which) -> tuple[str, int] | None:
    p = (c.get(which) or {}).get("httpGet")
    if not p:
        return None
    port = p["port"]
    if isinstance(port, str):
        port = next(x["containerPort"] for x in c["ports"] if x.get("name") == port)
    return p["path"], int(port)


def prestop_wait(c) -> float:
    """Seconds the preStop hook may take: pwctl drain --wait N, else 0."""
    cmd = " ".join(((c.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", []))
    m = re.search(r"--wait[ =](\d+)", cmd)
    return float(m.group(1)) if m else 0.0


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


def config_map(objs) -> dict | None:
    cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("pagewire-config")]
    return cms[0] if len(cms) == 1 else None


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


# --- ha: the ha overlay against the compose HA cluster, ha-external against ha --

HA_OVERLAYS = ("ha", "ha-external")
HA_CONFIG = K8S / "components" / "ha" / "coordinator.toml"
HA_EXTERNAL_CONFIG = K8S / "components" / "ha" / "external" / "coordinator.toml"
ETCD_IMAGE_SCRIPT = K8S / "image" / "etcd.sh"
ETCD_ENTRYPOINT = K8S / "image" / "etcd-entrypoint.sh"
# What the HA coordinator.toml may change in the base's: the store (etcd),
# the advertised name (each coordinator's own, from --advertise), the file
# store's state file (unused) and the [etcd] section.
# lease_ms too: the node lease must outlast a leader failover (the etcd
# lease) plus a heartbeat interval (k8s/components/ha/coordinator.toml).
HA_TOML_KEYS = {"store", "advertise", "state_file", "lease_ms", "etcd"}
# What ha-external's coordinator.toml may change in ha's: the endpoints and
# the [etcd] keys of TLS and etcd's own user.
HA_EXTERNAL_ETCD_KEYS = {"ca_file", "cert_file", "key_file", "domain", "username", "password_file"}


def env_map(v) -> dict[str, str]:
    """A compose `environment` (mapping or list) as a mapping."""
    if isinstance(v, list):
        v = dict(e.partition("=")[::2] for e in v)
    return {k: ("" if x is None else str(x)) for k, x in (v or {}).items()}


def merge_service(b: dict, o: dict) -> dict:
    """Compose's merge of an override file's service into the base's (the
    rules `docker-compose -f a -f b config` applies to the keys used here):
    environment merged by name, volumes by target, ports and expose
    appended, other mappings (depends_on, networks, healthcheck) merged one
    level deep, everything else (command, image, ...) replaced."""
    out = dict(b)
    for k, v in o.items():
        if k == "environment":
            out[k] = {**env_map(b.get(k)), **env_map(v)}
        elif k == "volumes":
            def tgt(x):
                return x.split(":")[1] if isinstance(x, str) else x["target"]
            by = {tgt(x): x for x in b.get(k) or []}
            by.update({tgt(x): x for x in v or []})
            out[k] = list(by.values())
        elif k in ("ports", "expose"):
            out[k] = list(b.get(k) or []) + list(v or [])
        elif isinstance(v, dict) and isinstance(b.get(k), dict):
            out[k] = {**b[k], **v}
        else:
            out[k] = v
    return out


def compose_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if k == "services":
            svcs = dict(base.get("services") or {})
            for name, s in (v or {}).items():
                svcs[name] = merge_service(svcs.get(name) or {}, s or {})
            out[k] = svcs
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


def toml_diff(a: dict, b: dict) -> set[str]:
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def check_base_but_ha_keys(rel: Path, base_toml: dict, toml: dict) -> None:
    """An HA coordinator file is the base's but for the HA keys."""
    diff = toml_diff(base_toml, toml)
    check(
        f"{rel} is k8s/base/config/coordinator.toml but for {', '.join(sorted(HA_TOML_KEYS))}",
        diff <= HA_TOML_KEYS,
        f"also differs in {sorted(diff - HA_TOML_KEYS)} (copy the base's change over)",
    )


def etcd_image_build() -> dict:
    """The default tag, ENTRYPOINT, USER and EXPOSE of the Dockerfile that
    k8s/image/etcd.sh writes, and the ports the entrypoint listens on."""
    info = {"tag": None, "entrypoint": None, "user": None, "expose": set(), "client": None, "peer": None, "data": None}
    if ETCD_IMAGE_SCRIPT.exists():
        t = ETCD_IMAGE_SCRIPT.read_text()
        m = re.search(r"(?m)^tag=(\S+)", t)
        info["tag"] = m.group(1) if m else None
        m = re.search(r'(?m)^ENTRYPOINT (\[.*\])$', t)
        info["entrypoint"] = json.loads(m.group(1)) if m else None
        m = re.search(r"(?m)^USER (\d+)", t)
        info["user"] = int(m.group(1)) if m else None
        m = re.search(r"(?m)^EXPOSE ([\d ]+)$", t)
        info["expose"] = {int(p) for p in m.group(1).split()} if m else set()
    if ETCD_ENTRYPOINT.exists():
        e = ETCD_ENTRYPOINT.read_text()
        for key, flag in (("client", "listen-client-urls"), ("peer", "listen-peer-urls")):
            m = re.search(rf"--{flag} http://0\.0\.0\.0:(\d+)", e)
            info[key] = int(m.group(1)) if m else None
        m = re.search(r"--data-dir (\S+)", e)
        info["data"] = m.group(1) if m else None
    return info


def pod_labels(obj) -> dict:
    return obj["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def anti_affinity_per_host(obj) -> bool:
    """Required pod anti-affinity on kubernetes.io/hostname against the
    object's own pods: at most one per host."""
    terms = (
        ((obj["spec"]["template"]["spec"].get("affinity") or {}).get("podAntiAffinity") or {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
        or []
    )
    return any(
        t.get("topologyKey") == "kubernetes.io/hostname"
        and selects((t.get("labelSelector") or {}).get("matchLabels", {}), pod_labels(obj))
        for t in terms
    )


def pdb_for(objs, obj, overlay) -> dict | None:
    for o in objs:
        if o["kind"] == "PodDisruptionBudget" and selects(o["spec"]["selector"].get("matchLabels", {}), pod_labels(obj)):
            return o
    return None


def env_value(c, name) -> str | None:
    return next((e.get("value") for e in c.get("env", []) if e["name"] == name), None)


def check_ha(
    tcp_objs, ha_objs, hax_objs, compose_path: Path, compose_ha_path: Path, base_coord_text: str, image: dict
) -> None:
    print(f"ha: k8s/overlays/ha against the compose HA cluster ({compose_path.name} with {compose_ha_path.name}):")
    compose = interpolate(
        compose_merge(yaml.safe_load(compose_path.read_text()), yaml.safe_load(compose_ha_path.read_text()))
    )
    services = compose.get("services", {})
    base_toml = tomllib.loads(base_coord_text)
    ha_text = HA_CONFIG.read_text()
    ha_toml = tomllib.loads(ha_text)
    grpc = port_of(ha_toml["listen"])
    http = port_of(ha_toml["metrics_listen"])

    # -- the config file, shared by compose and k8s
    rel = HA_CONFIG.relative_to(REPO)
    check_base_but_ha_keys(rel, base_toml, ha_toml)
    check(
        f"{rel}: advertise is empty (each coordinator's own name comes from --advertise)",
        ha_toml.get("advertise") == "",
        f"advertise = {ha_toml.get('advertise')!r}",
    )

    # -- the coordinators
    coords = {
        n: s
        for n, s in services.items()
        if (effective(argv(s.get("entrypoint")), argv(s.get("command")), image) or [""])[0] == "pagewire-coordinator"
    }
    sts = find(ha_objs, "StatefulSet", "pagewire-coordinator", "ha")
    kc = container(sts, "coordinator")
    replicas = sts["spec"].get("replicas", 1)
    check("compose HA runs 3 coordinators", len(coords) == 3, f"compose: {sorted(coords)}")
    check("k8s ha: StatefulSet pagewire-coordinator has 3 replicas", replicas == 3, f"replicas {replicas}")
    want_argv = ["pagewire-coordinator", "--config", "/etc/pagewire/coordinator.toml", "--advertise"]
    headless = sts["spec"]["serviceName"]
    advertised = []
    for n, s in sorted(coords.items()):
        dc = effective(argv(s.get("entrypoint")), argv(s.get("command")), image)
        want = f"{s.get('hostname') or n}:{grpc}"
        check(
            f"compose {n}: {' '.join(want_argv)} {want} (its own name, the listen port)",
            dc == want_argv + [want] and (s.get("hostname") in (None, n)),
            f"compose {dc}, hostname {s.get('hostname')!r}",
        )
        advertised.append(dc[-1] if dc else "")
    kargv = effective(argv(kc.get("command")), argv(kc.get("args")), image)
    kwant = f"$(POD_NAME).{headless}:{grpc}"
    check(
        f"k8s coordinator: {' '.join(want_argv)} {kwant} (compose's command line but for each one's name)",
        kargv == want_argv + [kwant],
        f"k8s {kargv}",
    )
    pod_name = next((e for e in kc.get("env", []) if e["name"] == "POD_NAME"), {})
    check(
        "k8s coordinator: POD_NAME from metadata.name",
        pod_name.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
    )
    svc = find(ha_objs, "Service", headless, "ha")
    check(
        f"k8s Service {headless} is headless, selects the coordinator pods, ports grpc {grpc} and http {http}",
        svc["spec"].get("clusterIP") == "None"
        and selects(svc["spec"]["selector"], pod_labels(sts))
        and {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": grpc, "http": http},
    )
    cm = config_map(ha_objs)
    # The reference: a coordinator that only ha.yml defines. The first one
    # is docker-compose.yml's single coordinator with ha.yml merged over it,
    # so it keeps that file's state volume (an override cannot remove a
    # mount; the etcd store never writes there): allowed, nothing else.
    single = yaml.safe_load(compose_path.read_text()).get("services", {})
    added = sorted(n for n in coords if n not in single)
    first = coords[added[0]] if added else {}
    state_dir = str(Path(base_toml["state_file"]).parent)

    def shape(s, leftover):
        out = {k: v for k, v in s.items() if k not in ("command", "hostname", "networks")}
        vols = [v for v in out.get("volumes") or [] if not (leftover and (v.split(":")[1] if isinstance(v, str) else v["target"]) == state_dir)]
        return {**out, "volumes": vols}

    for n, s in sorted(coords.items()):
        if s is first:
            continue
        leftover = n in single
        check(
            f"compose {n} is defined as {added[0] if added else '?'} (but for its name and addresses"
            + (f"; the single cluster's {state_dir} volume, unused with etcd" if leftover else "")
            + ")",
            shape(s, leftover) == shape(first, False),
            f"{sorted(k for k in set(s) | set(first) if shape(s, leftover).get(k) != shape(first, False).get(k))} differ",
        )
        src = compose_mounts(s, {}).get("/etc/pagewire/coordinator.toml", {})
        path = (compose_ha_path.parent / str(src.get("source"))).resolve() if src.get("kind") == "bind" else None
        check(f"compose {n} mounts {rel} at /etc/pagewire/coordinator.toml", path == HA_CONFIG.resolve(), f"{src}")
    km = k8s_mounts(sts, kc)
    m = km.get("/etc/pagewire/coordinator.toml", {})
    check(
        "k8s coordinator mounts the ConfigMap key coordinator.toml at /etc/pagewire/coordinator.toml",
        cm is not None and m.get("kind") == "configMap" and m.get("subPath") == "coordinator.toml"
        and m["volume"]["configMap"]["name"] == cm["metadata"]["name"],
    )
    check(
        f"ha: the ConfigMap's coordinator.toml is {rel} byte for byte",
        cm is not None and cm["data"].get("coordinator.toml") == ha_text,
    )
    check(
        "ha: the ConfigMap's node.toml is the base's byte for byte (the nodes' coordinators come from PAGEWIRE_COORDINATOR)",
        cm is not None and cm["data"].get("node.toml") == (K8S / "base" / "config" / "node.toml").read_text(),
    )
    dm = compose_mounts(first, {})
    check(
        "coordinator mount paths equal (config, token; no state: it is in etcd)",
        set(dm) == set(km),
        f"compose {sorted(dm)} vs k8s {sorted(km)}",
    )
    check("k8s ha: no PVC for the coordinators", not sts["spec"].get("volumeClaimTemplates"))
    de = set(env_map(first.get("environment")))
    ke = {e["name"] for e in kc.get("env", [])} - {"POD_NAME"}
    check("coordinator env names equal (k8s adds POD_NAME for --advertise)", de == ke, f"compose {sorted(de)} vs k8s {sorted(ke)}")
    dpr, kr = compose_probe(first), k8s_probe(kc, "readinessProbe")
    check(
        f"coordinator: compose healthcheck = k8s readinessProbe = /readyz on {http}",
        dpr == kr == ("/readyz", http),
        f"compose {dpr} vs k8s {kr}",
    )
    check("coordinator: same image", first.get("image") == kc.get("image"), f"compose {first.get('image')} vs k8s {kc.get('image')}")
    check("k8s coordinators: at most one per host (required anti-affinity on kubernetes.io/hostname)", anti_affinity_per_host(sts))
    pdb = pdb_for(ha_objs, sts, "ha")
    check(
        "k8s ha: the coordinators' PDB keeps 2 of 3 (minAvailable 2)",
        pdb is not None and pdb["spec"].get("minAvailable") == 2 and "maxUnavailable" not in pdb["spec"],
        f"{pdb and pdb['spec']}",
    )

    # -- the clients: all three coordinators
    k8s_list = ",".join(f"{sts['metadata']['name']}-{i}.{headless}:{grpc}" for i in range(replicas))
    compose_list = ",".join(advertised)
    for n in (*NODE_SVCS, TOOLS_SVC):
        got = env_map(services.get(n, {}).get("environment")).get("PAGEWIRE_COORDINATOR", "")
        check(
            f"compose {n}: PAGEWIRE_COORDINATOR names every coordinator as it advertises itself",
            sorted(got.split(",")) == sorted(advertised),
            f"{got!r} vs the coordinators' {compose_list!r}",
        )
    ds = find(ha_objs, "DaemonSet", "pagewire-node", "ha")
    node = container(ds, "node")
    admin = container(find(ha_objs, "Deployment", "pagewire-admin", "ha"), "pwctl")
    for what, c in (("node", node), ("admin pod", admin)):
        check(
            f"k8s {what}: PAGEWIRE_COORDINATOR = the {replicas} pods of {sts['metadata']['name']} under {headless}",
            env_value(c, "PAGEWIRE_COORDINATOR") == k8s_list,
            f"{env_value(c, 'PAGEWIRE_COORDINATOR')!r} vs {k8s_list!r}",
        )
    tcp_node = container(find(tcp_objs, "DaemonSet", "pagewire-node"), "node")
    tcp_pre = " ".join(tcp_node["lifecycle"]["preStop"]["exec"]["command"])
    pre = " ".join(((node.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", []))
    want_pre = re.sub(r"--coordinator \S+", '--coordinator "$PAGEWIRE_COORDINATOR"', tcp_pre)
    check(
        'k8s node preStop: the tcp overlay\'s drain with --coordinator "$PAGEWIRE_COORDINATOR"',
        pre == want_pre and want_pre != tcp_pre,
        f"{pre!r} vs the wanted {want_pre!r}",
    )
    rest = sorted(k for k in set(node) | set(tcp_node) if k not in ("env", "lifecycle") and node.get(k) != tcp_node.get(k))
    check("k8s node container is the tcp overlay's but for env and the preStop", not rest, f"differs in {rest}")
    check(
        "k8s node env is the tcp overlay's plus PAGEWIRE_COORDINATOR",
        [e for e in node.get("env", []) if e["name"] != "PAGEWIRE_COORDINATOR"] == tcp_node.get("env", []),
    )
    dn = set(env_map(services["node-1"].get("environment")))
    kn = {e["name"] for e in node.get("env", [])}
    check("node env names equal (compose HA vs k8s ha)", dn == kn, f"compose {sorted(dn)} vs k8s {sorted(kn)}")

    # -- etcd
    eb = etcd_image_build()
    etcd = {n: s for n, s in services.items() if str(s.get("image", "")).split(":")[0] == "pagewire-etcd"}
    ests = find(ha_objs, "StatefulSet", "pagewire-etcd", "ha")
    ec = container(ests, "etcd")
    ereplicas = ests["spec"].get("replicas", 1)
    check("compose HA runs 3 etcd members", len(etcd) == 3, f"compose: {sorted(etcd)}")
    check("k8s ha: StatefulSet pagewire-etcd has 3 replicas", ereplicas == 3, f"replicas {ereplicas}")
    kenv = {e["name"]: e.get("value") for e in ec.get("env", [])}
    members = kenv.get("PAGEWIRE_ETCD_MEMBERS", "")
    domain = kenv.get("PAGEWIRE_ETCD_DOMAIN", "")
    pods = [f"{ests['metadata']['name']}-{i}" for i in range(ereplicas)]
    check(
        "k8s etcd: PAGEWIRE_ETCD_MEMBERS names the StatefulSet's pods",
        members.split(",") == pods,
        f"{members!r} vs pods {pods}",
    )
    check(
        "k8s etcd: PAGEWIRE_ETCD_DOMAIN is the StatefulSet's headless Service",
        domain == ests["spec"]["serviceName"],
        f"{domain!r} vs serviceName {ests['spec']['serviceName']!r}",
    )
    for n, s in sorted(etcd.items()):
        e = env_map(s.get("environment"))
        nets = s.get("networks") or {}
        aliases = {a for v in (nets.values() if isinstance(nets, dict) else []) for a in ((v or {}).get("aliases") or [])}
        check(
            f"compose {n}: the k8s members and domain, its hostname in the list, reachable as {n}.{domain}",
            e.get("PAGEWIRE_ETCD_MEMBERS") == members
            and e.get("PAGEWIRE_ETCD_DOMAIN") == domain
            and s.get("hostname") == n
            and n in members.split(",")
            and f"{n}.{domain}" in aliases,
            f"env {e}, hostname {s.get('hostname')!r}, aliases {sorted(aliases)}",
        )
        check(f"compose {n}: same etcd image as k8s", s.get("image") == ec.get("image"), f"compose {s.get('image')} vs k8s {ec.get('image')}")
        check(
            f"compose {n}: env names = k8s etcd's",
            set(e) == set(kenv),
            f"compose {sorted(e)} vs k8s {sorted(kenv)}",
        )
        check(
            f"compose {n} and k8s etcd run the image's entrypoint (no command, entrypoint or args)",
            not any(s.get(k) for k in ("command", "entrypoint")) and not any(ec.get(k) for k in ("command", "args")),
        )
        dmnt = compose_mounts(s, {})
        kmnt = k8s_mounts(ests, ec)
        data = str(Path(eb["data"] or "/var/lib/etcd/data").parent)
        check(
            f"etcd data: {data} a compose volume in {n} and the k8s PVC",
            dmnt.get(data, {}).get("kind") == "volume" and kmnt.get(data, {}).get("kind") == "pvc"
            and set(dmnt) == set(kmnt),
            f"compose {dmnt}, k8s {sorted(kmnt)}",
        )
    check(
        f"the etcd image is k8s/image/etcd.sh's default tag {eb['tag']}",
        ec.get("image") == eb["tag"],
        f"k8s {ec.get('image')}",
    )
    check(
        "etcd.sh's image runs pagewire-etcd (the entrypoint) as uid 10002 = k8s runAsUser",
        eb["entrypoint"] == ["pagewire-etcd"]
        and eb["user"] == ec.get("securityContext", {}).get("runAsUser")
        == ests["spec"]["template"]["spec"].get("securityContext", {}).get("runAsUser"),
        f"ENTRYPOINT {eb['entrypoint']}, USER {eb['user']}",
    )
    client, peer = eb["client"], eb["peer"]
    kp = {p.get("name"): p["containerPort"] for p in ec.get("ports", [])}
    check(
        f"k8s etcd ports = the entrypoint's client {client} and peer {peer} = etcd.sh's EXPOSE",
        kp == {"client": client, "peer": peer} and eb["expose"] == {client, peer},
        f"k8s {kp}, EXPOSE {sorted(eb['expose'])}",
    )
    esvc = find(ha_objs, "Service", ests["spec"]["serviceName"], "ha")
    check(
        f"k8s Service {esvc['metadata']['name']}: headless, publishNotReadyAddresses, selects the members, ports client and peer",
        esvc["spec"].get("clusterIP") == "None"
        and esvc["spec"].get("publishNotReadyAddresses") is True
        and selects(esvc["spec"]["selector"], pod_labels(ests))
        and {p["name"]: p["port"] for p in esvc["spec"]["ports"]} == {"client": client, "peer": peer},
    )
    endpoints = [f"{m}.{domain}:{client}" for m in members.split(",")]
    check(
        f"{rel}: store names every member as MEMBER.DOMAIN:{client}",
        ha_toml.get("store") == "etcd://" + ",".join(endpoints),
        f"store {ha_toml.get('store')!r} vs etcd://{','.join(endpoints)}",
    )
    check(
        "k8s etcd: members start together (podManagementPolicy Parallel: a static bootstrap needs a quorum)",
        ests["spec"].get("podManagementPolicy") == "Parallel",
    )
    check("k8s etcd: at most one member per host (required anti-affinity on kubernetes.io/hostname)", anti_affinity_per_host(ests))
    epdb = pdb_for(ha_objs, ests, "ha")
    quorum = ereplicas // 2 + 1
    check(
        f"k8s etcd: the PDB keeps a quorum (minAvailable {quorum})",
        epdb is not None and epdb["spec"].get("minAvailable") == quorum,
        f"{epdb and epdb['spec']}",
    )
    rp = (ec.get("readinessProbe") or {}).get("httpGet") or {}
    lp = ec.get("livenessProbe") or {}
    lport = ((lp.get("tcpSocket") or lp.get("httpGet") or {}).get("port"))
    htest = " ".join(str(x) for x in ((next(iter(etcd.values()), {}).get("healthcheck") or {}).get("test") or []))
    check(
        f"etcd health on the client port {client}: k8s readiness GET /health, compose `etcdctl endpoint health` at 127.0.0.1:{client}",
        rp.get("path") == "/health" and rp.get("port") == client
        and re.search(rf"etcdctl .*--endpoints[ =]http://127\.0\.0\.1:{client}\b.* endpoint health", htest) is not None,
        f"k8s {rp}, compose {htest!r}",
    )
    check(f"k8s etcd liveness on the client port {client}", lport == client, f"{lp}")
    pol = find(ha_objs, "NetworkPolicy", "pagewire-etcd", "ha")["spec"]
    rules = [
        ({(p["port"], p.get("protocol", "TCP")) for p in r.get("ports", [])},
         [f["podSelector"].get("matchLabels", {}) for f in r.get("from", []) if "podSelector" in f])
        for r in pol.get("ingress", [])
    ]
    def admitted(port, obj):
        return any((port, "TCP") in ports and any(selects(f, pod_labels(obj)) for f in froms) for ports, froms in rules)
    others = [find(ha_objs, k, n, "ha") for k, n in (("DaemonSet", "pagewire-node"), ("Deployment", "pagewire-admin"))]
    check(
        f"NetworkPolicy pagewire-etcd: selects the members, {client} from the coordinators only, {peer} from the members only",
        selects(pol["podSelector"].get("matchLabels", {}), pod_labels(ests))
        and admitted(client, sts) and admitted(peer, ests)
        and not admitted(client, ests) and not admitted(peer, sts)
        and not any(admitted(p, o) for p in (client, peer) for o in others)
        and all(ports <= {(client, "TCP"), (peer, "TCP")} for ports, _ in rules),
        f"{rules}",
    )

    # -- ha-external: the same coordinators, a user's etcd, no etcd here
    print("ha-external: k8s/overlays/ha-external against ha:")
    xrel = HA_EXTERNAL_CONFIG.relative_to(REPO)
    x_text = HA_EXTERNAL_CONFIG.read_text()
    x_toml = tomllib.loads(x_text)
    check_base_but_ha_keys(xrel, base_toml, x_toml)
    top = toml_diff(ha_toml, x_toml)
    ediff = toml_diff(ha_toml.get("etcd", {}), x_toml.get("etcd", {}))
    check(
        f"{xrel} is {rel} but for store and [etcd] {', '.join(sorted(HA_EXTERNAL_ETCD_KEYS))}",
        top <= {"store", "etcd"} and ediff <= HA_EXTERNAL_ETCD_KEYS,
        f"differs in {sorted(top - {'store', 'etcd'})} and [etcd] {sorted(ediff - HA_EXTERNAL_ETCD_KEYS)}",
    )
    check(f"{xrel}: store is etcd://", str(x_toml.get("store", "")).startswith("etcd://"), f"{x_toml.get('store')!r}")
    xcm = config_map(hax_objs)
    check(
        f"ha-external: the ConfigMap's coordinator.toml is {xrel} byte for byte",
        xcm is not None and xcm["data"].get("coordinator.toml") == x_text,
    )
    etcd_left = sorted(f"{o['kind']} {o['metadata']['name']}" for o in hax_objs if "etcd" in o["metadata"]["name"] and o["kind"] != "Secret")
    check("ha-external: no etcd objects (no pagewire-etcd StatefulSet, Service, PDB, NetworkPolicy)", not etcd_left, f"{etcd_left}")
    xsts = find(hax_objs, "StatefulSet", "pagewire-coordinator", "ha-external")
    xc = container(xsts, "coordinator")
    xm = k8s_mounts(xsts, xc)
    tls_dirs = {p: v for p, v in xm.items() if v["kind"] == "secret" and v["volume"]["secret"]["secretName"].startswith("pagewire-etcd-tls")}
    secrets = {o["metadata"]["name"]: o for o in hax_objs if o["kind"] == "Secret"}
    files = {k: v for k, v in x_toml.get("etcd", {}).items() if k.endswith("_file")}
    for key, path in sorted(files.items()):
        d, name = str(Path(path).parent), Path(path).name
        sec = secrets.get(tls_dirs.get(d, {}).get("volume", {}).get("secret", {}).get("secretName", ""), {})
        check(
            f"ha-external: [etcd] {key} {path} is a key of the Secret pagewire-etcd-tls mounted at {d}",
            name in (sec.get("data") or {}) or name in (sec.get("stringData") or {}),
            f"mounted: {sorted(tls_dirs)}",
        )

    def unhashed(o) -> str:
        """The object as JSON with the generated names' hashes taken out
        (ConfigMap and Secret: different contents, different hashes)."""
        return re.sub(r'"(pagewire-(?:config|token))-[a-z0-9]{10}"', r'"\1"', json.dumps(o, sort_keys=True))

    def without_tls(o):
        o = json.loads(unhashed(o))
        ps = o["spec"]["template"]["spec"]
        ps["volumes"] = [v for v in ps.get("volumes", []) if v["name"] not in {t["volume"]["name"] for t in tls_dirs.values()}]
        for c in ps["containers"]:
            c["volumeMounts"] = [m for m in c.get("volumeMounts", []) if m["mountPath"] not in tls_dirs]
        return o

    check(
        "ha-external: the coordinator StatefulSet is ha's but for the TLS mount (and the generated names)",
        without_tls(xsts) == without_tls(sts),
    )
    for kind, name in (("DaemonSet", "pagewire-node"), ("Deployment", "pagewire-admin"), ("PodDisruptionBudget", "pagewire-coordinator")):
        a, b = find(ha_objs, kind, name, "ha"), find(hax_objs, kind, name, "ha-external")
        check(f"ha-external: {kind} {name} is ha's (but for the generated names)", unhashed(a) == unhashed(b))


# --- the checks -----------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rendered", type=Path, help="the rendered tcp overlay (YAML)")
    ap.add_argument(
        "--overlay",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help=f"a rendered overlay ({', '.join(RDMA_OVERLAYS + HA_OVERLAYS)}); the missing ones are rendered",
    )
    ap.add_argument("--compose", type=Path, default=K8S / "compose" / "docker-compose.yml")
    ap.add_argument(
        "--compose-ha",
        type=Path,
        default=K8S / "compose" / "ha.yml",
        help="the compose HA override (merged over --compose)",
    )
    a = ap.parse_args()

    if not a.compose.exists():
        sys.exit(f"check_drift: {a.compose} does not exist")
    compose = interpolate(yaml.safe_load(a.compose.read_text()))
    services = compose.get("services", {})
    for s in (COORD_SVC, *NODE_SVCS, TOOLS_SVC):
        if s not in services:
            sys.exit(f"check_drift: compose has no service {s}")
    objs = load_rendered(a.rendered) if a.rendered else render("tcp")
    rdma: dict[str, list[dict]] = {}
    for spec in a.overlay:
        name, sep, path = spec.partition("=")
        if not sep or name not in RDMA_OVERLAYS + HA_OVERLAYS:
            sys.exit(
                f"check_drift: --overlay {spec!r}: want NAME=FILE, NAME one of {', '.join(RDMA_OVERLAYS + HA_OVERLAYS)}"
            )
        rdma[name] = load_rendered(Path(path))
    if not a.compose_ha.exists():
        sys.exit(f"check_drift: {a.compose_ha} does not exist")
    for name in RDMA_OVERLAYS + HA_OVERLAYS:
        if name not in rdma:
            rdma[name] = render(name)
    image = dockerfile_runtime()
    cfg_dir = K8S / "base" / "config"
    tomls = {
        "coordinator": tomllib.loads((cfg_dir / "coordinator.toml").read_text()),
        "node": tomllib.loads((cfg_dir / "node.toml").read_text()),
    }
    toml_ports = {
        "coordinator": {
            "grpc": port_of(tomls["coordinator"]["listen"]),
            "http": port_of(tomls["coordinator"]["metrics_listen"]),
        },
        "node": {
            "grpc": port_of(tomls["node"]["listen"]),
            "http": port_of(tomls["node"]["metrics_listen"]),
            "transport": port_of(tomls["node"]["transports"]["tcp_listen"]),
        },
    }

    sts = find(objs, "StatefulSet", "pagewire-coordinator")
    ds = find(objs, "DaemonSet", "pagewire-node")
    admin = find(objs, "Deployment", "pagewire-admin")
    pairs = [
        ("coordinator", services[COORD_SVC], sts, container(sts, "coordinator")),
        *[("node", services[n], ds, container(ds, "node")) for n in NODE_SVCS],
    ]
    cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("pagewire-config")]
    configmap = cms[0] if len(cms) == 1 else None

    # The three compose nodes must be one definition but for their identity,
    # or "the k8s node matches node-1" says nothing about node-2.
    print("compose nodes alike:")
    strip = ("hostname", "environment", "networks", "container_name")
    base = {k: v for k, v in services[NODE_SVCS[0]].items() if k not in strip}
    for n in NODE_SVCS[1:]:
        other = {k: v for k, v in services[n].items() if k not in strip}
        check(f"{n} is defined as {NODE_SVCS[0]} (but for id, hostname, address)", other == base)
    for n in NODE_SVCS:
        check(f"{n}: PAGEWIRE_NODE_ID={n}", compose_env(services[n]).get("PAGEWIRE_NODE_ID") == n)

    checked_roles = set()
    for role, svc, obj, c in pairs:
        if role in checked_roles:
            continue  # node-2, node-3: identical to node-1 (checked above)
        checked_roles.add(role)
        print(f"{role}: compose service {[s for s in services if services[s] is svc][0]} vs {obj['kind']} {obj['metadata']['name']}/{c['name']}:")

        # Command line.
        dc = effective(argv(svc.get("entrypoint")), argv(svc.get("command")), image)
        kc = effective(argv(c.get("command")), argv(c.get("args")), image)
        want = [f"pagewire-{role}", "--config", f"/etc/pagewire/{role}.toml"]
        check("command line equal", dc == kc, f"compose {dc} vs k8s {kc}")
        check(f"command line is {' '.join(want)}", kc == want, f"k8s {kc}")

        # Env names.
        de = set(compose_env(svc))
        ke = {e["name"] for e in c.get("env", [])}
        check("env names equal", de == ke, f"compose {sorted(de)} vs k8s {sorted(ke)}")
        if role == "node":
            src = next((e for e in c.get("env", []) if e["name"] == "PAGEWIRE_NODE_ID"), {})
            check(
                "k8s PAGEWIRE_NODE_ID from spec.nodeName",
                src.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName",
            )
        check("no env_file in compose", not svc.get("env_file"))
        check("no envFrom in k8s", not c.get("envFrom"))

        # Mounts.
        dm = compose_mounts(svc, compose.get("volumes") or {})
        km = k8s_mounts(obj, c)
        cfg_path = f"/etc/pagewire/{role}.toml"
        src = dm.get(cfg_path, {})
        src_file = (a.compose.parent / str(src.get("source"))).resolve() if src.get("kind") == "bind" else None
        check(
            f"compose mounts k8s/base/config/{role}.toml at {cfg_path}",
            src_file == (cfg_dir / f"{role}.toml").resolve(),
            f"compose mounts {src or 'nothing'} there",
        )
        k = km.get(cfg_path, {})
        cm_name = (k.get("volume", {}).get("configMap") or {}).get("name")
        check(
            f"k8s mounts the ConfigMap key {role}.toml at {cfg_path}",
            k.get("kind") == "configMap"
            and k.get("subPath") == f"{role}.toml"
            and configmap is not None
            and cm_name == configmap["metadata"]["name"],
            f"k8s mounts {k or 'nothing'} there",
        )
        check(
            f"the ConfigMap's {role}.toml is k8s/base/config/{role}.toml byte for byte",
            configmap is not None
            and configmap.get("data", {}).get(f"{role}.toml") == (cfg_dir / f"{role}.toml").read_text(),
        )
        toml = tomls[role]
        token_dir = str(Path(toml["token_file"]).parent)
        check(f"token_file {toml['token_file']} is the compose token mount", token_dir in dm)
        check(
            f"token_file {toml['token_file']} is the k8s Secret mount",
            km.get(token_dir, {}).get("kind") == "secret",
        )
        if role == "coordinator":
            state_dir = str(Path(toml["state_file"]).parent)
            check(f"state_file's {state_dir} is a compose volume", dm.get(state_dir, {}).get("kind") == "volume")
            check(f"state_file's {state_dir} is the k8s PVC", km.get(state_dir, {}).get("kind") == "pvc")
        else:
            shm = str(toml["transports"]["shm_dir"])
            check(f"shm_dir {shm} is a compose tmpfs", dm.get(shm, {}).get("kind") == "tmpfs")
            ed = km.get(shm, {}).get("volume", {}).get("emptyDir") or {}
            check(f"shm_dir {shm} is a k8s emptyDir of medium Memory", ed.get("medium") == "Memory")
            dsize, ksize = dm.get(shm, {}).get("size"), ed.get("sizeLimit")
            check(
                "shm size equal",
                dsize is not None and ksize is not None and abs(mib(dsize) - mib(ksize)) < 1e-9,
                f"compose {dsize} vs k8s {ksize}",
            )
            data = str(Path(toml["backing_file"]).parent)
            check(f"backing_file's {data} mounted in compose", data in dm)
            check(f"backing_file's {data} mounted read-write in k8s", data in km and not km[data]["readOnly"])
        extra_d = set(dm) - set(km)
        extra_k = set(km) - set(dm)
        check("same mount paths", not extra_d and not extra_k, f"only compose {sorted(extra_d)}, only k8s {sorted(extra_k)}")

        # Ports.
        want_ports = set(toml_ports[role].values())
        kp = {p["containerPort"] for p in c.get("ports", [])}
        check(f"k8s containerPorts = the TOML's ports {sorted(want_ports)}", kp == want_ports, f"k8s {sorted(kp)}")
        names = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        check("k8s port names match the TOML's roles", names == toml_ports[role], f"k8s {names}")
        dp = set()
        for p in (svc.get("ports") or []) + (svc.get("expose") or []):
            s = str(p["target"] if isinstance(p, dict) else p).split("/")[0]
            dp.add(int(s.rsplit(":", 1)[-1].split("-")[0]))
        check("compose ports/expose within the TOML's ports", dp <= want_ports, f"compose {sorted(dp)}")
        if image["expose"]:
            check("Dockerfile EXPOSEs them", want_ports <= image["expose"], f"EXPOSE {sorted(image['expose'])}")

        # Probes.
        dpr = compose_probe(svc)
        kr = k8s_probe(c, "readinessProbe")
        kl = k8s_probe(c, "livenessProbe")
        http = toml_ports[role]["http"]
        check("compose healthcheck = k8s readinessProbe (path, port)", dpr is not None and dpr == kr, f"compose {dpr} vs k8s {kr}")
        check(f"readiness is /readyz on the HTTP port {http}", kr == ("/readyz", http), f"k8s {kr}")
        check(f"liveness is /healthz on the HTTP port {http}", kl == ("/healthz", http), f"k8s {kl}")

        # Shutdown budget.
        grace = obj["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        dgrace = seconds(svc.get("stop_grace_period", "10s"))
        if role == "node":
            drain = toml.get("shutdown_drain_timeout_ms", 20000) / 1000
            wait = prestop_wait(c)
            check(
                f"k8s grace {grace}s > preStop drain wait {wait:g}s + shutdown_drain_timeout {drain:g}s",
                grace > wait + drain,
            )
            check(f"compose stop_grace_period {dgrace:g}s > shutdown_drain_timeout {drain:g}s", dgrace > drain)
            pre = " ".join(((c.get("lifecycle") or {}).get("preStop") or {}).get("exec", {}).get("command", []))
            check(
                "preStop drains this node's process (--until-restart) with the coordinator and token of node.toml",
                'drain --until-restart "$PAGEWIRE_NODE_ID"' in pre
                and f"--coordinator {toml['coordinator']}" in pre
                and f"--token-file {toml['token_file']}" in pre,
                pre,
            )

        # Image and user.
        dimg = svc.get("image")
        check("same image", dimg == c.get("image"), f"compose {dimg} vs k8s {c.get('image')}")
        uid = c.get("securityContext", {}).get("runAsUser") or obj["spec"]["template"]["spec"].get("securityContext", {}).get("runAsUser")
        if image["user"]:
            check(f"k8s runAsUser = the image's USER {image['user']}", str(uid) == image["user"], f"k8s {uid}")
        if svc.get("user"):
            check("compose user = k8s runAsUser", str(svc["user"]).split(":")[0] == str(uid))

    # The coordinator's address and ports, as the nodes and the tools see it.
    print("addresses:")
    host, _, port = tomls["node"]["coordinator"].rpartition(":")
    svc_obj = find(objs, "Service", host)
    check(f"node.toml's coordinator {host} is a compose service", host in services)
    check(
        f"k8s Service {host} is headless and selects the coordinator pods",
        svc_obj["spec"].get("clusterIP") == "None"
        and all(sts["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc_obj["spec"]["selector"].items()),
    )
    sp = {p["name"]: p["port"] for p in svc_obj["spec"]["ports"]}
    check(f"Service ports = coordinator.toml's {toml_ports['coordinator']}", sp == toml_ports["coordinator"], f"Service {sp}")
    check(f"node.toml's coordinator port {port} is coordinator.toml's listen port", int(port) == toml_ports["coordinator"]["grpc"])
    tenv = compose_env(services[TOOLS_SVC])
    aenv = {e["name"]: e.get("value") for e in container(admin, "pwctl").get("env", [])}
    check(
        "admin pod's PAGEWIRE_COORDINATOR = compose tools' = node.toml's coordinator",
        aenv.get("PAGEWIRE_COORDINATOR") == tenv.get("PAGEWIRE_COORDINATOR") == tomls["node"]["coordinator"],
        f"admin {aenv.get('PAGEWIRE_COORDINATOR')}, tools {tenv.get('PAGEWIRE_COORDINATOR')}",
    )

    # NetworkPolicies open exactly the TOMLs' ports.
    internal = {toml_ports["coordinator"]["grpc"], toml_ports["node"]["grpc"], toml_ports["node"]["transport"]}
    metrics = {toml_ports["coordinator"]["http"], toml_ports["node"]["http"]}

    def np_ports(name):
        o = find(objs, "NetworkPolicy", name)
        return {p["port"] for r in o["spec"].get("ingress", []) for p in r.get("ports", [])}

    check(f"NetworkPolicy pagewire-internal opens {sorted(internal)}", np_ports("pagewire-internal") == internal)
    check(f"NetworkPolicy pagewire-metrics opens {sorted(metrics)}", np_ports("pagewire-metrics") == metrics)
    pol = find(objs, "NetworkPolicy", "pagewire-internal")["spec"]
    sel = pol["podSelector"].get("matchLabels", {})
    peers = [p["podSelector"].get("matchLabels", {}) for r in pol["ingress"] for p in r["from"] if "podSelector" in p]
    for obj in (sts, ds, admin):
        labels = obj["spec"]["template"]["metadata"].get("labels", {})
        check(
            f"{obj['kind']} {obj['metadata']['name']}'s pods are selected by and admitted to pagewire-internal",
            all(labels.get(k) == v for k, v in sel.items())
            and any(all(labels.get(k) == v for k, v in p.items()) for p in peers),
        )
    for role, obj in (("coordinator", sts), ("node", ds)):
        ann = obj["spec"]["template"]["metadata"].get("annotations", {})
        check(
            f"{role} scrape annotations name port {toml_ports[role]['http']} and /metrics",
            ann.get("prometheus.io/scrape") == "true"
            and ann.get("prometheus.io/port") == str(toml_ports[role]["http"])
            and ann.get("prometheus.io/path") == "/metrics",
        )

    check_verbs(objs, rdma, tomls["node"], toml_ports["node"])
    check_image()
    check_ha(
        objs,
        rdma["ha"],
        rdma["ha-external"],
        a.compose,
        a.compose_ha,
        (cfg_dir / "coordinator.toml").read_text(),
        image,
    )

    print(f"check_drift: {passes} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
