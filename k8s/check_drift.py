#!/usr/bin/env python3
"""Fails when the Kubernetes manifests drift from what the compose test runs,
or the RDMA overlays from the tcp one, or the image from the verbs transport,
or the ha overlays from the compose HA cluster.

This file holds the command and the compose-against-tcp checks; the rest
sit beside it: drift_lib.py (the pass/fail record, rendering, reading
compose services and Kubernetes objects), drift_verbs.py (the RDMA
overlays and the image), drift_ha.py (the ha overlays).

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


import drift_lib
from drift_ha import *  # noqa: F403
from drift_lib import *  # noqa: F403
from drift_verbs import *  # noqa: F403

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

    print(f"check_drift: {drift_lib.passes} passed, {len(drift_lib.failures)} failed")
    return 1 if drift_lib.failures else 0


if __name__ == "__main__":
    sys.exit(main())
